"""``opt.state_dict()`` in torch.optim's shape, for ``torch.distributed.checkpoint`` (DCP).

The sharded optimizers own coordinates, not parameters: rank r owns one contiguous slice of
each flat buffer (:mod:`scape.buffers`). In this state dict every parameter gets torch.optim's
entry ``state[param_id] = {name: tensor}``, and each tensor says which part of the whole it
holds, so DCP writes every rank's part once and reads back whatever overlaps:

==============================  ===========================================================
``exp_avg``, ``master``, ...    the parameter's flattened coordinates (global size
                                ``[numel]``, on any world size); this rank's part is the
                                slice it owns (maybe empty). DCP reshards them.
``residual``                    ``[W, numel]``: row r is rank r's gradient buffer over the
                                parameter (gradient + error-feedback residual); each rank
                                holds its own row.
``param_groups[g]["scape"]``    plain values, the same on every rank: the step, counters,
                                the world size, the block size and, per bucket, the masks
                                (bytes, as they are replicated).
==============================  ===========================================================

With more than one rank the tensors are ``ShardedTensor`` s (DCP's type for arbitrary
slices); on one rank they are plain tensors. Every value is a copy: DCP loads into the copies,
and ``load_state_dict`` checks the whole layout before it writes anything.

Loading onto another world size: the rows of ``residual`` follow the old world size, so
DCP's default planner refuses them (size mismatch). :class:`ReshardPlanner` reads them whole
instead; every new rank then starts from the mean of the old residuals, as
:func:`scape.load_checkpoint` does.
"""

from __future__ import annotations

import functools
import io
import warnings
from typing import Any

import torch
import torch.distributed as dist

from scape.checkpoint import ShardedState, agree_to_load, check_layout, finish_load
from scape.local_shards import global_ranks

FORMAT = "scape.torch/1"
KEY = "scape"
"""The key of the optimizer-wide values in ``param_groups[0]``."""


def _spans(b: Any) -> list[list[tuple[int, int]]]:
    """Per parameter of bucket ``b``, per rank: the ``(lo, hi)`` of the parameter's flattened
    coordinates that rank owns (``lo == hi == numel``: none). An empty part sits at the end,
    never at an offset where another rank's part starts: DCP's save keeps one chunk per
    ``(key, offset)`` across ranks, and could keep the empty one."""
    out = []
    for o, n in zip(b.offsets, b.numels):
        row = []
        for r in range(b.world):
            lo = min(max(r * b.shard_size - o, 0), n)
            hi = min(max((r + 1) * b.shard_size - o, 0), n)
            row.append((lo, hi) if hi > lo else (n, n))
        out.append(row)
    return out


