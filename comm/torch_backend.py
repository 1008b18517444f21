"""``TorchCommunicator``: the Communicator protocol on ``torch.distributed`` (gloo on CPU, nccl on
GPU), with ``async_op=True`` everywhere. It is the CPU path, the test path and the fallback.

Launch: any way that initializes ``torch.distributed`` (``torchrun --nproc-per-node=4 train.py``
and ``dist.init_process_group("gloo")``), then ``TorchCommunicator()`` uses the default group.
Without an initialized process group it is a single-rank communicator whose collectives are
local copies, so a single-process user needs no setup.

dtypes: the backend's own dtypes travel as they are. A dtype the backend lacks (int16 and
uint16 on gloo and nccl; any other) travels bit-cast as bytes (``uint8``) for all_gather,
broadcast and all_to_all, which only copy; reducing such a dtype raises ``ValueError``.

``op="avg"`` on gloo is a sum followed by a division by ``world_size`` inside ``Work.wait()``
(gloo in older torch versions has no average); on nccl it is NCCL's own average.

Errors: a failing or timed-out collective raises ``CommError`` from ``Work.wait()`` (or from the
call, if torch.distributed refuses to enqueue it). ``timeout`` bounds each ``wait()``; without
it, the process group's own timeout applies. After a ``CommError`` the group is broken: the
ranks cannot know which collectives the others completed, so training must stop or restart.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from .base import CommError, Communicator, CompletedWork, Work

REDUCIBLE_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16,
                    torch.int8, torch.uint8, torch.int32, torch.int64)
"""dtypes that gloo and nccl both reduce (``op="avg"`` additionally needs a floating dtype)."""

NATIVE_DTYPES = {
    "gloo": frozenset(REDUCIBLE_DTYPES) | {torch.bool},
    "nccl": frozenset(REDUCIBLE_DTYPES),
}
"""dtypes each torch.distributed backend carries as they are; any other dtype is bit-cast."""

_REDUCE_OP = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "avg": dist.ReduceOp.AVG}

# all_gather_single / reduce_scatter_single are the torch >= 2.10 names of the *_tensor calls.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _TorchWork(Work):
    """A torch.distributed work handle, the tensors it uses (kept alive until it completes) and
    an optional ``finish`` run once after it completes (e.g. the division of an average)."""

    def __init__(self, comm: TorchCommunicator, op: str, work: dist.Work,
                 keep: tuple[torch.Tensor, ...], finish: Callable[[], None] | None = None):
        self._comm = comm
        self._op = op
        self._step = comm.step
        self._work: dist.Work | None = work
        self._keep: tuple[torch.Tensor, ...] | None = keep
        self._finish = finish

    def wait(self) -> None:
        work = self._work
        if work is None:
            return
        timeout = self._comm.timeout
        try:
            done = work.wait() if timeout is None else work.wait(timeout)
        except Exception as e:  # noqa: BLE001 - every backend failure becomes a CommError
            raise CommError(self._op, self._comm.rank, self._step,
                            f"{type(e).__name__}: {e}") from e
        if done is False:
            raise CommError(self._op, self._comm.rank, self._step,
                            f"not complete within the timeout of {timeout}")
        if self._finish is not None:
            self._finish()
        self._work = None
        self._keep = None
        self._finish = None

    def is_completed(self) -> bool:
        return self._work is None or bool(self._work.is_completed())


class TorchCommunicator(Communicator):
    """The Communicator protocol on a torch.distributed process group.

    Args:
        group: the process group (default: the default group; if torch.distributed is not
            initialized, a single-rank communicator).
        timeout: bound on each ``Work.wait()`` and ``barrier()`` (``timedelta`` or seconds);
            ``None`` leaves it to the process group's own timeout.
        device: the device of the tensors. Multi-rank: defaults to ``cpu`` for gloo and the
            current CUDA device for nccl, and must agree with the backend. Single-rank:
            defaults to ``cpu``; local copies work on any device, so tensors on another device
            are accepted as long as ``out`` and ``inp`` agree.
    """

    def __init__(self, group: dist.ProcessGroup | None = None,
                 timeout: datetime.timedelta | float | None = None,
                 *, device: torch.device | str | None = None):
        self._init_stats()
        self.group = group
        self.timeout = _as_timedelta(timeout)
        self.single = group is None and not (dist.is_available() and dist.is_initialized())
        if self.single:
            self.backend = "local"
            self.rank, self.world_size = 0, 1
            self.device = torch.device(device if device is not None else "cpu")
            return
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("TorchCommunicator: a group was given but torch.distributed is "
                             "not initialized; call dist.init_process_group first")
        if group is not None and group == dist.GroupMember.NON_GROUP_MEMBER:
            raise ValueError("TorchCommunicator: this process is not a member of the group")
        backend = str(dist.get_backend(group))
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.device = _backend_device(backend, device)
        self.backend = "nccl" if self.device.type == "cuda" else "gloo"
        if self.backend not in backend:
            raise ValueError(f"TorchCommunicator: device {self.device} needs the "
                             f"{self.backend} backend, but the group's backend is {backend!r}")
        self._native = NATIVE_DTYPES[self.backend]

    def __repr__(self) -> str:
        return (f"TorchCommunicator(backend={self.backend!r}, rank={self.rank}, "
                f"world_size={self.world_size}, device={self.device})")

    def _reducible_dtypes(self) -> tuple[torch.dtype, ...]:
        return REDUCIBLE_DTYPES

    # -- collectives -----------------------------------------------------------------------
    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> Work:
        self._check_all_gather(out, inp, strict_device=not self.single)
        self._count("all_gather", out.nbytes)
        if self.single:
            out.view(-1).copy_(inp.view(-1))
            return CompletedWork()
        o, i = self._wire(out), self._wire(inp)
        return self._launch("all_gather", lambda: _all_gather_flat(
            o, i, group=self.group, async_op=True), (out, inp, o, i))

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, op: str = "avg") -> Work:
        self._check_reduce_scatter(out, inp, op, strict_device=not self.single)
        self._count("reduce_scatter", inp.nbytes)
        if self.single:
            out.view(-1).copy_(inp.view(-1))
            return CompletedWork()
        wire_op, finish = self._reduction(op, out)
        return self._launch("reduce_scatter", lambda: _reduce_scatter_flat(
            out.view(-1), inp.view(-1), op=wire_op, group=self.group, async_op=True),
            (out, inp), finish)

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor) -> Work:
        self._check_all_to_all(out, inp, strict_device=not self.single)
        self._count("all_to_all", inp.nbytes)
        if self.single:
            out.copy_(inp)
            return CompletedWork()
        # equal splits along dim 0; a bit-cast wire keeps them aligned (m * itemsize bytes)
        o, i = self._wire(out), self._wire(inp)
        return self._launch("all_to_all", lambda: dist.all_to_all_single(
            o, i, group=self.group, async_op=True), (out, inp, o, i))

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> Work:
        self._check_all_reduce(t, op, strict_device=not self.single)
        self._count("all_reduce", t.nbytes)
        if self.single:
            return CompletedWork()
        wire_op, finish = self._reduction(op, t)
        return self._launch("all_reduce", lambda: dist.all_reduce(
            t, op=wire_op, group=self.group, async_op=True), (t,), finish)

    def broadcast(self, t: torch.Tensor, src: int) -> Work:
        self._check_broadcast(t, src, strict_device=not self.single)
        self._count("broadcast", t.nbytes)
        if self.single:
            return CompletedWork()
        w = self._wire(t)
        global_src = src if self.group is None else dist.get_global_rank(self.group, src)
        return self._launch("broadcast", lambda: dist.broadcast(
            w, global_src, group=self.group, async_op=True), (t, w))

    def barrier(self) -> None:
        if self.single:
            return
        self._launch("barrier", lambda: dist.barrier(group=self.group, async_op=True),
                     ()).wait()

    # -- helpers ---------------------------------------------------------------------------
    def _wire(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` flat, as it travels: itself, or its bytes if the backend lacks its dtype."""
        flat = t.view(-1)
        return flat if t.dtype in self._native else flat.view(torch.uint8)

    def _reduction(self, op: str, result: torch.Tensor
                   ) -> tuple[Any, Callable[[], None] | None]:
        """The wire op, and what ``wait()`` must do to finish ``result``."""
        if op == "avg" and self.backend == "gloo":
            world = self.world_size

            def finish() -> None:
                result.div_(world)

            return dist.ReduceOp.SUM, finish
        return _REDUCE_OP[op], None

    def _launch(self, op: str, enqueue: Callable[[], dist.Work | None],
                keep: tuple[torch.Tensor, ...],
                finish: Callable[[], None] | None = None) -> Work:
        try:
            work = enqueue()
        except RuntimeError as e:
            raise CommError(op, self.rank, self.step, f"{type(e).__name__}: {e}") from e
        if work is None:  # not a member of the group: nothing to do
            return CompletedWork()
        return _TorchWork(self, op, work, keep, finish)


def _as_timedelta(timeout: datetime.timedelta | float | None) -> datetime.timedelta | None:
    if timeout is None or isinstance(timeout, datetime.timedelta):
        return timeout
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0:
        raise ValueError(f"timeout must be a positive number of seconds, a timedelta or None, "
                         f"got {timeout!r}")
    return datetime.timedelta(seconds=float(timeout))


def _backend_device(backend: str, device: torch.device | str | None) -> torch.device:
    """The device a group with ``backend`` (e.g. ``"gloo"``, ``"nccl"``,
    ``"cpu:gloo,cuda:nccl"``) runs collectives on."""
    if device is not None:
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        if dev.type not in ("cpu", "cuda"):
            raise ValueError(f"TorchCommunicator: device must be cpu or cuda, got {dev}")
        return dev
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
