"""Checkpoints on disk: atomic per-rank files, a checksummed manifest, a ``latest`` pointer.

``save_checkpoint(opt, root)`` writes one checkpoint directory per save::

    root/
      latest                            name of the last complete checkpoint (written last)
      step-00000120-3f9a0c1d/           step, then a token rank 0 draws for this save
        rank-00000-of-00004.pt          torch.save of rank r's opt.rank_state_dict()
        ...
        manifest.json                   format, optimizer, step, world size, and per file its
                                        size in bytes and SHA-256 (written after every file)

Every file (rank files, manifest, ``latest``) is written to a temporary file in the same
directory, flushed, fsync'ed and renamed over its name with ``os.replace``; the directory is
fsync'ed after the rename. A save never touches an earlier checkpoint's directory, and
``latest`` moves only once the new manifest is on disk, so a crash at any point of a save
leaves the previous checkpoint complete and still the one ``load_checkpoint(opt, root)`` finds.

``load_checkpoint(opt, path)`` (``path``: a checkpoint directory, or a root with ``latest``)
checks everything before it touches the optimizer: the manifest's fields, the file names (plain
names inside the directory), each file's size and SHA-256, unpickling with
``torch.load(weights_only=True)`` (tensors and plain containers only: a pickle that would run
code is refused), and every tensor's dtype and shape against the optimizer's layout. Each rank
reads only its own file when the world size is unchanged, and every old rank's file when it
differs (the optimizer then reshards, see :mod:`scape.checkpoint`). The outcome is exchanged
in one all-gather (:func:`scape.agreement.agree`), so a missing, truncated or altered file
raises on *every* rank, the same error, and the live model and optimizer are left exactly as
they were. Only then is ``opt.load_state_dict`` called.

Collectives: a save issues one broadcast (the directory token) and two all-gathers (the file
digests, then the outcome of the manifest write); a load issues one all-gather before the
optimizer's own parameter all-gather. Every rank must call these functions together.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import secrets
from pathlib import Path
from typing import Any

import torch

from scape import config
from scape.agreement import agree, digest
from scape.checkpoint import FORMAT as STATE_FORMAT
from scape.checkpoint import ShardedState, _check_structure

FORMAT = "scape.checkpoint/1"
MANIFEST = "manifest.json"
LATEST = "latest"
_RECORD = 1 + 32 + 8 + 400  # ok flag, sha256, size, error text


EXTRA = "extra"
"""Key of the ``extra=`` entries in a rank's file."""


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete, corrupt, unsafe or does not fit the optimizer."""


def _extra_state(extra: Any) -> dict[str, Any]:
    if not isinstance(extra, dict) or not all(isinstance(k, str) for k in extra):
        raise TypeError("save_checkpoint: extra must be a dict with str keys, got "
                        f"{type(extra).__name__}")
    return {k: v.state_dict() if callable(getattr(v, "state_dict", None)) else v
            for k, v in extra.items()}


def rank_file(rank: int, world: int) -> str:
    return f"rank-{rank:05d}-of-{world:05d}.pt"


# ------------------------------------------------------------------------------- writing
def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically: temp file in the same directory, fsync, rename."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def save_checkpoint(opt: ShardedState, root: str | os.PathLike[str], *,
                    extra: dict[str, Any] | None = None) -> Path:
    """Save every rank's optimizer state under ``root``; return the checkpoint directory.

    Call on every rank at the same step (after ``opt.step()``). The model needs no file of
    its own: ``load_checkpoint`` rebuilds the parameters from the fp32 master weights.
    ``extra``: what else this rank's file holds, by name, in the same atomic save: an object
    with ``state_dict()`` (an LR scheduler, a data loader) is saved as its state dict, anything
    else as it is (tensors, numbers, strings and containers of them, such as
    ``torch.get_rng_state()`` or a step count); :func:`load_checkpoint` gives them back.
    """
    opt.check_usable()
    comm = opt.comm
    rank, world = comm.rank, comm.world_size
    root = Path(root)
    # rank 0 draws the directory token: every save gets a fresh directory
    token = torch.zeros(8, dtype=torch.uint8)
    if rank == 0:
        token.copy_(torch.frombuffer(bytearray(secrets.token_bytes(8)), dtype=torch.uint8))
    comm.broadcast(token.to(comm.device), 0).wait()
    step = opt.step_count
    name = f"step-{step:08d}-{bytes(token.cpu().tolist())[:4].hex()}"
    ckpt = root / name

    record = torch.zeros(_RECORD, dtype=torch.uint8)
    try:
        state = opt.rank_state_dict()
        if extra is not None:
            state = dict(state, **{EXTRA: _extra_state(extra)})
        buf = io.BytesIO()
        torch.save(state, buf)
        data = buf.getvalue()
        ckpt.mkdir(parents=True, exist_ok=True)
        atomic_write(ckpt / rank_file(rank, world), data)
        record[0] = 1
        record[1:33] = torch.frombuffer(bytearray(hashlib.sha256(data).digest()),
                                        dtype=torch.uint8)
        record[33:41] = torch.tensor([len(data)], dtype=torch.int64).view(torch.uint8)
    except (OSError, RuntimeError, ValueError, TypeError) as e:
        msg = f"{type(e).__name__}: {e}".encode()[: _RECORD - 41]
        record[41:41 + len(msg)] = torch.frombuffer(bytearray(msg), dtype=torch.uint8)
    fault = getattr(opt, "_faults", None)
    if fault is not None:
        fault.fire(step, "save", opt)
    rows = torch.empty(world * _RECORD, dtype=torch.uint8, device=comm.device)
    comm.all_gather(rows, record.to(comm.device)).wait()
    rows = rows.cpu().view(world, _RECORD)
    failed = [r for r in range(world) if int(rows[r, 0]) != 1]
    error: Exception | None = None
    if failed:
        r = failed[0]
        text = bytes(rows[r, 41:].tolist()).rstrip(b"\0").decode(errors="replace")
        error = OSError(f"save_checkpoint: rank {r} could not write its file in {ckpt}: "
                        f"{text}")
    elif rank == 0:
        files = [{"name": rank_file(r, world), "sha256": bytes(rows[r, 1:33].tolist()).hex(),
                  "bytes": int(rows[r, 33:41].clone().view(torch.int64))}
                 for r in range(world)]
        manifest = {"format": FORMAT, "optimizer": opt.name, "step": step,
                    "world_size": world, "files": files}
        try:
            atomic_write(ckpt / MANIFEST, json.dumps(manifest, indent=1).encode())
            atomic_write(root / LATEST, (name + "\n").encode())
        except OSError as e:
            error = e
    # every rank returns only once the manifest and `latest` are on disk (or all raise)
    agree(comm, {"checkpoint": digest(name)}, error, what="save_checkpoint")
    return ckpt


# ------------------------------------------------------------------------------- reading
def resolve(path: str | os.PathLike[str]) -> Path:
    """The checkpoint directory ``path`` names: itself if it has a manifest, else the one its
    ``latest`` file points to."""
    path = Path(path)
    if (path / MANIFEST).is_file():
        return path
    latest = path / LATEST
    if latest.is_file():
        name = latest.read_text().strip()
        if not _plain_name(name):
            raise CheckpointError(f"{latest} holds {name!r}; expected a directory name in "
                                  f"{path}")
        target = path / name
        if not (target / MANIFEST).is_file():
            raise CheckpointError(f"{latest} points to {target}, which has no {MANIFEST} "
                                  "(incomplete or deleted checkpoint)")
        return target
    raise CheckpointError(f"no checkpoint at {path}: neither {MANIFEST} nor {LATEST} found "
                          "(a save that crashed before its manifest leaves no manifest)")


def _plain_name(name: Any) -> bool:
    return (isinstance(name, str) and bool(name) and name not in (".", "..")
            and "/" not in name and "\\" not in name and "\0" not in name)


def read_manifest(ckpt: Path) -> dict[str, Any]:
    """The manifest of checkpoint directory ``ckpt``, with every field checked."""
    path = ckpt / MANIFEST
    try:
        manifest = json.loads(path.read_bytes())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"unreadable manifest {path}: {type(e).__name__}: {e}") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        got = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise CheckpointError(f"{path}: expected format {FORMAT!r}, got {got!r}")
    world, step, files = manifest.get("world_size"), manifest.get("step"), manifest.get("files")
    if not isinstance(world, int) or world < 1 or not isinstance(step, int) or step < 0:
        raise CheckpointError(f"{path}: expected an int world_size >= 1 and step >= 0, got "
                              f"{world!r} and {step!r}")
    if not isinstance(files, list) or len(files) != world:
        raise CheckpointError(f"{path}: expected {world} file entries, got "
                              f"{len(files) if isinstance(files, list) else type(files)}")
    for r, f in enumerate(files):
        ok = (isinstance(f, dict) and f.get("name") == rank_file(r, world)
              and isinstance(f.get("sha256"), str) and len(f["sha256"]) == 64
              and isinstance(f.get("bytes"), int) and f["bytes"] >= 0)
        if not ok:
            raise CheckpointError(f"{path}: file entry {r} is {f!r}; expected name "
                                  f"{rank_file(r, world)!r}, a 64-digit sha256 and bytes")
    return manifest


def read_state(ckpt: Path, entry: dict[str, Any]) -> dict[str, Any]:
    """One rank's state dict: size and SHA-256 checked, then ``torch.load(weights_only=True)``."""
    path = ckpt / entry["name"]
    try:
        data = path.read_bytes()
    except OSError as e:
        raise CheckpointError(f"checkpoint file {path} is missing or unreadable: "
                              f"{type(e).__name__}: {e}") from e
    if len(data) != entry["bytes"]:
        raise CheckpointError(f"checkpoint file {path} has {len(data)} bytes, the manifest "
                              f"says {entry['bytes']} (truncated or replaced)")
    if hashlib.sha256(data).hexdigest() != entry["sha256"]:
        raise CheckpointError(f"checkpoint file {path} fails its SHA-256 check (corrupted)")
    try:
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unpickling failure is a refused checkpoint
        raise CheckpointError(f"checkpoint file {path} was refused by torch.load("
                              f"weights_only=True): {type(e).__name__}: {e}") from e
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint file {path} holds a {type(state).__name__}, "
                              "expected a state dict")
    return state