def _sharded(local: torch.Tensor, parts: list[tuple[int, list[int], list[int]]],
             global_size: list[int], me: int) -> Any:
    """A ``ShardedTensor`` of ``global_size`` made of ``parts`` = ``(global rank, offsets,
    sizes)`` (every rank's, all of them); this rank's (global rank ``me``) is ``local``. Every
    rank has a part, maybe empty (at an end of the range): DCP's load drops a
    ``ShardedTensor`` with no local part, and a key missing on one rank makes it read the
    checkpoint in an older key format."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import (
        ShardedTensorMetadata,
        TensorProperties,
    )

    device = str(local.device)
    metas = [ShardMetadata(list(off), list(size), f"rank:{r}/{device}")
             for r, off, size in parts]
    props = TensorProperties(dtype=local.dtype)
    md = ShardedTensorMetadata(metas, torch.Size(global_size), props)
    shards = [Shard(local, m) for m in metas
              if m.placement is not None and m.placement.rank() == me]
    with warnings.catch_warnings():  # torch marks ShardedTensor for replacement by DTensor,
        warnings.simplefilter("ignore", FutureWarning)  # which cannot hold arbitrary slices
        st = ShardedTensor._init_from_local_shards_and_global_metadata(shards, md)
    st.__class__ = _owned_slices(ShardedTensor)
    return st


def _global_offset(p: torch.Tensor, mesh: Any) -> int:
    """Where a DTensor parameter's local shard starts in its flattened coordinates: FSDP2's
    dim-0 chunks over a one-dimensional mesh (``ValueError`` for another layout)."""
    placements = p.placements  # type: ignore[attr-defined]
    if mesh is None or mesh.mesh.ndim != 1 or not placements[0].is_shard(0):
        raise ValueError(
            f"opt.state_dict() with DTensor parameters takes FSDP2's dim-0 sharding over a "
            f"one-dimensional mesh (fully_shard(..., mesh=mesh['dp_shard'])); got placements "
            f"{tuple(placements)} on a {mesh.mesh.ndim if mesh is not None else '?'}-D mesh "
            "(tensor parallel): this layout cannot be checkpointed through the optimizer's "
            "state dict yet")
    d0 = p.shape[0]
    chunk = -(-d0 // mesh.mesh.size(0))
    start = min(mesh.coordinate[0] * chunk, d0)
    return start * (p.numel() // d0) if d0 else 0


@functools.cache
def _owned_slices(base: type) -> type:
    """``ShardedTensor`` whose ``.to("cpu:0")`` stays on the CPU: torch's own moves the
    tensors to ``cpu`` but writes ``cpu:0`` into the placement, and then refuses it (the
    Hugging Face Trainer's accelerate moves every optimizer state dict that way)."""

    def plain(d: Any) -> Any:
        if isinstance(d, (str, torch.device)) and torch.device(d).type == "cpu":
            return torch.device("cpu")
        return d

    class OwnedSlices(base):  # type: ignore[misc, valid-type]
        def to(self, *args: Any, **kwargs: Any) -> Any:
            args = tuple(plain(a) for a in args)
            if "device" in kwargs:
                kwargs["device"] = plain(kwargs["device"])
            return super().to(*args, **kwargs)

        def __reduce_ex__(self, protocol: Any) -> Any:  # torch.save, pickle, deepcopy
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                shards = self.local_shards()
            parts = [(list(sh.metadata.shard_offsets), sh.tensor) for sh in shards]
            return SavedSlices, (parts, list(self.size()))

    return OwnedSlices


class SavedSlices:
    """A state-dict tensor after ``torch.save``/``torch.load`` (or ``copy.deepcopy``): the
    parts the saving rank held, where they lie, and the global size. ``load_state_dict``
    takes it on the rank that saved it (a rank's own file, as ``torch.save`` per rank).

    Plain data (lists of ints and tensors), registered at import with
    ``torch.serialization.add_safe_globals``, so ``torch.load`` with its defaults
    (``weights_only=True``) reads a rank's file; it is the only global the library adds."""

    def __init__(self, parts: list[tuple[list[int], torch.Tensor]], size: list[int]) -> None:
        ok = isinstance(parts, list) and isinstance(size, list) and all(
            isinstance(x, int) for x in size) and all(
            isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], list)
            and all(isinstance(x, int) for x in p[0]) and isinstance(p[1], torch.Tensor)
            for p in parts)
        if not ok:
            raise TypeError("SavedSlices(parts, size): parts is a list of (offsets, tensor), "
                            "offsets and size lists of ints")
        self.parts, self.global_size = parts, size

    def size(self) -> torch.Size:
        return torch.Size(self.global_size)


torch.serialization.add_safe_globals([SavedSlices])


def _pad_spans(b: Any) -> list[tuple[int, int]]:
    """Per rank, the ``(lo, hi)`` of the bucket's padding ``[numel, n_pad)`` it owns,
    counted from ``numel``."""
    tail = []
    for r in range(b.world):
        lo = min(max(r * b.shard_size, b.numel), b.n_pad) - b.numel
        hi = min(max((r + 1) * b.shard_size, b.numel), b.n_pad) - b.numel
        tail.append((lo, hi))
    return tail


def _padding(b: Any, tensors: dict[str, torch.Tensor], rank: int, single: bool, me: int,
             tails: list[int], spans: list[list[tuple[int, int, int]]]) -> dict[str, Any]:
    """The shard state over the bucket's padding (the ages of padding coordinates steer the
    masks of a block that holds both): kept with the bucket's last parameter, sized by the
    world size, so it is restored on the same world size and zeroed on another. With DTensor
    parameters each shard of the model has its own padding (``tails``, the parts ``spans``:
    per shard, per rank ``(global rank, lo, hi)``), laid end to end."""
    lo, hi = _pad_spans(b)[rank]
    total = sum(tails)
    parts = []
    for base, row in zip(_bases(tails), spans):
        parts += [(gr, [base + a] if c > a else [total], [c - a]) for gr, a, c in row]
    out: dict[str, Any] = {}
    for name, t in tensors.items():
        start = b.numel - b.shard_start
        local = t[max(start + lo, 0):max(start + hi, 0)].detach().clone()
        out[name] = local if single else _sharded(local, parts, [total], me)
    return out


