"""Mask-indexed copies: take_ (gather then zero), gather, scatter_ (DESIGN §1 steps 1, 5)."""

from __future__ import annotations

import torch

from . import reference
from ._checks import (
    FLOAT_DTYPES,
    check_block_size,
    check_blocked,
    check_idx,
    check_numel,
    check_out,
    check_same_device,
    check_tensor,
    use_triton,
)


def _check_indexed(name: str, t: torch.Tensor, idx: torch.Tensor,
                   block_size: int) -> tuple[int, int]:
    check_tensor(name, t, dtypes=FLOAT_DTYPES, ndim=1)
    block_size = check_block_size(block_size)
    n_blocks = check_blocked(name, t, block_size)
    n_blocks, k = check_idx(idx, n_blocks, block_size)
    check_same_device(**{name: t, "idx": idx})
    return n_blocks, k


def take_(src: torch.Tensor, idx: torch.Tensor, block_size: int, *,
          out: torch.Tensor | None = None, out_dtype: torch.dtype | None = None
          ) -> torch.Tensor:
    """``values = src[flat]`` cast to ``out_dtype`` (default ``src.dtype``), then
    ``src[flat] = 0``: the error-feedback compress when the residual lives in ``src``."""
    n_blocks, k = _check_indexed("src", src, idx, block_size)
    check_out("out", out, n_blocks * k, "one per mask entry", "src", src, out_dtype)
    if use_triton(src):
        pass  # Triton kernel: not yet available
    return reference.take_(src, idx, block_size, out=out, out_dtype=out_dtype)


def gather(src: torch.Tensor, idx: torch.Tensor, block_size: int, *,
           residual: torch.Tensor | None = None, out: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``src[flat] (+ residual[flat])`` summed in fp32 and cast; inputs untouched."""
    n_blocks, k = _check_indexed("src", src, idx, block_size)
    if residual is not None:
        check_tensor("residual", residual, dtypes=FLOAT_DTYPES, ndim=1)
        check_numel("residual", residual, src.numel(), "same length as src")
        check_same_device(src=src, residual=residual)
    check_out("out", out, n_blocks * k, "one per mask entry", "src", src, out_dtype)
    if use_triton(src):
        pass  # Triton kernel: not yet available
    return reference.gather(src, idx, block_size, residual=residual, out=out,
                            out_dtype=out_dtype)


def scatter_(dst: torch.Tensor, idx: torch.Tensor, block_size: int,
             values: torch.Tensor) -> None:
    """``dst[flat] = values`` cast to ``dst.dtype``; nothing else is written."""
    n_blocks, k = _check_indexed("dst", dst, idx, block_size)
    check_tensor("values", values, dtypes=FLOAT_DTYPES, ndim=1)
    check_numel("values", values, n_blocks * k, "one per mask entry")
    check_same_device(dst=dst, values=values)
    if use_triton(dst):
        pass  # Triton kernel: not yet available
    reference.scatter_(dst, idx, block_size, values)
