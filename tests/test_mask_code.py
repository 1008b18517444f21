"""The mask on the wire (scape.kernels.pack_mask / unpack_mask): Elias-Fano rows, or the
packed offsets where those are smaller. Round trips through the Triton kernel (in the
interpreter on CPU) and the torch twin, bit for bit alike; the rows read back by an
independent decoder in Python's integers; the sizes against the formula and the entropy of a
row; validation; and training, which must not change by a bit when the mask travels coded
(W=3, against the packed offsets). sm_80/sm_90 compilation and spills: tests/test_compile.py.
"""

from __future__ import annotations

import hashlib
import json
import math
import zlib

import pytest
import torch
from dist import run_ranks

import scape
import scape.optimizer
from scape import kernels
from scape.kernels import mask_code
from scape.kernels.pack import offset_bits, packed_nbytes


def _gen(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32("-".join(map(str, key)).encode()))


def _rows(n: int, k: int, block: int, *key) -> torch.Tensor:
    """``n`` rows of ``k`` distinct ascending offsets below ``block``; the first row takes the
    block's first ``k`` and the last its last ``k`` (the extremes of the high bitmap)."""
    g = _gen(n, k, block, *key)
    rows = [torch.randperm(block, generator=g)[:k].sort().values for _ in range(n)]
    rows[0] = torch.arange(k)
    if n > 1:
        rows[-1] = torch.arange(block - k, block)
    return torch.stack(rows).to(torch.int16)


def _decode_row(data: list[int], k: int, block: int) -> list[int]:
    """One Elias-Fano row read bit by bit: the low parts, then the set bits of the bitmap."""
    word = sum(b << (8 * i) for i, b in enumerate(data))
    low_bits = int(math.floor(math.log2(block / k)))
    lows = [(word >> (i * low_bits)) & ((1 << low_bits) - 1) for i in range(k)]
    high_len = k + ((block - 1) >> low_bits)
    ones = [p for p in range(high_len) if (word >> (k * low_bits + p)) & 1]
    assert len(ones) == k
    assert word >> (k * low_bits + high_len) == 0, "unused high bits must be zero"
    return [((p - i) << low_bits) | lo for i, (p, lo) in enumerate(zip(ones, lows))]


SHAPES = [(256, 1), (256, 3), (256, 41), (256, 256), (4096, 1), (4096, 5), (4096, 6),
          (4096, 41), (4096, 410), (4096, 1000), (4096, 2048), (4096, 4096), (32768, 5),
          (32768, 328), (32768, 3277)]


@pytest.mark.parametrize("block,k", SHAPES, ids=[f"B{b}-k{k}" for b, k in SHAPES])
@pytest.mark.parametrize("n,world", [(1, 1), (3, 2), (7, 3)])
def test_rows_round_trip_on_both_backends_bit_for_bit(block, k, n, world, kernel_backend):
    segs = [_rows(n, k, block, r) for r in range(world)]
    got = {}
    for name in ("triton", "torch"):
        kernel_backend(name)
        packed = [kernels.pack_mask(s, block) for s in segs]
        assert all(p.numel() == kernels.mask_nbytes(n, k, block) for p in packed)
        back = torch.full((world * n, k), -1, dtype=torch.int16)
        kernels.unpack_mask(torch.cat(packed), n, block, out=back)
        assert torch.equal(back, torch.cat(segs)), name
        got[name] = torch.cat(packed)
    assert torch.equal(got["triton"], got["torch"])
    if mask_code.uses_elias_fano(n, k, block):  # each row, read apart from the library
        row_bytes = mask_code.ef_row_bytes(k, block)
        data = got["torch"].view(world * n, row_bytes).tolist()
        for r, row in enumerate(torch.cat(segs).tolist()):
            assert _decode_row(data[r], k, block) == row


