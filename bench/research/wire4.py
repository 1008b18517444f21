"""4-bit values on the 8-bit wire, for research rows: what a 4-bit code would cost in quality.

A run whose config names this module in ``imports`` (``"imports": ["bench.research.wire4"]``)
codes the values of the 8-bit wires with 15 levels instead of 255, with the same per-row absmax
scale and rounding rule as :func:`scape.kernels.pack_values` at ``bits=4``:

- gradients (``grad_comm_dtype=torch.int8``): :func:`take_pack4_` replaces the optimizer's
  :func:`scape.kernels.take_pack8_`, and what the 4-bit code drops stays in the residual, as on
  the 8-bit wire;
- parameter updates (``param_comm_dtype=torch.int8``, with ``WIRE4_PARAMS`` set, the default):
  :class:`scape.wire.ParamWire8` codes its deltas with 15 levels too.

Each 4-bit code ``q`` travels as the 8-bit code ``17 q``, which the receivers' unchanged 8-bit
decoding maps to exactly the 4-bit value: ``s (2 * 17 q - 255) / 255 = s (2 q - 15) / 15``. The
wire still carries a byte per value, so ``opt.last_step.bytes`` is the 8-bit wire's; a research
row states its bytes from the formula, with ``b_g`` (and ``b_p``) ``1/2 + 4/k``. The library is
patched in this process only (and in the ranks of the runs that import this module); importing
:mod:`bench.research` does not import it.
"""

from __future__ import annotations

import torch

import scape.optimizer
import scape.wire
from scape.kernels import pack_values, unpack_values

LEVELS4 = 15
"""The 4-bit codebook's top code: codes ``0..15``, decoded ``s (2 q - 15) / 15``."""
STRIDE = 255 // LEVELS4
"""The 8-bit code of 4-bit code ``q`` is ``STRIDE * q`` (17)."""
WIRE4_PARAMS = True
"""Whether the parameter updates are coded with 15 levels too (else only the gradients)."""


def codes4(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """The 8-bit codes (uint8, multiples of 17) of the 4-bit codes of ``x`` (``[rows, k]``)
    with row scales ``s`` (``[rows]``): round to nearest of 16 levels over ``[-s, s]``; a row
    whose scale is 0 codes to 0, as :func:`scape.kernels.pack_values`."""
    safe = torch.where(s == 0, torch.ones_like(s), s).unsqueeze(1)
    t = torch.where(s.unsqueeze(1) == 0, torch.zeros_like(x), x / safe)
    u = torch.floor((t + 1.0) * (0.5 * LEVELS4) + 0.5).clamp_(0, LEVELS4)
    u = torch.nan_to_num(u, nan=0.0)
    return (u.to(torch.int32) * STRIDE).to(torch.uint8)


def take_pack4_(src: torch.Tensor, idx: torch.Tensor, block_size: int, *,
                codes: torch.Tensor | None = None, scales: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`scape.kernels.take_pack8_`'s contract with 4-bit codes in its bytes: ``scales[b]``
    is row ``b``'s largest ``|x|``, ``codes`` decode (8-bit) to within ``scales[b] / 15`` of
    ``x``, and ``src`` keeps ``x - decoded`` at the mask's entries."""
    n_blocks, k = idx.shape
    base = torch.arange(n_blocks, device=src.device, dtype=torch.int64) * block_size
    flat = (idx.to(torch.int64) + base.unsqueeze(1)).reshape(-1)
    x = src.index_select(0, flat).view(n_blocks, k)
    s = x.abs().amax(dim=1)
    q = codes4(x, s).reshape(-1)
    decoded = unpack_values(q, s, k, 8, n_blocks * k)
    src.index_copy_(0, flat, x.reshape(-1) - decoded)
    if codes is None:
        codes = torch.empty_like(q)
    if scales is None:
        scales = torch.empty_like(s)
    codes.copy_(q)
    scales.copy_(s)
    return codes, scales


def _pack_values4(values: torch.Tensor, scales: torch.Tensor, group: int, bits: int, *,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`scape.kernels.pack_values` with the 8-bit codes of 4-bit codes where ``bits`` is
    8 (the parameter wire's call)."""
    if bits != 8 or not WIRE4_PARAMS:
        return pack_values(values, scales, group, bits, out=out)
    q = codes4(values.float().view(-1, group), scales).reshape(-1)
    if out is None:
        return q
    out.copy_(q)
    return out


scape.optimizer.take_pack8_ = take_pack4_
scape.wire.pack_values = _pack_values4
