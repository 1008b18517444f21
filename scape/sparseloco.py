"""``scape.SparseLoCo``: local steps, blockwise top-k pseudo-gradients with error feedback and
low-bit values (arXiv 2508.15706).

Each rank trains ``H = sync_every`` steps with its own ``inner`` optimizer (no
communication). At a sync (machinery in :mod:`scape.diloco`), with pseudo-gradient
``delta = theta_synced - theta_local``:

1. **Error feedback** (replaces DiLoCo's outer momentum): ``a <- ef_decay * a + delta``.
2. **Select**: per block of ``B = block_size`` coordinates, the ``k = max(1, round(density *
   B))`` entries of largest ``|a|`` (``blockwise_topk``; ties to the lower offset), as int16
   block-local offsets. ``K = n_blocks * k`` entries per rank.
3. **Quantize** the selected values ``v = a[idx]``: with ``value_bits`` 2, 4 or 8, one fp32
   scale per block (the absmax of its ``k`` values) and a symmetric ``2**bits``-level
   codebook without zero (:mod:`scape.kernels.pack`; error at most ``scale / (2**bits - 1)``);
   16 sends bf16 values, 32 fp32 values, with no scale.
4. **Keep what was not sent**: ``a[idx] <- v - dequant(v)``. Unselected entries stay in ``a``
   whole and the quantization error of selected ones stays too, so
   ``a_after + sent == ef_decay * a_before + delta`` (to fp32 rounding).
5. **All-gather** one byte record per rank (below), decode every rank's contribution in rank
   order, sum them into a dense buffer and average: ``mean = sum / W``.
6. **Outer step** on every rank: ``theta_synced <- theta_synced - outer_lr * mean``;
   ``theta_local <- theta_synced``. All ranks decode the same bytes in the same order, so
   they end bitwise identical.

**Bytes per sync.** Each rank contributes one uint8 record of ``P`` bytes:

| value_bits | record layout (in this order)  | P                                             |
|------------|-------------------------------|-----------------------------------------------|
| 2, 4, 8    | scales fp32, offsets int16,   | ``4 * n_blocks + 2 * K + ceil(K * bits / 8)`` |
|            | packed codes                  |                                               |
| 16         | values bf16, offsets int16    | ``4 * K``                                     |
| 32         | values fp32, offsets int16    | ``6 * K``                                     |

with ``n_blocks = N_pad / B`` (``N`` padded to a multiple of ``B``) and ``K = n_blocks * k``.
The all-gather's payload in ``comm.stats`` is ``W * P`` (what every rank holds afterwards);
a ring all-gather puts ``(W - 1) * P`` on each rank's link. Nothing moves between syncs, so
the bytes per training step are ``W * P / sync_every``. Example: ``B = 4096``, density 0.02,
2 bits: ``k = 82`` and ``P / N = (4 + 2 * 82 + 20.5) / 4096`` = 0.046 bytes per parameter
per sync, against 4 bytes for DiLoCo's fp32 all-reduce.

Memory: three fp32 flat buffers of ``N_pad`` (``theta_synced``, ``a``, a work buffer).
"""

from __future__ import annotations

from typing import Any

import torch

from scape import config
from scape.comm import Communicator
from scape.diloco import LocalSGD
from scape.kernels import (
    absmax_scales,
    blockwise_topk,
    gather,
    pack_values,
    packed_nbytes,
    scatter_,
    unpack_values,
)

VALUE_BITS = (2, 4, 8, 16, 32)


def record_nbytes(n_blocks: int, k: int, value_bits: int) -> int:
    """``P``: bytes of one rank's record at a sync (table in the module docstring)."""
    n = n_blocks * k
    if value_bits == 32:
        return 6 * n
    if value_bits == 16:
        return 4 * n
    return 4 * n_blocks + 2 * n + packed_nbytes(n, value_bits)


