"""Rules for a sparse step: what the owner does with the synchronized compact gradient, and
which statistic picks the next mask.

A rule is a :class:`Rule`: an ``update`` function plus an optional ``score`` function.

``update(shard, g, idx, block_size, hp, model_out)``:

- ``shard``: the owner's :class:`ShardState` (fp32 ``master``, fp32 ``m``, int32 ``age`` over
  the whole shard, plus ``extra`` tensors a rule may keep);
- ``g``: the averaged gradient at the mask coordinates (fp32, compact, ``n_blocks * k``). With
  error feedback it is everything accumulated there since the coordinate was last sent;
- ``idx``: the owner's mask, int16 ``[n_blocks, k]`` block-local offsets;
- ``hp``: ``lr``, ``beta1``, ``beta2``, ``eps``, ``weight_decay`` of the param group;
- ``model_out``: compact buffer (model dtype) that must receive the new parameter values at
  the mask coordinates; it is all-gathered and scattered into every rank's model.

It must set ``age = 0`` at the mask and ``age += 1`` elsewhere. Only the mask coordinates are
sent, so a rule may change other coordinates of ``master`` only if every rank can reproduce
that change (otherwise the ranks' models drift apart).

``score(shard) -> Tensor`` (length S): the next mask takes, per block, the largest ``|score|``
(default: the first moment ``m``, DESIGN §1 step 4). A rule with ``score_reads_hp`` gets the
param group's hyperparameters too: ``score(shard, hp)``.

Optional seams, each free of communication: ``observe(shard, buf, error_feedback)`` sees the
owner's slice of its own gradient buffer at the start of every step (local statistics, kept
in the shard tensors named by ``extra``, which checkpoints save and reshard); ``reset(shard)``
runs after a skipped step, whose residuals were cleared; ``drift`` makes every rank move
unsent coordinates between syncs from replicated state (:mod:`scape.drift`).

Registering a variant is one :class:`Rule` in :data:`RULES` plus its test. The rules and what
each one measured are in bench/README.md ("Convergence and the quality research").
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import torch

from scape.drift import DriftSpec
from scape.kernels import adams_sparse_, noise_ema_
from scape.kernels import gain_score as kernel_gain_score


@dataclasses.dataclass
class ShardState:
    """Optimizer state of the shard a rank owns (length S each)."""

    master: torch.Tensor
    m: torch.Tensor
    age: torch.Tensor
    extra: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)


UpdateFn = Callable[[ShardState, torch.Tensor, torch.Tensor, int, dict, torch.Tensor], None]
ScoreFn = Callable[..., torch.Tensor]
"""``score(shard)``, or ``score(shard, hp)`` for a rule with ``score_reads_hp``."""
ObserveFn = Callable[[ShardState, torch.Tensor, bool], None]


@dataclasses.dataclass(frozen=True)
class Rule:
    """A sparse-step rule: the owner's update and the statistic the next mask is taken from."""

    update: UpdateFn
    score: ScoreFn | None = None
    """None: the first moment ``m`` (|m| picks the mask)."""
    drift: DriftSpec | None = None
    """None: unsent coordinates stand still; else they drift between syncs (scape.drift)."""
    observe: ObserveFn | None = None
    """Called at the start of every step with the owner's slice of its own gradient buffer
    (this step's local gradient + residual, before the take) and whether error feedback is
    on: local statistics a rule may keep in ``shard.extra`` at no communication cost."""
    extra: tuple[str, ...] = ()
    """Names of the fp32 shard-sized tensors the rule keeps in ``shard.extra`` (zeros at
    construction; saved, loaded and resharded with the shard)."""
    reset: Callable[[ShardState], None] | None = None
    """Called after a skipped step (non-finite gradient somewhere), whose residuals were
    cleared: what ``observe`` kept of the buffer no longer describes it."""
    score_reads_hp: bool = False
    """True: ``score(shard, hp)`` with the hyperparameters ``update`` gets (world size, betas)."""


def mask_positions(idx: torch.Tensor, block_size: int) -> torch.Tensor:
    """Flat int64 positions ``b * block_size + idx[b, j]`` of a mask, block-major."""
    start = torch.arange(idx.shape[0], device=idx.device, dtype=torch.int64)
    return (start.mul_(block_size)[:, None] + idx.long()).view(-1)