@pytest.mark.parametrize("block", [256, 1024, 4096, 32768])
def test_sizes_are_the_formula_the_smaller_coding_and_near_a_rows_entropy(block):
    bits = offset_bits(block)
    for k in sorted({1, 2, 3, 5, 8, 41, 100, block // 10, block // 4, block // 2, block}):
        low = int(math.floor(math.log2(block / k)))
        ef_bits = k * low + k + ((block - 1) >> low)
        assert mask_code.ef_row_bytes(k, block) == math.ceil(ef_bits / 8)
        for n in (1, 7, 64):
            packed = packed_nbytes(n * k, bits)
            ef = n * math.ceil(ef_bits / 8)
            assert kernels.mask_nbytes(n, k, block) == min(ef, packed)
            assert mask_code.uses_elias_fano(n, k, block) == (ef < packed)
        # any code of a row needs log2(C(B, k)) bits; Elias-Fano stays within two bits an
        # offset of it (plus the row's byte)
        entropy = math.log2(math.comb(block, k))
        assert ef_bits <= entropy + 2 * k + 1
    # the sparsities the library runs at B = 4096: 0.99 and 0.9 gain, 0.999 and up keep
    # the packing
    assert kernels.mask_nbytes(1, 41, 4096) == 44 < packed_nbytes(41, 12)
    assert kernels.mask_nbytes(1, 410, 4096) == 269
    assert not mask_code.uses_elias_fano(8, 4, 4096)


def test_validation_messages():
    idx = torch.zeros(2, 3, dtype=torch.int16)
    with pytest.raises(TypeError, match="idx must have dtype torch.int16"):
        kernels.pack_mask(idx.int(), 4096)
    with pytest.raises(ValueError, match="idx"):
        kernels.pack_mask(idx.view(-1), 4096)
    with pytest.raises(ValueError, match="k must be at most block_size"):
        kernels.pack_mask(torch.zeros(1, 300, dtype=torch.int16), 256)
    with pytest.raises(ValueError, match="block_size"):
        kernels.pack_mask(idx, 1000)
    with pytest.raises(ValueError, match="out"):
        kernels.pack_mask(idx, 4096, out=torch.empty(99, dtype=torch.uint8))
    out = torch.empty(6, 41, dtype=torch.int16)
    seg = kernels.mask_nbytes(3, 41, 4096)
    with pytest.raises(ValueError, match="multiple of n_rows"):
        kernels.unpack_mask(torch.zeros(seg, dtype=torch.uint8), 4, 4096, out=out)
    with pytest.raises(ValueError, match="packed"):
        kernels.unpack_mask(torch.zeros(seg, dtype=torch.uint8), 3, 4096, out=out)
    with pytest.raises(ValueError, match="n_rows"):
        kernels.mask_nbytes(0, 41, 4096)


# ------------------------------------------------------------ training does not change
def _packed_offsets(idx: torch.Tensor, block_size: int) -> torch.Tensor:
    return kernels.pack_offsets(idx.contiguous().view(-1), block_size)


def _unpacked_offsets(packed: torch.Tensor, n_rows: int, block_size: int, *,
                      out: torch.Tensor) -> torch.Tensor:
    kernels.unpack_offsets(packed, n_rows * out.shape[1], block_size, out=out.view(-1))
    return out


def _coded_against_packed(rank: int, world: int, steps: int) -> dict:
    """Each step's parameter hash and bytes of one run whose masks travel coded and of the
    same run whose masks travel as packed offsets (the wire before the coding)."""
    trails: dict = {}
    for name in ("coded", "packed"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Embedding(96, 64), torch.nn.Linear(64, 640),
                                    torch.nn.Linear(640, 96))
        opt = scape.SCAPE(model.parameters(), lr=1e-3, weight_decay=0.1, sparsity=0.99,
                          block_size=1024)
        opt.attach(model)
        saved = scape.optimizer.pack_mask, scape.optimizer.unpack_mask
        if name == "packed":
            scape.optimizer.pack_mask = _packed_offsets
            scape.optimizer.unpack_mask = _unpacked_offsets
        try:
            params, sent = [], []
            for t in range(steps):
                g = _gen("batch", t, rank)
                x = torch.randint(0, 96, (8, 12), generator=g)
                loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1),
                                                         x.roll(1, 1).flatten())
                loss.backward()
                opt.step()
                opt.zero_grad()
                flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
                params.append(hashlib.sha256(flat.numpy().tobytes()).hexdigest())
                sent.append(sum(opt.last_step.bytes.values()))
        finally:
            scape.optimizer.pack_mask, scape.optimizer.unpack_mask = saved
        trails[name] = (params, sent, [(m.n_blocks, m.k) for m in opt.masks if m])
    return trails


