"""Sparsity schedules: values a trainer writes into ``param_group["sparsity"]`` between steps,
as an LR scheduler writes ``lr`` (:class:`scape.SCAPE` reads the group's value whenever it
makes a mask).

A sparsity warm-up spends more of a run's bytes early, as Deep Gradient Compression (Lin et
al., 2018) does. Here it stands in for dense warm-up steps: with ``warmup_steps=1``, a ramp
from 0.5 to 0.99 (20 steps at 600 steps, 10 at 400) keeps a run within 1/50 of dense AdamS's
bytes, where the 20 default dense steps alone bring it to 1/22 at 600 steps. How such ramps
compare with the default warm-up, and with the same bytes spread evenly over the run:
docs/research.md, entry 11, "A sparsity ramp in place of the dense warm-up", "The ramp at
0.9". :class:`SparsityRamp` writes it, sized to a byte budget, as an LR scheduler does::

    opt = scape.SCAPE(model.parameters(), lr=3e-4, sparsity=0.99, warmup_steps=1)
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
from typing import TYPE_CHECKING, Any

from scape import config

if TYPE_CHECKING:
    from scape.optimizer import SCAPE


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


def _check_opt(opt: object, counts_bytes: bool = True) -> None:
    from scape.optimizer import SCAPE
    if not isinstance(opt, SCAPE):
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
    ``ramp_steps`` (no ramp when ``start`` is None). Dense AdamS sends ``N (b_g + b_p) + 8``
    a step: the same wire dtypes, no padding. Exact for every rank's payload, as
    ``opt.last_step.bytes`` counts it (ring factors aside); a group whose sparsity changes
    otherwise is not foreseen. A group whose embedding matrices are set apart
    (:mod:`scape.embeddings`) counts each bucket's own budget. Raises ``ValueError`` for a
    two-level optimizer.
    """
    _check_opt(opt)
    config.check_int("total_steps", total_steps, 1)
    ends = _ends(opt, ends)
    b_g = opt.grad_comm_dtype.itemsize
    w, bsz = opt.warmup_steps, opt.block_size

    def sparsity(g: int, t: int) -> float:
        if start is None or ends[g] == 0.0:
            return ends[g]
        return sparsity_ramp(t - w, start=min(start, ends[g]), end=ends[g],
                             ramp_steps=ramp_steps)

    dense_total = sent = 0.0
    for t in range(1, total_steps + 1):
        dense_step = opt.is_dense_step(t)  # the optimizer's own schedule
        next_dense = opt.is_dense_step(t + 1)
        sent += 8
        dense_total += 8
        for i, b in enumerate(opt.buckets):
            b_p = b.dtype.itemsize
            dense_total += b.numel * (b_g + b_p)
            if opt.masks[i] is None or dense_step:
                sent += b.n_pad * (b_g + b_p)
            else:  # the mask made at step t - 1
                k = opt.mask_budget(b, sparsity(b.group, t - 1))[0]
                sent += b.n_pad // bsz * k * (b_g + b_p)
            if opt.masks[i] is not None and t >= w and not next_dense:
                k = opt.mask_budget(b, sparsity(b.group, t))[0]
                sent += b.n_pad // bsz * k * 2  # the next mask
    return sent / dense_total


def longest_ramp(opt: SCAPE, total_steps: int, *, budget: float, start: float = 0.5,
                 ends: list[float] | None = None) -> int:
    """The most steps a ramp from ``start`` can take while ``total_steps`` steps of ``opt``
    send at most ``budget`` of dense AdamS's bytes (:func:`run_bytes`): 0 when only no ramp
    fits. Raises ``ValueError`` when even that does not fit (fewer warm-up steps, a lower
    target sparsity or a larger budget would)."""
    if not 0.0 < budget <= 1.0:
        raise ValueError(f"Invalid budget: {budget} (a fraction of dense's bytes in (0, 1])")
    ends = _ends(opt, ends)
    no_ramp = run_bytes(opt, total_steps, ends=ends)
    if no_ramp > budget:
        raise ValueError(f"{total_steps} steps of this optimizer send {no_ramp:.4f} of "
                         f"dense's bytes without a ramp, more than the budget {budget:.4f}: "
                         "use fewer warm-up steps, a higher sparsity or a larger budget")
    lo, hi = 0, max(0, total_steps - opt.warmup_steps)  # bytes grow with the ramp's length
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if run_bytes(opt, total_steps, start=start, ramp_steps=mid, ends=ends) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo


class SparsityRamp:
    """A sparsity warm-up for :class:`scape.SCAPE`, used like an LR scheduler: build it after
    the optimizer (it writes the first step's sparsity) and call :meth:`step` after each
    ``opt.step()``.

    Every sparse group's sparsity ramps from ``start`` to its value at construction (its
    target) over ``ramp_steps`` sparse steps (:func:`sparsity_ramp`), counted from
    ``opt.step_count``, so it follows a loaded checkpoint; a group whose target is below
    ``start`` keeps its target throughout. Give ``ramp_steps``, or ``total_steps`` and
    ``budget`` to take :func:`longest_ramp` (one level only: it counts bytes with the formula
    of README "Cost"). Save it with the
    optimizer (``scape.save_checkpoint(opt, root, extra={"ramp": ramp})``): its state holds
    the targets, which the groups' own values no longer show mid-ramp.
    """

    def __init__(self, opt: SCAPE, *, start: float = 0.5, ramp_steps: int | None = None,
                 total_steps: int | None = None, budget: float | None = None) -> None:
        _check_opt(opt, counts_bytes=ramp_steps is None)
        if (ramp_steps is None) == (total_steps is None or budget is None):
            raise ValueError("SparsityRamp takes ramp_steps, or total_steps and budget")
        self.opt = opt
        self.ends = _ends(opt, None)
        for end in self.ends:
            if end:
                sparsity_ramp(0, start=start, end=end, ramp_steps=0)  # its checks
        if ramp_steps is None:
            assert total_steps is not None and budget is not None
            ramp_steps = longest_ramp(opt, total_steps, budget=budget, start=start,
                                      ends=self.ends)
        config.check_int("ramp_steps", ramp_steps, 0)
        self.start, self.ramp_steps = float(start), int(ramp_steps)
        self.step()

    def step(self) -> None:
        """Write the sparsity of the optimizer's next step into every sparse group."""
        j = self.opt.step_count + 1 - self.opt.warmup_steps
        for g, end in zip(self.opt.param_groups, self.ends):
            if end:  # a group below start (denser) keeps its own sparsity throughout
                g["sparsity"] = sparsity_ramp(j, start=min(self.start, end), end=end,
                                              ramp_steps=self.ramp_steps)

    def state_dict(self) -> dict[str, Any]:
        return {"start": self.start, "ramp_steps": self.ramp_steps, "ends": list(self.ends)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if len(state["ends"]) != len(self.ends):
            raise ValueError(f"SparsityRamp state for {len(state['ends'])} param groups, the "
                             f"optimizer has {len(self.ends)}")
        self.start, self.ramp_steps = float(state["start"]), int(state["ramp_steps"])
        self.ends = [float(e) for e in state["ends"]]
        self.step()


def _ends(opt: SCAPE, ends: list[float] | None) -> list[float]:
    if ends is None:
        return [float(g["sparsity"]) for g in opt.param_groups]
    if len(ends) != len(opt.param_groups):
        raise ValueError(f"ends: {len(ends)} values for {len(opt.param_groups)} param groups")
    return [float(e) for e in ends]

