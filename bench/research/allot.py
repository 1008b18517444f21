"""Automatic per-group sparsity: one overall budget, allotted by where the signal is.

A hand-set split (the embedding matrices at 0.95, the rest at 0.9925: 99% of all coordinates
per step) closes more than half of the 99%-sparsity gap of the bundled workload at unchanged
bytes (docs/research.md, hypothesis 14). This module sets such a split from a measured signal
instead of by name (hypotheses 16 and 17).

**The signal.** The noise-sized rules (``catchup_snr_accum``, the ``catchup_agree*`` rules)
keep, per coordinate of the shard a rank owns, the EMA of its own gradient's square; with the
first moment ``m`` that gives the per-step noise ``sigma^2 = (s2 - m^2) / W`` of the global
mean and the *sign agreement* ``erf(|m| / (sigma_m sqrt 2))``, ``sigma_m^2 = sigma^2 (1 -
beta1) / (1 + beta1)``: the fraction of its steps dense AdamS would move the coordinate the
same way (the quantity :func:`scape.rules.catchup_agree` sizes its catch-up by). A
coordinate that agrees near 1 drifts steadily and loses progress for every step it waits; one
near 0 only jitters. ``m`` of a coordinate not sent lately is the value of its last sync.
Agreement is blind to scale: a group whose coordinates each move the loss more is not told
apart. :meth:`AgreementMeter.gain` is: the *gain* ``mu^2 / sqrt(v)`` of a coordinate is the
loss decrease per unit ``lr`` of one Adam-like step along its gradient mean ``mu`` (``v`` its
second moment), so a group's mean gain is what a step of its coordinates is worth.

**The allotment.** Group ``g`` (``n_g`` coordinates, mean signal ``A_g``: its agreement or its
gain) gets density ``d_g = lam * A_g^power``, with ``lam`` such that ``sum n_g d_g = (1 -
sparsity) * sum n_g``: the same coordinates per step in total as every group at ``sparsity``
(the same bytes, up to each block's rounding). ``d_g`` is kept in ``[max(1 / block_size, floor
* (1 - sparsity)), max_density]``; what a clipped group cannot take goes to the others
(water-filling). ``power = 0`` is every group at ``sparsity``; a larger power favours the
groups that read higher more.

    opt = scape.SCAPE(groups, lr=3e-4, update="catchup_agree_trust2_accum")
    meter, numels = AgreementMeter(opt), group_numels(opt)
    for t in range(steps):
        ...; loss.backward()
        meter.observe()                           # every step, before opt.step()
        if t >= warmup and (t - warmup) % 100 == 0:  # one all-reduce of 2 floats per group
            split = allot(meter.gain(), numels, 0.99, opt.block_size, power=1)
        if t >= warmup:
            apply_allotment(opt, split)
        opt.step()

**What it measured** (docs/research.md, hypothesis 16: 2,000 steps of the bundled workload at
99% overall, ``catchup_agree_trust2_accum``): read from a fresh gradient mean
(:class:`AgreementMeter`) at power 3, 1.082x dense AdamS on four seeds, against 1.118x with
every group at 0.99 and 1.051x for the best split set by hand. Read from ``m``
(:func:`group_agreement`: no extra state, but biased low for a sparse group, whose ``m`` is
stale) power 1 gave 1.087x and power 2 ran away (1.117x). With the default rule
(``catchup_agree_trust4_accum``) the fresh split made things worse (1.159x against 1.140x).
Split by gain (hypothesis 17) at power 1 it finds both embedding matrices (the position
embedding's coordinates agree no more than the blocks', but its gain reads 2-5x theirs from
sparse step 600 on): 1.067x on four seeds, 76% of the hand-set split's gain. At overall
sparsity 0.9847 (1/51.8 of dense bytes per sparse step) it gives 1.013x on seven seeds, as the
embeddings set by hand to 0.9 do (1.012x). With the default rule it gave 1.118x at 99% overall (by
hand 1.106x; one seed) and 1.055x at 0.9847 (two seeds; every group at 0.9841: 1.049x).
The library's default rule (``update="auto"``) takes each coordinate's gain into its masks
instead (:func:`scape.rules.gain_score_residual`, hypothesis 19) and splits nothing: the
optimizer sends each param group at its own ``sparsity``, and the split is made here, from
outside, by writing the groups' ``sparsity`` between steps (:func:`apply_allotment`; the
``-auto*`` rows of :mod:`bench.research.rows` do it through
:class:`bench.research.rows.Allotment`).

Only groups built sparse take part (a group built with ``sparsity=0`` stays dense and out of
the budget). Every rank computes the same split from the all-reduced means, so masks stay
consistent across ranks. The all-reduce is not hidden behind compute: run it every few
hundred steps, not every step.
"""

