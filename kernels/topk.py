"""Blockwise top-k mask selection (DESIGN §1 step 4).

Triton kernel: one program per block, no sort. Each entry gets an int32 key whose signed
order is the order we rank by:

- score part: the bits of ``|x|`` as int32 (non-negative floats order like their bit
  patterns; -0.0 and 0.0 both become 0), NaN mapped to -1, below every number;
- explore part: ``age`` itself.

The k-th largest key ``T`` is found by bisection on the key's 32 bits, most significant
first: a candidate bit is kept when at least k eligible entries have a key >= the candidate
(32 counting passes over the block). Entries with key > T are taken, and the lowest-offset
entries with key == T fill the rest (an exclusive prefix count of the ties). The explore
part repeats the search over ``age`` among entries the score part did not take. A final
pass compacts the selection by a prefix sum, so offsets come out ascending.

Bytes: the block is read once from memory (``block_size * (s + 4)`` bytes with age, ``s`` the
score element size, ``block_size * s`` without); writes ``2 * k`` bytes per block.

Two forms of the same search. A block of at most ``RESIDENT_MAX`` entries (the default 4096
among them) is loaded once into registers and every pass runs there; the explore search counts
among the entries the score part left, a mask computed once. A larger block is walked in
``CHUNK``-entry chunks so register use does not grow with ``block_size``: each pass re-reads
the block (from L1/L2), and the explore search recomputes the score part's tie ranks per chunk.
The two forms' times, against ``torch.topk`` over the same block view (which has no tie rule,
explore part or sorted output), are in docs/kernels.md, "The top-k, before and after".
"""

from __future__ import annotations

import torch

from . import topk_torch
from ._checks import (
    FLOAT_DTYPES,
    check_block_size,
    check_blocked,
    check_int,
    check_numel,
    check_same_device,
    check_tensor,
    use_triton,
)
from ._triton import tl, triton


@triton.jit
def _score_key(p_score, offs):
    """Order-preserving int32 image of |score|: float bits with the sign cleared; NaN -> -1."""
    return _key_of(tl.load(p_score + offs).to(tl.float32))


@triton.jit
def _key_of(x):
    """:func:`_score_key` of fp32 values already in registers."""
    bits = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    return tl.where(bits > 0x7F800000, -1, bits)


@triton.jit
def _top_selected(key, t, need, carry):
    """Entries above threshold ``t``, plus the first ``need`` ties of the block (``carry`` ties
    were seen in earlier chunks). Returns (selected, ties seen so far)."""
    eq = key == t
    eq_i = eq.to(tl.int32)
    rank = carry + tl.cumsum(eq_i, axis=0) - eq_i
    return (key > t) | (eq & (rank < need)), carry + tl.sum(eq_i, axis=0)


@triton.jit
def _explore_selected(age, taken, t, need, carry):
    """Like :func:`_top_selected` over ``age``, among entries not ``taken`` only."""
    free = ~taken
    eq = (age == t) & free
    eq_i = eq.to(tl.int32)
    rank = carry + tl.cumsum(eq_i, axis=0) - eq_i
    return ((age > t) & free) | (eq & (rank < need)), carry + tl.sum(eq_i, axis=0)


@triton.jit
def _threshold(key, need, eligible):
    """The largest int32 ``t`` with at least ``need`` eligible keys ``>= t``, by bisection on
    the bits: the key's signed order is its unsigned order with the sign bit flipped, so the
    flipped pattern ``u`` is built from the top bit down and ``u ^ int_min`` tested."""
    int_min = -2147483648
    u = tl.full((), 0, tl.int32)
    bit = tl.full((), int_min, tl.int32)
    for _ in range(32):
        cand = (u | bit) ^ int_min
        cnt = tl.sum(((key >= cand) & eligible).to(tl.int32), axis=0)
        u = tl.where(cnt >= need, u | bit, u)
        bit = (bit >> 1) & 0x7FFFFFFF
    return u ^ int_min


@triton.jit
def _topk_resident(p_score, p_age, p_idx, k, k_explore, BLOCK_SIZE: tl.constexpr,
                   HAS_EXPLORE: tl.constexpr):
    """The whole block in registers: load once, search, compact."""
    offs = tl.arange(0, BLOCK_SIZE)
    key = _score_key(p_score, offs)
    if HAS_EXPLORE:
        b_age = tl.load(p_age + offs)
    else:
        b_age = key
    _select_resident(key, b_age, p_idx, k, k_explore, BLOCK_SIZE, HAS_EXPLORE)


