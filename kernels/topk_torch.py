"""Blockwise top-k in torch ops, two-level: what :func:`scape.kernels.blockwise_topk` runs
without Triton (CPU tensors, ``SCAPE_KERNELS=torch``). Same result as
:func:`scape.kernels.reference.blockwise_topk`, bit for bit, which stays the plain ground truth.

Why: making the next mask is most of a sparse step's local compute on a CPU, and one
``torch.topk`` over every ``[n_blocks, block_size]`` row reads and sorts every entry of the
shard (docs/kernels.md, "The top-k on the CPU"). Here each block is cut into ``G`` groups of
``gs`` consecutive entries:

1. one pass takes the maximum key of every group (``[n_blocks, G]``);
2. per block, the ``m`` groups of largest ``(max, -group)`` are kept (a small ``topk``);
3. an exact top-k runs over the ``m * gs`` kept entries only, in column order.

Exact, ties included, for ``m = k``: let ``e`` (column ``c``, group ``g``) be one of the block's
top k by ``(key, -column)``. If ``g`` were not among the kept groups, k groups ``h`` rank above
it, and each one's first maximal entry ranks above ``e`` (a larger key; or the same key and,
since ``h < g``, a lower column): k entries above ``e``, a contradiction. The explore part
picks among entries the score part did not take: with the taken entries set below every
untaken age, ``m = k_explore`` groups suffice by the same argument (see
:func:`_explore_columns` for ages at the int32 minimum, where keeping ``k_top + k_explore``
groups by their maximum over all entries is used: at most ``k_top`` groups have their first
maximal entry taken).

``G`` is the power of two at or above ``8 k``; when that leaves groups of fewer than 8 entries
(``k > block_size / 64``, e.g. sparsity 0.9) the two levels cost more than they save
(docs/kernels.md, "The top-k on the CPU"), and the single-level reference path runs instead.

Bytes: the score is read twice (its integer image, then the group maxima) and ``age`` twice (a
copy with the taken entries lowered, then its group maxima); the kept entries, at most
``block_size / 8`` per block, are gathered.
"""

from __future__ import annotations

import torch

from .reference import _top_columns, _top_exact, _unique_keys
from .reference import blockwise_topk as _single_level

_NAN_BITS = 0x7F800000  # |x| bit patterns above this are NaN
_BELOW_EVERY_AGE = -(2**32)  # an int64 below every int32 age: entries the score part took
MIN_GROUP = 8


def group_count(k: int, block_size: int) -> int:
    """Groups per block for a top-``k``: the power of two at or above ``8 k``; 0 (the
    single-level path) when that leaves groups of fewer than ``MIN_GROUP`` entries."""
    groups = 1 << max(0, (8 * k - 1).bit_length())
    return groups if groups * MIN_GROUP <= block_size else 0


def _keep_groups(gmax: torch.Tensor, m: int) -> torch.Tensor:
    """Per row of the group maxima ``gmax`` (``[rows, groups]``), the ``m`` groups of largest
    ``(max, -group)``: int64 ``[rows, m]``, ascending."""
    groups = gmax.shape[1]
    rank_of_group = torch.arange(groups - 1, -1, -1, dtype=torch.int64, device=gmax.device)
    gkey = torch.add(rank_of_group, gmax.to(torch.int64), alpha=groups)  # distinct in a row
    return torch.topk(gkey, m, dim=1, sorted=False).indices.sort(dim=1).values


def _gather_groups(grouped: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """The entries of the ``kept`` groups, in column order: ``[rows, m * gs]``."""
    rows, m = kept.shape
    gs = grouped.shape[2]
    return grouped.gather(1, kept[:, :, None].expand(rows, m, gs)).view(rows, m * gs)


def _columns(kept: torch.Tensor, local: torch.Tensor, gs: int) -> torch.Tensor:
    """Block columns of positions ``local`` into the gathered kept groups."""
    return kept.gather(1, local // gs) * gs + local % gs


def _explore_columns(age: torch.Tensor, top: torch.Tensor | None,
                     k_explore: int) -> torch.Tensor:
    """Columns of the ``k_explore`` largest ``age`` (``[rows, groups, gs]``) per row among the
    entries not in ``top``, ties to the lower column.

    Fast path: the taken entries are set to the lowest int32 in a copy, and ``k_explore``
    groups are kept by the copy's maxima. The module's argument holds as long as every kept
    group's maximum is an untaken entry, which is certain when no kept maximum is the lowest
    int32 (checked on the ``[rows, k_explore]`` kept maxima). Otherwise (ages at the int32
    minimum) ``k_top + k_explore`` groups are kept by the maxima of all entries, and the taken
    ones are pushed below every age in int64.
    """
    rows, groups, gs = age.shape
    lowest = torch.iinfo(torch.int32).min
    order = age
    if top is not None:
        order = age.view(rows, groups * gs).clone().scatter_(1, top, lowest)
        order = order.view(rows, groups, gs)
    gmax = order.amax(dim=2)
    kept = _keep_groups(gmax, k_explore)
    if top is None or not bool((gmax.gather(1, kept) == lowest).any()):
        cand = _gather_groups(order, kept)
    else:
        kept = _keep_groups(age.amax(dim=2), top.shape[1] + k_explore)
        cand = _gather_groups(age, kept).to(torch.int64)
        taken = torch.zeros(rows, groups * gs, dtype=torch.bool, device=age.device)
        taken.scatter_(1, top, True)
        cand.masked_fill_(_gather_groups(taken.view(rows, groups, gs), kept),
                          _BELOW_EVERY_AGE)
    local = _top_columns(_unique_keys(cand, cand.shape[1]), k_explore)
    return _columns(kept, local, gs)


def blockwise_topk(score: torch.Tensor, k: int, block_size: int, *,
                   age: torch.Tensor | None = None, k_explore: int = 0) -> torch.Tensor:
    """Per block, the ``k - k_explore`` offsets of largest ``|score|`` (NaN lowest) and then
    the ``k_explore`` offsets of largest ``age`` among the rest, ties to the lower offset;
    int16 ``[n_blocks, k]``, ascending. Arguments are assumed validated."""
    k_top = k - k_explore
    groups = group_count(k, block_size)
    if groups == 0:
        return _single_level(score, k, block_size, age=age, k_explore=k_explore)
    n_blocks = score.numel() // block_size
    gs = block_size // groups
    x = score.view(n_blocks, block_size)
    if x.dtype != torch.float32:
        x = x.float()  # exact for bf16/fp16
    parts = []
    top = None
    if k_top > 0:
        bits = x.view(torch.int32) & 0x7FFFFFFF  # |x| as ordered integers; NaN above +inf
        grouped = bits.view(n_blocks, groups, gs)
        gmax = grouped.amax(dim=2)
        if bool((gmax > _NAN_BITS).any()):  # NaN ranks below every number
            bits.masked_fill_(bits > _NAN_BITS, -1)
            gmax = grouped.amax(dim=2)
        kept = _keep_groups(gmax, k_top)
        local = _top_exact(_gather_groups(grouped, kept), k_top, k_top * gs)
        top = _columns(kept, local, gs)
        parts.append(top)
    if k_explore > 0:
        assert age is not None  # validated by the public function
        parts.append(_explore_columns(age.view(n_blocks, groups, gs), top, k_explore))
    cols = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
    return cols.sort(dim=1).values.to(torch.int16)
