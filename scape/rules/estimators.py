"""What a rule reads to pick its next mask: the owner's local statistics of its own gradient
(noise and moment EMAs, kept in ``shard.extra``, observed at the start of every step) and the
scores and fused selections computed from them; :func:`unadvance_ages` puts back the ages a
fused pass advanced for a step that was then skipped."""

from __future__ import annotations

import torch

from scape.kernels import gain_score as kernel_gain_score
from scape.kernels import gain_topk as kernel_gain_topk
from scape.kernels import noise_ema_, restore_ages_
from scape.rules.state import ShardState


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


def observe_local_moments(shard: ShardState, buf: torch.Tensor, error_feedback: bool,
                          beta: float = NOISE_BETA) -> None:
    """:func:`observe_local_noise` at factor ``beta``, and the EMA of the local gradient itself
    in ``extra["mu"]`` (same weight ``s2w``; the same fused pass on a GPU)."""
    ex = shard.extra
    noise_ema_(buf, ex["prev"], shard.age, ex["s2"], ex["s2w"], beta=beta,
               error_feedback=error_feedback, mu=ex["mu"])


def gain_score(shard: ShardState, hp: dict, beta: float = NOISE_BETA) -> torch.Tensor:
    """What sending a coordinate now is worth: its fresh gradient signal times the steps the
    agreement rule would move it.

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
    is noisier the more ranks share it (docs/research.md, "Method", "One process or W
    ranks"). One fused pass on a GPU (:func:`scape.kernels.gain_score`, 20 bytes per
    coordinate). The score is written into the shard's buffer ``work["score"]`` and
    returned: the next call overwrites it.
    """
    ex = shard.extra
    return kernel_gain_score(ex["mu"], ex["s2"], ex["s2w"], shard.age, beta=beta,
                             beta1=hp["beta1"], world=hp.get("world", 1),
                             out=shard.buffer("score"))


def gain_score_residual(shard: ShardState, hp: dict, beta: float = NOISE_BETA) -> torch.Tensor:
    """:func:`gain_score` whose mean also reads the owner's own gradient summed since the
    coordinate was last sent (with error feedback: ``extra["prev"]``, this step's buffer,
    holds ``age`` of the owner's per-step gradients at an unsent coordinate): the EMA's mean
    covers about ``(1 + beta) / (1 - beta)`` (39) steps, the sum all ``age`` of the wait, so a
    weak but steady gradient shows in it the longer it waits, where the EMA's reading stays
    at noise. The two means are weighted by the steps they cover,
    ``mean = (39 * ema + age * sum / age) / (39 + age)``, its noise taken as
    ``var / (39 + age)``; the rest as :func:`gain_score`. One fused pass on a GPU
    (:func:`scape.kernels.gain_score` with ``prev``, 24 bytes per coordinate)."""
    ex = shard.extra
    return kernel_gain_score(ex["mu"], ex["s2"], ex["s2w"], shard.age, beta=beta,
                             beta1=hp["beta1"], world=hp.get("world", 1), prev=ex["prev"],
                             out=shard.buffer("score"))


def gain_select(shard: ShardState, hp: dict, k: int, k_explore: int, block_size: int,
                residual: bool = False, beta: float = NOISE_BETA) -> torch.Tensor:
    """The mask of largest :func:`gain_score` (``residual``: :func:`gain_score_residual`) of
    EMAs kept at factor ``beta``: one kernel on a GPU (:func:`scape.kernels.gain_topk`), the
    score never stored; on the CPU the score (into the shard's buffer) and ``blockwise_topk``."""
    ex = shard.extra
    return kernel_gain_topk(ex["mu"], ex["s2"], ex["s2w"], shard.age, k, block_size,
                            k_explore=k_explore, beta=beta, beta1=hp["beta1"],
                            world=hp.get("world", 1), prev=ex["prev"] if residual else None,
                            out=shard.buffer("score"))



def unadvance_ages(shard: ShardState, cur: torch.Tensor, block_size: int) -> None:
    """A step skipped after :func:`observe_select_gain` advanced its ages: put them back."""
    if shard.age_at_mask is not None:
        restore_ages_(shard.age, cur, block_size, shard.age_at_mask)
        shard.age_at_mask = None