def _bases(sizes: list[int]) -> list[int]:
    out, at = [], 0
    for n in sizes:
        out.append(at)
        at += n
    return out


def _to_bytes(t: torch.Tensor | None) -> bytes | None:
    if t is None:
        return None
    buf = io.BytesIO()
    torch.save(t.detach().cpu().clone(), buf)
    return buf.getvalue()


def _blob(value: Any) -> bytes:
    """Plain values (lists, dicts, strings, numbers, bytes) as one value of the state dict:
    DCP keeps one key for it, however many shards it describes."""
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def _unblob(b: Any, where: str) -> Any:
    if not isinstance(b, bytes):
        raise ValueError(f"{where}: expected bytes, got {type(b).__name__}")
    try:
        return torch.load(io.BytesIO(b), weights_only=True)
    except Exception as e:  # UnpicklingError, or whatever a damaged stream raises
        raise ValueError(f"{where}: cannot be read with torch.load(weights_only=True) (a "
                         "damaged state dict, or one carrying code)") from e


def _from_bytes(b: Any, where: str) -> torch.Tensor | None:
    """A replicated tensor saved as bytes (masks), unpickled with ``weights_only=True``."""
    if b is None or isinstance(b, torch.Tensor):
        return b
    if not isinstance(b, bytes):
        raise ValueError(f"{where}: expected bytes or a tensor, got {type(b).__name__}")
    try:
        t = torch.load(io.BytesIO(b), weights_only=True)
    except Exception as e:  # UnpicklingError, or whatever a damaged stream raises
        lines = str(e).splitlines() or [""]
        why = next((ln.strip() for ln in lines if "WeightsUnpickler" in ln), lines[0])
        raise ValueError(f"{where}: cannot be read with torch.load(weights_only=True) (a "
                         f"damaged state dict, or one carrying code): {why}") from e
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{where}: holds a {type(t).__name__}, not a tensor")
    return t


