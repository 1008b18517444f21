"""Fault injection: the one documented hook for making a rank die, hang or send bad values.

Set ``SCAPE_FAULT`` before the optimizer is built (it is read once, at construction)::

    SCAPE_FAULT="RANK:STEP:PHASE:KIND[=ARG]"        several faults: separate them with ","

    SCAPE_FAULT=1:5:reduce_scatter:die       rank 1 exits (os._exit(86)) at step 5, just before
                                             its gradient reduce-scatter
    SCAPE_FAULT=0:3:all_gather:hang=30       rank 0 sleeps 30 s before the parameter all-gather
    SCAPE_FAULT=1:4:grad:nan=17              rank 1 writes NaN into gradient coordinate 17

``STEP`` is the 1-based optimizer step (``opt.step_count`` during that step). Phases, in the
order a step runs them (DESIGN §1)::

    grad            after the gradients are folded into the buffer, before the statistics
    reduce_scatter  before the take and the gradient reduce-scatter
    all_reduce      before the scalar all-reduce (gradient norm, non-finite count)
    all_gather      before the shard update and the parameter all-gather
    mask_sync       before the next mask is made and its all-gather issued
    save            inside ``scape.save_checkpoint``: after this rank's file is written,
                    before the manifest (a crash in the middle of a save)

Kinds: ``die`` (``os._exit(ARG)``, default 86), ``kill`` (SIGKILL to itself), ``hang``
(sleep ARG seconds, default 3600, then carry on), ``nan`` / ``inf`` (write NaN / +Inf into the
first bucket's gradient buffer at flat index ARG, default the first coordinate this rank owns;
phase ``grad`` only). Before ``die`` and ``kill`` the rank completes the collectives it has in
flight, so the fault lands exactly at the named phase and not in an earlier collective.

Faults fire once, and only in the first attempt of an elastic job: when torchrun restarts the
workers (``TORCHELASTIC_RESTART_COUNT`` > 0) the hook is off, so a restarted job runs clean.
When ``SCAPE_FAULT`` is unset the optimizer holds ``None`` and a step pays one ``is None`` test
per phase.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from collections.abc import Mapping
from typing import Any

ENV = "SCAPE_FAULT"
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


def parse(text: str) -> list[Fault]:
    """Parse a ``SCAPE_FAULT`` value; ``ValueError`` naming the bad entry and the format."""
    faults = []
    for entry in text.split(","):
        entry = entry.strip()
        parts = entry.split(":")
        if len(parts) != 4:
            raise ValueError(f"Invalid {ENV} entry {entry!r}: expected {_FORMAT}")
        rank_s, step_s, phase, kind_s = parts
        kind, _, arg_s = kind_s.partition("=")
        try:
            rank, step = int(rank_s), int(step_s)
            arg = float(arg_s) if arg_s else None
        except ValueError:
            raise ValueError(f"Invalid {ENV} entry {entry!r}: RANK and STEP must be integers "
                             f"and ARG a number; expected {_FORMAT}") from None
        if rank < 0 or step < 1:
            raise ValueError(f"Invalid {ENV} entry {entry!r}: expected RANK >= 0 and STEP >= 1")
        if phase not in PHASES:
            raise ValueError(f"Invalid {ENV} phase {phase!r} in {entry!r}: expected one of "
                             f"{PHASES}")
        if kind not in KINDS:
            raise ValueError(f"Invalid {ENV} kind {kind!r} in {entry!r}: expected one of "
                             f"{KINDS}")
        if kind in ("nan", "inf") and phase != "grad":
            raise ValueError(f"Invalid {ENV} entry {entry!r}: kind {kind!r} needs phase "
                             f"'grad', got {phase!r}")
        faults.append(Fault(rank, step, phase, kind, arg))
    return faults


class FaultPlan:
    """The faults planned for this rank; :meth:`fire` is called at every phase boundary."""

    def __init__(self, faults: list[Fault]) -> None:
        self.faults = faults

    def fire(self, step: int, phase: str, opt: Any) -> None:
        for f in self.faults:
            if f.fired or f.step != step or f.phase != phase:
                continue
            f.fired = True
            _act(f, opt)


def from_env(rank: int, environ: Mapping[str, str] | None = None) -> FaultPlan | None:
    """This rank's faults from ``SCAPE_FAULT``, or ``None`` (unset, empty, none for this rank,
    or a restarted elastic job)."""
    env = os.environ if environ is None else environ
    text = env.get(ENV, "").strip()
    if not text:
        return None
    faults = [f for f in parse(text) if f.rank == rank]
    if int(env.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0 or not faults:
        return None
    return FaultPlan(faults)


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
        raise ValueError(f"Invalid {ENV} {f.kind} index {index}: expected a flat index in "
                         f"[0, {b.n_pad})")
    b.grad_flat[index] = float("nan") if f.kind == "nan" else float("inf")
