"""bench.research.wire4: 4-bit codes in the 8-bit wire's bytes keep the wire's contracts."""

import importlib
import sys

import pytest
import torch

import scape.optimizer
import scape.wire
from scape.kernels import take_pack8_, unpack_values


@pytest.fixture
def wire4():
    saved = scape.optimizer.take_pack8_, scape.wire.pack_values
    sys.modules.pop("bench.research.wire4", None)
    mod = importlib.import_module("bench.research.wire4")
    yield mod
    scape.optimizer.take_pack8_, scape.wire.pack_values = saved
    sys.modules.pop("bench.research.wire4", None)


@pytest.mark.parametrize("k", [1, 5, 41])
def test_take_pack4_keeps_what_it_drops_and_codes_on_16_levels(wire4, k):
    g = torch.Generator().manual_seed(k)
    n_blocks, block = 6, 64
    src = torch.randn(n_blocks * block, generator=g)
    src[:block] = 0.0  # a row whose scale is 0
    before = src.clone()
    idx = torch.stack([torch.randperm(block, generator=g)[:k] for _ in range(n_blocks)])
    idx = idx.to(torch.int16)
    codes = torch.full((n_blocks * k,), 7, dtype=torch.uint8)
    scales = torch.full((n_blocks,), float("nan"))
    wire4.take_pack4_(src, idx, block, codes=codes, scales=scales)
    flat = (idx.long() + torch.arange(n_blocks).unsqueeze(1) * block).reshape(-1)
    x = before[flat].view(n_blocks, k)
    torch.testing.assert_close(scales, x.abs().amax(dim=1), rtol=0, atol=0)
    assert bool((codes.long() % 17 == 0).all())
    decoded = unpack_values(codes, scales, k, 8, n_blocks * k).view(n_blocks, k)
    # what was delivered plus what stays is the gradient, at every entry
    torch.testing.assert_close(decoded.reshape(-1) + src[flat], before[flat])
    assert bool(((decoded - x).abs() <= scales.unsqueeze(1) / 15 * (1 + 1e-6)).all())
    untouched = torch.ones_like(src, dtype=torch.bool)
    untouched[flat] = False
    assert torch.equal(src[untouched], before[untouched])
    assert bool((decoded[0] == 0).all())


def test_the_patch_is_the_optimizers_take_and_the_8bit_take_is_finer(wire4):
    assert scape.optimizer.take_pack8_ is wire4.take_pack4_
    g = torch.Generator().manual_seed(0)
    src = torch.randn(4 * 256, generator=g)
    idx = torch.stack([torch.randperm(256, generator=g)[:41] for _ in range(4)]).to(torch.int16)
    a, b = src.clone(), src.clone()
    take_pack8_(a, idx, 256)
    wire4.take_pack4_(b, idx, 256)
    # the 4-bit code leaves more in the residual than the 8-bit one
    assert b.norm() > a.norm()
