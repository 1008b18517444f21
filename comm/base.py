"""The ``Communicator`` protocol shared by every backend, the ``Work`` handle, ``CommError``, and
the argument checks that every backend runs before it enqueues anything.

A communicator moves flat, contiguous tensors between the ``world_size`` ranks of a group:

    all_gather(out, inp)            out[r*n:(r+1)*n] = inp of rank r       (n = inp.numel())
    reduce_scatter(out, inp, op)    out = op over ranks of inp[r*m:(r+1)*m] (m = out.numel())
    all_reduce(t, op)               t = op over ranks of t                  (in place)
    broadcast(t, src)               t = t of rank src                       (in place)
    all_to_all(out, inp)            out[r*m:(r+1)*m] = inp[rank*m:(rank+1)*m] of rank r
                                                                  (m = inp.numel() // world_size)

Every collective returns a ``Work`` at once; nothing blocks until ``Work.wait()``. Several
collectives may be in flight and may be waited in any order. The result tensors must not be
read before ``wait()`` returns (a backend may finish the result inside ``wait()``, e.g. divide
a sum by the world size for ``op="avg"``), and the caller must not write the inputs before then.

Byte accounting (``stats``): each collective adds one call and its payload to its op's counter.
The payload is ``out.nbytes`` for all_gather (what every rank holds afterwards),
``inp.nbytes`` for reduce_scatter and all_to_all (what every rank contributes), ``t.nbytes``
for all_reduce and broadcast. These are payload bytes, not wire bytes: a ring all_gather puts
``(W-1)/W * out.nbytes`` on each rank's link.

Errors: arguments are checked on the calling rank before anything is enqueued and raise
``ValueError``/``TypeError``; since every rank runs the same checks on the same kind of
arguments, a bad call fails on every rank and leaves the group in step. Failures of the
communication itself (a peer died, a timeout) raise ``CommError``, which names the op, the rank
and the training step set with ``set_step()``.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping

import torch

OPS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast", "all_to_all")
"""The op names used as keys of ``Communicator.stats``."""

REDUCE_OPS = {
    "reduce_scatter": ("sum", "avg"),
    "all_reduce": ("sum", "avg", "max"),
}
"""Reduction ops accepted by each reducing collective."""


class CommError(RuntimeError):
    """A collective failed or timed out. ``op``, ``rank`` and ``step`` say which and where."""

    def __init__(self, op: str, rank: int, step: int | None, detail: str):
        self.op = op
        self.rank = rank
        self.step = step
        self.detail = detail
        where = f"rank {rank}" + (f", step {step}" if step is not None else "")
        super().__init__(f"{op} failed on {where}: {detail}")


class Work(abc.ABC):
    """Handle of one enqueued collective."""

    @abc.abstractmethod
    def wait(self) -> None:
        """Make the result usable by the caller; raise ``CommError`` if the collective failed.

        Host backends (gloo) block until done. Device backends (NCCL) make the caller's current
        CUDA stream wait for the collective and return without synchronizing the host.
        Calling ``wait()`` again is a no-op.
        """

    @abc.abstractmethod
    def is_completed(self) -> bool:
        """True once the collective has finished (never blocks). ``wait()`` is still required
        before reading the result."""


class CompletedWork(Work):
    """A ``Work`` that is already done (single-rank collectives are local copies)."""

    def wait(self) -> None:
        return None

    def is_completed(self) -> bool:
        return True


class FinishedWork(Work):
    """A collective in flight and a local step that completes its result, run once in
    ``wait()`` after the collective (on the caller's current stream, as a backend's own
    ``wait()`` finishes an average); what ``finish`` returns is dropped."""

    def __init__(self, work: Work, finish: Callable[[], object]):
        self._work = work
        self._finish: Callable[[], object] | None = finish

    def wait(self) -> None:
        if self._finish is None:
            return
        self._work.wait()
        self._finish()
        self._finish = None

    def is_completed(self) -> bool:
        return self._finish is None or self._work.is_completed()


class Communicator(abc.ABC):
    """A group of ``world_size`` ranks that run the same collectives in the same order.

    Subclasses set ``rank``, ``world_size`` and ``device``, call ``_init_stats()``, and
    implement the five collectives and ``barrier()``. The ``_check_*`` methods here do the
    argument checks common to every backend.
    """

    rank: int
    world_size: int
    device: torch.device
    _stats: dict[str, dict[str, int]]
    _step: int | None

    def _init_stats(self) -> None:
        self._stats = {op: {"calls": 0, "bytes": 0} for op in OPS}
        self._step = None

    # -- bookkeeping -----------------------------------------------------------------------
    @property
    def stats(self) -> Mapping[str, Mapping[str, int]]:
        """``{op: {"calls": int, "bytes": int}}`` for every op in ``OPS`` (live counters)."""
        return self._stats

    def reset_stats(self) -> None:
        """Zero every counter."""
        for counter in self._stats.values():
            counter["calls"] = 0
            counter["bytes"] = 0

    def set_step(self, step: int | None) -> None:
        """Record the training step the next collectives belong to; ``CommError`` names it.

        The optimizer calls this at the start of each ``step()``. ``None`` clears it.
        """
        if step is not None and (isinstance(step, bool) or not isinstance(step, int)):
            raise TypeError(f"step must be an int or None, got {type(step).__name__} {step!r}")
        self._step = step

    @property
    def step(self) -> int | None:
        """The step set by ``set_step()`` (None if unset)."""
        return self._step

    def _count(self, op: str, nbytes: int) -> None:
        self._stats[op]["calls"] += 1
        self._stats[op]["bytes"] += int(nbytes)

    # -- collectives -----------------------------------------------------------------------
    @abc.abstractmethod
    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> Work:
        """``out[r*n:(r+1)*n] = inp`` of rank r; ``out.numel() == world_size * inp.numel()``."""

    @abc.abstractmethod
    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, op: str = "avg") -> Work:
        """``out`` = op over ranks of ``inp[rank*m:(rank+1)*m]``, ``m = out.numel()``;
        ``op`` in ``"sum"``, ``"avg"``."""

    @abc.abstractmethod
    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor) -> Work:
        """Every rank sends one equal segment of ``inp`` to every rank: with
        ``m = inp.numel() // world_size``, ``out[r*m:(r+1)*m]`` on this rank is
        ``inp[rank*m:(rank+1)*m]`` of rank r (this rank's own segment included).

        ``inp`` and ``out`` are 1-D, contiguous, of one dtype and device, with the same numel,
        a multiple of ``world_size``. Any dtype: the bytes move as they are, nothing is reduced
        (a dtype the backend lacks travels bit-cast). Asynchronous like the others: ``out`` is
        valid after ``wait()``. Counted in ``stats["all_to_all"]`` as ``inp.nbytes``.
        """

    @abc.abstractmethod
    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> Work:
        """In place: ``t`` = op over ranks of ``t``; ``op`` in ``"sum"``, ``"avg"``, ``"max"``."""

    @abc.abstractmethod
    def broadcast(self, t: torch.Tensor, src: int) -> Work:
        """In place: ``t`` = ``t`` of rank ``src`` (a rank of this group)."""

    @abc.abstractmethod
    def barrier(self) -> None:
        """Block until every rank of the group has reached the barrier."""

    # -- argument checks (run before anything is enqueued) --------------------------------
    def _check_tensor(self, op: str, name: str, t: object, strict_device: bool = True) -> None:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_contiguous():
            raise ValueError(f"{op}: {name} must be contiguous (shape {tuple(t.shape)}, "
                             f"strides {t.stride()}); pass {name}.contiguous()")
        if strict_device and not _same_device(t.device, self.device):
            raise ValueError(f"{op}: {name} must be on {self.device} (this communicator's "
                             f"device), got {t.device}")

    def _check_pair(self, op: str, out: torch.Tensor, inp: torch.Tensor,
                    strict_device: bool = True) -> None:
        self._check_tensor(op, "out", out, strict_device)
        self._check_tensor(op, "inp", inp, strict_device)
        if out.dtype != inp.dtype:
            raise ValueError(f"{op}: out and inp must have the same dtype, got out {out.dtype} "
                             f"and inp {inp.dtype}")
        if out.device != inp.device:
            raise ValueError(f"{op}: out and inp must be on the same device, got out "
                             f"{out.device} and inp {inp.device}")

    def _check_all_gather(self, out: torch.Tensor, inp: torch.Tensor,
                          strict_device: bool = True) -> None:
        self._check_pair("all_gather", out, inp, strict_device)
        if out.numel() != self.world_size * inp.numel():
            raise ValueError(f"all_gather: out.numel() must be world_size * inp.numel() = "
                             f"{self.world_size} * {inp.numel()} = "
                             f"{self.world_size * inp.numel()}, got {out.numel()}")

    def _check_reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, op: str,
                              strict_device: bool = True) -> None:
        self._check_pair("reduce_scatter", out, inp, strict_device)
        if inp.numel() != self.world_size * out.numel():
            raise ValueError(f"reduce_scatter: inp.numel() must be world_size * out.numel() = "
                             f"{self.world_size} * {out.numel()} = "
                             f"{self.world_size * out.numel()}, got {inp.numel()}")
        self._check_reduction("reduce_scatter", op, out.dtype)

    def _check_all_to_all(self, out: torch.Tensor, inp: torch.Tensor,
                          strict_device: bool = True) -> None:
        self._check_pair("all_to_all", out, inp, strict_device)
        for name, t in (("out", out), ("inp", inp)):
            if t.dim() != 1:
                raise ValueError(f"all_to_all: {name} must be 1-D, got shape {tuple(t.shape)}; "
                                 f"pass {name}.view(-1)")
        if out.numel() != inp.numel():
            raise ValueError(f"all_to_all: out.numel() must equal inp.numel() = {inp.numel()}, "
                             f"got {out.numel()}")
        if inp.numel() % self.world_size:
            raise ValueError(f"all_to_all: inp.numel() must be a multiple of world_size = "
                             f"{self.world_size} (one equal segment per rank), got "
                             f"{inp.numel()}")

    def _check_all_reduce(self, t: torch.Tensor, op: str, strict_device: bool = True) -> None:
        self._check_tensor("all_reduce", "t", t, strict_device)
        self._check_reduction("all_reduce", op, t.dtype)

    def _check_broadcast(self, t: torch.Tensor, src: int, strict_device: bool = True) -> None:
        self._check_tensor("broadcast", "t", t, strict_device)
        if isinstance(src, bool) or not isinstance(src, int):
            raise TypeError(f"broadcast: src must be an int rank, got {type(src).__name__}")
        if not 0 <= src < self.world_size:
            raise ValueError(f"broadcast: src must be a rank in [0, {self.world_size}), "
                             f"got {src}")

    def _check_reduction(self, coll: str, op: object, dtype: torch.dtype) -> None:
        allowed = REDUCE_OPS[coll]
        if op not in allowed:
            raise ValueError(f"{coll}: op must be one of {allowed}, got {op!r}")
        reducible = self._reducible_dtypes()
        if dtype not in reducible:
            names = ", ".join(str(d).removeprefix("torch.") for d in reducible)
            raise ValueError(f"{coll}: this backend cannot reduce {dtype} (it travels only "
                             f"bit-cast, for all_gather, broadcast and all_to_all); reducible "
                             f"dtypes: {names}")
        if op == "avg" and not dtype.is_floating_point:
            raise ValueError(f"{coll}: op='avg' needs a floating dtype (an average of "
                             f"integers is not an integer), got {dtype}; use op='sum'")

    @abc.abstractmethod
    def _reducible_dtypes(self) -> tuple[torch.dtype, ...]:
        """The dtypes this backend can reduce natively."""


def _same_device(a: torch.device, b: torch.device) -> bool:
    """``a`` is ``b``, treating a CUDA device without an index as the current one."""
    if a.type != b.type:
        return False
    if a.type != "cuda":
        return True
    ia = a.index if a.index is not None else torch.cuda.current_device()
    ib = b.index if b.index is not None else torch.cuda.current_device()
    return ia == ib