class SparseLoCo(LocalSGD):
    """SparseLoCo: ``sync_every`` local steps with ``inner``, then every rank sends the
    per-block top-``density`` entries of its error-feedback accumulator, quantized to
    ``value_bits``, and all ranks apply the same outer step to the averaged contributions.

    Args:
        params: the parameters (or param groups) ``inner`` optimizes.
        inner: a ``torch.optim.Optimizer`` over exactly those parameters (e.g. AdamW).
        sync_every: ``H``, inner steps per outer sync.
        density: share of each block sent, in (0, 1]; ``k = max(1, round(density * B))``.
        block_size: ``B``, a power of two in [256, 32768].
        ef_decay: ``beta`` of the error-feedback accumulator ``a <- beta * a + delta``, in
            [0, 1] (0: no error feedback, what is not sent is dropped at the next sync).
        outer_lr: outer learning rate ``alpha``.
        value_bits: 2, 4, 8 (packed codes with a scale per block), 16 (bf16) or 32 (fp32).
        comm: the data-parallel group: a ProcessGroup, a 1-D DeviceMesh or a
            :class:`scape.comm.Communicator` (default: the default process group).

    ``opt.error_feedback`` is the accumulator ``a``; ``opt.last_sync`` holds this rank's
    offsets (``idx``) and dequantized values (``sent``) of the last sync. ``opt.last_step``,
    ``state_dict()`` and ``load_state_dict()`` follow ``scape.SCAPE``'s conventions; the
    inner optimizer's state is part of the state dict.
    """

    name = "SparseLoCo"

    def __init__(self, params: Any, inner: Any, *, sync_every: int = 32, density: float = 0.02,
                 block_size: int = 4096, ef_decay: float = 0.95, outer_lr: float = 1.0,
                 value_bits: int = 2, comm: Communicator | None = None) -> None:
        align = block_size if isinstance(block_size, int) and block_size > 0 else 1
        super().__init__(params, inner, sync_every=sync_every, comm=comm, align=align,
                         fields=dict(density=density, block_size=block_size,
                                     ef_decay=ef_decay, outer_lr=outer_lr,
                                     value_bits=value_bits))
        self.density = float(density)
        self.block_size = block_size
        self.ef_decay = float(ef_decay)
        self.outer_lr = float(outer_lr)
        self.value_bits = value_bits
        self.n_blocks = self.n_pad // block_size
        self.k = max(1, round(self.density * block_size))
        self.error_feedback = torch.zeros_like(self.synced)
        """The accumulator ``a`` (fp32, this rank's own)."""
        self.last_sync: dict[str, torch.Tensor] = {}

    @property
    def record_bytes(self) -> int:
        """``P``, the bytes this rank contributes to each sync's all-gather."""
        return record_nbytes(self.n_blocks, self.k, self.value_bits)

    def _validate(self, fields: dict[str, Any]) -> None:
        density, value_bits = fields["density"], fields["value_bits"]
        if isinstance(density, bool) or not isinstance(density, (int, float)) \
                or not 0.0 < density <= 1.0:
            raise ValueError(f"Invalid density: {density!r} (expected a float in (0, 1], "
                             "e.g. 0.02)")
        config.check_block_size(fields["block_size"])
        config.check_fraction("ef_decay", fields["ef_decay"])
        config.check_lr(fields["outer_lr"], "outer_lr")
        if isinstance(value_bits, bool) or not isinstance(value_bits, int):
            raise TypeError(f"value_bits must be an int; got {type(value_bits).__name__}")
        if value_bits not in VALUE_BITS:
            raise ValueError(f"Invalid value_bits: {value_bits} (expected one of "
                             f"{VALUE_BITS})")

    # ------------------------------------------------------------------- the sync
    def _encode(self, values: torch.Tensor, idx: torch.Tensor,
                record: torch.Tensor) -> torch.Tensor:
        """Write this rank's record; return the values as every rank will decode them."""
        nb, k, bits, n = self.n_blocks, self.k, self.value_bits, values.numel()
        if bits == 32:
            record[:4 * n].view(torch.float32).copy_(values)
            record[4 * n:].view(torch.int16).copy_(idx.view(-1))
            return values
        if bits == 16:
            wire = values.to(torch.bfloat16)
            record[:2 * n].view(torch.bfloat16).copy_(wire)
            record[2 * n:].view(torch.int16).copy_(idx.view(-1))
            return wire.to(torch.float32)
        scales = absmax_scales(values, k)
        record[:4 * nb].view(torch.float32).copy_(scales)
        record[4 * nb:4 * nb + 2 * n].view(torch.int16).copy_(idx.view(-1))
        codes = record[4 * nb + 2 * n:]
        pack_values(values, scales, k, bits, out=codes)
        return unpack_values(codes, scales, k, bits, n)

    def _decode(self, record: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(int16 ``[n_blocks, k]`` offsets, fp32 values) of one rank's record. Slices are
        copied before they are viewed as wider dtypes (a record may start at an odd byte)."""
        nb, k, bits = self.n_blocks, self.k, self.value_bits
        n = nb * k
        if bits in (16, 32):
            w = bits // 8
            dtype = torch.float32 if bits == 32 else torch.bfloat16
            values = record[:w * n].clone().view(dtype).to(torch.float32)
            idx = record[w * n:].clone().view(torch.int16)
        else:
            scales = record[:4 * nb].clone().view(torch.float32)
            idx = record[4 * nb:4 * nb + 2 * n].clone().view(torch.int16)
            values = unpack_values(record[4 * nb + 2 * n:], scales, k, bits, n)
        return idx.view(nb, k), values

    def _outer_sync(self) -> tuple[bool, int, bool]:
        """One sync. A non-finite pseudo-gradient on any rank skips it on every rank, at no
        extra byte: that rank sends a record whose values decode to NaN, every rank finds a
        non-finite entry in the same decoded sum, and ``theta_synced`` and ``a`` stay as they
        were (``a``'s update is made on a copy and kept only for a sync that applies)."""
        work, B, W = self._delta, self.block_size, self.comm.world_size
        record = torch.empty(self.record_bytes, dtype=torch.uint8, device=self.device)
        a = self.error_feedback.mul(self.ef_decay).add_(work)
        idx = torch.arange(self.k, dtype=torch.int16, device=self.device).repeat(
            self.n_blocks, 1)
        if bool(torch.isfinite(work).all()):
            idx = blockwise_topk(a, self.k, B)
            values = gather(a, idx, B)
            sent = self._encode(values, idx, record)
            scatter_(a, idx, B, values - sent)  # the quantization error stays in a
        else:  # poison this rank's record: every rank skips this sync
            values = torch.full((idx.numel(),), float("nan"), device=self.device)
            sent = self._encode(values, idx, record)
        everyone = torch.empty(W * record.numel(), dtype=torch.uint8, device=self.device)
        self.comm.all_gather(everyone, record).wait()
        total = work.zero_()
        for r in range(W):  # the same order on every rank: bitwise-identical sums
            idx_r, values_r = self._decode(everyone[r * record.numel():(r + 1) * record.numel()])
            scatter_(total, idx_r, B, gather(total, idx_r, B).add_(values_r))
        if not bool(torch.isfinite(total).all()):
            return self.k == B, W * idx.numel(), True
        self.error_feedback.copy_(a)
        self.last_sync = {"idx": idx, "sent": sent}
        total.div_(W)
        self.synced.sub_(total, alpha=self.outer_lr)
        return self.k == B, W * idx.numel(), False

    def _outer_state(self) -> dict[str, torch.Tensor]:
        return {"error_feedback": self.error_feedback}