from __future__ import annotations

import math

import torch

from scape.rules import NOISE_BETA, NOISE_STATE


def _check_fraction(name: str, v: object, hi_open: bool = False) -> None:
    """``v`` is a float in ``[0, 1]`` (``[0, 1)`` with ``hi_open``), as the library checks its
    own fractions."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= v <= 1.0 \
            or (hi_open and v == 1.0):
        raise ValueError(f"Invalid {name}: {v!r} (expected a float in "
                         f"[0, 1{')' if hi_open else ']'})")


def _check_noise_state(opt, who: str) -> None:
    if not opt.shards or any(k not in opt.shards[0].extra for k in NOISE_STATE):
        raise ValueError(f"{who} needs a rule that keeps the local noise estimate (a "
                         f"noise-sized rule such as 'catchup_agree_trust4_accum'), got "
                         f"update={opt.update!r}")


def group_numels(opt) -> dict[int, int]:
    """Coordinates (padding excluded) of each sparse param group of a :class:`scape.SCAPE`."""
    out: dict[int, int] = {}
    for b, m in zip(opt.buckets, opt.masks):
        if m is not None:
            out[b.group] = out.get(b.group, 0) + b.numel
    return out


def group_agreement(opt) -> dict[int, float]:
    """Mean sign agreement (module docstring) of each sparse param group over all ranks.

    One ``all_reduce`` (sum) of two floats per sparse group; every rank gets the same values.
    Needs a rule that keeps the local noise (``scape.rules.NOISE_STATE``)."""
    _check_noise_state(opt, "group_agreement")

    def stale(b, s, _, valid, beta1, world):
        mom = s.m[:valid]
        var = (_s2(s, valid) - mom.square()).clamp_(min=0.0)
        return _agree(mom.abs(), var, world, beta1)
    return _reduce(opt, stale, [None] * len(opt.buckets))


def _s2(s, valid: int) -> torch.Tensor:
    """The rule's bias-corrected EMA of the owner's squared gradient (``NOISE_STATE``)."""
    return s.extra["s2"][:valid] / s.extra["s2w"][:valid].clamp(min=1e-12)


def _agree(amp: torch.Tensor, var: torch.Tensor, world: int, beta1: float) -> torch.Tensor:
    """Sign agreement ``erf(amp / (sigma_m sqrt 2))`` of a mean of size ``amp`` against the
    per-rank gradient variance ``var`` (module docstring); ``var`` is overwritten."""
    var_m = var.div_(world).mul_((1.0 - beta1) / (1.0 + beta1)).add_(1e-30)
    return torch.special.erf(amp.div_(var_m.mul_(2.0).sqrt_()))


class AgreementMeter:
    """Fresh sign agreement per sparse group, free of the staleness of ``m``.

    :func:`group_agreement` reads ``m``, which for a coordinate not sent lately is the value
    of its last sync: the sparser a group, the staler its ``m`` and the lower its measured
    agreement, so a split taken from it feeds on itself (docs/research.md, hypothesis 16). The
    meter keeps, per shard coordinate, the EMA ``mu`` of the owner's own per-step gradient
    (the same ``beta`` as the rule's ``s2``: 4 more bytes per shard coordinate and one pass
    per step) and estimates the signal as ``mu^2 - var (1 - beta) / (1 + beta)`` (the EMA's
    own noise removed, ``var = s2 - mu^2``), so pure noise reads near 0 and a steady gradient
    near 1, whatever the group's sparsity.

    Call :meth:`observe` after the backward pass and before ``opt.step()`` on every step,
    dense warm-up steps included; :meth:`agreement` then returns what
    :func:`group_agreement` does (one all-reduce of two floats per sparse group). A
    non-finite gradient entry is left out, as the rule's ``s2`` leaves it out. The meter's
    EMA is not part of the optimizer's ``state_dict``: after a resume it starts again (its
    first readings, taken over fewer steps, are noisier)."""

    def __init__(self, opt, beta: float | None = None) -> None:
        _check_noise_state(opt, "AgreementMeter")
        self.opt = opt
        self.beta = NOISE_BETA if beta is None else beta
        _check_fraction("beta", self.beta)
        if self.beta == 1.0:
            raise ValueError("Invalid beta: 1.0 (expected a float in [0, 1): the EMA must move)")
        self.mu = [torch.zeros_like(s.m) if m is not None else None
                   for s, m in zip(opt.shards, opt.masks)]
        self.weight = 0.0

    def observe(self) -> None:
        """Fold this step's gradient at the shard into the EMA (before ``opt.step()``)."""
        opt = self.opt
        for b, s, mu in zip(opt.buckets, opt.shards, self.mu):
            if mu is None:
                continue
            b.fold_stray_grads()  # a .grad the user replaced (step() would fold it later)
            g = b.grad_flat[b.shard]
            if opt.error_feedback:  # the buffer also holds the residual: the rule's ``prev``
                g = g - torch.where(s.age == 0, 0.0, s.extra["prev"])
            # a non-finite entry (a step about to be skipped) leaves the coordinate as it was
            moved = mu.mul(self.beta).add_(g, alpha=1.0 - self.beta)
            mu.copy_(torch.where(torch.isfinite(g), moved, mu))
        self.weight = self.beta * self.weight + (1.0 - self.beta)

    def _moments(self, s, mu, valid) -> tuple[torch.Tensor, torch.Tensor]:
        """Per coordinate: the squared gradient mean with the EMA's own noise removed, and
        the per-rank gradient variance."""
        mean = mu[:valid] / self.weight
        var = (_s2(s, valid) - mean.square()).clamp_(min=0.0)
        shrink = (1.0 - self.beta) / (1.0 + self.beta)
        return (mean.square() - var * shrink).clamp_(min=0.0), var

    def _read(self, who: str, per_coord) -> dict[int, float]:
        if self.weight == 0.0:
            raise RuntimeError(f"AgreementMeter.{who}: observe() has not run yet")
        return _reduce(self.opt, per_coord, self.mu)

    def agreement(self) -> dict[int, float]:
        """Mean fresh sign agreement of each sparse group (all ranks)."""
        def fresh(b, s, mu, valid, beta1, world):
            mu2, var = self._moments(s, mu, valid)
            return _agree(mu2.sqrt_(), var, world, beta1)
        return self._read("agreement", fresh)

    def gain(self) -> dict[int, float]:
        """Mean expected loss decrease per step of each sparse group's coordinates (all ranks).

        Per coordinate ``mu^2 / sqrt(mu^2 + var / W)`` (``mu^2`` and ``var`` as in the class
        docstring, ``W`` the world size): the gradient mean times the step an Adam-like update
        takes along it (``lr * mu / sqrt(v)``, ``v`` the global mean gradient's second
        moment), per unit ``lr``. Unlike the agreement it carries the gradient's scale, so a
        group whose coordinates each move the loss more reads higher (hypothesis 17)."""
        def gain(b, s, mu, valid, beta1, world):
            mu2, var = self._moments(s, mu, valid)
            return mu2 / (mu2 + var.div_(world)).add_(1e-30).sqrt_()
        return self._read("gain", gain)