def lazy(shard: ShardState, g: torch.Tensor, idx: torch.Tensor, block_size: int, hp: dict,
         model_out: torch.Tensor) -> None:
    """DESIGN §1 step 3: AdamS at the mask coordinates; the rest are frozen (``age += 1``).

    Weight decay is lazy: a coordinate updated after ``a`` frozen steps is decayed by
    ``(1 - lr*wd)^(a+1)``, so the total decay matches dense AdamW. One fused kernel.
    """
    adams_sparse_(shard.master, shard.m, shard.age, g, idx, block_size, lr=hp["lr"],
                  beta1=hp["beta1"], beta2=hp["beta2"], eps=hp["eps"],
                  weight_decay=hp["weight_decay"], model_out=model_out)


def catchup_mean(shard: ShardState, g: torch.Tensor, idx: torch.Tensor, block_size: int,
                 hp: dict, model_out: torch.Tensor, power: float = 1.0) -> None:
    """Replay the ``a + 1`` steps a coordinate missed, from their mean gradient.

    With error feedback, ``g`` is the sum of the ``a + 1`` per-step gradients accumulated
    since the coordinate was last sent. This rule feeds their mean ``g / (a + 1)`` to AdamS
    as if it had arrived on each of those steps: the moment decays by ``beta1^(a+1)`` toward
    the mean, and the parameter moves ``(a + 1)^power`` normalized steps (each
    ``m / (sqrt(v)+eps)`` evaluated at the end state), with the lazy weight decay. At
    ``a = 0`` it is the lazy step. One fused kernel (``adams_sparse_(..., catchup=power)``).
    """
    adams_sparse_(shard.master, shard.m, shard.age, g, idx, block_size, lr=hp["lr"],
                  beta1=hp["beta1"], beta2=hp["beta2"], eps=hp["eps"],
                  weight_decay=hp["weight_decay"], model_out=model_out, catchup=power)


def catchup_sqrt(shard: ShardState, g: torch.Tensor, idx: torch.Tensor, block_size: int,
                 hp: dict, model_out: torch.Tensor) -> None:
    """:func:`catchup_mean` moving ``sqrt(a + 1)`` normalized steps: Adam's square-root
    batch-size scaling (the mean of ``a + 1`` gradients is one larger batch, not ``a + 1``
    independent steps)."""
    catchup_mean(shard, g, idx, block_size, hp, model_out, power=0.5)


def accumulated_score(shard: ShardState) -> torch.Tensor:
    """``m * (age + 1)``, ranked by its magnitude: the gradient mass waiting in the residuals.

    A coordinate unsent for ``a`` steps has accumulated about ``(a + 1) * E[g]`` across the
    ranks' residuals, and ``m`` estimates ``E[g]``. Selecting by this product sends each
    coordinate at a rate proportional to ``|m|`` instead of re-sending the same large-``|m|``
    coordinates while the rest wait for ``explore``. The mask takes ``|score|``, so the sign
    is left in (one pass, no ``abs``; rounding is sign-symmetric, so the magnitudes are
    bitwise those of ``|m| + |m| * age``).
    """
    return torch.addcmul(shard.m, shard.m, shard.age)  # age promotes to fp32


NOISE_BETA = 0.95
"""EMA factor of the owner's local second moment (:func:`observe_local_noise`)."""
NOISE_STATE = ("prev", "s2", "s2w")
"""The shard tensors :func:`observe_local_noise` keeps."""


def observe_local_noise(shard: ShardState, buf: torch.Tensor, error_feedback: bool) -> None:
    """EMA of the square of this rank's own per-step gradient at its shard (``extra["s2"]``,
    with its weight ``extra["s2w"]`` so that ``s2 / s2w`` is unbiased from the first step).

    The buffer holds the residual left by the previous step plus this step's gradient. The
    previous residual is the previous buffer (``extra["prev"]``) with the coordinates synced
    last step (``age == 0``: the mask, or everything after a dense step) zeroed, so this
    step's own gradient is ``buf - where(age == 0, 0, prev)``. One fused pass on a GPU
    (:func:`scape.kernels.noise_ema_`). A non-finite entry (a step about to be skipped) leaves
    that coordinate's ``s2`` and ``s2w`` as they were; after the skip,
    :func:`reset_local_noise` clears ``prev`` (the skip cleared the residual).
    """
    ex = shard.extra
    noise_ema_(buf, ex["prev"], shard.age, ex["s2"], ex["s2w"], beta=NOISE_BETA,
               error_feedback=error_feedback)


