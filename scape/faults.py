"""Fault injection: the one documented hook for making a rank die, hang or send bad values.

A test installs a plan on an optimizer; nothing is read from the environment::

    faults.install(opt, "1:5:reduce_scatter:die")     # this rank's faults of the spec, armed
    with faults.inject(opt, "0:3:all_gather:hang=30"):  # armed inside the block only
        ...

A spec is ``RANK:STEP:PHASE:KIND[=ARG]``, several separated by ``","`` (:func:`parse`)::

    1:5:reduce_scatter:die       rank 1 exits (os._exit(86)) at step 5, just before its
                                 gradient reduce-scatter
    0:3:all_gather:hang=30       rank 0 sleeps 30 s before the parameter all-gather
    1:4:grad:nan=17              rank 1 writes NaN into gradient coordinate 17

``STEP`` is the 1-based optimizer step (``opt.step_count`` during that step). Phases, in the
order a step runs them (DESIGN §1)::

    grad            after the gradients are folded into the buffer, before the statistics
    reduce_scatter  before the take and the gradient reduce-scatter
    all_reduce      before the scalar all-reduce (gradient norm, non-finite count; a step
                    whose scalars ride in its other collectives has none)
    all_gather      before the shard update and the parameter all-gather
    mask_sync       after the parameter all-gathers, before the next masks of buckets that
                    were dense this step are made and their all-gather issued (a sparse
                    bucket's next mask rides with its parameter all-gather)
    save            inside ``scape.save_checkpoint``: after this rank's file is written,
                    before the manifest (a crash in the middle of a save)

Kinds: ``die`` (``os._exit(ARG)``, default 86), ``kill`` (SIGKILL to itself), ``hang``
(sleep ARG seconds, default 3600, then carry on), ``nan`` / ``inf`` (write NaN / +Inf into the
first bucket's gradient buffer at flat index ARG, default the first coordinate this rank owns;
phase ``grad`` only). Before ``die`` and ``kill`` the rank completes the collectives it has in
flight, so the fault lands exactly at the named phase and not in an earlier collective.

Every fault fires once. Each rank installs the same spec; only its own faults are armed, and
an optimizer with none holds ``None``: a step then pays one ``is None`` test per phase. A
launcher that restarts failed jobs decides itself whether a restarted attempt arms the plan
again (``tests/torchrun_train.py`` reads ``SCAPE_FAULT`` and arms it in the first attempt only).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import time
from collections.abc import Iterator, Sequence
from typing import Any

PHASES = ("grad", "reduce_scatter", "all_reduce", "all_gather", "mask_sync", "save")
KINDS = ("die", "kill", "hang", "nan", "inf")
DIE_EXIT_CODE = 86
HANG_SECONDS = 3600.0
_FORMAT = "RANK:STEP:PHASE:KIND[=ARG] (e.g. 1:5:reduce_scatter:die)"


@dataclasses.dataclass
class Fault:
    """One planned fault: on ``rank``, at ``step``, at ``phase``, do ``kind`` (with ``arg``)."""

    rank: int
    step: int
    phase: str
    kind: str
    arg: float | None = None
    fired: bool = False


def parse(spec: str, rank: int | None = None) -> list[Fault]:
    """The faults of ``spec`` (``RANK:STEP:PHASE:KIND[=ARG]``, comma separated), or only those
    of ``rank``; ``ValueError`` naming the bad entry and the format."""
    faults = []
    for entry in spec.split(","):
        entry = entry.strip()
        parts = entry.split(":")
        if len(parts) != 4:
            raise ValueError(f"Invalid fault entry {entry!r}: expected {_FORMAT}")
        rank_s, step_s, phase, kind_s = parts
        kind, _, arg_s = kind_s.partition("=")
        try:
            f_rank, step = int(rank_s), int(step_s)
            arg = float(arg_s) if arg_s else None
        except ValueError:
            raise ValueError(f"Invalid fault entry {entry!r}: RANK and STEP must be integers "
                             f"and ARG a number; expected {_FORMAT}") from None
        if f_rank < 0 or step < 1:
            raise ValueError(f"Invalid fault entry {entry!r}: expected RANK >= 0 and STEP >= 1")
        if phase not in PHASES:
            raise ValueError(f"Invalid fault phase {phase!r} in {entry!r}: expected one of "
                             f"{PHASES}")
        if kind not in KINDS:
            raise ValueError(f"Invalid fault kind {kind!r} in {entry!r}: expected one of "
                             f"{KINDS}")
        if kind in ("nan", "inf") and phase != "grad":
            raise ValueError(f"Invalid fault entry {entry!r}: kind {kind!r} needs phase "
                             f"'grad', got {phase!r}")
        faults.append(Fault(f_rank, step, phase, kind, arg))
    return faults if rank is None else [f for f in faults if f.rank == rank]


class FaultPlan:
    """The faults armed on one rank's optimizer; :meth:`fire` is called at every phase
    boundary."""

    def __init__(self, faults: list[Fault]) -> None:
        self.faults = faults

    def fire(self, step: int, phase: str, opt: Any) -> None:
        for f in self.faults:
            if f.fired or f.step != step or f.phase != phase:
                continue
            f.fired = True
            _act(f, opt)


Plan = str | Sequence[Fault] | FaultPlan | None
"""What :func:`install` takes: a spec, faults (:func:`parse`), a plan, or ``None`` (none)."""


def install(opt: Any, plan: Plan) -> FaultPlan | None:
    """Arm ``plan``'s faults for this rank (``opt.comm.rank``) on ``opt``, a
    :class:`scape.SCAPE` or :class:`scape.DistributedAdamW`, in place of what it had; return
    that (``None``: nothing). ``None``, or a plan without a fault for this rank, disarms it.
    Raises ``ValueError`` for a bad spec and ``TypeError`` for an optimizer without the hook,
    before anything changes."""
    if not hasattr(opt, "_faults"):
        raise TypeError(f"{type(opt).__name__} has no fault hook (scape.SCAPE and "
                        "scape.DistributedAdamW have)")
    rank = opt.comm.rank
    if plan is None:
        mine: list[Fault] = []
    elif isinstance(plan, str):
        mine = parse(plan, rank)
    else:
        listed = plan.faults if isinstance(plan, FaultPlan) else plan
        if not all(isinstance(f, Fault) for f in listed):
            raise TypeError("install: expected a spec string, a list of faults.Fault, a "
                            f"FaultPlan or None, got {type(plan).__name__}")
        mine = [f for f in listed if f.rank == rank]
    previous: FaultPlan | None = opt._faults
    opt._faults = FaultPlan(mine) if mine else None
    return previous


def uninstall(opt: Any) -> FaultPlan | None:
    """Disarm ``opt``'s faults; return what was armed (``None``: nothing)."""
    return install(opt, None)


