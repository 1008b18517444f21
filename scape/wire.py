"""The compact parts of a sparse step's wire: the 8-bit gradient wire
(``grad_comm_dtype=torch.int8``), the 16-, 8-, 6- and 4-bit parameter wires
(``param_comm_dtype`` ``torch.float16``, ``torch.int8``, ``torch.int6``, ``torch.int4``) and
the mask's Elias-Fano rows (every wire).

**The mask.** The next mask travels as each mask row's ascending block-local offsets in
Elias-Fano code (:func:`scape.kernels.pack_mask`): ``ceil((k L + k + ((B - 1) >> L)) / 8)``
bytes a row, ``L = floor(log2(B / k))``, which at ``B = 4096`` is 44 bytes for ``k = 41``
(sparsity 0.99; 1.07 bytes an offset) and 269 for ``k = 410`` (0.9; 0.66); where ``log2(B)``
bits an offset (:func:`scape.kernels.pack_offsets`) is smaller (``k`` of 5 or less at
``B = 4096``) the offsets go packed. Every rank's rows are read back into the int16 mask
when the all-gather is waited. It is lossless: a run trains bit for bit as with 16-bit
offsets.

**Gradients.**
A sparse step's gradient values go as 8-bit codes with one fp32 scale per mask row
(:func:`scape.kernels.take_pack8_`: the row's absmax, the codebook of
:func:`scape.kernels.pack_values`), and what a code does not carry stays in the sender's
residual, so no gradient mass is lost: it is sent when the coordinate is next selected, as
an unselected one is. Codes of ranks with different scales cannot be summed on the wire, so
the reduce-scatter becomes an all-to-all of the same bytes per rank: rank ``r`` receives every
rank's codes and scales for the rows it owns, decodes them in fp32 and averages in rank order
(the same on every owner, whatever the backend).

One rank's segment for one owner, in bytes (``n`` = the owner's mask rows, ``k`` = entries
per row)::

    [ n fp32 scales | n * k codes | 0-3 zero bytes to a multiple of 4 ]

so a sparse step's gradient leg moves ``W * seg`` bytes per rank where the fp32 wire moves
``4 * W * n * k``: per mask entry ``1 + 4 / k`` bytes plus the padding, against 4 (bf16: 2).
Dense steps send fp32.

**Parameters.** With ``param_comm_dtype=torch.int8`` a sparse step's owner does not send the
new values of its mask entries but what the model copy still lacks of them,
``delta = master - model`` (fp32, the model copy read from its own replica), coded to 8 bits
with one fp32 scale per mask row (the row's absmax, the same codebook), in the segment layout
above; ``torch.float16`` codes each ``delta / s`` as an fp16 value instead (16 bits, 10 of
them mantissa: :func:`fp16_code`; for an fp32 model, where it halves the values' bytes),
``torch.int6`` and ``torch.int4`` code it to 6 or 4 bits on the same codebook's 64 or 16
levels (:func:`scape.kernels.pack_values`: 6-bit codes four to a 3-byte word, 4-bit two to a
byte; an owner's codes fill whole words, :func:`code_bytes`, the rest zero). Every rank,
the owner included, decodes every owner's segment and applies ``model = model + decoded``
(in fp32, stored in the model's dtype): the same operations on the same bytes, so the
replicas stay bitwise identical. The owner keeps its fp32 master; the gap ``master - model``
at a coordinate is what its last send did not carry, at most ``s / 255`` (6 bits:
``s / 63``; 4 bits: ``s / 15``; 16 bits: ``2**-11`` of the update itself, ``s / 2**25``
below ``s / 2**14``; ``s``: that row's largest ``|delta|``) plus one rounding to the model's
dtype, and it travels with the coordinate's next send (so it does not accumulate). A dense
step sends the values themselves and closes every gap.
"""

from __future__ import annotations

import types

import torch

