"""Mask-indexed copies: take_ (gather then zero), gather, scatter_ (DESIGN §1 steps 1, 5).

Triton kernels: a 2-D grid, one program per (block, slice of ``K_TILE`` mask entries). The
flat position ``b * block_size + idx[b, j]`` is computed in int64. With ``K = n_blocks * k``
mask entries, ``s`` the source and ``o`` the output element size, the bytes moved are:

- ``take_``:    ``K * (2 + s + o + s)``  (read idx, read src, write out, write zero to src)
- ``gather``:   ``K * (2 + s + o)``, plus ``K * r`` with a residual of element size ``r``
- ``scatter_``: ``K * (2 + v + d)``  (read idx and values, write dst)

Gathers touch one sector per entry, so at low density they run at the memory system's
random-access rate rather than its streaming bandwidth.
"""

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
from ._triton import tl, triton


@triton.jit
def _mask_positions(p_idx, k, BLOCK_SIZE: tl.constexpr, K_TILE: tl.constexpr):
    """(int64 flat positions, int64 compact positions, in-range mask) of this program's
    slice of the mask."""
    b = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1).to(tl.int64) * K_TILE + tl.arange(0, K_TILE)
    m_j = j < k
    compact = b * k + j
    off = tl.load(p_idx + compact, mask=m_j, other=0).to(tl.int64)
    return b * BLOCK_SIZE + off, compact, m_j


@triton.jit
def _take_kernel(p_src, p_idx, p_out, k, BLOCK_SIZE: tl.constexpr, K_TILE: tl.constexpr,
                 KEEP_ERROR: tl.constexpr):
    flat, compact, m_j = _mask_positions(p_idx, k, BLOCK_SIZE, K_TILE)
    b_val = tl.load(p_src + flat, mask=m_j, other=0.0)
    b_out = b_val.to(p_out.dtype.element_ty)
    tl.store(p_out + compact, b_out, mask=m_j)
    if KEEP_ERROR:  # what the cast lost, in fp32; a non-finite one (inf, NaN, overflow) is 0
        b_err = b_val.to(tl.float32) - b_out.to(tl.float32)
        b_err = tl.where(tl.abs(b_err) < float("inf"), b_err, 0.0)  # NaN compares false
        tl.store(p_src + flat, b_err.to(p_src.dtype.element_ty), mask=m_j)
    else:
        tl.store(p_src + flat, tl.zeros_like(b_val), mask=m_j)


