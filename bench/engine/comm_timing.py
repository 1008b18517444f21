"""Communication counters of the benchmark runner (:mod:`bench.engine.runner`).

:func:`timed_communicator` wraps a :class:`scape.comm.Communicator` and adds the seconds spent
blocked in ``Work.wait()`` (and barriers) to ``wait_s``; :class:`DDPCounter` counts the bytes
and the all-reduce time of DDP's gradient buckets through a comm hook.
"""

from __future__ import annotations

import time
from typing import Any

import torch


def timed_communicator(inner: Any) -> Any:
    """``inner`` behind a wrapper that adds the seconds spent in ``Work.wait()`` to
    ``.wait_s``. Collectives, byte counters and step tags are the inner communicator's."""
    from scape.comm import Communicator, Work

    class TimedWork(Work):
        def __init__(self, owner: Any, work: Any) -> None:
            self._owner, self._work = owner, work

        def wait(self) -> None:
            t0 = time.perf_counter()
            try:
                self._work.wait()
            finally:
                self._owner.wait_s += time.perf_counter() - t0

        def is_completed(self) -> bool:
            return bool(self._work.is_completed())

    class TimedCommunicator(Communicator):
        group = getattr(inner, "group", None)  # which ranks (the library's layout checks)

        def __init__(self) -> None:
            self.inner = inner
            self.rank, self.world_size, self.device = inner.rank, inner.world_size, inner.device
            self.wait_s = 0.0

        @property
        def stats(self) -> Any:
            return self.inner.stats

        def _reducible_dtypes(self) -> tuple[torch.dtype, ...]:
            return self.inner._reducible_dtypes()  # type: ignore[no-any-return]

        def reset_stats(self) -> None:
            self.inner.reset_stats()

        def set_step(self, step: int | None) -> None:
            self.inner.set_step(step)

        def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> Work:
            return TimedWork(self, self.inner.all_gather(out, inp))

        def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, op: str = "avg") -> Work:
            return TimedWork(self, self.inner.reduce_scatter(out, inp, op))

        def all_to_all(self, out: torch.Tensor, inp: torch.Tensor) -> Work:
            return TimedWork(self, self.inner.all_to_all(out, inp))

        def all_reduce(self, t: torch.Tensor, op: str = "sum") -> Work:
            return TimedWork(self, self.inner.all_reduce(t, op))

        def broadcast(self, t: torch.Tensor, src: int) -> Work:
            return TimedWork(self, self.inner.broadcast(t, src))

        def barrier(self) -> None:
            t0 = time.perf_counter()
            try:
                self.inner.barrier()
            finally:
                self.wait_s += time.perf_counter() - t0

    return TimedCommunicator()


class DDPCounter:
    """Bytes and all-reduce time of DDP's gradient buckets, through a comm hook.

    ``wait_s`` is the length of the union of the buckets' launch-to-completion intervals
    (buckets overlap each other, so their durations do not add up).
    """

    def __init__(self, world: int) -> None:
        self.world = world
        self.bytes = 0
        self.calls = 0
        self.intervals: list[tuple[float, float]] = []

    @property
    def wait_s(self) -> float:
        total, end = 0.0, float("-inf")
        for a, b in sorted(self.intervals):
            if b > end:
                total += b - max(a, end)
                end = b
        return total

    @property
    def stats(self) -> dict[str, dict[str, int]]:
        return {"all_reduce": {"calls": self.calls, "bytes": self.bytes}}

    def hook(self, state, bucket):  # type: ignore[no-untyped-def]  # DDP checks annotations
        import torch.distributed as dist

        buf = bucket.buffer()
        self.calls += 1
        self.bytes += 2 * buf.numel() * buf.element_size()  # ring: reduce-scatter + all-gather
        buf.div_(self.world)
        t0 = time.perf_counter()
        fut = dist.all_reduce(buf, async_op=True).get_future()

        def done(f: Any) -> torch.Tensor:
            self.intervals.append((t0, time.perf_counter()))
            return f.value()[0]

        return fut.then(done)