def _reduce(opt, per_coord, extra) -> dict[int, float]:
    """Mean over all ranks' real coordinates of ``per_coord(...)`` per sparse group."""
    groups = sorted(group_numels(opt))
    if not groups:
        raise ValueError("the optimizer has no sparse param group")
    device = opt.buckets[0].device
    sums = torch.zeros(2 * len(groups), dtype=torch.float64, device=device)
    world = opt.comm.world_size
    for b, m, s, x in zip(opt.buckets, opt.masks, opt.shards, extra):
        if m is None:
            continue
        valid = min(max(b.numel - b.shard_start, 0), b.shard_size)  # this rank's real coords
        if valid == 0:
            continue
        beta1 = opt.param_groups[b.group]["betas"][0]
        j = groups.index(b.group)
        sums[2 * j] += per_coord(b, s, x, valid, beta1, world).sum(dtype=torch.float64)
        sums[2 * j + 1] += valid
    if world > 1:
        opt.comm.all_reduce(sums, op="sum").wait()
    return {g: float(sums[2 * j] / sums[2 * j + 1]) if sums[2 * j + 1] > 0 else 0.0
            for j, g in enumerate(groups)}


def allot(signal: dict[int, float], numels: dict[int, int], sparsity: float,
          block_size: int, power: float = 1.0, max_density: float = 0.5,
          floor: float = 0.0) -> dict[int, float]:
    """Per-group sparsity for an overall ``sparsity`` (module docstring).

    ``signal`` (a group's mean agreement or gain, or any finite value >= 0: only ratios
    between groups matter) and ``numels`` are keyed alike (group index or name). Returns the
    sparsity of each group; ``sum n_g (1 - s_g) == (1 - sparsity) * sum n_g`` unless every
    group is clipped. ``floor`` in [0, 1]: no group's density below ``floor * (1 - sparsity)``
    (nor below ``1 / block_size``), so one extreme reading cannot starve the other groups."""
    _check_fraction("sparsity", sparsity, hi_open=True)
    if sparsity == 0.0:
        raise ValueError("allot: sparsity must be > 0 (a sparse budget to split)")
    if set(signal) != set(numels) or not numels:
        raise ValueError(f"allot: signal and numels must name the same groups, got "
                         f"{sorted(map(str, signal))} and {sorted(map(str, numels))}")
    if not (isinstance(power, (int, float)) and math.isfinite(power) and power >= 0):
        raise ValueError(f"allot: power must be a finite float >= 0, got {power!r}")
    if not (isinstance(floor, (int, float)) and 0.0 <= floor <= 1.0):
        raise ValueError(f"allot: floor must be a float in [0, 1], got {floor!r}")
    lo = max(1.0 / block_size, floor * (1.0 - sparsity))
    if not 1.0 / block_size <= 1.0 - sparsity <= max_density < 1.0:
        raise ValueError(f"allot: need 1/block_size <= 1 - sparsity <= max_density < 1, got "
                         f"density {1.0 - sparsity!r}, max_density {max_density!r}")
    for g, a in signal.items():
        if not (isinstance(a, (int, float)) and math.isfinite(a) and a >= 0.0):
            raise ValueError(f"allot: signal[{g!r}] must be a finite float >= 0, got {a!r}")
    top = max(signal.values())
    weight = {g: max(signal[g] / top if top > 0 else 1.0, 1e-6) ** power for g in numels}
    budget = (1.0 - sparsity) * sum(numels.values())
    density: dict = {}
    free = set(numels)
    while free:  # water-filling: fix the clipped groups, share the rest again
        left = budget - sum(numels[g] * density[g] for g in density)
        lam = left / sum(numels[g] * weight[g] for g in free)
        clipped = {g for g in free if not lo <= lam * weight[g] <= max_density}
        if not clipped:
            density.update({g: lam * weight[g] for g in free})
            break
        for g in clipped:
            density[g] = lo if lam * weight[g] < lo else max_density
        free -= clipped
    return {g: 1.0 - density[g] for g in numels}


def apply_allotment(opt, sparsity: dict[int, float]) -> None:
    """Write per-group sparsity (from :func:`allot`) into ``opt.param_groups``."""
    for g, sp in sparsity.items():
        opt.param_groups[g]["sparsity"] = float(sp)