from scape.comm import Communicator
from scape.comm.base import FinishedWork
from scape.kernels import (
    absmax_scales,
    gather,
    mask_nbytes,
    pack_values,
    packed_nbytes,
    scatter_,
    unpack_values,
    word_layout,
)

__all__ = ["FP16_CODES", "INT4", "INT6", "PARAM_BITS", "ParamWire", "Wire8", "code_bytes",
           "fp16_code", "fp16_decode", "fused_segment_bytes", "gather_parts", "mask_bytes",
           "segment_bytes"]


def as_dtype(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The bytes ``rows`` (uint8, any layout) as a flat ``dtype`` tensor (a copy)."""
    return rows.clone(memory_format=torch.contiguous_format).view(dtype).view(-1)


INT4: torch.dtype = torch.int4  # type: ignore[attr-defined]  # (the stubs omit sub-byte dtypes)
"""``torch.int4``, the 4-bit parameter wire's ``param_comm_dtype``."""
INT6: torch.dtype = torch.int6  # type: ignore[attr-defined]
"""``torch.int6``, the 6-bit parameter wire's ``param_comm_dtype``."""
PARAM_BITS = types.MappingProxyType({torch.float16: 16, torch.int8: 8, INT6: 6, INT4: 4})
"""The parameter wires' code widths by ``param_comm_dtype`` (module docstring)."""

FP16_CODES = 16
"""The code width of ``param_comm_dtype=torch.float16``: each update over its row's scale as an
fp16 value (module docstring), not a level of :func:`scape.kernels.pack_values`' codebook."""


def fp16_code(delta: torch.Tensor, scales: torch.Tensor, k: int) -> torch.Tensor:
    """The 16-bit codes (uint8, two bytes a value) of ``delta`` (fp32, rows of ``k``): each
    value over its row's ``scales`` (the rows' absmax; a zero row codes to zeros) rounded to
    fp16, to nearest. ``|x/s| <= 1``, so a code's error is at most ``2**-11`` of its value
    where ``|x/s| >= 2**-14`` (fp16's normal range) and ``2**-25`` of ``s`` below."""
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    return (delta.view(-1, k) / safe[:, None]).to(torch.float16).view(torch.uint8).view(-1)


def fp16_decode(codes: torch.Tensor, scales: torch.Tensor, k: int) -> torch.Tensor:
    """The fp32 values :func:`fp16_code`'s ``codes`` deliver: ``float(code) * s``."""
    return (codes.view(torch.float16).float().view(-1, k) * scales[:, None]).view(-1)


def segment_bytes(n_rows: int, k: int, scalars: int = 0, bits: int = 8) -> int:
    """Bytes of one rank's segment for one owner of ``n_rows`` mask rows of ``k`` entries
    coded to ``bits`` bits (and ``scalars`` fp32 values riding ahead of them)."""
    return fused_segment_bytes([(n_rows, k)], scalars, bits)


def fused_segment_bytes(rows: list[tuple[int, int]], scalars: int = 0, bits: int = 8) -> int:
    """Bytes of one rank's segment for one owner holding several buckets' rows, ``(n_rows,
    k)`` each, laid end to end, each bucket's codes ``bits`` wide and packed
    (:func:`scape.kernels.packed_nbytes`), and ``scalars`` fp32 values ahead of them; padded
    to a multiple of 4."""
    body = sum(4 * n + code_bytes(n * k, bits) for n, k in rows)
    return -(-(4 * scalars + body) // 4) * 4


def code_bytes(count: int, bits: int) -> int:
    """Bytes of ``count`` codes of ``bits`` bits in a segment: whole words of
    :func:`scape.kernels.word_layout` (``ceil(count * bits / 8)`` for 8 and 4 bits; 6-bit
    codes fill 3-byte words), so every owner's codes start at a code's boundary."""
    codes, _ = word_layout(bits)
    return packed_nbytes(-(-count // codes) * codes, bits)


class Wire8:
    """The all-to-all layout of the 8-bit wire (module docstring) for one or more buckets,
    ``rows`` = ``[(n_local, k), ...]``: each owner's segment holds every bucket's scales and
    codes in turn. With ``count=True`` it starts with the sender's non-finite count (fp32),
    which the owner sums (the step's skip, :mod:`scape.sharded`)."""

    def __init__(self, world: int, rows: list[tuple[int, int]], device: torch.device,
                 count: bool = False) -> None:
        self.world, self.rows, self.device = world, rows, device
        self.head = 4 if count else 0
        self.seg = fused_segment_bytes(rows, int(count))

    @staticmethod
    def decoded(codes: torch.Tensor, scales: torch.Tensor, k: int) -> torch.Tensor:
        """The fp32 values ``codes`` and ``scales`` deliver (rows of ``k``)."""
        return unpack_values(codes, scales, k, 8, codes.numel())

    def pack(self, coded: list[tuple[torch.Tensor, torch.Tensor]],
             count: torch.Tensor | None = None) -> torch.Tensor:
        """The send buffer from each bucket's ``(codes, scales)``: owner ``r``'s segment
        holds each bucket's mask rows ``r * n_local`` on (after ``count``, one fp32 value,
        where the layout carries it)."""
        w = self.world
        parts = []
        if self.head:
            assert count is not None
            parts.append(count.float().reshape(1).view(torch.uint8).expand(w, 4))
        for (n, k), (codes, scales) in zip(self.rows, coded):
            parts += [scales.view(w, n).view(torch.uint8).view(w, 4 * n), codes.view(w, n * k)]
        pad = self.seg - self.head - sum(4 * n + n * k for n, k in self.rows)
        if pad:
            parts.append(torch.zeros(w, pad, dtype=torch.uint8, device=self.device))
        return torch.cat(parts, dim=1).view(-1)

    def unpack_mean(self, recv: torch.Tensor, outs: list[torch.Tensor],
                    count: torch.Tensor | None = None) -> None:
        """Each of ``outs`` (fp32, ``n_local * k``) = the mean over ranks of its bucket's
        values in ``recv``; ``count`` (one fp32) = the sum of the ranks' counts, where the
        layout carries them."""
        w, at = self.world, self.head
        segs = recv.view(w, self.seg)
        if at:
            assert count is not None
            torch.sum(as_dtype(segs[:, :at], torch.float32), dim=0, keepdim=True, out=count)
        for (n, k), out in zip(self.rows, outs):
            scales = as_dtype(segs[:, at:at + 4 * n], torch.float32)
            codes = segs[:, at + 4 * n:at + 4 * n + n * k].contiguous().view(-1)
            at += 4 * n + n * k
            vals = unpack_values(codes, scales, k, 8, w * n * k).view(w, n * k)
            torch.sum(vals, dim=0, out=out)
            out.div_(w)

    def exchange(self, comm: Communicator, send: torch.Tensor
                 ) -> tuple[list[torch.Tensor], torch.Tensor | None, FinishedWork]:
        """Start the all-to-all: ``(gs, count, work)``; each bucket's ``g`` holds its
        averaged values and ``count`` (None without it) the summed counts once
        ``work.wait()`` returned."""
        recv = torch.empty_like(send)
        gs = [torch.empty(n * k, dtype=torch.float32, device=self.device) for n, k in self.rows]
        count = torch.empty(1, dtype=torch.float32, device=self.device) if self.head else None
        return gs, count, FinishedWork(comm.all_to_all(recv, send),
                                       lambda: self.unpack_mean(recv, gs, count))


class ParamWire:
    """One bucket's compact parameter wire on one sparse step (module docstring), ``bits``
    (16, 8, 6 or 4, :data:`PARAM_BITS`) a coded update: :meth:`code` makes the owner's segment of
    the all-gather, :meth:`apply` writes every rank's decoded updates into the model copy
    once it has landed."""

    def __init__(self, world: int, n_local: int, k: int, block_size: int,
                 bits: int = 8) -> None:
        self.world, self.n_local, self.k, self.block_size = world, n_local, k, block_size
        self.bits = bits
        self.codes = code_bytes(n_local * k, bits)
        self.seg = segment_bytes(n_local, k, bits=bits)

    def code(self, master: torch.Tensor, model_shard: torch.Tensor,
             rows: torch.Tensor) -> torch.Tensor:
        """The owner's segment (uint8, :attr:`seg` bytes): ``master - model_shard`` at its
        mask ``rows`` (``[n_local, k]``), coded."""
        n, k = self.n_local, self.k
        delta = gather(master, rows, self.block_size)
        delta.sub_(gather(model_shard, rows, self.block_size, out_dtype=torch.float32))
        scales = absmax_scales(delta, k)
        codes = fp16_code(delta, scales, k) if self.bits == FP16_CODES \
            else pack_values(delta, scales, k, self.bits)
        parts = [scales.view(torch.uint8), codes]
        pad = self.seg - 4 * n - codes.numel()
        if pad:
            parts.append(torch.zeros(pad, dtype=torch.uint8, device=codes.device))
        return torch.cat(parts)

    def apply(self, param_flat: torch.Tensor, mask: torch.Tensor, segs: torch.Tensor) -> None:
        """``param_flat[mask] += decoded`` (fp32 sum, stored in the model's dtype) for every
        owner's rows of the full ``mask`` (``[W n_local, k]``), in the same order on every
        rank; ``segs``: the gathered segments (``[W, seg]`` bytes)."""
        w, n, k, bits = self.world, self.n_local, self.k, self.bits
        scales = as_dtype(segs[:, :4 * n], torch.float32)
        codes = segs[:, 4 * n:4 * n + self.codes].contiguous().view(-1)
        if bits == FP16_CODES:
            values = fp16_decode(codes, scales, k)
        elif (n * k) % word_layout(bits)[0] == 0:  # the owners' codes lie end to end
            values = unpack_values(codes, scales, k, bits, w * n * k)
        else:  # each owner's last word is part empty: decode it with a zero scale, drop it
            per = self.codes * 8 // bits
            each = torch.zeros(w, per, dtype=torch.float32, device=segs.device)
            each[:, :n * k] = scales.view(w, n).repeat_interleave(k, dim=1)
            values = unpack_values(codes, each.view(-1), 1, bits, w * per)
            values = values.view(w, per)[:, :n * k].reshape(-1)
        values.add_(gather(param_flat, mask, self.block_size, out_dtype=torch.float32))
        scatter_(param_flat, mask, self.block_size, values)


def mask_bytes(n_rows: int, k: int, block_size: int) -> int:
    """Bytes of one rank's next mask, ``n_rows`` rows of ``k`` offsets, on the wire
    (:func:`scape.kernels.mask_nbytes`)."""
    return mask_nbytes(n_rows, k, block_size)


def gather_parts(comm: Communicator, parts: list[torch.Tensor]
                 ) -> tuple[object, list[torch.Tensor], torch.Tensor]:
    """Start one all-gather of the bytes of ``parts`` (1-D tensors of any dtype, the same
    sizes on every rank) laid end to end: ``(work, views, send)``, where ``views[j]`` is
    ``[W, parts[j].nbytes]``, every rank's bytes of part ``j`` (read them once ``work.wait()``
    returned), and ``send`` the buffer the collective reads."""
    raw = [p.reshape(-1).view(torch.uint8) for p in parts]
    send = torch.cat(raw)
    recv = torch.empty(comm.world_size * send.numel(), dtype=torch.uint8, device=send.device)
    work = comm.all_gather(recv, send)
    segs, views, at = recv.view(comm.world_size, -1), [], 0
    for r in raw:
        views.append(segs[:, at:at + r.numel()])
        at += r.numel()
    return work, views, send
