"""Sparsity schedules: values a trainer writes into ``param_group["sparsity"]`` between steps,
as an LR scheduler writes ``lr`` (:class:`scape.SCAPE` reads the group's value whenever it
makes a mask).

A sparsity warm-up spends more of a run's bytes early, as Deep Gradient Compression (Lin et
al., 2018) does. On the bundled workload it did not beat the same bytes spread evenly over the
run (docs/research.md): take it for what it is, a schedule, not a quality fix. Where it pays
is in place of dense warm-up steps: 2 dense steps and a 40-step ramp from 0.5 kept nearly all
the quality of 20 dense steps for 22% fewer bytes over a 2,000-step run (docs/research.md).
"""

from __future__ import annotations

import math

from scape import config


def sparsity_ramp(step: int, *, start: float, end: float, ramp_steps: int) -> float:
    """Sparsity at ``step`` of a warm-up from ``start`` to ``end`` over ``ramp_steps`` steps.

    The density ``1 - sparsity`` falls geometrically, ``d(t) = d0 * (d1 / d0)^(t / R)``, so
    each equal stretch of steps divides it by the same factor; from ``ramp_steps`` on it is
    ``end``. ``step`` counts from the start of the ramp (for :class:`scape.SCAPE`, usually the
    first sparse step: ``opt.step_count - warmup_steps``); a negative step gives ``start``.
    The mean density over the ramp is ``(d0 - d1) / ln(d0 / d1)``
    (:func:`mean_ramp_density`), which is what the ramp costs in bytes.

        for t in range(steps):
            for g in opt.param_groups:
                g["sparsity"] = sparsity_ramp(t - 20, start=0.9, end=0.99, ramp_steps=400)
            ...; opt.step()
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
