"""The default rule's next mask in one kernel: the gain score computed where the block top-k
reads it (``scape.rules.gain_score_residual`` then ``blockwise_topk``, DESIGN §1 step 4).

Triton: one program per block, the block held in registers (blocks of at most
``topk.RESIDENT_MAX`` entries): load ``mu``, ``s2``, ``s2w``, ``age`` (and ``prev``), compute
the score with the same code as :func:`scape.kernels.gain_score`'s kernel, and run the
resident top-k search on it. The score never goes to memory. Bytes per coordinate: reads 16
(20 with ``prev``), writes ``2 k`` per block; the two kernels it replaces move 24 + 8.
Larger blocks (their top-k re-reads the block on each of its passes, and would recompute the
score on each) run the two kernels, as the CPU does: the masks are the same either way.

``noise_gain_topk_`` does all of a sparse step's work over the shard that does not wait for the
step's gradient to be synchronized, in one program per block, before the take: the noise
EMAs (``noise_ema_``), the step's ages (every age up by one, the step's own mask ``cur``
reset; the old ages at ``cur`` go out for the catch-up), then the gain score and the resident
search for the next mask, on values still in registers. Bytes per coordinate: reads ``buf``,
``prev``, ``age``, ``s2``, ``s2w``, ``mu`` (24), writes ``prev``, ``age``, ``s2``, ``s2w``,
``mu`` (20); per entry of ``cur`` 2 + 4 + 4 (read the offset and the old age, write it out,
zero the age), ``2 k`` per block out. The three kernels it replaces (``noise_ema_``, the
catch-up's pass over the ages, ``gain_topk``) move 40 + 8 + 20 = 68.
"""

from __future__ import annotations

import torch

