"""The embedding matrices' share of a sparse group's bytes (``update="agree"``, the default).

The rows of a token embedding (and of a head tied to it) take a gradient at every step, the
rows of frequent tokens large and steady ones. Masks with one budget per block give them the
share of the rest of the model, and they lag behind dense AdamS more than the rest does
(docs/research.md, "Where `gpt`'s lag at 0.9 is", "The embedding matrices' share"). A
per-block budget cannot move the bytes to them: the group's layout is contiguous, so they
fill a few ranks' shards whole.

With ``update="agree"``, :meth:`scape.SCAPE.attach` (before the first step) gives the
``nn.Embedding`` weights of each sparse group a bucket of their own in that group, and the
group's ``sparsity`` keeps its meaning: what the group sends in all. With ``k`` the group's
budget per block of ``B`` (:func:`scape.rules.block_budget`) and ``f`` the embeddings' share of
the group's blocks, the embeddings' budget per block is::

    k_e = min(B / 2, 5 k)   where the group's masks read the wait (sparsity up to 0.974)
    k_e = 2 k               above, at most the largest budget that does not read the wait

(so that ``agree`` keeps the group's catch-up bound and EMAs there), at most what gives them
half of the group's bytes and at least ``k``; the rest of the group takes what is left,
``k_r = (k - f k_e) / (1 - f)`` (the sparsities this gives on the benchmark workloads:
docs/research.md, "The embedding matrices set apart inside one group").
"""

from __future__ import annotations

import math

import torch
from torch import nn

from scape.rules import reads_wait, round_half_up

SHORT_FACTOR = 5
"""The embeddings' budget over the group's, where the masks read the wait (sparsity <= 0.974)."""
LONG_FACTOR = 2
"""The same above 0.974."""
MAX_SHARE = 0.5
"""The largest share of the group's bytes the embeddings take."""


def embedding_weights(model: nn.Module) -> set[int]:
    """The ids of ``model``'s ``nn.Embedding`` weights (a head tied to one is the same tensor)."""
    return {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}


def split_budget(k: int, block_size: int, share: float) -> tuple[int, int]:
    """``(k_e, k_r)``: per block, the embeddings' budget and the rest's, for a group whose
    budget is ``k`` per block and whose embeddings hold ``share`` of its blocks (in (0, 1))."""
    if not 0.0 < share < 1.0:
        raise ValueError(f"share must be in (0, 1), got {share!r}")
    if reads_wait(k, block_size):
        k_e = min(block_size // 2, SHORT_FACTOR * k)
    else:
        k_e = LONG_FACTOR * k
        while k_e > k and reads_wait(k_e, block_size):
            k_e -= 1
    k_e = max(k, min(k_e, math.floor(MAX_SHARE * k / share)))
    k_r = max(1, round_half_up((k - share * k_e) / (1.0 - share)))
    return k_e, k_r


def share_of_blocks(buckets: list, group: int) -> float:
    """The set-apart buckets' share of ``group``'s blocks (0.0 when none is set apart)."""
    total = sum(b.n_pad for b in buckets if b.group == group)
    apart = sum(b.n_pad for b in buckets if b.group == group and b.apart)
    return apart / total if apart and apart < total else 0.0


def to_set_apart(model: nn.Module, groups: list[list[torch.Tensor]],
                 sparse: list[bool]) -> frozenset[int]:
    """The ids of the embedding weights to set apart: those of sparse groups that hold other
    trainable parameters as well."""
    ids = embedding_weights(model)
    apart: set[int] = set()
    for params, is_sparse in zip(groups, sparse):
        mine = {id(p) for p in params if id(p) in ids}
        if is_sparse and mine and len(mine) < len(params):
            apart |= mine
    return frozenset(apart)
