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
(default: the first moment ``m``, DESIGN §1 step 4).

Registering a variant is one :class:`Rule` in :data:`RULES` plus its test. The rules and what
each one measured are in bench/README.md ("Convergence and the quality research").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from scape.kernels import adams_sparse_


@dataclasses.dataclass
class ShardState:
    """Optimizer state of the shard a rank owns (length S each)."""

    master: torch.Tensor
    m: torch.Tensor
    age: torch.Tensor
    extra: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)


UpdateFn = Callable[[ShardState, torch.Tensor, torch.Tensor, int, dict, torch.Tensor], None]
ScoreFn = Callable[[ShardState], torch.Tensor]


@dataclasses.dataclass(frozen=True)
class Rule:
    """A sparse-step rule: the owner's update and the statistic the next mask is taken from."""

    update: UpdateFn
    score: ScoreFn | None = None
    """None: the first moment ``m`` (|m| picks the mask)."""


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
    """``|m| * (age + 1)``: an estimate of the gradient mass waiting in the residuals.

    A coordinate unsent for ``a`` steps has accumulated about ``(a + 1) * E[g]`` across the
    ranks' residuals, and ``m`` estimates ``E[g]``. Selecting by this product sends each
    coordinate at a rate proportional to ``|m|`` instead of re-sending the same large-``|m|``
    coordinates while the rest wait for ``explore``.
    """
    mag = shard.m.abs()
    return mag.addcmul_(mag, shard.age)  # |m| + |m|*age in two passes (age promotes)


RULES: dict[str, Rule] = {
    "lazy": Rule(lazy),
    "lazy_accum": Rule(lazy, accumulated_score),
    "catchup_mean": Rule(catchup_mean),
    "catchup_accum": Rule(catchup_mean, accumulated_score),
    "catchup_sqrt": Rule(catchup_sqrt),
    "catchup_sqrt_accum": Rule(catchup_sqrt, accumulated_score),
}
"""Sparse-step rules by the name passed as ``update=``."""