@contextlib.contextmanager
def inject(opt: Any, plan: Plan) -> Iterator[FaultPlan | None]:
    """:func:`install` ``plan`` on ``opt`` for the ``with`` block, then put back what it had;
    yields the plan armed on this rank (``None``: no fault of it is this rank's)."""
    previous = install(opt, plan)
    try:
        yield opt._faults
    finally:
        opt._faults = previous


def _settle(opt: Any) -> None:
    """Complete every collective this rank has in flight (parameter and mask all-gathers)."""
    opt.finish_param_sync()
    for m in getattr(opt, "masks", ()):
        if m is not None:
            m.wait()


def _act(f: Fault, opt: Any) -> None:
    if f.kind in ("die", "kill"):
        if f.phase != "save":
            _settle(opt)
        if f.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        os._exit(int(f.arg) if f.arg is not None else DIE_EXIT_CODE)
    if f.kind == "hang":
        time.sleep(f.arg if f.arg is not None else HANG_SECONDS)
        return
    b = opt.buckets[0]
    index = int(f.arg) if f.arg is not None else b.shard_start
    if not 0 <= index < b.n_pad:
        raise ValueError(f"Invalid fault {f.kind} index {index}: expected a flat index in "
                         f"[0, {b.n_pad})")
    b.grad_flat[index] = float("nan") if f.kind == "nan" else float("inf")
