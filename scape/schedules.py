"""Sparsity schedules: values a trainer writes into ``param_group["sparsity"]`` between steps,
as an LR scheduler writes ``lr`` (:class:`scape.SCAPE` reads the group's value whenever it
makes a mask).

A sparsity warm-up spends more of a run's bytes early, as Deep Gradient Compression (Lin et
al., 2018) does. On the bundled workload it did not beat the same bytes spread evenly over the
run (docs/research.md). Where it pays is in place of dense warm-up steps: with
``warmup_steps=1``, a 20-step ramp from 0.5 to 0.99 kept a 600-step run within 1/50 of dense
AdamS's bytes (the 20 default dense steps: 1/22) and ended closer to dense AdamS than the
default on two workloads, two seeds each, and so did a ramp from 0.5 to 0.9 at 0.9
(docs/research.md, "A sparsity ramp in place of the dense warm-up", "The ramp at 0.9"). Write
it before every step, as an LR scheduler writes ``lr``; sparse step ``j`` (from 0) then sends
a mask made at ``sparsity_ramp(j)``:

    opt = scape.SCAPE(model.parameters(), lr=3e-4, sparsity=0.99, warmup_steps=1)
    for batch in loader:
        for g in opt.param_groups:
            g["sparsity"] = scape.sparsity_ramp(opt.step_count + 1 - opt.warmup_steps,
                                                start=0.5, end=0.99, ramp_steps=20)
        loss_fn(model, batch).backward()
        opt.step()
        opt.zero_grad()
"""

from __future__ import annotations

import math

from scape import config


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
