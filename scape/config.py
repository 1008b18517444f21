"""Hyperparameter validation shared by the optimizers.

Every check raises ``ValueError``/``TypeError`` in torch.optim's style ("Invalid learning
rate: -1"), naming what was expected and what was got. Nothing here communicates: the
optimizers run these checks first, then exchange the outcome so that every rank raises the
same error (see :mod:`scape.agreement`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch


def check_lr(lr: Any, name: str = "learning rate") -> None:
    if isinstance(lr, torch.Tensor):
        if lr.numel() != 1:
            raise ValueError(f"Invalid {name}: expected a scalar, got a tensor of shape "
                             f"{tuple(lr.shape)}")
        lr = float(lr)
    if not isinstance(lr, (int, float)) or isinstance(lr, bool):
        raise TypeError(f"Invalid {name}: expected a float, got {type(lr).__name__}")
    if not math.isfinite(lr) or lr < 0.0:
        raise ValueError(f"Invalid {name}: {lr} (expected a finite value >= 0)")


def check_betas(betas: Any) -> None:
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"Invalid betas: {betas!r} (expected a pair (beta1, beta2))")
    for i, b in enumerate(betas):
        if not isinstance(b, (int, float)) or isinstance(b, bool) or not 0.0 <= b < 1.0:
            raise ValueError(f"Invalid beta parameter at index {i}: {b!r} "
                             "(expected a float in [0, 1))")


def check_eps(eps: Any) -> None:
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps > 0.0 \
            or not math.isfinite(eps):
        raise ValueError(f"Invalid epsilon value: {eps!r} (expected a finite float > 0)")


def check_weight_decay(wd: Any) -> None:
    if not isinstance(wd, (int, float)) or isinstance(wd, bool) or not wd >= 0.0 \
            or not math.isfinite(wd):
        raise ValueError(f"Invalid weight_decay value: {wd!r} (expected a finite float >= 0)")


def check_sparsity(s: Any) -> None:
    if not isinstance(s, (int, float)) or isinstance(s, bool) or not 0.0 <= s < 1.0:
        raise ValueError(f"Invalid sparsity: {s!r} (expected a float in [0, 1); "
                         "0 means dense)")


def check_block_size(b: Any) -> None:
    if not isinstance(b, int) or isinstance(b, bool) or b < 256 or b > 32768 or b & (b - 1):
        raise ValueError(f"Invalid block_size: {b!r} (expected a power of two in "
                         "[256, 32768], e.g. 4096)")


def check_int(name: str, v: Any, lo: int) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or v < lo:
        raise ValueError(f"Invalid {name}: {v!r} (expected an integer >= {lo})")


def check_fraction(name: str, v: Any) -> None:
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0.0 <= v <= 1.0:
        raise ValueError(f"Invalid {name}: {v!r} (expected a float in [0, 1])")


def check_max_grad_norm(v: Any) -> None:
    if v is None:
        return
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0.0 \
            or not math.isfinite(v):
        raise ValueError(f"Invalid max_grad_norm: {v!r} (expected None or a finite float > 0)")


def check_params(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """The trainable tensors of one param group: floating point, dense, distinct, one device.

    Returns the tensors that require grad (frozen ones are not sharded at all). DTensors
    (FSDP2, tensor parallel) are checked here as tensors; :func:`scape.local_shards.inspect`
    checks their meshes.
    """
    params = list(params)
    seen: set[int] = set()
    device = None
    out = []
    for i, p in enumerate(params):
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"optimizer params must be tensors, got {type(p).__name__} at "
                            f"index {i}")
        if not p.is_leaf:
            raise ValueError(f"can't optimize a non-leaf tensor (param {i}, shape "
                             f"{tuple(p.shape)})")
        if p.layout != torch.strided:
            raise ValueError(f"param {i} has layout {p.layout}; only dense (strided) tensors "
                             "are supported")
        if not p.dtype.is_floating_point:
            raise TypeError(f"param {i} has dtype {p.dtype}; expected a floating point dtype "
                            "(float32, bfloat16 or float16)")
        if p.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise TypeError(f"param {i} has dtype {p.dtype}; expected float32, bfloat16 or "
                            "float16")
        if id(p) in seen:
            raise ValueError(f"param {i} (shape {tuple(p.shape)}) appears more than once; "
                             "pass every parameter once")
        seen.add(id(p))
        if device is None:
            device = p.device
        elif p.device != device:
            raise ValueError(f"params are on several devices ({device} and {p.device}); "
                             "put every parameter on one device")
        if p.requires_grad:
            out.append(p)
    return out
