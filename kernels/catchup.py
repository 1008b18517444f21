"""The agreement catch-up of the default rule (``scape.rules.catchup_agree``) as one kernel.

At the mask of a sparse step the owner moves each sent coordinate the steps dense AdamS
would have moved it while it waited: gather ``p``, ``m``, ``age``, ``s2``, ``s2w`` at the
mask, size the step by the agreement factor ``erf``, bound it by the block's RMS (trust),
AdamS with lazy decay, scatter ``p`` and ``m`` back, age every coordinate, write the new
values in the model's dtype for the all-gather. As torch ops that is about 40 launches and
a shard-sized temporary; here one program per block does all of it.

Each program first streams its block once: ``age += 1`` (read and write, 8 bytes per
coordinate) and, with a trust bound, the sum of squares of ``p`` (4). A barrier, then the
block's ``k`` mask entries: read ``idx`` (2), ``g`` (``s``), ``p``, ``m``, ``age``, ``s2``,
``s2w`` (20); write ``p``, ``m``, ``age = 0`` (12) and ``model_out`` (``o``). Bytes per step:
``12 S + K (34 + s + o)`` (``8 S`` without trust), ``S`` the shard's length, ``K`` the mask's.
The age read at a mask entry after the barrier is already ``a + 1``. With ``age_at_mask``
(the ages advanced by :func:`scape.kernels.noise_gain_topk_`) the ages are not touched:
``4 S + K (30 + s + o)``.
"""

from __future__ import annotations

import math

import torch

from . import reference
from ._checks import (
    FLOAT_DTYPES,
    check_block_size,
    check_blocked,
    check_hparams,
    check_idx,
    check_numel,
    check_out,
    check_same_device,
    check_tensor,
    use_triton,
)
from ._triton import tl, triton


