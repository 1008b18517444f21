"""Low-bit value packing: quantize to 2, 4, 6 or 8 bits with one scale per group, and back.

The codebook is symmetric and uniform with ``L = 2**bits`` levels and no zero level:

    level(q) = (2q - (L - 1)) / (L - 1)        q = 0 .. L-1,  level in [-1, 1]
    2 bits:  -1, -1/3, +1/3, +1             4 bits: -1, -13/15, ..., +13/15, +1

A value ``x`` of group ``g`` (``group`` consecutive values share one scale ``s_g``, normally
the group's absmax, see :func:`absmax_scales`) gets the nearest code

    t = x / s_g                    (0 when s_g == 0)
    q = clamp(floor((t + 1) * (L - 1) / 2 + 1/2), 0, L - 1)      (NaN -> 0)

and decodes to ``s_g * (2q - (L - 1)) / (L - 1)``. The rounding error is at most
``s_g / (L - 1)``. Without a zero level every code carries a sign, which suits the inputs this
is made for: the top-k entries of a block by magnitude (SparseLoCo's pseudo-gradients), all
far from zero relative to the block's absmax.

Packing is global, little-endian: code ``i`` takes bits ``[i * bits, (i + 1) * bits)`` of the
stream, byte ``j`` holding bits ``8j .. 8j + 7`` low bit first. For 2, 4 and 8 bits that is
byte ``i // P`` at bit ``(i % P) * bits``, ``P = 8 // bits`` codes per byte; 6-bit codes go
four to a 3-byte word (:func:`word_layout`), one in two spanning two bytes. ``n`` values take
``ceil(n * bits / 8)`` bytes and unused high bits of the last byte are zero.

Triton kernels: ``_pack_kernel`` has one program per ``WORD_TILE`` words and loads a
``[WORD_TILE, codes]`` tile of values (each with its group's scale), so the codes of a word
are combined in registers; it reads ``n * v`` bytes of values (``v`` their element size) plus
``4 * n / group`` of scales, and writes ``ceil(n * bits / 8)``. ``_unpack_kernel`` has one
program per ``TILE`` values; it reads the packed bytes (a 6-bit code from its one or two) and
scales and writes ``4 * n``.
Divisions are correctly rounded (``div_rn``) so both paths agree with the torch reference
bit for bit.

:func:`take_pack8_` is the sparse step's 8-bit gradient wire in one pass: it takes the mask's
entries out of a residual buffer (as :func:`scape.kernels.take_`), codes each mask row of ``k``
values with the row's absmax as its scale (8 bits, the codebook above, one code per byte),
and writes what the code does not carry back into the buffer (error feedback): after it,
``buffer + decoded == before`` at every mask entry, up to one fp32 rounding of the
difference. ``_take_pack8_kernel`` has one program per mask row (``K_TILE`` =
``next_power_of_2(k)``); it reads ``2 + 4`` bytes per entry (offset, value) and writes
``1 + 4`` (code, residual), plus 4 bytes of scale per row.
"""

from __future__ import annotations

import math

import torch

from ._checks import (
    FLOAT_DTYPES,
    check_block_size,
    check_blocked,
    check_idx,
    check_numel,
    check_same_device,
    check_tensor,
    use_triton,
)
from ._triton import tl, triton
from .reference import _flat

PACK_BITS = (2, 4, 6, 8)
"""Code widths :func:`pack_values` accepts."""


def packed_nbytes(n: int, bits: int) -> int:
    """Bytes that ``n`` codes of ``bits`` bits take: ``ceil(n * bits / 8)``."""
    return (n * bits + 7) // 8