def torch_state_dict(opt: ShardedState, bucket_extras: list[dict[str, torch.Tensor | None]]
                     ) -> dict[str, Any]:
    """The state dict of the module docstring (``bucket_extras``: per bucket, the replicated
    tensors the subclass keeps, such as masks). With DTensor parameters (FSDP2) the tensors
    are in the parameters' global coordinates and the layout of every shard of the model is
    recorded (one ``all_gather_object`` over the shard mesh)."""
    opt.check_usable()
    comm = opt.comm
    world, rank = comm.world_size, comm.rank
    mesh = getattr(opt, "shard_mesh", None)
    single = world == 1 and mesh is None  # plain tensors
    ranks = [0] if single else global_ranks(comm)
    me = ranks[rank]
    pid: dict[Any, int] = {}
    for g in opt.param_groups:
        for p in g["params"]:
            pid[p] = len(pid)
    mine: dict[str, list[Any]] = {"params": [], "pads": [], "buckets": []}
    for b, extras in zip(opt.buckets, bucket_extras):
        for p, n, spans in zip(b.params, b.numels, _spans(b)):
            g0, full = (_global_offset(p, mesh) if b.dtensor else 0), p.numel()
            mine["params"].append({
                "state": [(ranks[r], [g0 + lo] if hi > lo else [full], [hi - lo])
                          for r, (lo, hi) in enumerate(spans)],
                "residual": [(ranks[r], [r, g0], [1, n]) for r in range(world)]})
        mine["pads"].append((b.n_pad - b.numel, [(ranks[r], a, c)
                                                 for r, (a, c) in enumerate(_pad_spans(b))]))
        info = {"group": b.group, "apart": b.apart, "dtype": str(b.dtype), "numel": b.numel,
                "shapes": [list(shape) for shape in b.shapes],
                **{k: _to_bytes(v) for k, v in extras.items()}}
        if mesh is not None:
            info["tail"] = b.n_pad - b.numel
        mine["buckets"].append(info)
    everyone: list[Any] = [mine]
    if mesh is not None:  # every shard's layout, the same list on every rank
        everyone = [None] * mesh.mesh.size(0)
        dist.all_gather_object(everyone, mine, group=mesh.groups[0])
    state: dict[int, dict[str, Any]] = {}
    k = 0
    for i, (b, s) in enumerate(zip(opt.buckets, opt.shards)):
        tensors = opt.state_tensors(s)
        residual = opt.residual(i)
        for p, o, n, spans in zip(b.params, b.offsets, b.numels, _spans(b)):
            lo, hi = spans[rank]
            parts = [part for e in everyone for part in e["params"][k]["state"]]
            rows = [part for e in everyone for part in e["params"][k]["residual"]]
            entry: dict[str, Any] = {}
            for name, t in tensors.items():
                local = t[max(lo + o - b.shard_start, 0):max(hi + o - b.shard_start, 0)]
                local = local.detach().clone()
                entry[name] = local if single else _sharded(local, parts, [p.numel()], me)
            tails = [e["pads"][i][0] for e in everyone]
            if p is b.params[-1] and max(tails) > 0:
                entry["padding"] = _padding(b, tensors, rank, single, me, tails,
                                            [e["pads"][i][1] for e in everyone])
            own = residual[o:o + n].view(1, n)
            entry["residual"] = own if single else _sharded(own, rows, [world, p.numel()], me)
            state[pid[p]] = entry
            k += 1
    groups = []
    for g in opt.param_groups:
        entry = {k_: v for k_, v in g.items() if k_ != "params"}
        entry["params"] = [pid[p] for p in g["params"]]
        groups.append(entry)
    layout: dict[str, Any] = {"buckets": mine["buckets"]} if mesh is None else {
        "shard_buckets": _blob([e["buckets"] for e in everyone])}
    groups[0][KEY] = {"format": FORMAT, "optimizer": opt.name, "world_size": world,
                      "step": opt.step_count, "block_size": opt.block_size,
                      "counters": dict(opt.counters()), **layout}
    return {"state": state, "param_groups": groups}


def is_torch_state_dict(sd: Any) -> bool:
    return isinstance(sd, dict) and "state" in sd and "param_groups" in sd


def _parts(t: Any) -> list[tuple[list[int], torch.Tensor]]:
    """``(offsets, tensor)`` of what this rank holds of ``t`` (a plain tensor: all of it)."""
    if isinstance(t, SavedSlices):
        return t.parts
    if isinstance(t, torch.Tensor) and not hasattr(t, "local_shards"):
        return [([0] * t.dim(), t)]
    return [(list(sh.metadata.shard_offsets), sh.tensor) for sh in t.local_shards()]


def _size(t: Any) -> list[int]:
    return list(t.size())


def _optional(opt: ShardedState) -> set[str]:
    """State names a state dict may lack (the rule's statistics): they start at zero."""
    return set(getattr(opt, "optional_state_names", ()))


def _check(opt: ShardedState, sd: dict[str, Any]) -> dict[str, Any]:
    """Raise ``ValueError`` if ``sd`` does not fit ``opt``; return its optimizer-wide values."""
    groups = sd["param_groups"]
    info = groups[0].get(KEY) if groups and isinstance(groups[0], dict) else None
    if not isinstance(info, dict) or info.get("format") != FORMAT:
        raise ValueError(f"not a {FORMAT} state dict: param_groups[0][{KEY!r}] is missing "
                         "(a state dict of another optimizer?)")
    info = _this_shard(opt, info)
    check_layout(opt, info["optimizer"], groups, info["block_size"], info["buckets"])
    for i, (saved, live) in enumerate(zip(groups, opt.param_groups)):
        if len(saved["params"]) != len(live["params"]):
            raise ValueError(f"param group {i}: state dict has {len(saved['params'])} "
                             f"parameters, the optimizer has {len(live['params'])}")
    pids = [pid for g in groups for pid in g["params"]]
    live_params = [p for g in opt.param_groups for p in g["params"]]
    state = sd["state"]
    owned = {id(p) for b in opt.buckets for p in b.params}
    names = set(opt.state_tensors(opt.shards[0])) | {"residual"}
    optional = _optional(opt)
    for pid, p in zip(pids, live_params):
        if id(p) not in owned:
            continue
        entry = state.get(pid)
        if not isinstance(entry, dict):
            raise ValueError(f"state dict has no state for parameter {pid} (shape "
                             f"{tuple(p.shape)})")
        missing = names - set(entry) - optional
        if missing:
            raise ValueError(f"parameter {pid}: state dict lacks {sorted(missing)} (saved by "
                             "another update= rule or optimizer?)")
        for name in names & set(entry) - {"residual"}:
            if _size(entry[name]) != [p.numel()]:
                raise ValueError(f"parameter {pid}: {name} has size {_size(entry[name])}, the "
                                 f"parameter has shape {tuple(p.shape)}")
        rs = _size(entry["residual"])
        if len(rs) != 2 or rs[1] != p.numel() or rs[0] < 1:
            raise ValueError(f"parameter {pid}: residual has size {rs}, expected [W, "
                             f"{p.numel()}]")
    return info


