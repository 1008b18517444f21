"""Gradient statistics for clipping and the non-finite skip decision (DESIGN §1).

Triton: a deterministic two-stage reduction. Stage one, one program per ``TILE`` entries,
writes a partial fp32 sum of squares and an int32 non-finite count; stage two, one program,
adds the partials in a fixed order (sum in fp32, count in int64) and writes the fp32 pair.
Bytes: reads ``N * s`` (``s`` the element size) plus ``8`` per tile of partials, writes 8.
No atomics, so the result is bitwise reproducible run to run.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import reference
from ._checks import FLOAT_DTYPES, check_tensor, use_triton


@triton.jit
def _grad_stats_kernel(p_x, p_sumsq, p_count, n, TILE: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * TILE + tl.arange(0, TILE)
    b_x = tl.load(p_x + offs, mask=offs < n, other=0.0).to(tl.float32)
    nonfinite = ~(tl.abs(b_x) < float("inf"))  # NaN compares false, so it counts
    tl.store(p_sumsq + pid, tl.sum(b_x * b_x, axis=0))
    tl.store(p_count + pid, tl.sum(nonfinite.to(tl.int32), axis=0))


@triton.jit
def _grad_stats_finish_kernel(p_sumsq, p_count, p_out, n_parts, PART_TILE: tl.constexpr):
    acc = tl.zeros((PART_TILE,), tl.float32)
    cnt = tl.zeros((PART_TILE,), tl.int64)
    for start in range(0, n_parts, PART_TILE):
        offs = start + tl.arange(0, PART_TILE)
        m_parts = offs < n_parts
        acc += tl.load(p_sumsq + offs, mask=m_parts, other=0.0)
        cnt += tl.load(p_count + offs, mask=m_parts, other=0).to(tl.int64)
    tl.store(p_out, tl.sum(acc, axis=0))
    tl.store(p_out + 1, tl.sum(cnt, axis=0).to(tl.float32))


STATS_TILE = 4096
STATS_WARPS = 8
PART_TILE = 1024


def grad_stats_triton(x: torch.Tensor) -> torch.Tensor:
    """Launch both stages (argument already validated)."""
    n = x.numel()
    n_parts = triton.cdiv(n, STATS_TILE)
    sumsq = torch.empty(n_parts, dtype=torch.float32, device=x.device)
    count = torch.empty(n_parts, dtype=torch.int32, device=x.device)
    out = torch.empty(2, dtype=torch.float32, device=x.device)
    _grad_stats_kernel[(n_parts,)](x, sumsq, count, n, TILE=STATS_TILE, num_warps=STATS_WARPS)
    _grad_stats_finish_kernel[(1,)](sumsq, count, out, n_parts, PART_TILE=PART_TILE,
                                    num_warps=4)
    return out


def grad_stats(x: torch.Tensor) -> torch.Tensor:
    """fp32 tensor ``[sum of squares of all entries, count of non-finite entries]``.

    The sum covers every entry, so it is inf or NaN whenever a non-finite entry exists: the
    skip decision reads the count (exact up to 2^24), clipping reads the sum.
    """
    check_tensor("x", x, dtypes=FLOAT_DTYPES, ndim=1)
    if x.numel() == 0:
        raise ValueError("x must have at least one element; got 0")
    if use_triton(x):
        return grad_stats_triton(x)
    return reference.grad_stats(x)
