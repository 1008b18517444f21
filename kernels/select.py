"""The default rule's next mask in one kernel: the gain score computed where the block top-k
reads it (``scape.rules.gain_score_residual`` then ``blockwise_topk``, DESIGN §1 step 4).

Triton: one program per block, the block held in registers (blocks of at most
``topk.RESIDENT_MAX`` entries): load ``mu``, ``s2``, ``s2w``, ``age`` (and ``prev``), compute
the score with the same code as :func:`scape.kernels.gain_score`'s kernel, and run the
resident top-k search on it. The score never goes to memory. Bytes per coordinate: reads 16
(20 with ``prev``), writes ``2 k`` per block; the two kernels it replaces move 24 + 8.
Larger blocks (their top-k re-reads the block on each of its passes, and would recompute the
score on each) run the two kernels, as the CPU does: the masks are the same either way.
"""

from __future__ import annotations

import torch

from . import stats, topk
from ._checks import (
    check_block_size,
    check_blocked,
    check_int,
    use_triton,
)
from ._triton import tl, triton


@triton.jit
def _gain_topk_kernel(p_mu, p_s2, p_s2w, p_age, p_prev, p_idx, k, k_explore, span,
                      var_m_scale, BLOCK_SIZE: tl.constexpr, HAS_PREV: tl.constexpr,
                      HAS_EXPLORE: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    b_age = tl.load(p_age + offs)
    score = stats._gain(p_mu, p_s2, p_s2w, p_prev, offs, offs >= 0, b_age, span,
                        var_m_scale, HAS_PREV)
    topk._select_resident(topk._key_of(score), b_age, p_idx + pid * k, k, k_explore,
                          BLOCK_SIZE, HAS_EXPLORE)


def gain_topk_warps(block_size: int) -> int:
    """Warps per program: the top-k's up to 2048 entries, 8 at 4096 and 16 at 8192 (the
    score's inputs add to the block's registers: at 8192 entries 4 warps use ptxas's 255
    registers and 8 warps spill on sm_90; 16 warps use about 100, no spill)."""
    return 16 if block_size >= 8192 else 8 if block_size >= 4096 else \
        topk.topk_config(block_size)["num_warps"]


def gain_topk_triton(mu: torch.Tensor, s2: torch.Tensor, s2w: torch.Tensor,
                     age: torch.Tensor, k: int, block_size: int, *, k_explore: int,
                     span: float, var_m_scale: float,
                     prev: torch.Tensor | None = None) -> torch.Tensor:
    """Launch :func:`_gain_topk_kernel`, one program per block (validated arguments)."""
    n_blocks = mu.numel() // block_size
    idx = torch.empty(n_blocks, k, dtype=torch.int16, device=mu.device)
    _gain_topk_kernel[(n_blocks,)](
        mu, s2, s2w, age, mu if prev is None else prev, idx, k, k_explore, span, var_m_scale,
        BLOCK_SIZE=block_size, HAS_PREV=prev is not None, HAS_EXPLORE=k_explore > 0,
        num_warps=gain_topk_warps(block_size))
    return idx


def gain_topk(mu: torch.Tensor, s2: torch.Tensor, s2w: torch.Tensor, age: torch.Tensor,
              k: int, block_size: int, *, k_explore: int = 0, beta: float, beta1: float,
              world: int, prev: torch.Tensor | None = None,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """The mask of largest gain: ``blockwise_topk(gain_score(...), k, block_size, age=age,
    k_explore=k_explore)``, the same int16 ``[n_blocks, k]`` offsets (ties to the lower
    offset, ascending), in one kernel on a GPU for blocks of up to 8192 entries.

    Arguments as :func:`scape.kernels.gain_score` and :func:`scape.kernels.blockwise_topk`
    (``age`` is both the score's wait and the explore order). ``out``: where the two-kernel
    path (CPU tensors, larger blocks) writes the score, a buffer reused step to step.
    """
    stats.check_gain_inputs(mu, s2, s2w, age, prev)
    block_size = check_block_size(block_size)
    check_blocked("mu", mu, block_size)
    k = check_int("k", k, 1, block_size)
    k_explore = check_int("k_explore", k_explore, 0, k)
    span, var_m_scale = stats.gain_factors(beta, beta1, world)
    if use_triton(mu) and block_size <= topk.RESIDENT_MAX:
        return gain_topk_triton(mu, s2, s2w, age, k, block_size, k_explore=k_explore,
                                span=span, var_m_scale=var_m_scale, prev=prev)
    score = stats.gain_score(mu, s2, s2w, age, beta=beta, beta1=beta1, world=world,
                             prev=prev, out=out)
    return topk.blockwise_topk(score, k, block_size, age=age if k_explore else None,
                               k_explore=k_explore)
