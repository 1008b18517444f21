"""take_pack8_: the 8-bit gradient wire's fused take, code and error feedback. The Triton
kernel (through the interpreter on CPU) against the torch twin bit for bit; the invariants
(buffer + decoded == before at the mask, untouched elsewhere, error within scale / 255, codes
those of pack_values); zero rows; validation. The wire's all-to-all against the fp32
reduce-scatter carrying the same decoded values (W=4). sm_80/sm_90 compilation and spills:
tests/test_compile.py."""

from __future__ import annotations

import zlib

import pytest
import torch
from dist import run_ranks

import scape
import scape.optimizer
from scape import kernels
from scape.kernels import pack
from scape.wire import Wire8


def _gen(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32("-".join(map(str, key)).encode()))


def _case(n_blocks: int, block: int, k: int, *key) -> tuple[torch.Tensor, torch.Tensor]:
    """A residual buffer whose blocks span magnitudes 1e-4 .. 1e1, and a random mask of k
    distinct offsets per block."""
    g = _gen(n_blocks, block, k, *key)
    mag = torch.logspace(-4, 1, n_blocks).repeat_interleave(block)
    src = torch.randn(n_blocks * block, generator=g) * mag
    idx = torch.stack([torch.randperm(block, generator=g)[:k] for _ in range(n_blocks)])
    return src, idx.to(torch.int16)


CASES = [pytest.param(1, 256, 1, id="k1"), pytest.param(3, 256, 3, id="k3"),
         pytest.param(5, 4096, 41, id="k41-0.99"), pytest.param(2, 4096, 410, id="k410-0.9"),
         pytest.param(2, 1024, 1000, id="k1000-odd")]


@pytest.mark.parametrize("n_blocks,block,k", CASES)
def test_triton_matches_torch_and_keeps_every_gradient(n_blocks, block, k, kernel_backend):
    src, idx = _case(n_blocks, block, k)
    out = {}
    for name in ("triton", "torch"):
        kernel_backend(name)
        buf = src.clone()
        codes = torch.full((n_blocks * k,), 7, dtype=torch.uint8)
        scales = torch.full((n_blocks,), float("nan"))
        kernels.take_pack8_(buf, idx, block, codes=codes, scales=scales)
        out[name] = (buf, codes, scales)
    for a, b in zip(out["triton"], out["torch"]):
        assert torch.equal(a, b), "triton and torch differ"
    buf, codes, scales = out["torch"]
    flat = (torch.arange(n_blocks).view(-1, 1) * block + idx.long()).view(-1)
    x = src[flat]
    torch.testing.assert_close(scales, x.view(n_blocks, k).abs().amax(1), rtol=0, atol=0)
    decoded = kernels.unpack_values(codes, scales, k, 8, n_blocks * k)
    assert torch.equal(codes, kernels.pack_values(x, scales, k, 8))
    # error feedback: what stays in the buffer plus what the codes deliver is the gradient
    # (two fp32 roundings: of x - decoded, then of the sum; each within half an ulp of
    # max(|x|, |decoded|), and |decoded| <= |x| + scale / 255)
    bound = scales.repeat_interleave(k) / 255 * (1 + 1e-6)
    gap = (buf[flat] + decoded - x).abs()
    assert (gap <= 2 ** -23 * (x.abs() + bound)).all(), gap.max()
    assert (buf[flat].abs() <= bound).all(), "coding error above scale / 255"
    rest = torch.ones_like(src, dtype=torch.bool)
    rest[flat] = False
    assert torch.equal(buf[rest], src[rest]), "entries outside the mask changed"


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_zero_rows_code_to_zero_error(backend, kernel_backend):
    kernel_backend(backend)
    src, idx = _case(3, 256, 5, "zero")
    src[:256] = 0.0  # a block of zeros: scale 0, decoded 0, nothing left behind
    buf = src.clone()
    codes, scales = kernels.take_pack8_(buf, idx, 256)
    assert scales[0] == 0 and scales[1:].gt(0).all()
    assert buf[:256].eq(0).all()
    decoded = kernels.unpack_values(codes, scales, 5, 8, 15)
    assert decoded[:5].eq(0).all()


def test_validation_messages():
    src, idx = _case(2, 256, 4, "val")
    with pytest.raises(TypeError, match="src must have dtype torch.float32"):
        kernels.take_pack8_(src.bfloat16(), idx, 256)
    with pytest.raises(ValueError, match="one row per block"):
        kernels.take_pack8_(src, idx[:1], 256)
    with pytest.raises(ValueError, match="codes"):
        kernels.take_pack8_(src, idx, 256, codes=torch.empty(7, dtype=torch.uint8))
    with pytest.raises(ValueError, match="scales"):
        kernels.take_pack8_(src, idx, 256, scales=torch.empty(3))
    assert pack.take_pack8_config(41)["K_TILE"] == 64