def reset_local_noise(shard: ShardState) -> None:
    """After a skipped step the residual is zero: the next buffer is that step's gradient
    alone, so the previous buffer to subtract is zero too."""
    shard.extra["prev"].zero_()


GAIN_STATE = NOISE_STATE + ("mu",)
"""The noise state plus ``mu``, the EMA of the owner's own per-step gradient
(:func:`gain_score`)."""


def observe_local_moments(shard: ShardState, buf: torch.Tensor, error_feedback: bool) -> None:
    """:func:`observe_local_noise`, and the EMA of the local gradient itself in
    ``extra["mu"]`` (same ``beta`` and weight ``s2w``; the same fused pass on a GPU)."""
    ex = shard.extra
    noise_ema_(buf, ex["prev"], shard.age, ex["s2"], ex["s2w"], beta=NOISE_BETA,
               error_feedback=error_feedback, mu=ex["mu"])


def gain_score(shard: ShardState, hp: dict) -> torch.Tensor:
    """What sending a coordinate now is worth: its fresh gradient signal times the steps the
    agreement rule would move it (hypothesis 19 in bench/README.md).

    ``|m| * (age + 1)`` (:func:`accumulated_score`) ranks by the first moment of the
    coordinate's last sync: stale for a coordinate not sent lately, and blind to noise, so a
    large, noisy coordinate wins the mask again and again only to move about one step. Here
    the signal comes from the owner's own fresh EMA ``mu`` of its per-step gradient
    (:func:`observe_local_moments`): ``sig^2 = mean^2 - var (1 - beta) / (1 + beta)`` (the
    EMA's own noise removed; ``mean = mu / s2w``, ``var = s2 / s2w - mean^2``, the per-rank
    variance), and the score is ``sig * max(1, (age + 1) * erf(sig / (sigma_m sqrt 2)))``
    with ``sigma_m^2 = var / W * (1 - beta1) / (1 + beta1)`` as :func:`catchup_agree`: the
    loss decrease per unit lr of the catch-up the rule would make (its trust bound aside).
    A coordinate whose per-step sign is a coin toss scores about its small ``sig``; it waits
    for ``explore``. The owner's mean is that of its own share of the batch, so the reading
    is noisier the more ranks share it (measured on 4 ranks; one process fed the global
    batch reads it better than any rank could). What the split
    (:meth:`scape.allot.AgreementMeter.gain`) sizes the groups' budgets by, per coordinate,
    here picks the coordinates inside a block. One fused pass on a GPU
    (:func:`scape.kernels.gain_score`, 20 bytes per coordinate).
    """
    ex = shard.extra
    return kernel_gain_score(ex["mu"], ex["s2"], ex["s2w"], shard.age, beta=NOISE_BETA,
                             beta1=hp["beta1"], world=hp.get("world", 1))


def gain_score_residual(shard: ShardState, hp: dict) -> torch.Tensor:
    """:func:`gain_score` whose mean also reads the owner's own gradient summed since the
    coordinate was last sent (with error feedback: ``extra["prev"]``, this step's buffer,
    holds ``age`` of the owner's per-step gradients at an unsent coordinate): the EMA's mean
    covers about ``(1 + beta) / (1 - beta)`` (39) steps, the sum all ``age`` of the wait, so a
    weak but steady gradient shows in it the longer it waits, where the EMA's reading stays
    at noise (hypothesis 20). The two means are weighted by the steps they cover,
    ``mean = (39 * ema + age * sum / age) / (39 + age)``, its noise taken as
    ``var / (39 + age)``; the rest as :func:`gain_score`. One fused pass on a GPU
    (:func:`scape.kernels.gain_score` with ``prev``, 24 bytes per coordinate)."""
    ex = shard.extra
    return kernel_gain_score(ex["mu"], ex["s2"], ex["s2w"], shard.age, beta=NOISE_BETA,
                             beta1=hp["beta1"], world=hp.get("world", 1), prev=ex["prev"])


