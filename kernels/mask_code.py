"""A mask on the wire: each mask row's ascending offsets in Elias-Fano code, or packed to
``log2(B)`` bits (:func:`scape.kernels.pack_offsets`) where that is smaller.

A mask row is the ``k`` offsets one block of ``B`` coordinates selected, ascending (every
selection makes them so: DESIGN §1, step 4). Elias-Fano (Elias, 1974; Fano, 1971) codes ``k``
ascending values below ``B`` in ``k L + k + ((B - 1) >> L)`` bits with ``L = floor(log2(B /
k))``: each value's low ``L`` bits as they are, and its high part ``x >> L`` in unary, as the
position ``(x >> L) + i`` of the ``i``-th set bit of a bitmap. That is within two bits an
offset of the ``log2(C(B, k)) / k`` bits any code of a row needs. At ``B = 4096`` a row of
``k = 41`` (sparsity 0.99) takes 44 bytes (1.07 an offset, against 1.5 packed), of ``k =
410`` (0.9) 270 (0.66), of ``k = 2048`` (0.5) 768 (0.38). Below about ``k = 4`` the packing
is smaller; :func:`mask_nbytes` takes whichever is, from ``k``, ``B`` and the row count, which
every rank knows, so nothing on the wire says which.

Layout of an Elias-Fano row, little-endian within the byte: bits ``[i L, (i + 1) L)`` are the
low part of offset ``i``, bit ``k L + p`` is bit ``p`` of the high bitmap (``p < k + ((B - 1)
>> L)``), and the unused bits of the row's last byte are zero. Every row starts on a byte
(``ceil(bits / 8)`` bytes each), so a segment of ``n`` rows is ``n`` times a row's bytes.

Decoding reads every set bit of a row's bitmap: its rank among them (a prefix sum) is the
offset's index ``i``, its position less ``i`` the high part. ``_unpack_rows_kernel`` has one
program per row and walks the bitmap in chunks of ``CHUNK`` bits, carrying the count; it
reads the row's bytes (each bitmap byte up to 8 times, from cache) and writes ``2 k``.
Encoding (the owner's own rows): ``_pack_rows_kernel`` has one program per row and makes its
bytes ``ENCODE_TILE`` at a time, each bit from the offsets: a low bit from one load, a bitmap
bit ``p`` from a binary search for the first ``i`` with ``(x_i >> L) + i >= p``
(``floor(log2(k)) + 2`` loads, from cache); it reads ``2 k`` bytes and writes the row's. On
CPU tensors both run as torch ops (a byte per bit of the rows in between).
"""

from __future__ import annotations

import torch

from ._checks import check_block_size, check_numel, check_same_device, check_tensor, use_triton
from ._triton import tl, triton
from .pack import offset_bits, pack_offsets, packed_nbytes, unpack_offsets

MAX_CHUNK = 1024
"""The most bitmap bits ``_unpack_rows_kernel`` reads at once (fewer for a shorter bitmap)."""
ENCODE_TILE = 128
"""The most row bytes ``_pack_rows_kernel`` makes at once (fewer for a shorter row)."""