# ------------------------------------------------------------------- packed mask offsets
@pytest.mark.parametrize("block", [256, 4096, 32768])
@pytest.mark.parametrize("n,world", [(1, 1), (3, 2), (287, 3), (1000, 4)])
def test_offsets_pack_to_log2_block_bits_and_back(block, n, world, kernel_backend):
    bits = pack.offset_bits(block)
    assert bits == block.bit_length() - 1
    segs = [torch.randint(0, block, (n,), dtype=torch.int16, generator=_gen(block, n, r))
            for r in range(world)]
    got = {}
    for name in ("triton", "torch"):
        kernel_backend(name)
        packed = [kernels.pack_offsets(s, block) for s in segs]
        assert all(p.numel() == kernels.packed_nbytes(n, bits) for p in packed)
        back = torch.full((world * n,), -1, dtype=torch.int16)
        kernels.unpack_offsets(torch.cat(packed), n, block, out=back)
        assert torch.equal(back, torch.cat(segs)), name
        got[name] = torch.cat(packed)
    assert torch.equal(got["triton"], got["torch"])
    # the stream, read bit by bit in Python's integers
    data = got["torch"][:kernels.packed_nbytes(n, bits)].tolist()
    word = sum(b << (8 * i) for i, b in enumerate(data))
    assert [(word >> (i * bits)) & ((1 << bits) - 1) for i in range(n)] == segs[0].tolist()
    assert word >> (n * bits) == 0, "unused high bits must be zero"


def test_offset_validation_messages():
    idx = torch.zeros(6, dtype=torch.int16)
    with pytest.raises(TypeError, match="idx must have dtype torch.int16"):
        kernels.pack_offsets(idx.int(), 4096)
    with pytest.raises(ValueError, match="n_seg"):
        kernels.unpack_offsets(torch.zeros(9, dtype=torch.uint8), 4, 4096,
                               out=torch.empty(6, dtype=torch.int16))
    with pytest.raises(ValueError, match="packed"):
        kernels.unpack_offsets(torch.zeros(8, dtype=torch.uint8), 3, 4096,
                               out=torch.empty(6, dtype=torch.int16))


# ----------------------------------------------- the all-to-all against the reduce-scatter
def _same_values_body(rank: int, world: int, steps: int) -> list[tuple[float, float]]:
    """Per step: max |p_int8 - p_decoded| and max |p_int8 - p_fp32| over the rank's
    parameters, from one start and the same gradients; ``p_decoded`` is the fp32 wire whose
    take sends the 8-bit wire's decoded values (and keeps its coding error as residual)."""
    exact_take = scape.optimizer.take_

    def decoded_take(src, idx, block_size, out=None, out_dtype=None, keep_error=False):
        codes, scales = kernels.take_pack8_(src, idx, block_size)
        return Wire8.decoded(codes, scales, idx.shape[1])

    params = {}
    for name, take, kw in (("int8", exact_take, {"grad_comm_dtype": torch.int8}),
                           ("decoded", decoded_take, {}), ("fp32", exact_take, {})):
        p = torch.nn.Parameter(torch.randn(8 * 4096 * world, generator=_gen("p")) * 0.02)
        scape.optimizer.take_ = take
        try:
            opt = scape.SCAPE([p], lr=1e-3, sparsity=0.99, warmup_steps=1, **kw)
            trail = []
            for t in range(steps):
                g = _gen("g", t, rank)  # gradients that span decades, as a residual's rows
                p.grad = torch.randn(p.numel(), generator=g) \
                    * torch.rand(p.numel(), generator=g) ** 4
                opt.step()
                trail.append(p.detach().clone())
        finally:
            scape.optimizer.take_ = exact_take
        params[name] = trail
    return [(float((a - b).abs().max()), float((a - c).abs().max()))
            for a, b, c in zip(params["int8"], params["decoded"], params["fp32"])]


def test_the_all_to_all_delivers_what_the_reduce_scatter_would_of_the_same_values():
    # The 8-bit wire's owners decode every rank's codes and average them in rank order; the
    # fp32 wire's reduce-scatter sums the same decoded values in its own order. The steps
    # agree to that order's rounding, while the coding itself moves the parameters by about
    # a step (lr): a run of the 8-bit wire differs from the fp32 wire's by its code, not by
    # its collective.
    steps = 8
    for rows in run_ranks(_same_values_body, 4, steps, timeout=300):
        assert rows[0] == (0.0, 0.0), "the dense first step differs"
        for t, (path, code) in enumerate(rows[1:], 1):
            assert path <= 1e-6, f"step {t}: the collectives differ by {path:.3g}"
            assert code >= 1e-4, f"step {t}: the coding moved nothing ({code:.3g})"
