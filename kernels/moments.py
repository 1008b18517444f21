"""Fused optimizer updates: AdamS dense and sparse (lazy decay), AdamW (DESIGN §1 step 3)."""

from __future__ import annotations

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

_F32 = (torch.float32,)


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
        pass  # Triton kernel: not yet available
    reference.adams_dense_(p, m, g, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                           weight_decay=weight_decay, model_out=model_out)


def adams_sparse_(p: torch.Tensor, m: torch.Tensor, age: torch.Tensor, g: torch.Tensor,
                  idx: torch.Tensor, block_size: int, *, lr: float, beta1: float,
                  beta2: float, eps: float, weight_decay: float,
                  model_out: torch.Tensor | None = None) -> None:
    """AdamS at the mask's coordinates with lazy weight decay; every other coordinate ages.

    ``p``, ``m`` fp32 and ``age`` int32 cover the whole shard; ``g`` is compact (one value
    per mask entry, block-major). At a masked coordinate of age ``a``:
    ``p = p*(1-lr*wd)^(a+1) - lr*m_new/(sqrt(v)+eps)`` with ``v`` built from the old ``m``,
    then ``age = 0``; elsewhere ``p``, ``m`` are untouched and ``age += 1``. ``model_out``
    (compact) receives the new ``p`` at the masked coordinates, cast to its dtype.
    """
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
        pass  # Triton kernel: not yet available
    reference.adams_sparse_(p, m, age, g, idx, block_size, lr=lr, beta1=beta1, beta2=beta2,
                            eps=eps, weight_decay=weight_decay, model_out=model_out)


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
        pass  # Triton kernel: not yet available
    reference.adamw_dense_(p, m, v, g, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                           weight_decay=weight_decay, step=step, model_out=model_out)