def _check_tensor(where: str, t: Any, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype != dtype or tuple(t.shape) != shape:
        got = (f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor)
               else type(t).__name__)
        raise CheckpointError(f"{where}: expected a {dtype} tensor of shape {shape}, got {got}")


def _counter_ok(v: Any, nested: bool = True) -> bool:
    """An optimizer counter: an int, a finite float, or (one level) a map of param group index
    to one of those (per-group counters; the index as a string, or as an int in files saved
    by earlier versions)."""
    if isinstance(v, bool):
        return False
    if isinstance(v, int):
        return True
    if isinstance(v, float):
        return math.isfinite(v)
    return nested and isinstance(v, dict) and all(
        _group_key(k) and _counter_ok(x, nested=False) for k, x in v.items())


def _group_key(k: Any) -> bool:
    """A param group's index: a non-negative int, or its decimal string."""
    if isinstance(k, str):
        return k.isascii() and k.isdecimal()
    return isinstance(k, int) and not isinstance(k, bool) and k >= 0


def validate_state(opt: ShardedState, sd: dict[str, Any], rank: int,
                   manifest: dict[str, Any]) -> None:
    """Check that old rank ``rank``'s state dict fits ``opt`` (dtypes, shapes, masks, groups)."""
    where = f"checkpoint rank {rank}"
    try:
        if sd.get("format") != STATE_FORMAT:
            raise CheckpointError(f"{where}: expected state format {STATE_FORMAT!r}, got "
                                  f"{sd.get('format')!r}")
        _check_structure(opt, sd)
    except (KeyError, TypeError, ValueError) as bad:
        raise CheckpointError(f"{where} does not fit this optimizer: {bad}") from bad
    expect = (manifest["world_size"], rank, manifest["step"], manifest["optimizer"])
    got = (sd.get("world_size"), sd.get("rank"), sd.get("step"), sd.get("optimizer"))
    if got != expect:
        raise CheckpointError(f"{where}: (world_size, rank, step, optimizer) is {got}, the "
                              f"manifest says {expect}")
    counters = sd.get("counters")
    if not isinstance(counters, dict) or not all(_counter_ok(v) for v in counters.values()):
        raise CheckpointError(f"{where}: counters must be a dict of ints, finite floats or "
                              f"{{param group: finite float}} maps, got {counters!r}")
    for i, saved in enumerate(sd["param_groups"]):  # as many as opt has (_check_structure)
        if not isinstance(saved, dict):
            raise CheckpointError(f"{where}: param group {i} is {type(saved).__name__}")
        try:
            config.check_lr(saved.get("lr"))
            config.check_betas(saved.get("betas"))
            config.check_eps(saved.get("eps"))
            config.check_weight_decay(saved.get("weight_decay"))
        except (TypeError, ValueError) as bad:
            raise CheckpointError(f"{where}, param group {i}: {bad}") from bad
    world = manifest["world_size"]
    masks = getattr(opt, "masks", [None] * len(opt.buckets))
    for i, (e, b, s, m) in enumerate(zip(sd["buckets"], opt.buckets, opt.shards, masks)):
        at = f"{where}, bucket {i}"
        shard, n_pad = e.get("shard_size"), e.get("n_pad")
        if not isinstance(shard, int) or not isinstance(n_pad, int) or shard * world != n_pad \
                or n_pad < b.numel or e.get("shard_start") != rank * shard:
            raise CheckpointError(f"{at}: inconsistent layout (shard_size {shard!r}, n_pad "
                                  f"{n_pad!r}, world {world}, {b.numel} elements)")
        for name, t in s.tensors().items():  # names the shard does not keep are dropped
            _check_tensor(f"{at}, {name}", e.get(name), t.dtype, (shard,))
        _check_tensor(f"{at}, residual", e.get("residual"), torch.float32, (n_pad,))
        extra = e.get("extra")
        if not isinstance(extra, dict) or set(extra) != set(s.extra):
            raise CheckpointError(f"{at}: extra state {sorted(extra or {})} != "
                                  f"{sorted(s.extra)} (saved with another update rule? "
                                  "build the optimizer with the update= it was saved with)")
        for k, t in extra.items():
            _check_tensor(f"{at}, {k}", t, s.extra[k].dtype, (shard,))
        for key in ("mask_next", "mask_current"):
            mask = e.get(key)
            if mask is None:
                continue
            if m is None:
                raise CheckpointError(f"{at}: has {key} but this bucket is dense")
            k = mask.shape[1] if isinstance(mask, torch.Tensor) and mask.dim() == 2 else -1
            if not 1 <= k <= opt.block_size:
                raise CheckpointError(f"{at}, {key}: {k} coordinates per block, outside "
                                      f"[1, {opt.block_size}]")
            _check_tensor(f"{at}, {key}", mask, torch.int16, (n_pad // opt.block_size, k))
            if bool((mask < 0).any()) or bool((mask >= opt.block_size).any()):
                raise CheckpointError(f"{at}, {key}: offsets outside [0, {opt.block_size})")


def load_checkpoint(opt: ShardedState, path: str | os.PathLike[str], *,
                    extra: dict[str, Any] | None = None) -> int:
    """Load the checkpoint at ``path`` (a checkpoint directory, or a root with ``latest``)
    into ``opt`` on every rank, on any world size; return its step.

    ``extra``: the names to restore of what :func:`save_checkpoint` saved with ``extra=``
    (from this rank's file; on another world size, from old rank ``rank % old_world``): an
    object with ``load_state_dict`` loads its state, any other value is replaced in the dict.
    A name the checkpoint lacks raises like any other mismatch, before anything is loaded.

    Raises :class:`CheckpointError` (a ``ValueError``) on every rank, with the optimizer and
    the model untouched, when any rank finds a problem.
    """
    opt.check_usable()
    comm = opt.comm
    rank, world = comm.rank, comm.world_size
    error: Exception | None = None
    states: list[dict[str, Any]] = []
    saved_extra: dict[str, Any] = {}
    name = ""
    try:
        ckpt = resolve(path)
        name = str(ckpt.resolve())
        manifest = read_manifest(ckpt)
        if manifest.get("optimizer") != opt.name:
            raise CheckpointError(f"{ckpt} holds a {manifest.get('optimizer')!r} state, not "
                                  f"{opt.name!r}")
        old_world = manifest["world_size"]
        ranks = [rank] if old_world == world else list(range(old_world))
        for r in ranks:
            sd = read_state(ckpt, manifest["files"][r])
            validate_state(opt, sd, r, manifest)
            states.append(sd)
        saved_extra = states[rank % old_world if old_world != world else 0].get(EXTRA, {})
        if extra is not None:
            if not isinstance(extra, dict):
                raise CheckpointError(f"load_checkpoint: extra must be a dict, got "
                                      f"{type(extra).__name__}")
            missing = sorted(set(extra) - set(saved_extra))
            if missing:
                raise CheckpointError(f"{ckpt} has no extra {missing} (it has "
                                      f"{sorted(saved_extra)})")
    except CheckpointError as e:
        error = e
    # one all-gather: the same error on every rank if any rank failed; the same directory
    agree(comm, {"checkpoint": digest(name) if error is None else 0}, error,
          what="load_checkpoint")
    states = [{k: v for k, v in sd.items() if k != EXTRA} for sd in states]
    opt.load_state_dict(states[0] if world == manifest["world_size"] else states)
    if extra is not None:
        for k in extra:
            if callable(getattr(extra[k], "load_state_dict", None)):
                extra[k].load_state_dict(saved_extra[k])
            else:
                extra[k] = saved_extra[k]
    return int(manifest["step"])
