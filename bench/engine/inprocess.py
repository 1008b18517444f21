"""W ranks as threads of one process: a :class:`scape.comm.Communicator` whose collectives run
through shared memory, for W data-parallel ranks on one device (``python -m bench.gpu``).

NCCL cannot place two ranks on one GPU, and processes sharing a GPU would stage every
collective through the host. Here the ranks are threads: each builds its own model replica,
gradient buffer and optimizer on the one device and talks through an
:class:`InProcessCommunicator` of one :class:`InProcessGroup`::

    group = InProcessGroup(world_size=8, device="cuda")
    comms = group.communicators()          # rank r's communicator: comms[r]
    # thread r: opt = scape.SCAPE(model_r.parameters(), lr=3e-4, comm=comms[r]) ...

A collective runs when it is called and returns a completed ``Work``: every rank posts its
input, waits at the group's ``threading.Barrier``, computes its own output from every rank's
input (in rank order, so the result is the same on every rank and run), and waits at the
barrier again before it returns (no rank writes an input another still reads). Reductions add
the ranks' tensors in rank order (16-bit floats accumulated in fp32); ``avg`` divides the sum
by the world size afterwards, as ``TorchCommunicator`` does on gloo. Bytes are counted as the
other backends count them (``comm.stats``), so a step's bytes equal a real run's.

On a GPU every thread must launch on the device's default stream (PyTorch's default for each
thread): the barrier orders the threads' launches on the host, and one stream then orders the
kernels, so no event is needed. A collective on another stream raises ``CommError``.

``InProcessGroup.sync_device = True`` synchronizes the device at both barriers, so that
``InProcessCommunicator.comm_s`` (seconds from the last rank's arrival to the end of the
collective, this rank's clock) holds the device time of the collectives themselves; off, it
holds host time only. A thread that fails calls :meth:`InProcessGroup.abort`: the others' next
collective raises ``CommError`` instead of waiting for ever; ``timeout`` bounds every barrier.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from bench.engine.nullcomm import REDUCIBLE_DTYPES
from scape.comm.base import CommError, Communicator, CompletedWork, Work


class InProcessGroup:
    """The shared state of ``world_size`` in-process ranks: one barrier and one slot per rank."""

    def __init__(self, world_size: int, device: str | torch.device = "cpu",
                 timeout: float | None = 600.0) -> None:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        self.world_size = world_size
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.timeout = timeout
        self.sync_device = False
        self._barrier = threading.Barrier(world_size, timeout=timeout)
        self._slots: list[Any] = [None] * world_size

    def communicators(self) -> list[InProcessCommunicator]:
        """One communicator per rank, rank order."""
        return [InProcessCommunicator(self, r) for r in range(self.world_size)]

    def abort(self) -> None:
        """Break the barrier: every rank waiting, or arriving later, raises ``CommError``."""
        self._barrier.abort()

    def _sync(self) -> None:
        if self.sync_device and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


class InProcessCommunicator(Communicator):
    """Rank ``rank`` of an :class:`InProcessGroup` (module docstring)."""

    def __init__(self, group: InProcessGroup, rank: int) -> None:
        if not 0 <= rank < group.world_size:
            raise ValueError(f"need 0 <= rank < {group.world_size}, got {rank}")
        self.group = group
        self.rank, self.world_size, self.device = rank, group.world_size, group.device
        self.comm_s = 0.0
        self._init_stats()

    def __repr__(self) -> str:
        return (f"InProcessCommunicator(rank={self.rank}, world_size={self.world_size}, "
                f"device={self.device})")

    def _reducible_dtypes(self) -> tuple[torch.dtype, ...]:
        return REDUCIBLE_DTYPES

    # -- the exchange ----------------------------------------------------------------------
    def _wait(self, op: str) -> None:
        try:
            self.group._barrier.wait()
        except threading.BrokenBarrierError:
            raise CommError(op, self.rank, self.step,
                            "the group was aborted (another rank failed) or a barrier timed "
                            f"out after {self.group.timeout} s") from None

    def _run(self, op: str, inp: Any, compute: Callable[[Sequence[Any]], None]) -> Work:
        """Post ``inp``, wait for every rank's, ``compute(inputs)`` (this rank's output), wait
        until every rank has read, return a completed ``Work``."""
        if self.device.type == "cuda" and \
                torch.cuda.current_stream(self.device) != torch.cuda.default_stream(self.device):
            raise CommError(op, self.rank, self.step, "InProcessCommunicator runs on the "
                            "device's default stream only (every rank's kernels in one order)")
        group = self.group
        group._slots[self.rank] = inp
        group._sync()
        self._wait(op)
        t0 = time.perf_counter()
        try:
            compute(list(group._slots))
            group._sync()
        except Exception:
            group.abort()
            raise
        self._wait(op)
        self.comm_s += time.perf_counter() - t0
        return CompletedWork()

    # -- collectives -----------------------------------------------------------------------
    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> Work:
        self._check_all_gather(out, inp)
        self._count("all_gather", out.nbytes)

        def compute(inputs: Sequence[torch.Tensor]) -> None:
            torch.cat([t.view(-1) for t in inputs], out=out.view(-1))

        return self._run("all_gather", inp, compute)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, op: str = "avg") -> Work:
        self._check_reduce_scatter(out, inp, op)
        self._count("reduce_scatter", inp.nbytes)
        m = out.numel()
        lo = self.rank * m

        def compute(inputs: Sequence[torch.Tensor]) -> None:
            out.view(-1).copy_(_reduce([t.view(-1)[lo:lo + m] for t in inputs], op))

        return self._run("reduce_scatter", inp, compute)

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor) -> Work:
        self._check_all_to_all(out, inp)
        self._count("all_to_all", inp.nbytes)
        m = inp.numel() // self.world_size
        lo = self.rank * m

        def compute(inputs: Sequence[torch.Tensor]) -> None:
            torch.cat([t.view(-1)[lo:lo + m] for t in inputs], out=out.view(-1))

        return self._run("all_to_all", inp, compute)

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> Work:
        self._check_all_reduce(t, op)
        self._count("all_reduce", t.nbytes)
        result: list[torch.Tensor] = []

        def compute(inputs: Sequence[torch.Tensor]) -> None:
            result.append(_reduce(inputs, op))  # written after every rank has read

        work = self._run("all_reduce", t, compute)
        t.copy_(result[0])
        return work

    def broadcast(self, t: torch.Tensor, src: int) -> Work:
        self._check_broadcast(t, src)
        self._count("broadcast", t.nbytes)
        result: list[torch.Tensor] = []

        def compute(inputs: Sequence[torch.Tensor]) -> None:
            if self.rank != src:
                result.append(inputs[src].clone())

        work = self._run("broadcast", t, compute)
        if result:
            t.copy_(result[0])
        return work

    def barrier(self) -> None:
        """Every rank waits here (with ``sync_device``, after the device finished); not counted
        in ``comm_s``."""
        self.group._sync()
        self._wait("barrier")


def _reduce(tensors: Sequence[torch.Tensor], op: str) -> torch.Tensor:
    """``op`` over ``tensors`` in order (a new tensor of their dtype)."""
    dtype = tensors[0].dtype
    wide = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    acc = tensors[0].to(wide, copy=True)
    for t in tensors[1:]:
        if op == "max":
            torch.maximum(acc, t.to(wide), out=acc)
        else:
            acc.add_(t.to(wide))
    if op == "avg":
        acc.div_(len(tensors))
    return acc.to(dtype)


def run_threads(fn: Callable[..., Any], world_size: int, *args: Any,
                device: str | torch.device = "cpu", timeout: float | None = 600.0,
                group: InProcessGroup | None = None) -> list[Any]:
    """``fn(rank, comm, *args)`` on ``world_size`` threads of one :class:`InProcessGroup`;
    the results by rank. A rank's exception aborts the group (the others raise ``CommError``)
    and is raised here, the first failing rank's, with the others' named."""
    group = group or InProcessGroup(world_size, device, timeout)
    comms = group.communicators()
    results: list[Any] = [None] * world_size
    errors: list[tuple[int, BaseException]] = []

    def body(rank: int) -> None:
        try:
            results[rank] = fn(rank, comms[rank], *args)
        except BaseException as e:  # noqa: BLE001 - reported below, with the rank
            errors.append((rank, e))
            group.abort()

    threads = [threading.Thread(target=body, args=(r,), name=f"rank{r}", daemon=True)
               for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        first = next((e for e in errors if not isinstance(e[1], CommError)), errors[0])
        others = ", ".join(f"rank {r}: {type(e).__name__}" for r, e in errors if e is not first[1])
        raise RuntimeError(f"rank {first[0]} of {world_size} failed: "
                           f"{type(first[1]).__name__}: {first[1]}"
                           + (f" ({others})" if others else "")) from first[1]
    return results