@triton.jit
def _select_resident(key, b_age, p_idx, k, k_explore, BLOCK_SIZE: tl.constexpr,
                     HAS_EXPLORE: tl.constexpr):
    """Search and compact a block held in registers: ``key`` the int32 images of ``|score|``,
    ``b_age`` the ages (unused without explore)."""
    offs = tl.arange(0, BLOCK_SIZE)
    k_top = k - k_explore
    t_top = _threshold(key, k_top, offs >= 0)
    need_top = k_top - tl.sum((key > t_top).to(tl.int32), axis=0)
    m_sel, _ = _top_selected(key, t_top, need_top, 0)
    if HAS_EXPLORE:
        free = ~m_sel
        t_age = _threshold(b_age, k_explore, free)
        need_age = k_explore - tl.sum(((b_age > t_age) & free).to(tl.int32), axis=0)
        m_age, _ = _explore_selected(b_age, m_sel, t_age, need_age, 0)
        m_sel = m_sel | m_age
    sel_i = m_sel.to(tl.int32)
    slot = tl.cumsum(sel_i, axis=0) - sel_i
    tl.store(p_idx + slot, offs.to(tl.int16), mask=m_sel)


@triton.jit
def _blockwise_topk_kernel(p_score, p_age, p_idx, k, k_explore,
                           BLOCK_SIZE: tl.constexpr, CHUNK: tl.constexpr,
                           HAS_EXPLORE: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    p_score += pid * BLOCK_SIZE
    p_age += pid * BLOCK_SIZE
    p_idx += pid * k
    if CHUNK == BLOCK_SIZE:
        _topk_resident(p_score, p_age, p_idx, k, k_explore, BLOCK_SIZE, HAS_EXPLORE)
    else:
        _topk_chunked(p_score, p_age, p_idx, k, k_explore, BLOCK_SIZE, CHUNK, HAS_EXPLORE)


@triton.jit
def _topk_chunked(p_score, p_age, p_idx, k, k_explore, BLOCK_SIZE: tl.constexpr,
                  CHUNK: tl.constexpr, HAS_EXPLORE: tl.constexpr):
    """The block in ``CHUNK``-entry pieces, re-read on every pass."""
    offs = tl.arange(0, CHUNK)
    k_top = k - k_explore
    int_min = -2147483648

    # Score threshold: the largest t with count(key >= t) >= k_top, bit by bit. The key's
    # signed order is its unsigned order with the sign bit flipped, so we build the flipped
    # pattern `u` from the top bit down and test `u ^ int_min`.
    u = tl.full((), 0, tl.int32)
    bit = tl.full((), int_min, tl.int32)
    for _ in range(32):
        cand = (u | bit) ^ int_min
        cnt = tl.full((), 0, tl.int32)
        for c in range(0, BLOCK_SIZE, CHUNK):
            b_key = _score_key(p_score, c + offs)
            cnt += tl.sum((b_key >= cand).to(tl.int32), axis=0)
        u = tl.where(cnt >= k_top, u | bit, u)
        bit = (bit >> 1) & 0x7FFFFFFF
    t_top = u ^ int_min
    n_above = tl.full((), 0, tl.int32)
    for c in range(0, BLOCK_SIZE, CHUNK):
        b_key = _score_key(p_score, c + offs)
        n_above += tl.sum((b_key > t_top).to(tl.int32), axis=0)
    need_top = k_top - n_above

    t_age = tl.full((), 0, tl.int32)
    need_age = tl.full((), 0, tl.int32)
    if HAS_EXPLORE:
        # Age threshold among the entries the score part did not take.
        u = tl.full((), 0, tl.int32)
        bit = tl.full((), int_min, tl.int32)
        for _ in range(32):
            cand = (u | bit) ^ int_min
            cnt = tl.full((), 0, tl.int32)
            ties = tl.full((), 0, tl.int32)
            for c in range(0, BLOCK_SIZE, CHUNK):
                m_top, ties = _top_selected(_score_key(p_score, c + offs), t_top, need_top,
                                            ties)
                b_age = tl.load(p_age + c + offs)
                cnt += tl.sum(((b_age >= cand) & ~m_top).to(tl.int32), axis=0)
            u = tl.where(cnt >= k_explore, u | bit, u)
            bit = (bit >> 1) & 0x7FFFFFFF
        t_age = u ^ int_min
        n_above = tl.full((), 0, tl.int32)
        ties = tl.full((), 0, tl.int32)
        for c in range(0, BLOCK_SIZE, CHUNK):
            m_top, ties = _top_selected(_score_key(p_score, c + offs), t_top, need_top, ties)
            b_age = tl.load(p_age + c + offs)
            n_above += tl.sum(((b_age > t_age) & ~m_top).to(tl.int32), axis=0)
        need_age = k_explore - n_above

    # Compaction: running prefix count of the selection gives each offset its output slot.
    written = tl.full((), 0, tl.int32)
    ties = tl.full((), 0, tl.int32)
    age_ties = tl.full((), 0, tl.int32)
    for c in range(0, BLOCK_SIZE, CHUNK):
        m_sel, ties = _top_selected(_score_key(p_score, c + offs), t_top, need_top, ties)
        if HAS_EXPLORE:
            b_age = tl.load(p_age + c + offs)
            m_age, age_ties = _explore_selected(b_age, m_sel, t_age, need_age, age_ties)
            m_sel = m_sel | m_age
        sel_i = m_sel.to(tl.int32)
        slot = written + tl.cumsum(sel_i, axis=0) - sel_i
        tl.store(p_idx + slot, (c + offs).to(tl.int16), mask=m_sel)
        written += tl.sum(sel_i, axis=0)


RESIDENT_MAX = 8192
"""Largest block held in registers whole."""


def topk_config(block_size: int) -> dict[str, int]:
    """Launch settings: a block of at most :data:`RESIDENT_MAX` entries is one chunk held in
    registers, with 8 warps at 2048 and 4096 entries and 4 otherwise; a larger one is walked
    in chunks of 2048 with 8 warps (8 entries per thread). Chosen on an H100 by
    ``python -m bench.topk_variants`` (docs/kernels.md)."""
    if block_size <= RESIDENT_MAX:
        return {"CHUNK": block_size, "num_warps": 8 if block_size in (2048, 4096) else 4}
    return {"CHUNK": 2048, "num_warps": 8}


def blockwise_topk_triton(score: torch.Tensor, k: int, block_size: int, *,
                          age: torch.Tensor | None = None, k_explore: int = 0) -> torch.Tensor:
    """Launch :func:`_blockwise_topk_kernel` (arguments already validated)."""
    n_blocks = score.numel() // block_size
    idx = torch.empty((n_blocks, k), dtype=torch.int16, device=score.device)
    cfg = topk_config(block_size)
    _blockwise_topk_kernel[(n_blocks,)](
        score, age if age is not None else score, idx, k, k_explore,
        BLOCK_SIZE=block_size, CHUNK=cfg["CHUNK"], HAS_EXPLORE=k_explore > 0,
        num_warps=cfg["num_warps"])
    return idx


def blockwise_topk(score: torch.Tensor, k: int, block_size: int, *,
                   age: torch.Tensor | None = None, k_explore: int = 0) -> torch.Tensor:
    """Exact per-block selection: int16 ``[n_blocks, k]`` block-local offsets, ascending.

    Per block, the ``k - k_explore`` entries of largest ``|score|``; then, if ``age`` (int32,
    same length) is given, the ``k_explore`` entries of largest ``age`` among the rest. Ties
    go to the lower offset; NaN ranks below every number; -0.0 equals 0.0. Deterministic.
    CUDA tensors run the Triton kernel; others the exact two-level torch path
    (:mod:`scape.kernels.topk_torch`), equal bit for bit to ``reference.blockwise_topk``.
    """
    check_tensor("score", score, dtypes=FLOAT_DTYPES, ndim=1)
    block_size = check_block_size(block_size)
    check_blocked("score", score, block_size)
    k = check_int("k", k, 1, block_size)
    k_explore = check_int("k_explore", k_explore, 0, k)
    if age is not None:
        check_tensor("age", age, dtypes=(torch.int32,), ndim=1)
        check_numel("age", age, score.numel(), "one per score entry")
        check_same_device(score=score, age=age)
    elif k_explore > 0:
        raise ValueError(f"k_explore={k_explore} needs age (an int32 tensor); got age=None")
    if use_triton(score):
        return blockwise_topk_triton(score, k, block_size, age=age, k_explore=k_explore)
    return topk_torch.blockwise_topk(score, k, block_size, age=age, k_explore=k_explore)