def _this_shard(opt: ShardedState, info: dict[str, Any]) -> dict[str, Any]:
    """``info`` with ``buckets`` the layout of this rank's shard of the model (a state dict
    of DTensor parameters records every shard's); ``ValueError`` if the model is sharded
    into another number of parts than when it was saved, or only one of the two is."""
    mesh = getattr(opt, "shard_mesh", None)
    saved: Any = info.get("shard_buckets")
    if saved is not None:
        saved = _unblob(saved, "the shards' layout")
        if not isinstance(saved, list):
            raise ValueError(f"the shards' layout: expected a list, got {type(saved).__name__}")
    if (saved is None) != (mesh is None):
        how = ("DTensor parameters (FSDP2)", "plain parameters")
        raise ValueError(f"the state dict was saved with {how[saved is None]} and the "
                         f"optimizer has {how[mesh is None]}; load it into the same layout")
    if mesh is None:
        return info
    shards = mesh.mesh.size(0)
    if len(saved) != shards:
        raise ValueError(
            f"the state dict was saved with the model sharded {len(saved)} ways (dp_shard) "
            f"and this model is sharded {shards} ways: another dp_replicate size loads, the "
            "dp_shard size must stay the same")
    return {**info, "buckets": saved[mesh.coordinate[0]], "shard_buckets": saved}


def load_torch_state_dict(opt: ShardedState, sd: dict[str, Any]
                          ) -> list[dict[str, torch.Tensor | None]]:
    """Load a state dict of :func:`torch_state_dict` (as saved, or filled by DCP); return per
    bucket the replicated extras (masks) for the subclass. Checks everything first."""
    info, pending, extras = agree_to_load(opt, lambda: _read(opt, sd),
                                          lambda read: read[0]["step"])
    for dest, src in pending:
        dest.copy_(src)
    finish_load(opt, info["step"], info["counters"], sd["param_groups"], skip=("params", KEY))
    return extras


_LAYOUT_KEYS = ("group", "apart", "dtype", "numel", "shapes", "tail")