@triton.jit
def _pack_rows_kernel(p_idx, p_out, k, low_bits, row_bytes, SEARCH: tl.constexpr,
                      BYTE_TILE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    src = p_idx + row * k
    j = tl.arange(0, 8)[None, :]
    low_end = k * low_bits
    for start in range(0, row_bytes, BYTE_TILE):
        b = start + tl.arange(0, BYTE_TILE)
        t = b[:, None] * 8 + j  # bits of the row, a byte to a line
        in_row = b[:, None] < row_bytes
        is_low = in_row & (t < low_end)  # bit t % L of offset t // L
        e = t // tl.maximum(low_bits, 1)
        x = tl.load(src + e, mask=is_low, other=0).to(tl.int32)
        low_bit = (x >> (t - e * low_bits)) & 1
        # the bitmap: bit p is set where p = (x_i >> L) + i for an i, which ascends with i,
        # so the first i with (x_i >> L) + i >= p decides it (a binary search)
        p = t - low_end
        is_high = in_row & (t >= low_end)
        lo = tl.zeros([BYTE_TILE, 8], dtype=tl.int32)
        hi = lo + k
        for _ in range(SEARCH):
            mid = (lo + hi) // 2
            xm = tl.load(src + mid, mask=is_high & (mid < k), other=0).to(tl.int32)
            below = (mid < k) & ((xm >> low_bits) + mid < p)
            lo = tl.where(below, mid + 1, lo)
            hi = tl.where(below, hi, mid)
        xi = tl.load(src + lo, mask=is_high & (lo < k), other=0).to(tl.int32)
        high_bit = ((lo < k) & ((xi >> low_bits) + lo == p)).to(tl.int32)
        bit = tl.where(is_low, low_bit, tl.where(is_high, high_bit, 0))
        byte = tl.sum(bit << j, axis=1)
        tl.store(p_out + row * row_bytes + b, byte.to(tl.uint8), mask=b < row_bytes)


@triton.jit
def _unpack_rows_kernel(p_packed, p_out, k, low_bits, row_bytes, high_bits,
                        CHUNK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = p_packed + row * row_bytes
    low_mask = (1 << low_bits) - 1
    seen = tl.sum(tl.zeros([CHUNK], dtype=tl.int32), axis=0)  # set bits of earlier chunks
    for start in range(0, high_bits, CHUNK):
        q = start + tl.arange(0, CHUNK)
        m = q < high_bits
        at = k * low_bits + q  # the bit's place in the row
        byte = tl.load(base + (at >> 3), mask=m, other=0).to(tl.int32)
        bit = (byte >> (at & 7)) & 1
        i = seen + tl.cumsum(bit, axis=0) - 1  # the offset this set bit is the high part of
        ok = m & (bit == 1)
        lo = i * low_bits  # its low part: bits [lo, lo + low_bits), within three bytes
        b0 = tl.load(base + (lo >> 3), mask=ok, other=0).to(tl.int32)
        b1 = tl.load(base + (lo >> 3) + 1, mask=ok & ((lo >> 3) + 1 < row_bytes),
                     other=0).to(tl.int32)
        b2 = tl.load(base + (lo >> 3) + 2, mask=ok & ((lo >> 3) + 2 < row_bytes),
                     other=0).to(tl.int32)
        low = ((b0 | (b1 << 8) | (b2 << 16)) >> (lo & 7)) & low_mask
        value = ((q - i) << low_bits) | low
        tl.store(p_out + row * k + i, value.to(tl.int16), mask=ok)
        seen += tl.sum(bit, axis=0)


def ef_low_bits(k: int, block_size: int) -> int:
    """``L = floor(log2(block_size / k))``: the low bits an Elias-Fano row keeps per offset."""
    return (block_size // k).bit_length() - 1


def ef_row_bytes(k: int, block_size: int) -> int:
    """Bytes of one Elias-Fano row of ``k`` offsets below ``block_size``:
    ``ceil((k L + k + ((block_size - 1) >> L)) / 8)``."""
    low = ef_low_bits(k, block_size)
    return (k * low + k + ((block_size - 1) >> low) + 7) // 8


def uses_elias_fano(n_rows: int, k: int, block_size: int) -> bool:
    """Whether ``n_rows`` rows of ``k`` offsets travel in Elias-Fano code: where it is
    smaller than :func:`scape.kernels.pack_offsets` (a tie keeps the packing)."""
    return n_rows * ef_row_bytes(k, block_size) \
        < packed_nbytes(n_rows * k, offset_bits(block_size))


def mask_nbytes(n_rows: int, k: int, block_size: int) -> int:
    """Bytes of one rank's mask of ``n_rows`` rows of ``k`` offsets on the wire
    (:func:`pack_mask`): the smaller of ``n_rows`` Elias-Fano rows and the packed offsets."""
    _check_shape(n_rows, k, block_size)
    return min(n_rows * ef_row_bytes(k, block_size),
               packed_nbytes(n_rows * k, offset_bits(block_size)))


def _check_shape(n_rows: object, k: object, block_size: int) -> None:
    check_block_size(block_size)
    for name, v in (("n_rows", n_rows), ("k", k)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int; got {v!r}")
    assert isinstance(k, int)
    if k > block_size:
        raise ValueError(f"k must be at most block_size ({block_size}); got {k}")


def pack_mask_ref(idx: torch.Tensor, block_size: int, out: torch.Tensor) -> torch.Tensor:
    """Torch implementation of :func:`pack_mask`'s Elias-Fano rows (a byte per bit of the rows
    in between: ``n * row_bytes * 8`` bytes)."""
    n, k = idx.shape
    low_bits, row_bytes = ef_low_bits(k, block_size), ef_row_bytes(k, block_size)
    x, dev = idx.to(torch.int32), idx.device
    bits = torch.zeros(n, row_bytes * 8, dtype=torch.uint8, device=dev)
    if low_bits:
        shifts = torch.arange(low_bits, dtype=torch.int32, device=dev)
        low = (x & ((1 << low_bits) - 1)).unsqueeze(2) >> shifts & 1
        bits[:, :k * low_bits] = low.view(n, k * low_bits)
    place = (k * low_bits + (x >> low_bits)).to(torch.int64) \
        + torch.arange(k, dtype=torch.int64, device=dev)
    bits.scatter_(1, place, 1)
    weights = torch.arange(8, dtype=torch.uint8, device=dev)
    out.view(n, row_bytes).copy_((bits.view(n, row_bytes, 8) << weights).sum(2, dtype=torch.uint8))
    return out


def unpack_mask_ref(packed: torch.Tensor, k: int, block_size: int,
                    out: torch.Tensor) -> torch.Tensor:
    """Torch implementation of :func:`unpack_mask`'s Elias-Fano rows (``out`` ``[rows, k]``);
    a row without exactly ``k`` set bits raises ``ValueError``."""
    rows = out.shape[0]
    low_bits, row_bytes = ef_low_bits(k, block_size), ef_row_bytes(k, block_size)
    high_bits = k + ((block_size - 1) >> low_bits)
    dev = packed.device
    shifts = torch.arange(8, dtype=torch.uint8, device=dev)
    bits = (packed.view(rows, row_bytes).unsqueeze(2) >> shifts & 1).view(rows, row_bytes * 8)
    high = bits[:, k * low_bits:k * low_bits + high_bits].bool()
    i = high.cumsum(1, dtype=torch.int32) - 1  # each set bit's offset index
    q = torch.arange(high_bits, dtype=torch.int32, device=dev)
    part = torch.masked_select(q - i, high)  # the high parts, row by row
    if part.numel() != rows * k:
        raise ValueError(f"packed does not hold {rows} Elias-Fano rows of {k} offsets")
    value = part.view(rows, k) << low_bits
    if low_bits:
        lows = torch.arange(low_bits, dtype=torch.int32, device=dev)
        value |= (bits[:, :k * low_bits].view(rows, k, low_bits).to(torch.int32) << lows).sum(
            2, dtype=torch.int32)
    out.copy_(value)
    return out


def pack_mask(idx: torch.Tensor, block_size: int, *,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """One rank's mask rows ``idx`` (int16 ``[n_rows, k]``, each row ascending, offsets in
    ``[0, block_size)``) as :func:`mask_nbytes` bytes (uint8, 1-D): Elias-Fano rows, or the
    offsets packed to ``log2(block_size)`` bits where that is smaller. Neither the order nor
    the range is checked (it would read them); a row that is not ascending does not decode to
    itself."""
    check_tensor("idx", idx, dtypes=(torch.int16,), ndim=2)
    n, k = idx.shape
    _check_shape(n, k, block_size)
    n_bytes = mask_nbytes(n, k, block_size)
    if out is None:
        out = torch.empty(n_bytes, dtype=torch.uint8, device=idx.device)
    check_tensor("out", out, dtypes=(torch.uint8,), ndim=1)
    check_numel("out", out, n_bytes, f"the {n_bytes} bytes of {n} mask rows of {k}")
    check_same_device(idx=idx, out=out)
    if not uses_elias_fano(n, k, block_size):
        return pack_offsets(idx.contiguous().view(-1), block_size, out=out)
    if use_triton(idx):
        row_bytes = ef_row_bytes(k, block_size)
        _pack_rows_kernel[(n,)](idx.contiguous(), out, k, ef_low_bits(k, block_size), row_bytes,
                                SEARCH=k.bit_length(),
                                BYTE_TILE=min(ENCODE_TILE, triton.next_power_of_2(row_bytes)),
                                num_warps=4)
        return out
    return pack_mask_ref(idx, block_size, out)


def unpack_mask(packed: torch.Tensor, n_rows: int, block_size: int, *,
                out: torch.Tensor) -> torch.Tensor:
    """Read back the mask rows of consecutive segments of ``packed``, each
    :func:`pack_mask` of ``n_rows`` rows (every rank's in an all-gather), into ``out``
    (int16 ``[segments * n_rows, k]``, the row length ``k`` read from its shape)."""
    check_tensor("packed", packed, dtypes=(torch.uint8,), ndim=1)
    check_tensor("out", out, dtypes=(torch.int16,), ndim=2)
    rows, k = out.shape
    _check_shape(n_rows, k, block_size)
    if rows % n_rows:
        raise ValueError(f"out's {rows} rows must be a multiple of n_rows ({n_rows})")
    seg = mask_nbytes(n_rows, k, block_size)
    check_numel("packed", packed, rows // n_rows * seg,
                f"{rows // n_rows} segments of {seg} bytes")
    check_same_device(packed=packed, out=out)
    if not out.is_contiguous():
        raise ValueError("out must be contiguous")
    if not uses_elias_fano(n_rows, k, block_size):
        return unpack_offsets(packed, n_rows * k, block_size, out=out.view(-1))
    if use_triton(packed):
        low_bits = ef_low_bits(k, block_size)
        high_bits = k + ((block_size - 1) >> low_bits)
        chunk = min(MAX_CHUNK, triton.next_power_of_2(high_bits))
        _unpack_rows_kernel[(rows,)](packed, out, k, low_bits, ef_row_bytes(k, block_size),
                                     high_bits, CHUNK=chunk, num_warps=4)
        return out
    return unpack_mask_ref(packed, k, block_size, out)