def catchup_snr(shard: ShardState, g: torch.Tensor, idx: torch.Tensor, block_size: int,
                hp: dict, model_out: torch.Tensor, floor: float = 0.0,
                agree: bool = False, cap: float = 1.0, trust: float | None = None) -> None:
    """Catch-up whose number of steps follows the signal-to-noise ratio of what arrived.

    ``g`` is the sum of ``a + 1`` global-mean gradients. With ``sigma^2`` the per-step noise
    variance of the global mean (the owner's local variance ``s2 - m^2`` divided by W: each
    rank's gradient is one of W equal parts), the mean ``gbar = g / (a+1)`` has noise
    ``sigma^2 / (a+1)``; ``mu^2 = max(gbar^2 - sigma^2/(a+1), 0)`` estimates the signal and
    ``r = mu^2 (a+1) / sigma^2`` the ratio. The coordinate moves
    ``n = max((a+1)^floor, (a+1) * sqrt(r / (1 + r)))`` normalized AdamS steps: all ``a+1``
    when the signal dominates (full catch-up), down to ``(a+1)^floor`` on pure noise.
    Moment and decay as :func:`catchup_mean`. Torch ops (not fused).

    ``agree=True`` (:func:`catchup_agree`) sizes the step by what dense AdamS would have
    moved instead: ``n = max((a+1)^floor, (a+1) * erf(|mu| / (sigma_m sqrt 2)))``.
    ``cap < 1`` bounds ``n`` by ``(a+1)^cap`` (:func:`catchup_agree_cap`). ``trust=c`` bounds
    the displacement instead: ``n <= max(sqrt(a+1), c * rms_b / lr)`` with ``rms_b`` the RMS
    of the coordinate's block of ``master`` (:func:`catchup_agree_trust`).
    """
    flat = mask_positions(idx, block_size)
    p_sel, m_sel = shard.master.index_select(0, flat), shard.m.index_select(0, flat)
    a1 = shard.age.index_select(0, flat).float().add_(1.0)
    gbar = g.float() / a1
    denom = (m_sel * m_sel).mul_(hp["beta2"]).addcmul_(gbar, gbar, value=1.0 - hp["beta2"])
    denom.sqrt_().add_(hp["eps"])
    s2 = shard.extra["s2"].index_select(0, flat).div_(
        shard.extra["s2w"].index_select(0, flat).clamp_(min=1e-12))
    sigma2 = (s2 - m_sel.square()).clamp_(min=0.0).div_(hp.get("world", 1)).add_(1e-30)
    mu2 = (gbar.square() - sigma2 / a1).clamp_(min=0.0)
    if agree:  # noise of dense AdamS's m: the EMA of per-step means
        sigma_m2 = sigma2 * ((1.0 - hp["beta1"]) / (1.0 + hp["beta1"]))
        frac = torch.special.erf(mu2.div_(sigma_m2.mul_(2.0)).sqrt_())
    else:
        r = mu2.mul_(a1).div_(sigma2)
        frac = (r / (1.0 + r)).sqrt_()
    steps = torch.maximum(a1 * frac, a1.pow(floor))
    if cap < 1.0:
        steps = torch.minimum(steps, a1.pow(cap))
    if trust is not None and hp["lr"] > 0.0:
        rms = shard.master.view(-1, block_size).square().mean(dim=1).sqrt_()
        reach = rms.mul_(trust / hp["lr"]).repeat_interleave(idx.shape[1])
        steps = torch.minimum(steps, torch.maximum(a1.sqrt(), reach))
    keep = torch.pow(hp["beta1"], a1)  # beta1^(a+1); 0 when beta1 = 0
    m_sel.mul_(keep).addcmul_(1.0 - keep, gbar)
    if hp["weight_decay"] != 0.0:
        p_sel.mul_(a1.mul(math.log1p(-hp["lr"] * hp["weight_decay"])).exp_())
    p_sel.addcmul_(m_sel / denom, steps, value=-hp["lr"])
    shard.master.index_copy_(0, flat, p_sel)
    shard.m.index_copy_(0, flat, m_sel)
    shard.age.add_(1)
    shard.age.index_fill_(0, flat, 0)
    model_out.copy_(p_sel)