def _read(opt: ShardedState, sd: dict[str, Any]
          ) -> tuple[dict[str, Any], list[tuple[Any, Any]], list[dict[str, Any]]]:
    """Check ``sd`` against ``opt``; return its optimizer-wide values, the copies to make and
    per bucket the replicated extras (masks), decoded."""
    info = _check(opt, sd)
    extras = [{k: _from_bytes(v, f"bucket {i} {k}") for k, v in e.items()
               if k not in _LAYOUT_KEYS and v is not None}
              for i, e in enumerate(info["buckets"])]
    world, rank = opt.comm.world_size, opt.comm.rank
    old_world = info["world_size"]
    pids = [pid for g in sd["param_groups"] for pid in g["params"]]
    live_params = [p for g in opt.param_groups for p in g["params"]]
    pid_of = {id(p): pid for pid, p in zip(pids, live_params)}
    mesh = getattr(opt, "shard_mesh", None)
    pending = []  # (destination, source) pairs, written only once all are read and checked
    for i, (b, s) in enumerate(zip(opt.buckets, opt.shards)):
        tensors = opt.state_tensors(s)
        for p, o, n, spans in zip(b.params, b.offsets, b.numels, _spans(b)):
            entry = sd["state"][pid_of[id(p)]]
            lo, hi = spans[rank]
            g0 = _global_offset(p, mesh) if b.dtensor else 0  # where the local shard lies
            for name, t in tensors.items():
                dest = t[max(lo + o - b.shard_start, 0):max(hi + o - b.shard_start, 0)]
                if name not in entry:  # a statistic of this rule the saving one did not keep
                    pending.append((dest, torch.zeros_like(dest)))
                    continue
                for off, part in _parts(entry[name]):
                    part, at = part.reshape(-1), off[0] - g0
                    a, c = max(at, lo), min(at + part.numel(), hi)
                    if a < c:
                        pending.append((dest[a - lo:c - lo], part[a - at:c - at]))
            if p is b.params[-1] and b.n_pad > b.numel:
                start = b.numel - b.shard_start
                plo, phi = _pad_spans(b)[rank]
                saved = entry.get("padding") if old_world == world else None
                base = 0
                if mesh is not None:  # the shards' paddings lie end to end
                    base = sum(e[i]["tail"]
                               for e in info["shard_buckets"][:mesh.coordinate[0]])
                for name, t in tensors.items():
                    dest = t[max(start + plo, 0):max(start + phi, 0)]
                    if saved is None or name not in saved:
                        pending.append((dest, torch.zeros_like(dest)))
                        continue
                    for off, part in _parts(saved[name]):
                        at = off[0] - base
                        a, c = max(at, plo), min(at + part.numel(), phi)
                        if a < c:
                            pending.append((dest[a - plo:c - plo],
                                            part.reshape(-1)[a - at:c - at]))
            rows = entry["residual"]
            dest = b.grad_flat[o:o + n]
            if _size(rows)[0] == world == old_world:
                own = [part[rank - off[0]] for off, part in _parts(rows)
                       if off[0] <= rank < off[0] + part.shape[0]]
                if len(own) != 1:
                    raise ValueError(
                        f"residual of parameter {pid_of[id(p)]}: rank {rank}'s row is not in "
                        "the state dict, which holds another rank's part (every rank saves and "
                        "loads its own: torch.save per rank, DCP or scape.save_checkpoint)")
                pending.append((dest, own[0]))
            else:  # another world size: the mean of the old ranks' residuals, read whole
                whole = [part for _, part in _parts(rows)]
                if len(whole) != 1 or list(whole[0].shape) != [old_world, p.numel()]:
                    raise ValueError(
                        f"the state dict is from {old_world} ranks and this is {world}: load "
                        "it with dcp.load(..., planner=scape.dcp.ReshardPlanner()) so every "
                        "rank reads every old rank's residual")
                mean = whole[0][:, g0:g0 + n].to(torch.float32).mean(0)
                pending.append((dest, mean.view_as(dest)))
    return info, pending, extras


def _reshard_planner() -> Any:
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint._nested_dict import set_element
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    class ReshardPlanner(DefaultLoadPlanner):
        """DCP's default load planner, except that what is sized by the world size (the
        ``residual`` rows, the buckets' ``padding``) is read whole when it was saved on
        another one, instead of refused; the optimizer's ``load_state_dict`` then gives every
        rank the mean of the old residuals and zeroes the padding."""

        def set_up_planner(self, state_dict: Any, metadata: Any = None,
                           is_coordinator: bool = False) -> None:
            super().set_up_planner(state_dict, metadata, is_coordinator)
            for fqn, obj in list(self.state_dict.items()):
                md = metadata.state_dict_metadata.get(fqn) if metadata is not None else None
                w_sized = fqn.endswith(".residual") or ".padding." in fqn
                if not w_sized or not isinstance(md, TensorStorageMetadata):
                    continue
                if list(md.size) == list(obj.size()):
                    continue
                whole = torch.empty(md.size, dtype=md.properties.dtype)
                self.state_dict[fqn] = whole
                if self.flatten_state_dict:
                    set_element(self.original_state_dict, self.mappings[fqn], whole)

    return ReshardPlanner


def __getattr__(name: str) -> Any:  # ReshardPlanner imports DCP only when asked for
    if name == "ReshardPlanner":
        return _reshard_planner()
    raise AttributeError(name)