def test_training_is_bit_for_bit_that_of_the_packed_offsets():
    steps = 14
    ranks = run_ranks(_coded_against_packed, 3, steps, timeout=300)
    for rank, trails in enumerate(ranks):
        (coded, coded_bytes, shapes), (packed, packed_bytes, _) = \
            trails["coded"], trails["packed"]
        for t in range(steps):
            assert coded[t] == packed[t], (rank, t)
            assert coded[t] == ranks[0]["coded"][0][t], "replicas differ"
        # every step shares the next mask (after the dense first step too), in fewer bytes
        # (on the start's ramp from 0.9 at B=1024: k of 102 and down to 10)
        assert all(c < p for c, p in zip(coded_bytes, packed_bytes)), (coded_bytes, packed_bytes)
        assert shapes, "the run must have sparse buckets"


def _own_selection(rank: int, world: int, steps: int) -> dict:
    """Each step's parameter hash of runs of a rule with its own ``select``: the selection as
    ``blockwise_topk`` makes it (rows ascending) and the same rows in descending order."""
    import dataclasses

    base = scape.rules.get("sqrt")

    def select(flip: bool):
        def fn(shard, hp, k, k_explore, block_size):
            idx = kernels.blockwise_topk(base.score(shard), k, block_size,
                                         age=shard.age if k_explore else None,
                                         k_explore=k_explore)
            return idx.flip(1) if flip else idx
        return fn

    trails: dict = {}
    for name, flip in (("ascending", False), ("descending", True)):
        scape.rules.register(f"own-{name}", dataclasses.replace(base, select=select(flip)),
                             replace=True)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 640), torch.nn.Linear(640, 96))
        opt = scape.SCAPE(model.parameters(), lr=1e-3, sparsity=0.99, block_size=1024,
                          update=f"own-{name}")
        params = []
        for t in range(steps):
            x = torch.randn(8, 64, generator=_gen("own", t, rank))
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
            opt.finish_param_sync()
            flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            params.append(hashlib.sha256(flat.numpy().tobytes()).hexdigest())
        trails[name] = params
    return trails


def test_a_rules_own_selection_in_any_order_trains_as_ascending_rows():
    """The wire codes ascending rows; a rule's ``select`` may return a row in any order, and
    the run is bit for bit the one whose rows came ascending, on every rank."""
    steps = 8
    ranks = run_ranks(_own_selection, 2, steps, timeout=300)
    for rank, trails in enumerate(ranks):
        for t in range(steps):
            assert trails["descending"][t] == trails["ascending"][t], (rank, t)
            assert trails["ascending"][t] == ranks[0]["ascending"][t], "replicas differ"


def test_mask_cost_smoke(capsys):
    from bench.research import mask_cost

    assert mask_cost.main(["--quick"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["rows"], r["k"], r["device"]) for r in rows] == [(52, 41, "cpu"), (52, 410, "cpu")]
    for r in rows:  # the bytes are the formula's
        assert r["bytes_elias_fano"] == kernels.mask_nbytes(r["rows"], r["k"], 4096)
        assert r["bytes_elias_fano"] < r["bytes_packed"]
        assert all(r[key] > 0 for key in r if key.endswith("_ms"))