def catchup_agree(shard: ShardState, g: torch.Tensor, idx: torch.Tensor, block_size: int,
                  hp: dict, model_out: torch.Tensor) -> None:
    """Catch-up sized like dense AdamS's own displacement over the ``a + 1`` steps.

    AdamS steps by about ``sign(m)`` every step (``m^2`` is its second-moment proxy), so over
    ``a + 1`` steps it moves ``(a + 1) * E[sign(m_t)]`` along the mean. With the per-step mean
    ``mu`` and the noise of its moment ``sigma_m^2 = sigma^2 (1 - beta1) / (1 + beta1)`` (an
    EMA of per-step means of variance ``sigma^2``), ``E[sign(m_t)] = erf(|mu| / (sigma_m
    sqrt 2))`` for Gaussian noise. Unlike :func:`catchup_snr`, the fraction does not grow with
    the wait: a coordinate whose per-step sign is a coin toss moves little however long it
    waited. Floor one step; ``mu^2``, ``sigma^2`` and the rest as :func:`catchup_snr`.
    """
    catchup_snr(shard, g, idx, block_size, hp, model_out, agree=True)


def catchup_agree_sqrt(shard: ShardState, g: torch.Tensor, idx: torch.Tensor, block_size: int,
                       hp: dict, model_out: torch.Tensor) -> None:
    """:func:`catchup_agree` never below the square-root rule (floor ``sqrt(a+1)`` steps):
    it moves like ``catchup_sqrt`` where the noise estimate says little, and up to the full
    ``a + 1`` steps where the arrived mean is clearly signal."""
    catchup_snr(shard, g, idx, block_size, hp, model_out, floor=0.5, agree=True)


def catchup_agree_cap(shard: ShardState, g: torch.Tensor, idx: torch.Tensor, block_size: int,
                      hp: dict, model_out: torch.Tensor) -> None:
    """:func:`catchup_agree` never above the square-root rule: ``n = min(sqrt(a+1),
    max(1, (a+1) * erf(...)))``. It keeps the agreement rule's small steps where the noise
    dominates and drops its full catch-up where the signal does, which overshoots when the
    gradient changes during a long wait (large learning rates)."""
    catchup_snr(shard, g, idx, block_size, hp, model_out, agree=True, cap=0.5)


def catchup_agree_trust(shard: ShardState, g: torch.Tensor, idx: torch.Tensor, block_size: int,
                        hp: dict, model_out: torch.Tensor) -> None:
    """:func:`catchup_agree` whose catch-up moves a coordinate at most about the RMS of its
    block's parameters (``lr * n <= rms_b``), never less than the square-root rule allows:
    ``n = min(n_agree, max(sqrt(a+1), rms_b / lr))``. A stale mean is trusted for a
    displacement on the scale of the weights, not beyond (where the gradient has likely
    changed); at a small learning rate the bound is loose and the rule is the agreement rule."""
    catchup_snr(shard, g, idx, block_size, hp, model_out, agree=True, trust=1.0)


def catchup_agree_trust2(shard: ShardState, g: torch.Tensor, idx: torch.Tensor,
                         block_size: int, hp: dict, model_out: torch.Tensor) -> None:
    """:func:`catchup_agree_trust` with half the reach: ``lr * n <= rms_b / 2``."""
    catchup_snr(shard, g, idx, block_size, hp, model_out, agree=True, trust=0.5)


def catchup_agree_trust4(shard: ShardState, g: torch.Tensor, idx: torch.Tensor,
                         block_size: int, hp: dict, model_out: torch.Tensor) -> None:
    """:func:`catchup_agree_trust` with a quarter of the reach: ``lr * n <= rms_b / 4``."""
    catchup_snr(shard, g, idx, block_size, hp, model_out, agree=True, trust=0.25)


def catchup_snr_sqrt(shard: ShardState, g: torch.Tensor, idx: torch.Tensor, block_size: int,
                     hp: dict, model_out: torch.Tensor) -> None:
    """:func:`catchup_snr` never below the square-root rule (floor ``sqrt(a+1)`` steps)."""
    catchup_snr(shard, g, idx, block_size, hp, model_out, floor=0.5)


def _noise_sized(update: UpdateFn) -> Rule:
    """A rule that sizes the catch-up by the owner's local noise estimate: accumulated-mass
    selection and the local-noise seams."""
    return Rule(update, accumulated_score, observe=observe_local_noise, extra=NOISE_STATE,
                reset=reset_local_noise)


TRUST_LR = (0.5, 0.25)
"""``catchup_agree_trustlr``: the bound ``c`` at the peak lr and as the lr goes to 0."""