@triton.jit
def _gather_kernel(p_src, p_residual, p_idx, p_out, k, BLOCK_SIZE: tl.constexpr,
                   K_TILE: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    flat, compact, m_j = _mask_positions(p_idx, k, BLOCK_SIZE, K_TILE)
    b_val = tl.load(p_src + flat, mask=m_j, other=0.0)
    if HAS_RESIDUAL:
        b_val = b_val.to(tl.float32) + tl.load(p_residual + flat, mask=m_j,
                                               other=0.0).to(tl.float32)
    tl.store(p_out + compact, b_val.to(p_out.dtype.element_ty), mask=m_j)


@triton.jit
def _scatter_kernel(p_dst, p_idx, p_values, k, BLOCK_SIZE: tl.constexpr,
                    K_TILE: tl.constexpr):
    flat, compact, m_j = _mask_positions(p_idx, k, BLOCK_SIZE, K_TILE)
    b_val = tl.load(p_values + compact, mask=m_j, other=0.0)
    tl.store(p_dst + flat, b_val.to(p_dst.dtype.element_ty), mask=m_j)


def sparse_config(k: int) -> dict[str, int]:
    """Launch settings: up to 1024 mask entries per program (the whole row for small k)."""
    k_tile = min(triton.next_power_of_2(k), 1024)
    return {"K_TILE": k_tile, "num_warps": 4 if k_tile >= 512 else 1 if k_tile <= 64 else 2}


def _grid(n_blocks: int, k: int, k_tile: int) -> tuple[int, int]:
    return (n_blocks, triton.cdiv(k, k_tile))


def _compact_out(src: torch.Tensor, n: int, out: torch.Tensor | None,
                 out_dtype: torch.dtype | None) -> torch.Tensor:
    if out is not None:
        return out
    return torch.empty(n, dtype=out_dtype or src.dtype, device=src.device)


def take_triton(src: torch.Tensor, idx: torch.Tensor, block_size: int, *,
                out: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
                keep_error: bool = False) -> torch.Tensor:
    """Launch :func:`_take_kernel` (arguments already validated)."""
    n_blocks, k = idx.shape
    out = _compact_out(src, n_blocks * k, out, out_dtype)
    cfg = sparse_config(k)
    _take_kernel[_grid(n_blocks, k, cfg["K_TILE"])](
        src, idx, out, k, BLOCK_SIZE=block_size, K_TILE=cfg["K_TILE"],
        KEEP_ERROR=bool(keep_error), num_warps=cfg["num_warps"])
    return out


def gather_triton(src: torch.Tensor, idx: torch.Tensor, block_size: int, *,
                  residual: torch.Tensor | None = None, out: torch.Tensor | None = None,
                  out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Launch :func:`_gather_kernel` (arguments already validated)."""
    n_blocks, k = idx.shape
    out = _compact_out(src, n_blocks * k, out, out_dtype)
    cfg = sparse_config(k)
    _gather_kernel[_grid(n_blocks, k, cfg["K_TILE"])](
        src, residual if residual is not None else src, idx, out, k, BLOCK_SIZE=block_size,
        K_TILE=cfg["K_TILE"], HAS_RESIDUAL=residual is not None, num_warps=cfg["num_warps"])
    return out


def scatter_triton(dst: torch.Tensor, idx: torch.Tensor, block_size: int,
                   values: torch.Tensor) -> None:
    """Launch :func:`_scatter_kernel` (arguments already validated)."""
    n_blocks, k = idx.shape
    cfg = sparse_config(k)
    _scatter_kernel[_grid(n_blocks, k, cfg["K_TILE"])](
        dst, idx, values, k, BLOCK_SIZE=block_size, K_TILE=cfg["K_TILE"],
        num_warps=cfg["num_warps"])


def _check_indexed(name: str, t: torch.Tensor, idx: torch.Tensor,
                   block_size: int) -> tuple[int, int]:
    check_tensor(name, t, dtypes=FLOAT_DTYPES, ndim=1)
    block_size = check_block_size(block_size)
    n_blocks = check_blocked(name, t, block_size)
    n_blocks, k = check_idx(idx, n_blocks, block_size)
    check_same_device(**{name: t, "idx": idx})
    return n_blocks, k


def take_(src: torch.Tensor, idx: torch.Tensor, block_size: int, *,
          out: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
          keep_error: bool = False) -> torch.Tensor:
    """``values = src[flat]`` cast to ``out_dtype`` (default ``src.dtype``), then
    ``src[flat] = 0``: the error-feedback compress when the residual lives in ``src``.

    With ``keep_error``, ``src[flat]`` keeps what the cast lost instead,
    ``src - values`` computed in fp32 (0 where that is not finite: an inf or NaN entry, or one
    the cast overflowed), so for an fp32 ``src`` ``src[flat] + values == before`` bitwise at
    every finite entry the cast did not overflow; with ``values`` in ``src``'s dtype it is 0."""
    n_blocks, k = _check_indexed("src", src, idx, block_size)
    check_out("out", out, n_blocks * k, "one per mask entry", "src", src, out_dtype)
    if use_triton(src):
        return take_triton(src, idx, block_size, out=out, out_dtype=out_dtype,
                           keep_error=keep_error)
    return reference.take_(src, idx, block_size, out=out, out_dtype=out_dtype,
                           keep_error=keep_error)


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
        return gather_triton(src, idx, block_size, residual=residual, out=out,
                             out_dtype=out_dtype)
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
        return scatter_triton(dst, idx, block_size, values)
    reference.scatter_(dst, idx, block_size, values)