@triton.jit
def _catchup_agree_kernel(p_p, p_m, p_age, p_s2, p_s2w, p_g, p_idx, p_out, p_waited, k, lr,
                          beta2, eps, world, var_m_ratio, log_beta1, log_decay, reach_scale,
                          BLOCK_SIZE: tl.constexpr, CHUNK: tl.constexpr,
                          K_TILE: tl.constexpr, HAS_TRUST: tl.constexpr,
                          HAS_DECAY: tl.constexpr, HAS_OUT: tl.constexpr,
                          AGED: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    base = b * BLOCK_SIZE
    # 1. the block, streamed once: every coordinate ages (unless AGED: the ages were
    # advanced before and p_waited holds the mask entries' old ones); the trust bound's sum
    # of squares
    b_sumsq = tl.zeros((CHUNK,), tl.float32)
    for start in range(0, BLOCK_SIZE, CHUNK):
        offs = base + start + tl.arange(0, CHUNK)
        if not AGED:
            tl.store(p_age + offs, tl.load(p_age + offs) + 1)
        if HAS_TRUST:
            b_x = tl.load(p_p + offs)
            b_sumsq += b_x * b_x
    reach = tl.sqrt(tl.sum(b_sumsq, axis=0) / BLOCK_SIZE) * reach_scale
    tl.debug_barrier()  # the ages written above are read at the mask below
    # 2. the mask entries of the block
    for j0 in range(0, k, K_TILE):
        j = j0 + tl.arange(0, K_TILE)
        m_j = j < k
        compact = b * k + j
        flat = base + tl.load(p_idx + compact, mask=m_j, other=0).to(tl.int64)
        if AGED:
            b_a1 = tl.load(p_waited + compact, mask=m_j, other=0).to(tl.float32) + 1.0
        else:
            b_a1 = tl.load(p_age + flat, mask=m_j, other=1).to(tl.float32)  # a + 1 by now
        b_g = tl.load(p_g + compact, mask=m_j, other=0.0).to(tl.float32) / b_a1
        b_p = tl.load(p_p + flat, mask=m_j, other=0.0)
        b_m = tl.load(p_m + flat, mask=m_j, other=0.0)
        b_var = tl.load(p_s2 + flat, mask=m_j, other=0.0) / \
            tl.maximum(tl.load(p_s2w + flat, mask=m_j, other=1.0), 1e-12)
        denom = tl.sqrt(beta2 * b_m * b_m + (1.0 - beta2) * b_g * b_g) + eps
        sigma2 = tl.maximum(b_var - b_m * b_m, 0.0) / world + 1e-30
        mu2 = tl.maximum(b_g * b_g - sigma2 / b_a1, 0.0)
        frac = tl.math.erf(tl.sqrt(mu2 / (sigma2 * var_m_ratio * 2.0)))
        steps = tl.maximum(b_a1 * frac, 1.0)
        if HAS_TRUST:
            steps = tl.minimum(steps, tl.maximum(tl.sqrt(b_a1), reach))
        keep = tl.exp(b_a1 * log_beta1)  # beta1^(a+1)
        b_m = keep * b_m + (1.0 - keep) * b_g
        if HAS_DECAY:
            b_p = b_p * tl.exp(b_a1 * log_decay)  # (1 - lr*wd)^(a+1)
        b_p = b_p - lr * (b_m / denom) * steps
        tl.store(p_p + flat, b_p, mask=m_j)
        tl.store(p_m + flat, b_m, mask=m_j)
        if not AGED:
            tl.store(p_age + flat, tl.zeros((K_TILE,), tl.int32), mask=m_j)
        if HAS_OUT:
            tl.store(p_out + compact, b_p.to(p_out.dtype.element_ty), mask=m_j)


def catchup_config(block_size: int, k: int) -> dict[str, int]:
    """Launch settings: the block streamed ``CHUNK`` entries at a time, up to 1024 mask
    entries per pass, 4 warps (8 for blocks of 8192 and more)."""
    return {"CHUNK": min(block_size, 2048), "K_TILE": min(triton.next_power_of_2(k), 1024),
            "num_warps": 8 if block_size >= 8192 else 4}


def catchup_agree_triton(p: torch.Tensor, m: torch.Tensor, age: torch.Tensor,
                         s2: torch.Tensor, s2w: torch.Tensor, g: torch.Tensor,
                         idx: torch.Tensor, block_size: int, *, lr: float, beta1: float,
                         beta2: float, eps: float, weight_decay: float, world: int,
                         trust: float | None = None,
                         model_out: torch.Tensor | None = None,
                         age_at_mask: torch.Tensor | None = None) -> None:
    """Launch :func:`_catchup_agree_kernel`, one program per block (validated arguments)."""
    n_blocks, k = idx.shape
    cfg = catchup_config(block_size, k)
    has_trust = trust is not None and lr > 0.0
    # log(beta1); beta1 = 0 gives a finite stand-in whose exp underflows to 0 for a+1 >= 1
    log_beta1 = math.log(beta1) if beta1 > 0.0 else -1e30
    log_decay = math.log1p(-lr * weight_decay) if weight_decay != 0.0 else 0.0
    _catchup_agree_kernel[(n_blocks,)](
        p, m, age, s2, s2w, g, idx, model_out if model_out is not None else p,
        age if age_at_mask is None else age_at_mask, k, lr, beta2,
        eps, float(world), (1.0 - beta1) / (1.0 + beta1), log_beta1, log_decay,
        trust / lr if has_trust else 0.0,  # type: ignore[operator]
        BLOCK_SIZE=block_size, CHUNK=cfg["CHUNK"], K_TILE=cfg["K_TILE"], HAS_TRUST=has_trust,
        HAS_DECAY=weight_decay != 0.0, HAS_OUT=model_out is not None,
        AGED=age_at_mask is not None, num_warps=cfg["num_warps"])


def catchup_agree_(p: torch.Tensor, m: torch.Tensor, age: torch.Tensor, s2: torch.Tensor,
                   s2w: torch.Tensor, g: torch.Tensor, idx: torch.Tensor, block_size: int, *,
                   lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                   world: int, trust: float | None = None,
                   model_out: torch.Tensor | None = None,
                   age_at_mask: torch.Tensor | None = None) -> None:
    """The agreement catch-up at the mask, in place; every other coordinate ages.

    ``p``, ``m``, ``s2``, ``s2w`` fp32 and ``age`` int32 cover the shard (``s2 / s2w`` the
    owner's second moment of its per-step gradient, :func:`scape.kernels.noise_ema_`);
    ``g`` is compact (one value per mask entry, block-major): the averaged gradient summed
    over the ``a + 1`` steps the coordinate waited. At a mask entry of age ``a``::

        gbar   = g / (a+1)
        v      = b2 m^2 + (1-b2) gbar^2                              (old m)
        sigma2 = max(s2/max(s2w, 1e-12) - m^2, 0) / world + 1e-30    (noise of the mean)
        mu2    = max(gbar^2 - sigma2/(a+1), 0)
        n      = max((a+1) erf(sqrt(mu2 / (2 sigma2 (1-b1)/(1+b1)))), 1)
        n      = min(n, max(sqrt(a+1), trust * rms_b / lr))           (trust given, lr > 0)
        m      = b1^(a+1) m + (1 - b1^(a+1)) gbar
        p      = p (1-lr wd)^(a+1) - lr n m / (sqrt(v) + eps)

    then ``age = 0``; elsewhere ``age += 1``. ``rms_b`` is the RMS of the coordinate's block
    of ``p`` before the update. ``model_out`` (compact) receives the new ``p`` cast to its
    dtype. ``world`` is the number of ranks whose mean ``g`` is. ``age_at_mask`` (int32,
    compact), if given, holds the mask entries' ages ``a`` and says the ages were advanced
    already (:func:`scape.kernels.noise_gain_topk_`): ``age`` is then neither read nor
    written.
    """
    for name, t in (("p", p), ("m", m), ("s2", s2), ("s2w", s2w)):
        check_tensor(name, t, dtypes=(torch.float32,), ndim=1)
        check_numel(name, t, p.numel(), "same length as p")
    check_tensor("age", age, dtypes=(torch.int32,), ndim=1)
    check_numel("age", age, p.numel(), "same length as p")
    block_size = check_block_size(block_size)
    n_blocks = check_blocked("p", p, block_size)
    n_blocks, k = check_idx(idx, n_blocks, block_size)
    check_tensor("g", g, dtypes=FLOAT_DTYPES, ndim=1)
    check_numel("g", g, n_blocks * k, "one per mask entry")
    check_same_device(p=p, m=m, age=age, s2=s2, s2w=s2w, g=g, idx=idx)
    check_out("model_out", model_out, n_blocks * k, "one per mask entry", "p", p)
    if age_at_mask is not None:
        check_tensor("age_at_mask", age_at_mask, dtypes=(torch.int32,), ndim=1)
        check_numel("age_at_mask", age_at_mask, n_blocks * k, "one per mask entry")
        check_same_device(p=p, age_at_mask=age_at_mask)
    lr, beta1, beta2, eps, weight_decay = check_hparams(
        lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay)
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"world must be an int >= 1, got {world!r}")
    if trust is not None and (isinstance(trust, bool) or not isinstance(trust, (int, float))
                              or not trust >= 0.0 or math.isinf(trust)):
        raise ValueError(f"trust must be None or a finite float >= 0, got {trust!r}")
    trust = None if trust is None else float(trust)
    if use_triton(p):
        return catchup_agree_triton(p, m, age, s2, s2w, g, idx, block_size, lr=lr,
                                    beta1=beta1, beta2=beta2, eps=eps,
                                    weight_decay=weight_decay, world=world, trust=trust,
                                    model_out=model_out, age_at_mask=age_at_mask)
    reference.catchup_agree_(p, m, age, s2, s2w, g, idx, block_size, lr=lr, beta1=beta1,
                             beta2=beta2, eps=eps, weight_decay=weight_decay, world=world,
                             trust=trust, model_out=model_out, age_at_mask=age_at_mask)
