"""Communication counters of the benchmark runner (:mod:`bench.engine.runner`).

:func:`timed_communicator` wraps a :class:`scape.comm.Communicator` and adds the seconds spent
blocked in ``Work.wait()`` (and barriers) to ``wait_s``; :class:`DDPCounter` counts the bytes
and the all-reduce time of DDP's gradient buckets through a comm hook;
:func:`delayed_communicator` adds a link's latency where the kernel has no ``netem``.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from scape.comm import Communicator, Work


class _Wrapping(Communicator):
    """``inner`` with each collective's ``Work`` passed through ``self._wrap(op, work)``;
    counters, step tags and barriers are the inner communicator's."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.group = getattr(inner, "group", None)  # which ranks (the library's layout checks)
        self.rank, self.world_size, self.device = inner.rank, inner.world_size, inner.device

    def _wrap(self, op: str, work: Any) -> Work:
        raise NotImplementedError

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
        return self._wrap("all_gather", self.inner.all_gather(out, inp))

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, op: str = "avg") -> Work:
        return self._wrap("reduce_scatter", self.inner.reduce_scatter(out, inp, op))

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor) -> Work:
        return self._wrap("all_to_all", self.inner.all_to_all(out, inp))

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> Work:
        return self._wrap("all_reduce", self.inner.all_reduce(t, op))

    def broadcast(self, t: torch.Tensor, src: int) -> Work:
        return self._wrap("broadcast", self.inner.broadcast(t, src))

    def barrier(self) -> None:
        self.inner.barrier()


class _TimedWork(Work):
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


class _Timed(_Wrapping):
    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.wait_s = 0.0

    def _wrap(self, op: str, work: Any) -> Work:
        return _TimedWork(self, work)

    def barrier(self) -> None:
        t0 = time.perf_counter()
        try:
            self.inner.barrier()
        finally:
            self.wait_s += time.perf_counter() - t0


def timed_communicator(inner: Any) -> Any:
    """``inner`` behind a wrapper that adds the seconds spent in ``Work.wait()`` to
    ``.wait_s``. Collectives, byte counters and step tags are the inner communicator's."""
    return _Timed(inner)


RING_STEPS = {"all_gather": 1, "reduce_scatter": 1, "all_to_all": 1, "all_reduce": 2,
              "broadcast": 1}
"""Per op, the multiple of ``W - 1`` message rounds a ring algorithm makes (an all-reduce is
a reduce-scatter and an all-gather; an all-to-all, ``W - 1`` pairwise exchanges)."""


class _DelayedWork(Work):
    def __init__(self, work: Any, done_at: float) -> None:
        self._work, self._done_at = work, done_at

    def wait(self) -> None:
        self._work.wait()
        left = self._done_at - time.perf_counter()
        if left > 0:
            time.sleep(left)

    def is_completed(self) -> bool:
        return bool(self._work.is_completed()) and time.perf_counter() >= self._done_at


class _Delayed(_Wrapping):
    def __init__(self, inner: Any, delay_s: float) -> None:
        super().__init__(inner)
        self.delay_s, self._free_at = delay_s, 0.0

    def _wrap(self, op: str, work: Any) -> Work:
        start = max(time.perf_counter(), self._free_at)
        self._free_at = start + RING_STEPS[op] * (self.world_size - 1) * self.delay_s
        return _DelayedWork(work, self._free_at)


def delayed_communicator(inner: Any, delay_s: float) -> Any:
    """``inner`` on a link of one-way latency ``delay_s``, modelled: collectives run on
    ``inner`` as they are, but one launched at ``t`` completes (``Work.wait()`` returns) no
    sooner than ``max(t, the previous one's completion) + rounds * delay_s``, ``rounds =``
    :data:`RING_STEPS` ``[op] * (W - 1)`` (collectives share the link in launch order, as
    on one communicator's stream). The transfer time of the bytes is not added to it: use it
    on an unshaped link, where that time is small. Barriers are not delayed."""
    return _Delayed(inner, delay_s)


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
