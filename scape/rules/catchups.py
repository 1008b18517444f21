"""The catch-ups: what the owner of a shard does at the coordinates a sparse step sent.

Each is an ``update`` of a :class:`scape.rules.Rule` (its contract is in
:mod:`scape.rules`): it moves the mask's coordinates of ``master`` and ``m`` from the
synchronized compact gradient, sets ``age = 0`` there and ``age += 1`` elsewhere, and writes
the new values into ``model_out``. ``lazy`` takes one AdamS step; the others also catch up
the steps a coordinate waited (:func:`catchup_agree`: the default's).
"""

from __future__ import annotations

import math

import torch

from scape.kernels import adams_sparse_
from scape.kernels import catchup_agree_ as kernel_catchup_agree_
from scape.rules.state import ShardState


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
    ``cap < 1`` bounds ``n`` by ``(a+1)^cap``. ``trust=c`` bounds the displacement instead:
    ``n <= max(sqrt(a+1), c * rms_b / lr)`` with ``rms_b`` the RMS of the coordinate's block
    of ``master``.
    """
    flat = mask_positions(idx, block_size)
    p_sel, m_sel = shard.master.index_select(0, flat), shard.m.index_select(0, flat)
    a1 = shard.age.index_select(0, flat).float().add_(1.0)
    gbar = g.float() / a1
    denom, sigma2, mu2 = arrived_mean(shard, flat, m_sel, gbar, a1, hp)
    if agree:
        frac = sign_agreement(sigma2, mu2, hp["beta1"])
    else:
        r = mu2.mul_(a1).div_(sigma2)
        frac = (r / (1.0 + r)).sqrt_()
    steps = torch.maximum(a1 * frac, a1.pow(floor))
    if cap < 1.0:
        steps = torch.minimum(steps, a1.pow(cap))
    if trust is not None and hp["lr"] > 0.0:
        reach = trust_reach(shard.master, block_size, idx.shape[1], trust, hp["lr"])
        steps = torch.minimum(steps, torch.maximum(a1.sqrt(), reach))
    move_selected(shard, flat, p_sel, m_sel, gbar, a1, denom, steps, hp, model_out)


def move_selected(shard: ShardState, flat: torch.Tensor, p_sel: torch.Tensor,
                  m_sel: torch.Tensor, gbar: torch.Tensor, a1: torch.Tensor,
                  denom: torch.Tensor, steps: torch.Tensor, hp: dict,
                  model_out: torch.Tensor) -> None:
    """A catch-up's move once its size is known (:func:`catchup_snr`): the moment ``m_sel``
    decays by ``beta1^(a+1)`` toward the arrived mean ``gbar``, the lazy weight decay of the
    ``a + 1`` steps, ``steps`` normalized steps ``m / denom``; then the mask's ``master`` and
    ``m`` written back, ``age = 0`` there and ``age += 1`` elsewhere, the new values into
    ``model_out``. ``p_sel`` and ``m_sel`` are overwritten."""
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


def arrived_mean(shard: ShardState, flat: torch.Tensor, m_sel: torch.Tensor,
                 gbar: torch.Tensor, a1: torch.Tensor,
                 hp: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What a catch-up reads of the mean ``gbar`` of the ``a1 = a + 1`` gradients that arrived
    at the flat positions ``flat``, against the moment ``m_sel`` there: AdamS's denominator
    ``sqrt(beta2 m^2 + (1 - beta2) gbar^2) + eps``, the per-step noise variance ``sigma^2`` of
    the global mean (the owner's local variance ``s2 - m^2`` over W) and the signal ``mu^2 =
    max(gbar^2 - sigma^2 / (a + 1), 0)`` (:func:`catchup_snr`)."""
    denom = (m_sel * m_sel).mul_(hp["beta2"]).addcmul_(gbar, gbar, value=1.0 - hp["beta2"])
    denom.sqrt_().add_(hp["eps"])
    s2 = shard.extra["s2"].index_select(0, flat).div_(
        shard.extra["s2w"].index_select(0, flat).clamp_(min=1e-12))
    sigma2 = (s2 - m_sel.square()).clamp_(min=0.0).div_(hp.get("world", 1)).add_(1e-30)
    mu2 = (gbar.square() - sigma2 / a1).clamp_(min=0.0)
    return denom, sigma2, mu2


def sign_agreement(sigma2: torch.Tensor, mu2: torch.Tensor, beta1: float) -> torch.Tensor:
    """``E[sign(m_t)] = erf(|mu| / (sigma_m sqrt 2))`` of dense AdamS's moment, an EMA of
    per-step means whose noise is ``sigma_m^2 = sigma^2 (1 - beta1) / (1 + beta1)``
    (:func:`catchup_agree`). Overwrites ``mu2``."""
    sigma_m2 = sigma2 * ((1.0 - beta1) / (1.0 + beta1))
    return torch.special.erf(mu2.div_(sigma_m2.mul_(2.0)).sqrt_())


def trust_reach(master: torch.Tensor, block_size: int, k: int, trust: float,
                lr: float) -> torch.Tensor:
    """``trust * rms_b / lr`` in steps, for each of ``k`` mask entries of each block:
    ``rms_b`` the RMS of the block of ``master`` (the trust bound of :func:`catchup_snr`)."""
    rms = master.view(-1, block_size).square().mean(dim=1).sqrt_()
    return rms.mul_(trust / lr).repeat_interleave(k)


def catchup_agree(shard: ShardState, g: torch.Tensor, idx: torch.Tensor, block_size: int,
                  hp: dict, model_out: torch.Tensor, trust: float | None = None) -> None:
    """Catch-up sized like dense AdamS's own displacement over the ``a + 1`` steps.

    AdamS steps by about ``sign(m)`` every step (``m^2`` is its second-moment proxy), so over
    ``a + 1`` steps it moves ``(a + 1) * E[sign(m_t)]`` along the mean. With the per-step mean
    ``mu`` and the noise of its moment ``sigma_m^2 = sigma^2 (1 - beta1) / (1 + beta1)`` (an
    EMA of per-step means of variance ``sigma^2``), ``E[sign(m_t)] = erf(|mu| / (sigma_m
    sqrt 2))`` for Gaussian noise: a coordinate whose per-step sign is a coin toss moves little
    however long it waited. Floor one step. ``trust=c`` bounds the displacement by ``c`` times
    the RMS of the coordinate's block of weights, never below the square-root rule:
    ``n <= max(sqrt(a+1), c * rms_b / lr)`` (a stale mean is trusted on the scale of the
    weights, not beyond). ``mu^2``, ``sigma^2`` and the rest as :func:`catchup_snr`, whose
    ``agree=True`` form it equals bit for bit on the CPU. One fused kernel on a GPU
    (:func:`scape.kernels.catchup_agree_`).
    """
    ex = shard.extra
    kernel_catchup_agree_(shard.master, shard.m, shard.age, ex["s2"], ex["s2w"], g, idx,
                          block_size, lr=hp["lr"], beta1=hp["beta1"], beta2=hp["beta2"],
                          eps=hp["eps"], weight_decay=hp["weight_decay"],
                          world=hp.get("world", 1), trust=trust, model_out=model_out,
                          age_at_mask=shard.age_at_mask)
    shard.age_at_mask = None