# --------------------------------------------------------------------------- Triton kernels
@triton.jit
def _pack_kernel(p_values, p_scales, p_out, n, n_bytes, group, BITS: tl.constexpr,
                 CODES: tl.constexpr, WBYTES: tl.constexpr, WORD_TILE: tl.constexpr):
    LEVELS: tl.constexpr = (1 << BITS) - 1
    word = tl.program_id(0).to(tl.int64) * WORD_TILE + tl.arange(0, WORD_TILE)
    slot = tl.arange(0, CODES)
    pos = word[:, None] * CODES + slot[None, :]
    m_pos = pos < n
    b_x = tl.load(p_values + pos, mask=m_pos, other=0.0).to(tl.float32)
    b_s = tl.load(p_scales + pos // group, mask=m_pos, other=1.0).to(tl.float32)
    safe_s = tl.where(b_s == 0.0, 1.0, b_s)
    t = tl.where(b_s == 0.0, 0.0, tl.div_rn(b_x, safe_s))
    u = tl.floor((t + 1.0) * (0.5 * LEVELS) + 0.5)
    m_num = u == u  # NaN -> code 0 (checked before the clamp, whose NaN rule is unspecified)
    u = tl.minimum(tl.maximum(u, 0.0), LEVELS * 1.0)
    q = tl.where(m_num & m_pos, u, 0.0).to(tl.int32)  # unused high bits stay zero
    b_word = tl.sum(q << (slot[None, :] * BITS), axis=1)
    if WBYTES == 1:
        tl.store(p_out + word, b_word.to(tl.uint8), mask=word < n_bytes)
    else:  # a word of WBYTES (3) bytes, stored a byte at a time
        j = tl.arange(0, 4)
        at = word[:, None] * WBYTES + j[None, :]
        b_bytes = (b_word[:, None] >> (j[None, :] * 8)) & 255
        tl.store(p_out + at, b_bytes.to(tl.uint8), mask=(j[None, :] < WBYTES) & (at < n_bytes))


@triton.jit
def _unpack_kernel(p_packed, p_scales, p_out, n, group, BITS: tl.constexpr,
                   CODES: tl.constexpr, WBYTES: tl.constexpr, TILE: tl.constexpr):
    LEVELS: tl.constexpr = (1 << BITS) - 1
    pos = tl.program_id(0).to(tl.int64) * TILE + tl.arange(0, TILE)
    m_pos = pos < n
    if WBYTES == 1:
        b_byte = tl.load(p_packed + pos // CODES, mask=m_pos, other=0).to(tl.int32)
        q = (b_byte >> ((pos % CODES) * BITS).to(tl.int32)) & LEVELS
    else:  # a code may span two bytes of its word
        bit = (pos % CODES) * BITS
        base = (pos // CODES) * WBYTES + bit // 8
        shift = (bit % 8).to(tl.int32)
        b0 = tl.load(p_packed + base, mask=m_pos, other=0).to(tl.int32)
        b1 = tl.load(p_packed + base + 1, mask=m_pos & (shift + BITS > 8), other=0).to(tl.int32)
        q = ((b0 | (b1 << 8)) >> shift) & LEVELS
    b_s = tl.load(p_scales + pos // group, mask=m_pos, other=0.0).to(tl.float32)
    level = (2 * q - LEVELS).to(tl.float32)
    tl.store(p_out + pos, tl.div_rn(b_s * level, LEVELS * 1.0), mask=m_pos)


@triton.jit
def _take_pack8_kernel(p_src, p_idx, p_codes, p_scales, k, BLOCK_SIZE: tl.constexpr,
                       K_TILE: tl.constexpr):
    LEVELS: tl.constexpr = 255
    b = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, K_TILE)
    m_j = j < k
    compact = b * k + j
    flat = b * BLOCK_SIZE + tl.load(p_idx + compact, mask=m_j, other=0).to(tl.int64)
    b_x = tl.load(p_src + flat, mask=m_j, other=0.0).to(tl.float32)
    s = tl.max(tl.where(m_j, tl.abs(b_x), 0.0), axis=0)
    safe_s = tl.where(s == 0.0, 1.0, s)
    t = tl.where(s == 0.0, 0.0, tl.div_rn(b_x, safe_s))
    u = tl.floor((t + 1.0) * (0.5 * LEVELS) + 0.5)
    m_num = u == u  # NaN -> code 0, as _pack_kernel
    u = tl.minimum(tl.maximum(u, 0.0), LEVELS * 1.0)
    q = tl.where(m_num, u, 0.0).to(tl.int32)
    decoded = tl.div_rn(s * (2 * q - LEVELS).to(tl.float32), LEVELS * 1.0)
    tl.store(p_codes + compact, q.to(tl.uint8), mask=m_j)
    tl.store(p_src + flat, b_x - decoded, mask=m_j)
    tl.store(p_scales + b, s)


def take_pack8_config(k: int) -> dict[str, int]:
    """Launch settings of :func:`_take_pack8_kernel`: the whole mask row in one program."""
    k_tile = triton.next_power_of_2(k)
    return {"K_TILE": k_tile, "num_warps": max(1, min(8, k_tile // 256))}


def take_pack8_triton(src: torch.Tensor, idx: torch.Tensor, block_size: int,
                      codes: torch.Tensor, scales: torch.Tensor) -> None:
    """Launch :func:`_take_pack8_kernel` (arguments already validated)."""
    n_blocks, k = idx.shape
    cfg = take_pack8_config(k)
    _take_pack8_kernel[(n_blocks,)](src, idx, codes, scales, k, BLOCK_SIZE=block_size,
                                    K_TILE=cfg["K_TILE"], num_warps=cfg["num_warps"])


def word_layout(bits: int) -> tuple[int, int]:
    """``(codes, bytes)`` of the smallest whole number of bytes that holds whole codes of
    ``bits`` bits: one byte of ``8 // bits`` codes for 2, 4 and 8 bits; 3 bytes of 4 codes
    for 6."""
    wbytes = math.lcm(bits, 8) // 8
    return 8 * wbytes // bits, wbytes


def pack_config(bits: int) -> dict[str, int]:
    """Launch settings: 1024 values per program (``1024 / codes`` words), 4 warps."""
    codes, _ = word_layout(bits)
    return {"WORD_TILE": 1024 // codes, "TILE": 1024, "num_warps": 4}


def pack_triton(values: torch.Tensor, scales: torch.Tensor, group: int, bits: int,
                out: torch.Tensor) -> torch.Tensor:
    """Launch :func:`_pack_kernel` (arguments already validated)."""
    n, n_bytes = values.numel(), out.numel()
    cfg = pack_config(bits)
    codes, wbytes = word_layout(bits)
    grid = (triton.cdiv(triton.cdiv(n, codes), cfg["WORD_TILE"]),)
    _pack_kernel[grid](values, scales, out, n, n_bytes, group, BITS=bits, CODES=codes,
                       WBYTES=wbytes, WORD_TILE=cfg["WORD_TILE"], num_warps=cfg["num_warps"])
    return out


def unpack_triton(packed: torch.Tensor, scales: torch.Tensor, group: int, bits: int,
                  out: torch.Tensor) -> torch.Tensor:
    """Launch :func:`_unpack_kernel` (arguments already validated)."""
    n = out.numel()
    cfg = pack_config(bits)
    codes, wbytes = word_layout(bits)
    _unpack_kernel[(triton.cdiv(n, cfg["TILE"]),)](
        packed, scales, out, n, group, BITS=bits, CODES=codes, WBYTES=wbytes,
        TILE=cfg["TILE"], num_warps=cfg["num_warps"])
    return out


# --------------------------------------------------------------------------- torch reference
def pack_ref(values: torch.Tensor, scales: torch.Tensor, group: int, bits: int,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """Torch implementation of :func:`pack_values` (the CPU path and the ground truth)."""
    levels = (1 << bits) - 1
    codes, wbytes = word_layout(bits)
    n = values.numel()
    x = values.float().view(-1, group)
    s = scales.float().view(-1, 1)
    t = torch.where(s == 0, torch.zeros_like(x), x / torch.where(s == 0, 1.0, s))
    u = torch.floor((t + 1.0) * (0.5 * levels) + 0.5).clamp(0.0, float(levels))
    q = torch.where(torch.isnan(u), 0.0, u).to(torch.int64).view(-1)
    n_words = -(-n // codes)
    q = torch.cat([q, q.new_zeros(n_words * codes - n)]).view(n_words, codes)
    shifts = torch.arange(codes, dtype=torch.int64, device=q.device) * bits
    words = (q << shifts).sum(dim=1, keepdim=True)
    at = torch.arange(wbytes, dtype=torch.int64, device=q.device) * 8
    packed = ((words >> at) & 255).view(-1)[:packed_nbytes(n, bits)].to(torch.uint8)
    if out is None:
        return packed
    out.copy_(packed)
    return out


def unpack_ref(packed: torch.Tensor, scales: torch.Tensor, group: int, bits: int, n: int,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """Torch implementation of :func:`unpack_values`."""
    levels = (1 << bits) - 1
    bit = torch.arange(n, dtype=torch.int64, device=packed.device) * bits
    p = torch.cat([packed.to(torch.int64), packed.new_zeros(1, dtype=torch.int64)])
    word = p[bit // 8] | (p[bit // 8 + 1] << 8)
    q = (word >> (bit % 8)) & levels
    level = (2 * q - levels).to(torch.float32)
    s = scales.float().repeat_interleave(group)
    vals = (s * level) / float(levels)
    if out is None:
        return vals
    out.copy_(vals)
    return out


def take_pack8_ref(src: torch.Tensor, idx: torch.Tensor, block_size: int,
                   codes: torch.Tensor, scales: torch.Tensor) -> None:
    """Torch implementation of :func:`take_pack8_` (the CPU path and the ground truth)."""
    n_blocks, k = idx.shape
    flat = _flat(idx, block_size)
    x = src.index_select(0, flat).view(n_blocks, k)
    s = x.abs().amax(dim=1)
    scales.copy_(s)
    packed = pack_ref(x.reshape(-1), s, k, 8)
    codes.copy_(packed)
    decoded = unpack_ref(packed, s, k, 8, n_blocks * k)
    src.index_copy_(0, flat, x.reshape(-1) - decoded)


# --------------------------------------------------------------------------- public API
def _check_bits(bits: object) -> int:
    if isinstance(bits, bool) or not isinstance(bits, int):
        raise TypeError(f"bits must be an int; got {type(bits).__name__}")
    if bits not in PACK_BITS:
        raise ValueError(f"bits must be one of {PACK_BITS}; got {bits}")
    return bits


def _check_groups(n: int, scales: object, group: object) -> None:
    if isinstance(group, bool) or not isinstance(group, int):
        raise TypeError(f"group must be an int; got {type(group).__name__}")
    if group < 1 or n % group:
        raise ValueError(f"group must be a positive divisor of the value count {n}; "
                         f"got {group}")
    check_tensor("scales", scales, dtypes=(torch.float32,), ndim=1)
    check_numel("scales", scales, n // group, f"one per group of {group} values")  # type: ignore[arg-type]


def absmax_scales(values: torch.Tensor, group: int) -> torch.Tensor:
    """fp32 scale per group of ``group`` consecutive values: the group's largest ``|x|``."""
    check_tensor("values", values, dtypes=FLOAT_DTYPES, ndim=1)
    if isinstance(group, bool) or not isinstance(group, int) or group < 1 \
            or values.numel() % group:
        raise ValueError(f"group must be a positive divisor of the value count "
                         f"{values.numel()}; got {group!r}")
    return values.float().view(-1, group).abs().amax(dim=1)


def pack_values(values: torch.Tensor, scales: torch.Tensor, group: int, bits: int, *,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """Quantize ``values`` (1-D float, length ``n``, a multiple of ``group``) to ``bits``-bit
    codes with one fp32 scale per ``group`` values, packed ``8 // bits`` to a byte.

    Returns (or writes into ``out``) a uint8 tensor of ``ceil(n * bits / 8)`` bytes. The
    codebook and the rounding rule are in the module docstring.
    """
    bits = _check_bits(bits)
    check_tensor("values", values, dtypes=FLOAT_DTYPES, ndim=1)
    n = values.numel()
    if n == 0:
        raise ValueError("values must not be empty")
    _check_groups(n, scales, group)
    check_same_device(values=values, scales=scales)
    n_bytes = packed_nbytes(n, bits)
    if out is not None:
        check_tensor("out", out, dtypes=(torch.uint8,), ndim=1)
        check_numel("out", out, n_bytes, f"ceil({n} * {bits} / 8) packed bytes")
        check_same_device(values=values, out=out)
    if use_triton(values):
        if out is None:
            out = torch.empty(n_bytes, dtype=torch.uint8, device=values.device)
        return pack_triton(values, scales, group, bits, out)
    return pack_ref(values, scales, group, bits, out)


def unpack_values(packed: torch.Tensor, scales: torch.Tensor, group: int, bits: int, n: int,
                  *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Decode ``n`` values packed by :func:`pack_values` into fp32:
    ``value_i = scale_g * (2 q_i - (L - 1)) / (L - 1)`` with ``g = i // group``."""
    bits = _check_bits(bits)
    check_tensor("packed", packed, dtypes=(torch.uint8,), ndim=1)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive int (the number of values); got {n!r}")
    check_numel("packed", packed, packed_nbytes(n, bits), f"ceil({n} * {bits} / 8) bytes")
    _check_groups(n, scales, group)
    check_same_device(packed=packed, scales=scales)
    if out is not None:
        check_tensor("out", out, dtypes=(torch.float32,), ndim=1)
        check_numel("out", out, n, "one per value")
        check_same_device(packed=packed, out=out)
    if use_triton(packed):
        if out is None:
            out = torch.empty(n, dtype=torch.float32, device=packed.device)
        return unpack_triton(packed, scales, group, bits, out)
    return unpack_ref(packed, scales, group, bits, n, out)


def take_pack8_(src: torch.Tensor, idx: torch.Tensor, block_size: int, *,
                codes: torch.Tensor | None = None, scales: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The mask's entries of ``src`` as 8-bit codes with one fp32 scale per mask row, the
    coding error left in ``src`` (error feedback).

    ``src``: fp32, 1-D, ``n_blocks * block_size`` long (a residual buffer); ``idx``: int16
    ``[n_blocks, k]`` offsets into each block (distinct within a row). For row ``b`` with
    values ``x = src[b * block_size + idx[b]]``: ``scales[b] = max |x|``; ``codes[b * k + j]``
    is ``x[j]``'s 8-bit code (:func:`pack_values` with ``bits=8, group=k``: decodes to
    ``scales[b] * (2 q - 255) / 255``, within ``scales[b] / 255`` of ``x[j]``); then
    ``src[...] = x - decoded``. Returns ``(codes, scales)``: uint8 of ``n_blocks * k``, fp32 of
    ``n_blocks`` (written into ``codes``/``scales`` when given). Inputs are expected finite;
    a NaN codes to 0 as in :func:`pack_values`.
    """
    check_tensor("src", src, dtypes=(torch.float32,), ndim=1)
    block_size = check_block_size(block_size)
    n_blocks = check_blocked("src", src, block_size)
    _, k = check_idx(idx, n_blocks, block_size)
    check_same_device(src=src, idx=idx)
    if codes is None:
        codes = torch.empty(n_blocks * k, dtype=torch.uint8, device=src.device)
    if scales is None:
        scales = torch.empty(n_blocks, dtype=torch.float32, device=src.device)
    check_tensor("codes", codes, dtypes=(torch.uint8,), ndim=1)
    check_numel("codes", codes, n_blocks * k, "one per mask entry")
    check_tensor("scales", scales, dtypes=(torch.float32,), ndim=1)
    check_numel("scales", scales, n_blocks, "one per mask row")
    check_same_device(src=src, codes=codes, scales=scales)
    if use_triton(src):
        take_pack8_triton(src, idx, block_size, codes, scales)
    else:
        take_pack8_ref(src, idx, block_size, codes, scales)
    return codes, scales


# --------------------------------------------------------------------------- mask offsets
# A mask's int16 block-local offsets lie in [0, B) with B a power of two, so log2(B) bits
# carry each (12 at B = 4096): ``n`` offsets take ``ceil(n * bits / 8)`` bytes, offset ``i``
# at bits ``[i * bits, (i + 1) * bits)`` of the little-endian stream. With ``bits >= 8`` a
# byte holds parts of at most two offsets, so each byte is made from two loads; an offset
# spans at most three bytes, so each is read back from three.
OFFSET_TILE = 1024


@triton.jit
def _pack_offsets_kernel(p_idx, p_out, n, n_bytes, BITS: tl.constexpr, TILE: tl.constexpr):
    byte = tl.program_id(0).to(tl.int64) * TILE + tl.arange(0, TILE)
    m_byte = byte < n_bytes
    bit = byte * 8
    i0 = bit // BITS
    i1 = i0 + 1
    v0 = tl.load(p_idx + i0, mask=m_byte & (i0 < n), other=0).to(tl.int32) & ((1 << BITS) - 1)
    v1 = tl.load(p_idx + i1, mask=m_byte & (i1 < n) & (i1 * BITS < bit + 8),
                 other=0).to(tl.int32) & ((1 << BITS) - 1)
    b_byte = (v0 >> (bit - i0 * BITS).to(tl.int32)) | (v1 << (i1 * BITS - bit).to(tl.int32))
    tl.store(p_out + byte, (b_byte & 255).to(tl.uint8), mask=m_byte)


@triton.jit
def _unpack_offsets_kernel(p_packed, p_out, n_seg, seg_bytes, n, BITS: tl.constexpr,
                           TILE: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * TILE + tl.arange(0, TILE)
    m_i = i < n
    seg = i // n_seg
    bit = (i % n_seg) * BITS
    base = seg * seg_bytes + bit // 8
    end = seg * seg_bytes + seg_bytes
    b0 = tl.load(p_packed + base, mask=m_i, other=0).to(tl.int32)
    b1 = tl.load(p_packed + base + 1, mask=m_i & (base + 1 < end), other=0).to(tl.int32)
    b2 = tl.load(p_packed + base + 2, mask=m_i & (base + 2 < end), other=0).to(tl.int32)
    word = b0 | (b1 << 8) | (b2 << 16)
    v = (word >> (bit % 8).to(tl.int32)) & ((1 << BITS) - 1)
    tl.store(p_out + i, v.to(tl.int16), mask=m_i)


def offset_bits(block_size: int) -> int:
    """Bits per packed offset of a mask over blocks of ``block_size`` (a power of two)."""
    return max(8, int(block_size).bit_length() - 1)


def pack_offsets_ref(idx: torch.Tensor, bits: int, out: torch.Tensor) -> torch.Tensor:
    """Torch implementation of :func:`pack_offsets`."""
    n, n_bytes = idx.numel(), out.numel()
    v = idx.to(torch.int64) & ((1 << bits) - 1)
    bit = torch.arange(n_bytes, dtype=torch.int64, device=idx.device) * 8
    i0 = bit // bits
    i1 = i0 + 1
    v0 = torch.where(i0 < n, v[i0.clamp(max=n - 1)], 0)
    ok1 = (i1 < n) & (i1 * bits < bit + 8)
    v1 = torch.where(ok1, v[i1.clamp(max=n - 1)], 0)
    out.copy_(((v0 >> (bit - i0 * bits)) | (v1 << (i1 * bits - bit))) & 255)
    return out


def unpack_offsets_ref(packed: torch.Tensor, n_seg: int, bits: int,
                       out: torch.Tensor) -> torch.Tensor:
    """Torch implementation of :func:`unpack_offsets`."""
    seg_bytes = packed_nbytes(n_seg, bits)
    i = torch.arange(out.numel(), dtype=torch.int64, device=packed.device)
    seg, bit = i // n_seg, (i % n_seg) * bits
    base = seg * seg_bytes + bit // 8
    end = seg * seg_bytes + seg_bytes
    p = torch.cat([packed.to(torch.int64), packed.new_zeros(2, dtype=torch.int64)])
    word = p[base] | torch.where(base + 1 < end, p[base + 1], 0) << 8 \
        | torch.where(base + 2 < end, p[base + 2], 0) << 16
    out.copy_((word >> (bit % 8)) & ((1 << bits) - 1))
    return out


def pack_offsets(idx: torch.Tensor, block_size: int, *,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """A mask's offsets (int16, 1-D, each in ``[0, block_size)``) as a stream of
    :func:`offset_bits` bits each: uint8 of ``packed_nbytes(n, bits)`` (unused high bits of
    the last byte zero). Offsets outside the range are not checked (it would read them)."""
    check_tensor("idx", idx, dtypes=(torch.int16,), ndim=1)
    bits = offset_bits(check_block_size(block_size))
    n = idx.numel()
    if n == 0:
        raise ValueError("idx must not be empty")
    n_bytes = packed_nbytes(n, bits)
    if out is None:
        out = torch.empty(n_bytes, dtype=torch.uint8, device=idx.device)
    check_tensor("out", out, dtypes=(torch.uint8,), ndim=1)
    check_numel("out", out, n_bytes, f"ceil({n} * {bits} / 8) packed bytes")
    check_same_device(idx=idx, out=out)
    if use_triton(idx):
        _pack_offsets_kernel[(triton.cdiv(n_bytes, OFFSET_TILE),)](
            idx, out, n, n_bytes, BITS=bits, TILE=OFFSET_TILE, num_warps=4)
        return out
    return pack_offsets_ref(idx, bits, out)


def unpack_offsets(packed: torch.Tensor, n_seg: int, block_size: int, *,
                   out: torch.Tensor) -> torch.Tensor:
    """Read back ``out.numel()`` offsets from ``packed``: consecutive segments of
    ``packed_nbytes(n_seg, bits)`` bytes, each one :func:`pack_offsets` of ``n_seg`` offsets
    (every rank's in an all-gather), into ``out`` (int16, 1-D, a multiple of ``n_seg``)."""
    check_tensor("packed", packed, dtypes=(torch.uint8,), ndim=1)
    bits = offset_bits(check_block_size(block_size))
    check_tensor("out", out, dtypes=(torch.int16,), ndim=1)
    if isinstance(n_seg, bool) or not isinstance(n_seg, int) or n_seg < 1 \
            or out.numel() % n_seg:
        raise ValueError(f"n_seg must be a positive divisor of out's {out.numel()} offsets; "
                         f"got {n_seg!r}")
    seg_bytes = packed_nbytes(n_seg, bits)
    check_numel("packed", packed, out.numel() // n_seg * seg_bytes,
                f"{out.numel() // n_seg} segments of {seg_bytes} bytes")
    check_same_device(packed=packed, out=out)
    if use_triton(packed):
        n = out.numel()
        _unpack_offsets_kernel[(triton.cdiv(n, OFFSET_TILE),)](
            packed, out, n_seg, seg_bytes, n, BITS=bits, TILE=OFFSET_TILE, num_warps=4)
        return out
    return unpack_offsets_ref(packed, n_seg, bits, out)
