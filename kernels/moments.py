"""Fused optimizer updates: AdamS dense and sparse (lazy decay), AdamW (DESIGN §1 step 3).

Triton kernels, all arithmetic in fp32, bytes per coordinate (``g`` of element size ``s``,
``model_out`` of element size ``o``, 0 when absent):

- ``adams_dense_``: reads p, m, g; writes p, m (and model_out): ``16 + s + o`` bytes over
  the N coordinates, one program per ``TILE`` contiguous coordinates.
- ``adamw_dense_``: reads p, m, v, g; writes p, m, v (and model_out): ``24 + s + o``.
- ``adams_sparse_``: at the K masked coordinates reads idx, g, p, m, age and writes p, m,
  age and model_out (``2 + s + 12 + 12 + o`` bytes each, random access), then a streaming
  pass over the whole shard ``age += 1`` (8 bytes per coordinate). The masked kernel writes
  ``age = -1`` so that the streaming pass leaves it at 0; two launches in stream order, no
  intra-kernel race between them.
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
    check_int,
    check_numel,
    check_out,
    check_same_device,
    check_tensor,
    use_triton,
)
from ._triton import tl, triton

_F32 = (torch.float32,)


@triton.jit
def _adams_dense_kernel(p_p, p_m, p_g, p_out, n, lr, beta1, beta2, eps, decay,
                        TILE: tl.constexpr, HAS_OUT: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * TILE + tl.arange(0, TILE)
    m_n = offs < n
    b_p = tl.load(p_p + offs, mask=m_n, other=0.0)
    b_m = tl.load(p_m + offs, mask=m_n, other=0.0)
    b_g = tl.load(p_g + offs, mask=m_n, other=0.0).to(tl.float32)
    denom = tl.sqrt(beta2 * b_m * b_m + (1.0 - beta2) * b_g * b_g) + eps
    b_m = beta1 * b_m + (1.0 - beta1) * b_g
    b_p = b_p * decay - lr * (b_m / denom)
    tl.store(p_p + offs, b_p, mask=m_n)
    tl.store(p_m + offs, b_m, mask=m_n)
    if HAS_OUT:
        tl.store(p_out + offs, b_p.to(p_out.dtype.element_ty), mask=m_n)


@triton.jit
def _adamw_dense_kernel(p_p, p_m, p_v, p_g, p_out, n, beta1, beta2, eps, decay, step_size,
                        bias2_sqrt, TILE: tl.constexpr, HAS_OUT: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * TILE + tl.arange(0, TILE)
    m_n = offs < n
    b_p = tl.load(p_p + offs, mask=m_n, other=0.0)
    b_m = tl.load(p_m + offs, mask=m_n, other=0.0)
    b_v = tl.load(p_v + offs, mask=m_n, other=0.0)
    b_g = tl.load(p_g + offs, mask=m_n, other=0.0).to(tl.float32)
    b_p = b_p * decay
    b_m = b_m + (1.0 - beta1) * (b_g - b_m)  # torch.lerp's formula for weight < 0.5
    b_v = b_v * beta2 + (1.0 - beta2) * b_g * b_g
    denom = tl.sqrt(b_v) / bias2_sqrt + eps
    b_p = b_p - step_size * (b_m / denom)
    tl.store(p_p + offs, b_p, mask=m_n)
    tl.store(p_m + offs, b_m, mask=m_n)
    tl.store(p_v + offs, b_v, mask=m_n)
    if HAS_OUT:
        tl.store(p_out + offs, b_p.to(p_out.dtype.element_ty), mask=m_n)


@triton.jit
def _adams_sparse_kernel(p_p, p_m, p_age, p_g, p_idx, p_out, k, lr, beta1, beta2, eps,
                         log_decay, log_beta1, power, BLOCK_SIZE: tl.constexpr,
                         K_TILE: tl.constexpr,
                         HAS_DECAY: tl.constexpr, HAS_OUT: tl.constexpr,
                         CATCHUP: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1).to(tl.int64) * K_TILE + tl.arange(0, K_TILE)
    m_j = j < k
    compact = b * k + j
    flat = b * BLOCK_SIZE + tl.load(p_idx + compact, mask=m_j, other=0).to(tl.int64)
    b_g = tl.load(p_g + compact, mask=m_j, other=0.0).to(tl.float32)
    b_p = tl.load(p_p + flat, mask=m_j, other=0.0)
    b_m = tl.load(p_m + flat, mask=m_j, other=0.0)
    if HAS_DECAY or CATCHUP:
        b_a1 = tl.load(p_age + flat, mask=m_j, other=0).to(tl.float32) + 1.0
    if CATCHUP:
        b_g = b_g / b_a1  # the mean of the a+1 accumulated per-step gradients
    denom = tl.sqrt(beta2 * b_m * b_m + (1.0 - beta2) * b_g * b_g) + eps
    if CATCHUP:
        keep = tl.exp(b_a1 * log_beta1)  # beta1^(a+1)
        b_m = keep * b_m + (1.0 - keep) * b_g
    else:
        b_m = beta1 * b_m + (1.0 - beta1) * b_g
    if HAS_DECAY:
        # lazy decay (1 - lr*wd)^(age+1) = exp((age+1) * log1p(-lr*wd))
        b_p = b_p * tl.exp(b_a1 * log_decay)
    if CATCHUP:
        b_p = b_p - lr * (b_m / denom) * tl.exp(power * tl.log(b_a1))  # (a+1)^power steps
    else:
        b_p = b_p - lr * (b_m / denom)
    tl.store(p_p + flat, b_p, mask=m_j)
    tl.store(p_m + flat, b_m, mask=m_j)
    tl.store(p_age + flat, tl.full((K_TILE,), -1, tl.int32), mask=m_j)
    if HAS_OUT:
        tl.store(p_out + compact, b_p.to(p_out.dtype.element_ty), mask=m_j)


@triton.jit
def _age_kernel(p_age, n, TILE: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * TILE + tl.arange(0, TILE)
    m_n = offs < n
    tl.store(p_age + offs, tl.load(p_age + offs, mask=m_n, other=0) + 1, mask=m_n)


DENSE_TILE = 2048
DENSE_WARPS = 8


def adams_dense_triton(p: torch.Tensor, m: torch.Tensor, g: torch.Tensor, *, lr: float,
                       beta1: float, beta2: float, eps: float, weight_decay: float,
                       model_out: torch.Tensor | None = None) -> None:
    """Launch :func:`_adams_dense_kernel` (arguments already validated)."""
    n = p.numel()
    _adams_dense_kernel[(triton.cdiv(n, DENSE_TILE),)](
        p, m, g, model_out if model_out is not None else p, n, lr, beta1, beta2, eps,
        1.0 - lr * weight_decay, TILE=DENSE_TILE, HAS_OUT=model_out is not None,
        num_warps=DENSE_WARPS)


def adamw_dense_triton(p: torch.Tensor, m: torch.Tensor, v: torch.Tensor, g: torch.Tensor, *,
                       lr: float, beta1: float, beta2: float, eps: float,
                       weight_decay: float, step: int,
                       model_out: torch.Tensor | None = None) -> None:
    """Launch :func:`_adamw_dense_kernel`; bias corrections are host scalars."""
    n = p.numel()
    _adamw_dense_kernel[(triton.cdiv(n, DENSE_TILE),)](
        p, m, v, g, model_out if model_out is not None else p, n, beta1, beta2, eps,
        1.0 - lr * weight_decay, lr / (1.0 - beta1 ** step), (1.0 - beta2 ** step) ** 0.5,
        TILE=DENSE_TILE, HAS_OUT=model_out is not None, num_warps=DENSE_WARPS)


def adams_sparse_triton(p: torch.Tensor, m: torch.Tensor, age: torch.Tensor, g: torch.Tensor,
                        idx: torch.Tensor, block_size: int, *, lr: float, beta1: float,
                        beta2: float, eps: float, weight_decay: float,
                        model_out: torch.Tensor | None = None,
                        catchup: float | None = None) -> None:
    """Launch :func:`_adams_sparse_kernel` then :func:`_age_kernel` (validated arguments)."""
    n_blocks, k = idx.shape
    k_tile = min(triton.next_power_of_2(k), 1024)
    log_decay = math.log1p(-lr * weight_decay) if weight_decay != 0.0 else 0.0
    # log(beta1); beta1 = 0 gives a finite stand-in whose exp underflows to 0 for a+1 >= 1
    log_beta1 = math.log(beta1) if beta1 > 0.0 else -1e30
    _adams_sparse_kernel[(n_blocks, triton.cdiv(k, k_tile))](
        p, m, age, g, idx, model_out if model_out is not None else p, k, lr, beta1, beta2,
        eps, log_decay, log_beta1, 1.0 if catchup is None else catchup,
        BLOCK_SIZE=block_size, K_TILE=k_tile, HAS_DECAY=weight_decay != 0.0,
        HAS_OUT=model_out is not None, CATCHUP=catchup is not None,
        num_warps=4 if k_tile >= 512 else 2)
    n = age.numel()
    _age_kernel[(triton.cdiv(n, DENSE_TILE),)](age, n, TILE=DENSE_TILE, num_warps=DENSE_WARPS)


def _check_state(p: torch.Tensor, **state: torch.Tensor) -> None:
    check_tensor("p", p, dtypes=_F32, ndim=1)
    for name, t in state.items():
        check_tensor(name, t, dtypes=(torch.int32,) if name == "age" else _F32, ndim=1)
        check_numel(name, t, p.numel(), "same length as p")
    check_same_device(p=p, **state)


def _check_dense_grad(p: torch.Tensor, g: torch.Tensor,
                      model_out: torch.Tensor | None) -> None:
    check_tensor("g", g, dtypes=FLOAT_DTYPES, ndim=1)
    check_numel("g", g, p.numel(), "same length as p")
    check_same_device(p=p, g=g)
    check_out("model_out", model_out, p.numel(), "same length as p", "p", p)


def adams_dense_(p: torch.Tensor, m: torch.Tensor, g: torch.Tensor, *, lr: float,
                 beta1: float, beta2: float, eps: float, weight_decay: float,
                 model_out: torch.Tensor | None = None) -> None:
    """AdamS on every coordinate, in place on fp32 ``p`` and ``m`` (``g`` any float dtype)::

        v = b2*m^2 + (1-b2)*g^2;  m = b1*m + (1-b1)*g;  p = p - lr*(m/(sqrt(v)+eps) + wd*p)

    ``model_out``, if given, receives the new ``p`` cast to its dtype.
    """
    _check_state(p, m=m)
    _check_dense_grad(p, g, model_out)
    lr, beta1, beta2, eps, weight_decay = check_hparams(
        lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay)
    if use_triton(p):
        return adams_dense_triton(p, m, g, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                                  weight_decay=weight_decay, model_out=model_out)
    reference.adams_dense_(p, m, g, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                           weight_decay=weight_decay, model_out=model_out)


def adams_sparse_(p: torch.Tensor, m: torch.Tensor, age: torch.Tensor, g: torch.Tensor,
                  idx: torch.Tensor, block_size: int, *, lr: float, beta1: float,
                  beta2: float, eps: float, weight_decay: float,
                  model_out: torch.Tensor | None = None,
                  catchup: float | None = None) -> None:
    """AdamS at the mask's coordinates with lazy weight decay; every other coordinate ages.

    ``p``, ``m`` fp32 and ``age`` int32 cover the whole shard; ``g`` is compact (one value
    per mask entry, block-major). At a masked coordinate of age ``a``:
    ``p = p*(1-lr*wd)^(a+1) - lr*m_new/(sqrt(v)+eps)`` with ``v`` built from the old ``m``,
    then ``age = 0``; elsewhere ``p``, ``m`` are untouched and ``age += 1``. ``model_out``
    (compact) receives the new ``p`` at the masked coordinates, cast to its dtype.

    ``catchup=c`` (SCAPE's ``"catchup"`` rules) replays the ``a + 1`` steps a coordinate
    missed from their mean gradient ``g/(a+1)`` (with error feedback ``g`` is their sum):
    ``v = b2*m^2 + (1-b2)*mean^2``, ``m = b1^(a+1)*m + (1-b1^(a+1))*mean``,
    ``p = p*(1-lr*wd)^(a+1) - lr*(a+1)^c*m/(sqrt(v)+eps)``: ``c = 1`` moves one normalized
    step per missed step, ``c = 0.5`` Adam's square-root batch scaling. At ``a = 0`` every
    ``c`` gives the plain step. ``None`` (default): the plain step.
    """
    if catchup is not None and (isinstance(catchup, bool) or not isinstance(catchup, (int, float))
                                or not 0.0 <= catchup <= 1.0):
        raise ValueError(f"catchup must be None or a float in [0, 1], got {catchup!r}")
    catchup = None if catchup is None else float(catchup)
    _check_state(p, m=m, age=age)
    block_size = check_block_size(block_size)
    n_blocks = check_blocked("p", p, block_size)
    n_blocks, k = check_idx(idx, n_blocks, block_size)
    check_tensor("g", g, dtypes=FLOAT_DTYPES, ndim=1)
    check_numel("g", g, n_blocks * k, "one per mask entry")
    check_same_device(p=p, g=g, idx=idx)
    check_out("model_out", model_out, n_blocks * k, "one per mask entry", "p", p)
    lr, beta1, beta2, eps, weight_decay = check_hparams(
        lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay)
    if use_triton(p):
        return adams_sparse_triton(p, m, age, g, idx, block_size, lr=lr, beta1=beta1,
                                   beta2=beta2, eps=eps, weight_decay=weight_decay,
                                   model_out=model_out, catchup=catchup)
    reference.adams_sparse_(p, m, age, g, idx, block_size, lr=lr, beta1=beta1, beta2=beta2,
                            eps=eps, weight_decay=weight_decay, model_out=model_out,
                            catchup=catchup)


def adamw_dense_(p: torch.Tensor, m: torch.Tensor, v: torch.Tensor, g: torch.Tensor, *,
                 lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                 step: int, model_out: torch.Tensor | None = None) -> None:
    """``torch.optim.AdamW`` in place on fp32 ``p``, ``m``, ``v`` (bias-corrected, decoupled
    decay applied first); ``step`` is 1-based. ``model_out`` receives ``p`` cast."""
    _check_state(p, m=m, v=v)
    _check_dense_grad(p, g, model_out)
    lr, beta1, beta2, eps, weight_decay = check_hparams(
        lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay)
    step = check_int("step", step, 1, 2**62)
    if use_triton(p):
        return adamw_dense_triton(p, m, v, g, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                                  weight_decay=weight_decay, step=step, model_out=model_out)
    reference.adamw_dense_(p, m, v, g, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                           weight_decay=weight_decay, step=step, model_out=model_out)
