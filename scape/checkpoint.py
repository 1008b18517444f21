"""State of the sharded optimizers: save a rank's shard, load it back, or reshard.

``state_dict()`` holds what this rank owns: per bucket the shard's state by name (its
``tensors()``: fp32 master weights and first moment, SCAPE's int32 ages; and its ``extra``:
a rule's statistics, AdamW's second moment), this rank's residual (its whole fp32 gradient
buffer), the masks, and the step. Resume is bit-exact on the same world size. A record may
hold names the shard does not keep (``age`` in a ``DistributedAdamW`` record saved before it
stopped keeping ages): loading drops them.

Loading onto another world size takes the list of *every* old rank's state dict. Sharded
tensors are concatenated, stripped of padding and cut again for the new layout. Residuals
are not sharded (each rank keeps its own over the whole buffer); every new rank gets the mean
of the old residuals. Masks are kept per block; the new layout only adds or drops padding
blocks, whose selections are arbitrary (offsets ``0..k-1``).

After loading, the model parameters are rebuilt from the master weights with one
all-gather, so every rank's model matches the optimizer state exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, cast

import torch

from scape.agreement import agree, digest

if TYPE_CHECKING:
    from scape.buffers import Bucket
    from scape.comm import Communicator
    from scape.local_shards import ShardMesh


class ShardedState(Protocol):
    """What checkpoints (this module, :mod:`scape.dcp`, :mod:`scape.io`) read and write of a
    sharded optimizer (:class:`scape.SCAPE`, :class:`scape.DistributedAdamW`).

    The layout: ``comm`` (the data-parallel group), ``block_size``, ``buckets`` (the flat
    buffers, :class:`scape.buffers.Bucket`, one per param group and dtype), ``shards`` (per
    bucket what this rank keeps of its owned slice), ``param_groups`` (torch.optim's). The
    state: :meth:`state_tensors` per shard, :meth:`residual` per bucket, :meth:`counters`
    and :attr:`step_count`; :meth:`load_counters` restores the last two once the tensors are
    written. ``name`` is the optimizer's name as checkpoints record it.
    """

    name: str
    comm: Communicator
    block_size: int
    buckets: list[Bucket]
    shards: list[Any]
    param_groups: list[dict[str, Any]]

    @property
    def step_count(self) -> int: ...

    @property
    def shard_mesh(self) -> ShardMesh | None: ...

    @property
    def optional_state_names(self) -> tuple[str, ...]: ...

    def check_usable(self) -> None: ...

    def finish_param_sync(self) -> None: ...

    def state_tensors(self, shard: Any) -> dict[str, torch.Tensor]: ...

    def residual(self, i: int) -> torch.Tensor: ...

    def counters(self) -> dict[str, Any]: ...

    def load_counters(self, counters: dict[str, Any], step: int) -> None: ...

    def rank_state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: Any) -> None: ...


T = TypeVar("T")
FORMAT = "scape.sharded/1"


def sharded_state(opt: ShardedState, extra_per_bucket: list[dict[str, Any]]) -> dict[str, Any]:
    opt.check_usable()  # never save the state of a step whose collectives failed
    buckets = []
    for i, (b, s, extra) in enumerate(zip(opt.buckets, opt.shards, extra_per_bucket)):
        entry = {"group": b.group, "apart": b.apart, "dtype": str(b.dtype), "numel": b.numel,
                 "n_pad": b.n_pad,
                 "shapes": [list(s) for s in b.shapes],
                 "shard_start": b.shard_start, "shard_size": b.shard_size,
                 "residual": opt.residual(i),
                 "extra": {k: v.detach().clone() for k, v in s.extra.items()}}
        for name, t in s.tensors().items():
            entry[name] = t.detach().clone()
        entry.update(extra)
        buckets.append(entry)
    return {"format": FORMAT, "optimizer": opt.name, "world_size": opt.comm.world_size,
            "rank": opt.comm.rank, "step": opt.step_count, "block_size": opt.block_size,
            "counters": dict(opt.counters()),
            "param_groups": [{k: v for k, v in g.items() if k != "params"}
                             for g in opt.param_groups],
            "buckets": buckets}


def _check_structure(opt: ShardedState, sd: dict[str, Any]) -> None:
    if not isinstance(sd, dict) or sd.get("format") != FORMAT:
        raise ValueError(f"not a {FORMAT} state dict (got format "
                         f"{sd.get('format') if isinstance(sd, dict) else type(sd).__name__!r})")
    check_layout(opt, sd["optimizer"], sd["param_groups"], sd["block_size"], sd["buckets"])


_APART_HINT = (" (with update='agree', the default, attach(model) before the first step gives "
               "the embedding matrices buckets of their own: build and attach the optimizer as "
               "the one that saved did, then load)")


def check_layout(opt: ShardedState, optimizer: str, groups: list[dict[str, Any]], block_size: int,
                 buckets: list[dict[str, Any]]) -> None:
    """Raise ``ValueError`` naming what differs if a saved state's optimizer, param groups,
    buckets (group, dtype, size, parameter shapes) or block size do not fit ``opt``; both
    state-dict forms (this module's and :mod:`scape.dcp`'s) are checked here."""
    if optimizer != opt.name:
        raise ValueError(f"state dict is from {optimizer}, not {opt.name}")
    if len(groups) != len(opt.param_groups):
        raise ValueError(f"state dict has {len(groups)} param groups, the "
                         f"optimizer has {len(opt.param_groups)}")
    for i, (saved, live) in enumerate(zip(groups, opt.param_groups)):
        if "sparsity" not in live:
            continue
        sp = saved.get("sparsity") if isinstance(saved, dict) else None
        if not isinstance(sp, (int, float)) or isinstance(sp, bool) or not 0.0 <= sp < 1.0 \
                or (sp > 0) != (live["sparsity"] > 0):
            raise ValueError(f"param group {i}: saved sparsity {sp!r} does not fit this "
                             f"optimizer's {live['sparsity']!r} (a sparse group stays sparse "
                             "and a dense one dense; the value itself is restored, like lr)")
    apart = [bool(e.get("apart", False)) for e in buckets]  # a state saved without it: none
    hint = _APART_HINT if any(apart) or any(b.apart for b in opt.buckets) else ""
    if len(buckets) != len(opt.buckets):
        raise ValueError(f"state dict has {len(buckets)} buckets (param group x dtype), "
                         f"the optimizer has {len(opt.buckets)}{hint}")
    for i, (e, b) in enumerate(zip(buckets, opt.buckets)):
        if apart[i] != b.apart:
            raise ValueError(f"bucket {i} differs: it holds embedding matrices set apart in "
                             f"{'the state dict' if apart[i] else 'the optimizer'} only{hint}")
        if (e["group"], e["dtype"], e["numel"]) != (b.group, str(b.dtype), b.numel):
            raise ValueError(
                f"bucket {i} differs: state dict has group {e['group']}, {e['dtype']}, "
                f"{e['numel']} elements; optimizer has group {b.group}, {b.dtype}, "
                f"{b.numel} elements (param groups or parameters changed)")
        shapes = [list(s) for s in b.shapes]
        if "shapes" in e and e["shapes"] != shapes:  # states saved before 0.2 carry none
            raise ValueError(
                f"bucket {i} differs: state dict has parameters of shapes {e['shapes']}, the "
                f"optimizer has {shapes} (parameters in another order, or another model)")
    if block_size != opt.block_size:
        raise ValueError(f"state dict block_size {block_size} != {opt.block_size}")


def agree_to_load(opt: ShardedState, read: Callable[[], T], step_of: Callable[[T], Any]) -> T:
    """Run ``read()``, which checks a state and returns what to load without writing
    anything, then agree with every rank (one all-gather): if it raised on any rank, or the
    ranks load different steps (``step_of``), every rank raises before anything is written."""
    error: Exception | None = None
    result, step = None, None
    try:
        result = read()
        step = step_of(result)
    except (ValueError, TypeError, KeyError) as e:
        error = e if not isinstance(e, KeyError) else ValueError(f"state dict lacks {e}")
    agree(opt.comm, {"step": digest(step)}, error, what="load_state_dict")
    return cast(T, result)


def finish_load(opt: ShardedState, step: int, counters: dict[str, Any],
                groups: list[dict[str, Any]], skip: tuple[str, ...] = ("params",)) -> None:
    """The step, counters and param-group values (``lr``, ``sparsity``, ... but ``skip``) of
    a loaded state; then the model parameters from the loaded master weights (one all-gather
    per bucket), so every rank's model matches the optimizer state exactly."""
    opt.load_counters(counters, step)
    for g, saved in zip(opt.param_groups, groups):
        for k, v in saved.items():
            if k not in skip:
                g[k] = v
    for b, s in zip(opt.buckets, opt.shards):
        opt.comm.all_gather(b.param_flat, s.master.to(b.dtype)).wait()
        b.publish()


def _repad(full: torch.Tensor, numel: int, n_pad: int) -> torch.Tensor:
    out = torch.zeros(n_pad, dtype=full.dtype)
    out[:numel] = full[:numel]
    return out


def _reshard(old_shards: list[torch.Tensor], b: Any) -> torch.Tensor:
    """This rank's shard of bucket ``b`` cut from every old rank's shard (padding removed)."""
    full = torch.cat([t.cpu() for t in old_shards])
    return _repad(full, b.numel, b.n_pad)[b.shard].to(b.device)


def load_sharded_state(opt: ShardedState, state: Any) -> list[dict[str, Any]]:
    """Load ``state`` into ``opt``; return the per-bucket extras (masks) for the subclass.
    A state that does not fit raises on every rank (one all-gather) before anything loads."""
    states = agree_to_load(opt, lambda: _states_to_load(opt, state), lambda sds: sds[0]["step"])
    return _load_states(opt, states)


def _states_to_load(opt: ShardedState, state: Any) -> list[dict[str, Any]]:
    """The checked state dicts this rank loads from (its own, or every old rank's)."""
    world, rank = opt.comm.world_size, opt.comm.rank
    if isinstance(state, dict):
        _check_structure(opt, state)
        if state["world_size"] != world or state["rank"] != rank:
            raise ValueError(
                f"state dict is rank {state['rank']} of {state['world_size']}; this is rank "
                f"{rank} of {world}. To load onto another world size pass the list of every "
                "old rank's state dict")
        states = [state]
    elif isinstance(state, (list, tuple)) and state:
        for sd in state:
            _check_structure(opt, sd)
        states = sorted(state, key=lambda sd: sd["rank"])
        old_world = states[0]["world_size"]
        if [sd["rank"] for sd in states] != list(range(old_world)) or any(
                sd["world_size"] != old_world or sd["step"] != states[0]["step"]
                for sd in states):
            raise ValueError("the list must hold one state dict per old rank (0..W-1), all "
                             "from the same step and world size")
        if old_world == world:  # same layout: this rank's own state, bit-exact
            states = [states[rank]]
    else:
        raise TypeError("load_state_dict expects a state dict or a list of every rank's "
                        f"state dicts, got {type(state).__name__}")
    return states


def _load_states(opt: ShardedState, states: list[dict[str, Any]]) -> list[dict[str, Any]]:
    world = opt.comm.world_size
    extras = []
    for i, (b, s) in enumerate(zip(opt.buckets, opt.shards)):
        entries = [sd["buckets"][i] for sd in states]
        dev = b.device
        if len(states) == 1 and states[0]["world_size"] == world:
            e = entries[0]
            for name, t in s.tensors().items():  # what the shard keeps; the rest is dropped
                t.copy_(e[name])
            for k in s.extra:  # what the rule keeps; the rest of the file's is dropped
                if k in e["extra"]:
                    s.extra[k].copy_(e["extra"][k])
                else:  # a checkpoint of a rule that did not keep it: start from zero
                    s.extra[k].zero_()
            b.grad_flat.copy_(e["residual"])
        else:
            for name, t in s.tensors().items():
                t.copy_(_reshard([e[name] for e in entries], b))
            for k in s.extra:
                if all(k in e["extra"] for e in entries):
                    s.extra[k].copy_(_reshard([e["extra"][k] for e in entries], b))
                else:
                    s.extra[k].zero_()
            residual = torch.stack([e["residual"].cpu()[:b.numel] for e in entries]).mean(0)
            b.grad_flat.copy_(_repad(residual, b.numel, b.n_pad).to(dev))
        extras.append({k: v.to(dev) for k, v in entries[0].items()
                       if k.startswith(("mask", "drift")) and v is not None})

    finish_load(opt, states[0]["step"], states[0]["counters"], states[0]["param_groups"])
    return extras
