"""Rules for a sparse step: what the owner does with the synchronized compact gradient.

A rule is one function ``rule(shard, g, idx, block_size, hp, model_out)``:

- ``shard``: the owner's :class:`ShardState` (fp32 ``master``, fp32 ``m``, int32 ``age`` over
  the whole shard, plus ``extra`` tensors a rule may keep);
- ``g``: the averaged gradient at the mask coordinates (fp32, compact, ``n_blocks * k``);
- ``idx``: the owner's mask, int16 ``[n_blocks, k]`` block-local offsets;
- ``hp``: ``lr``, ``beta1``, ``beta2``, ``eps``, ``weight_decay`` of the param group;
- ``model_out``: compact buffer (model dtype) that must receive the new parameter values at
  the mask coordinates; it is all-gathered and scattered into every rank's model.

Only the mask coordinates are sent, so a rule may change other coordinates of ``master`` only
if every rank can reproduce that change (otherwise the ranks' models drift apart).
Registering a variant is one function plus one entry in :data:`RULES`.
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


Rule = Callable[[ShardState, torch.Tensor, torch.Tensor, int, dict, torch.Tensor], None]


def lazy(shard: ShardState, g: torch.Tensor, idx: torch.Tensor, block_size: int, hp: dict,
         model_out: torch.Tensor) -> None:
    """DESIGN §1 step 3: AdamS at the mask coordinates; the rest are frozen (``age += 1``).

    Weight decay is lazy: a coordinate updated after ``a`` frozen steps is decayed by
    ``(1 - lr*wd)^(a+1)``, so the total decay matches dense AdamW.
    """
    adams_sparse_(shard.master, shard.m, shard.age, g, idx, block_size, lr=hp["lr"],
                  beta1=hp["beta1"], beta2=hp["beta2"], eps=hp["eps"],
                  weight_decay=hp["weight_decay"], model_out=model_out)


RULES: dict[str, Rule] = {"lazy": lazy}
"""Sparse-step rules by the name passed as ``update=``."""