from . import reference, stats, topk
from ._checks import (
    check_block_size,
    check_blocked,
    check_idx,
    check_int,
    check_numel,
    check_same_device,
    check_tensor,
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


@triton.jit
def _noise_gain_topk_kernel(p_buf, p_prev, p_age, p_s2, p_s2w, p_mu, p_cur, p_waited, p_idx,
                            k_cur, k, k_explore, beta, span, var_m_scale,
                            BLOCK_SIZE: tl.constexpr, K_TILE: tl.constexpr,
                            ERROR_FEEDBACK: tl.constexpr, HAS_EXPLORE: tl.constexpr,
                            RESIDUAL: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    base = pid * BLOCK_SIZE
    offs = base + tl.arange(0, BLOCK_SIZE)
    # 1. the noise EMAs (stats.noise_ema_'s arithmetic)
    b_buf = tl.load(p_buf + offs)
    b_age = tl.load(p_age + offs)
    b_s2, b_s2w, b_mu = stats._ema(b_buf, tl.load(p_prev + offs), b_age, tl.load(p_s2 + offs),
                                   tl.load(p_s2w + offs), tl.load(p_mu + offs), beta,
                                   ERROR_FEEDBACK)
    tl.store(p_s2 + offs, b_s2)
    tl.store(p_s2w + offs, b_s2w)
    tl.store(p_mu + offs, b_mu)
    tl.store(p_prev + offs, b_buf)
    b_ema, b_var = stats._gain_moments(b_mu, b_s2, b_s2w)  # what the score keeps of them
    # 2. this step's ages: the old ones at its mask out, every age up by one, the mask's 0
    for j0 in range(0, k_cur, K_TILE):
        j = j0 + tl.arange(0, K_TILE)
        m_j = j < k_cur
        flat = base + tl.load(p_cur + pid * k_cur + j, mask=m_j, other=0).to(tl.int64)
        tl.store(p_waited + pid * k_cur + j, tl.load(p_age + flat, mask=m_j, other=0),
                 mask=m_j)
    tl.debug_barrier()  # every old age read (above and in step 1) before any is written
    tl.store(p_age + offs, b_age + 1)
    tl.debug_barrier()
    for j0 in range(0, k_cur, K_TILE):
        j = j0 + tl.arange(0, K_TILE)
        m_j = j < k_cur
        flat = base + tl.load(p_cur + pid * k_cur + j, mask=m_j, other=0).to(tl.int64)
        tl.store(p_age + flat, tl.zeros((K_TILE,), tl.int32), mask=m_j)
    tl.debug_barrier()
    b_age = tl.load(p_age + offs)
    # 3. the next mask: the gain score (RESIDUAL: with the wait, prev being this buffer)
    score = stats._gain_of(b_ema, b_var, b_buf, b_age, span, var_m_scale, RESIDUAL)
    topk._select_resident(topk._key_of(score), b_age, p_idx + pid * k, k, k_explore,
                          BLOCK_SIZE, HAS_EXPLORE)


FUSED_MAX = 4096
"""The largest block :func:`noise_gain_topk_` runs as one kernel: at 8192 entries the EMAs'
inputs on top of the search's registers spill (ptxas, sm_80 and sm_90, at 16 and 32 warps)."""


def cur_tile(k_cur: int) -> int:
    """Entries of this step's mask handled per pass of :func:`_noise_gain_topk_kernel`."""
    return min(triton.next_power_of_2(k_cur), 1024)


def noise_gain_topk_triton(buf: torch.Tensor, prev: torch.Tensor, age: torch.Tensor,
                           s2: torch.Tensor, s2w: torch.Tensor, mu: torch.Tensor,
                           cur: torch.Tensor, k: int, block_size: int, *, k_explore: int,
                           beta: float, span: float, var_m_scale: float,
                           error_feedback: bool,
                           residual: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch :func:`_noise_gain_topk_kernel`, one program per block (validated arguments)."""
    n_blocks, k_cur = cur.shape
    idx = torch.empty(n_blocks, k, dtype=torch.int16, device=buf.device)
    waited = torch.empty(n_blocks * k_cur, dtype=torch.int32, device=buf.device)
    _noise_gain_topk_kernel[(n_blocks,)](
        buf, prev, age, s2, s2w, mu, cur, waited, idx, k_cur, k, k_explore, beta, span,
        var_m_scale, BLOCK_SIZE=block_size, K_TILE=cur_tile(k_cur),
        ERROR_FEEDBACK=error_feedback, HAS_EXPLORE=k_explore > 0, RESIDUAL=residual,
        num_warps=gain_topk_warps(block_size))
    return idx, waited


def noise_gain_topk_(buf: torch.Tensor, prev: torch.Tensor, age: torch.Tensor,
                     s2: torch.Tensor, s2w: torch.Tensor, mu: torch.Tensor, cur: torch.Tensor,
                     k: int, block_size: int, *, k_explore: int = 0, beta: float,
                     beta1: float, world: int, error_feedback: bool = True,
                     residual: bool = True,
                     out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A sparse step's work over the shard before its gradient is synchronized, in place:
    :func:`scape.kernels.noise_ema_` (with ``mu``), then the step's ages (every age up by one,
    those of the step's own mask ``cur`` reset to 0), then the next mask
    :func:`gain_topk` on the new ages, with the wait ``prev`` (now this ``buf``) if
    ``residual`` (``scape.rules.gain_score_residual``; False: the EMA's mean alone,
    ``scape.rules.gain_score``). Returns the next mask (int16 ``[n_blocks, k]``) and the old
    ages at ``cur`` (int32, one per entry of ``cur``, block-major), which the catch-up takes
    as ``scape.kernels.catchup_agree_(..., age_at_mask=)``.

    Arguments as those functions (``cur``: int16 ``[n_blocks, k_cur]`` offsets, ascending per
    row). One kernel on a GPU for blocks of up to 4096 entries (the default), the state read
    and written once; elsewhere the three ops in turn (``out``: where the CPU writes the
    score), with the same results.
    """
    stats.check_gain_inputs(mu, s2, s2w, age, prev)
    n = mu.numel()
    check_tensor("buf", buf, dtypes=(torch.float32,), ndim=1)
    check_numel("buf", buf, n, "same length as mu")
    block_size = check_block_size(block_size)
    n_blocks = check_blocked("mu", mu, block_size)
    check_idx(cur, n_blocks, block_size, name="cur")
    check_same_device(buf=buf, mu=mu, cur=cur)
    k = check_int("k", k, 1, block_size)
    k_explore = check_int("k_explore", k_explore, 0, k)
    span, var_m_scale = stats.gain_factors(beta, beta1, world)
    if use_triton(mu) and block_size <= FUSED_MAX:
        return noise_gain_topk_triton(buf, prev, age, s2, s2w, mu, cur, k, block_size,
                                      k_explore=k_explore, beta=float(beta), span=span,
                                      var_m_scale=var_m_scale,
                                      error_feedback=bool(error_feedback),
                                      residual=bool(residual))
    stats.noise_ema_(buf, prev, age, s2, s2w, beta=beta, error_feedback=error_feedback, mu=mu)
    age_at_mask = reference.advance_ages_(age, cur, block_size)
    idx = gain_topk(mu, s2, s2w, age, k, block_size, k_explore=k_explore, beta=beta,
                    beta1=beta1, world=world, prev=prev if residual else None, out=out)
    return idx, age_at_mask