def catchup_agree_trustlr(shard: ShardState, g: torch.Tensor, idx: torch.Tensor,
                          block_size: int, hp: dict, model_out: torch.Tensor) -> None:
    """:func:`catchup_agree_trust` with a bound that follows the learning rate: ``c = 1/4 +
    1/4 * lr / lr_peak`` (half the RMS at the peak, towards a quarter as the schedule decays),
    ``lr_peak`` the largest lr the group has had (``hp["lr_peak"]``, kept by
    :class:`scape.SCAPE`; the current lr without it). Early in a run the half bound trains
    faster, late the quarter ends lower (bench/README.md, hypothesis 18)."""
    lr = hp["lr"]
    hi, lo = TRUST_LR
    frac = lr / max(hp.get("lr_peak", lr), lr) if lr > 0.0 else 1.0
    catchup_snr(shard, g, idx, block_size, hp, model_out, agree=True,
                trust=lo + (hi - lo) * frac)


GAIN_SCORES: tuple[ScoreFn, ...] = (gain_score, gain_score_residual)
"""The scores that take a coordinate's fresh gain (the masks of the ``*_gain*`` rules)."""


def _gain_selected(update: UpdateFn, score: ScoreFn = gain_score) -> Rule:
    """A noise-sized rule whose masks take the coordinates of largest ``score`` (one of
    :data:`GAIN_SCORES`)."""
    return Rule(update, score, observe=observe_local_moments, extra=GAIN_STATE,
                reset=reset_local_noise, score_reads_hp=True)


def agree_trust_rule(c: float) -> Rule:
    """The trust-bounded agreement rule at any bound ``c`` (``trust2``: 1/2, ``trust4``: 1/4):
    all share their state, so an optimizer's ``rule`` may be swapped between them (a bound
    scheduled with the learning rate, bench/README.md hypothesis 18)."""
    if isinstance(c, bool) or not (isinstance(c, (int, float)) and math.isfinite(c) and c > 0):
        raise ValueError(f"agree_trust_rule: c must be a finite float > 0, got {c!r}")
    return _noise_sized(functools.partial(catchup_snr, agree=True, trust=float(c)))


RULES: dict[str, Rule] = {
    "lazy": Rule(lazy),
    "lazy_accum": Rule(lazy, accumulated_score),
    "catchup_mean": Rule(catchup_mean),
    "catchup_accum": Rule(catchup_mean, accumulated_score),
    "catchup_sqrt": Rule(catchup_sqrt),
    "catchup_sqrt_accum": Rule(catchup_sqrt, accumulated_score),
    "drift_sqrt_accum": Rule(catchup_sqrt, accumulated_score, DriftSpec(0.99)),
    "drift90_sqrt_accum": Rule(catchup_sqrt, accumulated_score, DriftSpec(0.9)),
    "drift_accum": Rule(catchup_mean, accumulated_score, DriftSpec(0.99)),
    "drift_commit_sqrt_accum": Rule(catchup_sqrt, accumulated_score, DriftSpec(0.99, True)),
    "drift90_commit_sqrt_accum": Rule(catchup_sqrt, accumulated_score, DriftSpec(0.9, True)),
    "drift_commit_lazy_accum": Rule(lazy, accumulated_score, DriftSpec(0.99, True)),
    "drift_commit_accum": Rule(catchup_mean, accumulated_score, DriftSpec(0.99, True)),
    "catchup_snr_accum": _noise_sized(catchup_snr),
    "catchup_agree_accum": _noise_sized(catchup_agree),
    "catchup_snr_sqrt_accum": _noise_sized(catchup_snr_sqrt),
    "catchup_agree_sqrt_accum": _noise_sized(catchup_agree_sqrt),
    "catchup_agree_cap_accum": _noise_sized(catchup_agree_cap),
    "catchup_agree_trust_accum": _noise_sized(catchup_agree_trust),
    "catchup_agree_trust2_accum": _noise_sized(catchup_agree_trust2),
    "catchup_agree_trust4_accum": _noise_sized(catchup_agree_trust4),
    "catchup_agree_trustlr_accum": _noise_sized(catchup_agree_trustlr),
    "catchup_agree_trust2_gain": _gain_selected(catchup_agree_trust2),
    "catchup_agree_trust4_gain": _gain_selected(catchup_agree_trust4),
    "catchup_agree_trust2_gainr": _gain_selected(catchup_agree_trust2, gain_score_residual),
    "catchup_agree_trust4_gainr": _gain_selected(catchup_agree_trust4, gain_score_residual),
}
"""Sparse-step rules by the name passed as ``update=``."""
