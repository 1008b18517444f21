"""The start of a run: dense steps, then a sparsity ramp; and sparsity schedules a trainer
writes into ``param_group["sparsity"]`` between steps, as an LR scheduler writes ``lr``.

:class:`scape.SCAPE` ramps by itself: after ``warmup_steps`` dense steps (1 by default) each
sparse group's sparsity rises from :func:`ramp_start` of its own to its own over
:func:`start_ramp_steps` steps, sized from the optimizer's ``total_steps`` so that a run at
sparsity 0.99 sends at most :data:`RAMP_BUDGET` of dense AdamS's bytes. A sparsity warm-up
spends more of a run's bytes early, as Deep Gradient Compression (Lin et al., 2018) does; here
it stands in for a longer dense warm-up (docs/research.md, entry 11, "A sparsity ramp in place
of the dense warm-up", and "A third workload, kept apart").

:class:`SparsityRamp` is the same ramp written from outside, in place of the optimizer's
own, for a ramp of another start or length (or none), as an LR scheduler does::

    opt = scape.SCAPE(model.parameters(), lr=3e-4, sparsity=0.99)
    ramp = scape.SparsityRamp(opt, start=0.5, total_steps=400, budget=1 / 50)  # 10 steps
    for batch in loader:
        loss_fn(model, batch).backward()
        opt.step()
        ramp.step()
        opt.zero_grad()

:func:`run_bytes` is what a run sends against dense AdamS (the formula of README "Cost",
step by step), :func:`longest_ramp` the ramp a budget allows.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from scape import config
from scape.wire import PARAM_BITS, fused_segment_bytes, mask_bytes, segment_bytes

SCAPE = Any
"""What the functions here take: a :class:`scape.SCAPE` (``scape.optimizer`` imports this
module, so it is checked by what it has, not imported)."""

RAMP_START = 0.5
"""The sparsity the start's ramp begins at, at most: half the coordinates (a group at or below
it has no ramp). Chosen on the two bundled workloads (docs/research.md, entry 11); at 0.9 a
later start lost on `gpt` over 2,000 steps ("The start's ramp at ten times the density")."""
RAMP_FACTOR = 10
"""The start's density over the group's own, where that is sparser than :data:`RAMP_START`:
a 0.99 group starts at 0.9. On the third workload a 0.99 run's ramp from 0.9 ended 1.8% lower
than one from 0.5 within the same bytes (docs/research.md, "The third workload's remaining
constants")."""

RAMP_BUDGET = 1 / 50
"""The bytes, as a fraction of dense AdamS's, that a run at :data:`RAMP_REFERENCE` may send
with its ramp (the byte goal README "Cost" states)."""
RAMP_REFERENCE = 0.99
"""The sparsity the ramp's length is sized at: a group at any sparsity ramps for as many steps
as one at 0.99 would (so 0.9, which alone sends more than :data:`RAMP_BUDGET`, ramps too)."""
RUN_STEPS_UNSIZED = 2000
"""The run's length the ramp is sized for when the optimizer is not told it: within
:data:`RAMP_BUDGET` from runs of about that length on (363 steps at 0.99, 89 at 0.9 on the
bundled model); a shorter run sends more (give ``total_steps``)."""


def ramp_start(end: float) -> float:
    """Where the start's ramp to sparsity ``end`` begins: at :data:`RAMP_FACTOR` times the
    group's density, but no denser than :data:`RAMP_START` (0.9 for a group at 0.99, 0.5 at
    0.9, 0.99 at 0.999; ``end`` itself at or below 0.5: no ramp)."""
    config.check_sparsity(end)
    return min(end, max(RAMP_START, 1.0 - RAMP_FACTOR * (1.0 - end)))


_OWN = "own"
"""A ``start`` for the private byte counters: each group ramps from :func:`ramp_start` of its
own sparsity (the optimizer's own ramp)."""


def sparsity_ramp(step: int, *, start: float, end: float, ramp_steps: int) -> float:
    """Sparsity at ``step`` of a warm-up from ``start`` to ``end`` over ``ramp_steps`` steps.

    The density ``1 - sparsity`` falls geometrically, ``d(t) = d0 * (d1 / d0)^(t / R)``, so
    each equal stretch of steps divides it by the same factor; from ``ramp_steps`` on it is
    ``end``. ``step`` counts from the start of the ramp (for :class:`scape.SCAPE`, the first
    sparse step: ``opt.step_count + 1 - opt.warmup_steps`` before a step, the module's
    example); a negative step gives ``start``. The mean density over the ramp is
    ``(d0 - d1) / ln(d0 / d1)`` (:func:`mean_ramp_density`), which is what the ramp costs in
    bytes.
    """
    config.check_sparsity(start)
    config.check_sparsity(end)
    config.check_int("ramp_steps", ramp_steps, 0)
    if start == 0.0 or end == 0.0:
        raise ValueError("Invalid sparsity ramp: start and end must be > 0 (a sparse group "
                         "stays sparse)")
    if ramp_steps == 0 or step >= ramp_steps:
        return float(end)
    frac = max(step, 0) / ramp_steps
    d0, d1 = 1.0 - start, 1.0 - end
    return 1.0 - d0 * (d1 / d0) ** frac


def mean_ramp_density(start: float, end: float) -> float:
    """Mean density ``1 - sparsity`` over a :func:`sparsity_ramp` (continuous limit)."""
    d0, d1 = 1.0 - start, 1.0 - end
    return d0 if math.isclose(d0, d1) else (d0 - d1) / math.log(d0 / d1)


def _check_opt(opt: Any, counts_bytes: bool = True) -> None:
    # methods only: reading ``ramp_steps`` here would size the optimizer's ramp as a side effect
    if not all(hasattr(opt, a) for a in ("masks", "mask_budget", "is_dense_step", "sparsity_at")):
        raise TypeError(f"expected a scape.SCAPE optimizer, got {type(opt).__name__}")
    from scape.two_level import NodeLevel
    if counts_bytes and isinstance(opt.level, NodeLevel):
        raise ValueError("a two-level optimizer sends different bytes on each level: read "
                         "opt.last_step.level_bytes instead")


def run_bytes(opt: SCAPE, total_steps: int, *, start: float | None = None,
              ramp_steps: int = 0, ends: list[float] | None = None) -> float:
    """What ``total_steps`` steps of ``opt`` send, as a fraction of what dense sharded AdamS
    sends over as many steps, from the formula of README "Cost" applied step by step.

    Step ``t`` (from 1) is dense for ``t <= opt.warmup_steps`` and on ``opt.dense_every``,
    else sparse; from the last warm-up step on, each step (but one before a dense refresh)
    also shares the next mask, made at :func:`sparsity_ramp` ``(t - warmup_steps)`` from
    ``start`` to each sparse group's sparsity (``ends``: their values now by default) over
    ``ramp_steps`` (no ramp when ``start`` is None; both left out: the optimizer's own ramp,
    each group's from its :func:`ramp_start` over :meth:`scape.SCAPE.ramp_steps_of`); a sparse
    step whose scalars ride in its collectives (no clipping, every group sparse, plain
    parameters) counts the count and the sums of squares there instead of the 8-byte
    all-reduce. Dense AdamS sends ``N (b_g + b_p) + 8``
    a step: the same wire dtypes (fp32 gradients for the 8-bit wire, :mod:`scape.wire`, whose
    sparse steps count its segments, as for 8-bit parameter updates), no padding. Exact for
    every rank's payload, as
    ``opt.last_step.bytes`` counts it (ring factors aside); a group whose sparsity changes
    otherwise is not foreseen. A group whose embedding matrices are set apart
    (:mod:`scape.embeddings`) counts each bucket's own budget. Raises ``ValueError`` for a
    two-level optimizer.
    """
    _check_opt(opt)
    config.check_int("total_steps", total_steps, 1)
    if start is None and ramp_steps == 0 and opt.ramp_steps:  # the optimizer's own ramp:
        lengths = [opt.ramp_steps_of(g) for g in range(len(opt.param_groups))]  # each group's
        return _run_bytes(opt, total_steps, _OWN, lengths, _ends(opt, ends))
    return _run_bytes(opt, total_steps, start, ramp_steps, _ends(opt, ends))


def _run_bytes(opt: SCAPE, total_steps: int, start: float | str | None,
               ramp_steps: int | list[int], ends: list[float],
               reference_wire: bool = False) -> float:
    wire = torch.float32 if reference_wire else opt.grad_comm_dtype
    wire8 = wire == torch.int8  # scape.wire: codes and row scales
    b_g = 4 if wire8 else wire.itemsize  # a dense step's (and dense AdamS's)
    param_bits = None if reference_wire or opt.param_comm_dtype is None \
        else PARAM_BITS[opt.param_comm_dtype]  # 16-, 8-, 6- or 4-bit updates
    # a sparse step's scalars ride in its two collectives (scape.sharded): no all-reduce, the
    # count in every owner's gradient segment, the sum of squares with each owner's values
    ride = not reference_wire and opt.max_grad_norm is None and opt.shard_mesh is None \
        and all(m is not None for m in opt.masks)
    w, bsz = opt.warmup_steps, opt.block_size

    def sparsity(g: int, t: int) -> float:
        if start is None or ends[g] == 0.0:
            return ends[g]
        s0 = ramp_start(ends[g]) if start == _OWN else min(float(start), ends[g])
        return sparsity_ramp(t - w, start=s0, end=ends[g], ramp_steps=lengths[g])

    lengths = ramp_steps if isinstance(ramp_steps, list) else [ramp_steps] * len(ends)

    def step_bytes(t: int, dense_step: bool, next_dense: bool) -> int:
        """What step ``t`` sends (every quantity is a whole number of bytes: sums are exact)."""
        rides = ride and not dense_step  # one gradient collective and one all-gather in all
        sent = 0 if rides else 8
        rows = []  # every sparse bucket's (n_local, k) on the 8-bit wire
        for i, b in enumerate(opt.buckets):
            b_p = b.dtype.itemsize
            if opt.masks[i] is None or dense_step:
                sent += b.n_pad * (b_g + b_p)
            else:  # the mask made at step t - 1
                k = opt.mask_budget(b, sparsity(b.group, t - 1))[0]
                n_local = b.n_pad // bsz // b.world
                sent += b.world * segment_bytes(n_local, k, bits=param_bits) if param_bits \
                    else b.n_pad // bsz * k * b_p
                if wire8 and rides:
                    rows.append((n_local, k))
                elif wire8:
                    sent += b.world * segment_bytes(n_local, k)
                else:
                    sent += b.n_pad // bsz * k * b_g
            if opt.masks[i] is not None and t >= w and not next_dense:
                k = opt.mask_budget(b, sparsity(b.group, t))[0]
                n_next = b.n_pad // bsz  # the next mask's rows: int16 offsets in the reference
                sent += n_next * k * 2 if reference_wire \
                    else b.world * mask_bytes(n_next // b.world, k, bsz)
        if rides:  # the count in every owner's gradient segment, the sum of squares with the
            world = opt.comm.world_size  # values
            sent += world * fused_segment_bytes(rows, 1) if wire8 else world * b_g
            sent += world * 4
        return sent

    dense_total = total_steps * (8 + sum(b.numel * (b_g + b.dtype.itemsize)
                                         for b in opt.buckets))
    # step by step while the ramp or the warm-up shapes a step; from ``steady`` on a step's
    # bytes depend only on whether it and the next are dense (every ``dense_every``-th)
    steady = w + 2 + (max(lengths, default=0) if start is not None else 0)
    sent = 0
    for t in range(1, min(steady, total_steps + 1)):
        sent += step_bytes(t, opt.is_dense_step(t), opt.is_dense_step(t + 1))
    if steady <= total_steps:
        n, every = total_steps - steady + 1, opt.dense_every
        if every == 0:
            counts = {(False, False): n}
        elif every == 1:
            counts = {(True, True): n}
        else:  # t and t + 1 are never both multiples of ``every``
            n_dense = total_steps // every - (steady - 1) // every
            n_before = (total_steps + 1) // every - steady // every
            counts = {(True, False): n_dense, (False, True): n_before,
                      (False, False): n - n_dense - n_before}
        for (dense_step, next_dense), count in counts.items():
            if count:
                sent += count * step_bytes(steady, dense_step, next_dense)
    return sent / dense_total


def longest_ramp(opt: SCAPE, total_steps: int, *, budget: float, start: float | None = None,
                 ends: list[float] | None = None) -> int:
    """The most steps a ramp from ``start`` (``None``: each group from :func:`ramp_start` of
    its own sparsity, as the optimizer's own ramp) can take while ``total_steps`` steps of
    ``opt`` send at most ``budget`` of dense AdamS's bytes (:func:`run_bytes`): 0 when only no
    ramp fits. Raises ``ValueError`` when even that does not fit (fewer warm-up steps, a lower
    target sparsity or a larger budget would)."""
    _check_opt(opt)
    config.check_int("total_steps", total_steps, 1)
    return _longest_ramp(opt, total_steps, budget, _OWN if start is None else start,
                         _ends(opt, ends))


def _longest_ramp(opt: SCAPE, total_steps: int, budget: float, start: float | str,
                  ends: list[float], reference_wire: bool = False) -> int:
    if not 0.0 < budget <= 1.0:
        raise ValueError(f"Invalid budget: {budget} (a fraction of dense's bytes in (0, 1])")
    no_ramp = _run_bytes(opt, total_steps, None, 0, ends, reference_wire)
    if no_ramp > budget:
        raise ValueError(f"{total_steps} steps of this optimizer send {no_ramp:.4f} of "
                         f"dense's bytes without a ramp, more than the budget {budget:.4f}: "
                         "use fewer warm-up steps, a higher sparsity or a larger budget")
    lo, hi = 0, max(0, total_steps - opt.warmup_steps)  # bytes grow with the ramp's length
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _run_bytes(opt, total_steps, start, mid, ends, reference_wire) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo


def start_ramp_steps(opt: SCAPE, total_steps: int | None, start: float | None = None) -> int:
    """The length of the start ramp from sparsity ``start`` (``None``: :func:`ramp_start` of
    :data:`RAMP_REFERENCE`, 0.9) for a run of ``total_steps`` steps of ``opt``: the longest
    that keeps it within :data:`RAMP_BUDGET` of dense AdamS's bytes were every sparse group at
    :data:`RAMP_REFERENCE` and ramping from ``start`` (:func:`longest_ramp`); 0 where not even
    no ramp fits (a run of a few steps, or many dense ones). ``total_steps=None`` sizes it for
    :data:`RUN_STEPS_UNSIZED` steps. So a group ramps as long as a 0.99 run from its start
    could: 0.99 from 0.9, and 0.9 from 0.5 over fewer steps. The same on every rank (it reads
    the layout only). A two-level optimizer is sized by the same formula over its buckets. The
    bytes are counted on the reference wire, fp32 gradients, the model's values, int16 offsets
    and the scalars in an all-reduce of their own, whatever the wire is (``grad_comm_dtype``,
    ``param_comm_dtype``, the packed offsets of :mod:`scape.wire`), so the start does not
    depend on the wire: a smaller wire lowers the whole run's bytes instead of buying a longer
    ramp."""
    if not any(g["sparsity"] > 0 for g in opt.param_groups):
        return 0  # nothing to ramp
    steps = RUN_STEPS_UNSIZED if total_steps is None else total_steps
    s0 = ramp_start(RAMP_REFERENCE) if start is None else start
    ends = [RAMP_REFERENCE if g["sparsity"] > 0 else 0.0 for g in opt.param_groups]
    try:
        return _longest_ramp(opt, steps, RAMP_BUDGET, s0, ends, reference_wire=True)
    except ValueError:  # even no ramp sends more than the budget
        return 0


class SparsityRamp:
    """A sparsity warm-up for :class:`scape.SCAPE`, used like an LR scheduler: build it after
    the optimizer (it writes the first step's sparsity) and call :meth:`step` after each
    ``opt.step()``.

    Every sparse group's sparsity ramps from ``start`` to its value at construction (its
    target) over ``ramp_steps`` sparse steps (:func:`sparsity_ramp`), counted from
    ``opt.step_count``, so it follows a loaded checkpoint; a group whose target is below
    ``start`` keeps its target throughout. ``start=None`` (the default) starts each group at
    :func:`ramp_start` of its target, where the optimizer's own ramp starts (one length for
    every group, where the optimizer's own gives each its own). Give ``ramp_steps``, or
    ``total_steps`` and ``budget`` to take :func:`longest_ramp` (one level only: it counts
    bytes with the formula of README "Cost"); ``ramp_steps=0`` is no ramp. It replaces the
    optimizer's own start ramp (``opt.ramp_steps`` becomes 0). Save it with the
    optimizer (``scape.save_checkpoint(opt, root, extra={"ramp": ramp})``): its state holds
    the targets, which the groups' own values no longer show mid-ramp.
    """

    def __init__(self, opt: SCAPE, *, start: float | None = None, ramp_steps: int | None = None,
                 total_steps: int | None = None, budget: float | None = None) -> None:
        _check_opt(opt, counts_bytes=ramp_steps is None)
        if (ramp_steps is None) == (total_steps is None or budget is None):
            raise ValueError("SparsityRamp takes ramp_steps, or total_steps and budget")
        self.opt = opt
        self.ends = _ends(opt, None)
        for end in self.ends:
            if end and start is not None:
                sparsity_ramp(0, start=start, end=end, ramp_steps=0)  # its checks
        if ramp_steps is None:
            assert total_steps is not None and budget is not None
            ramp_steps = longest_ramp(opt, total_steps, budget=budget, start=start,
                                      ends=self.ends)
        config.check_int("ramp_steps", ramp_steps, 0)
        self.start = None if start is None else float(start)
        self.ramp_steps = int(ramp_steps)
        opt.ramp_steps = 0  # this ramp replaces the optimizer's own
        self.step()

    def step(self) -> None:
        """Write the sparsity of the optimizer's next step into every sparse group."""
        j = self.opt.step_count + 1 - self.opt.warmup_steps
        for g, end in zip(self.opt.param_groups, self.ends):
            if end:  # a group below start (denser) keeps its own sparsity throughout
                s0 = ramp_start(end) if self.start is None else min(self.start, end)
                g["sparsity"] = sparsity_ramp(j, start=s0, end=end, ramp_steps=self.ramp_steps)

    def state_dict(self) -> dict[str, Any]:
        return {"start": self.start, "ramp_steps": self.ramp_steps, "ends": list(self.ends)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if len(state["ends"]) != len(self.ends):
            raise ValueError(f"SparsityRamp state for {len(state['ends'])} param groups, the "
                             f"optimizer has {len(self.ends)}")
        start = state["start"]
        self.start = None if start is None else float(start)
        self.ramp_steps = int(state["ramp_steps"])
        self.ends = [float(e) for e in state["ends"]]
        self.step()


def _ends(opt: SCAPE, ends: list[float] | None) -> list[float]:
    if ends is None:
        return [float(g["sparsity"]) for g in opt.param_groups]
    if len(ends) != len(opt.param_groups):
        raise ValueError(f"ends: {len(ends)} values for {len(opt.param_groups)} param groups")
    return [float(e) for e in ends]

