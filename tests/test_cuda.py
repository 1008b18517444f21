"""The compiled Triton kernels and the optimizer on a real CUDA device.

Everywhere else the kernels run through Triton's interpreter on CPU tensors. Here every public
op runs compiled on the GPU, on fresh random inputs at realistic sizes, against the CPU
implementation (itself checked against brute force and float64 in the other kernel tests):
selection and copies bit for bit, arithmetic within the per-dtype tolerance of a float64
reference, casts to the model dtype exactly round-to-nearest-even (no interpreter allowance).
Then the optimizer: one SCAPE run on the GPU against the same run on the CPU, the single-rank
NCCL communicator against the torch one, the Triton kernels seen launching inside the step,
and the NVTX ranges left balanced.

The interpreter (``TRITON_INTERPRET=1``, which the other tests need and conftest sets by
default) cannot compile for the GPU, so this module is its own run on a CUDA machine::

    TRITON_INTERPRET=0 python -m pytest tests/test_cuda.py -rA

Without a CUDA device, or under the interpreter, every test here is skipped with the reason.
"""

from __future__ import annotations

import os
import zlib

import pytest
import torch
from conftest import nan_empty
from kernel_cases import (
    adams_f64,
    adamw_f64,
    assert_cast_equal,
    assert_close,
    assert_gain_close,
    check_adams_sparse,
    flat_positions,
    gain_inputs,
    make_scores,
    noise_ema_f64,
    random_mask,
    seeded,
)

import scape
from scape import kernels
from scape.kernels import pack as pack_mod
from scape.kernels import reference as ref
from scape.kernels import topk_torch
from scape.profiling import PHASES

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="needs a CUDA device; torch.cuda.is_available() is False"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                       reason="TRITON_INTERPRET=1 runs Triton on the CPU; run this module as "
                              "TRITON_INTERPRET=0 python -m pytest tests/test_cuda.py"),
]

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
HP = dict(lr=3e-2, beta1=0.9, beta2=0.95, eps=1e-8)
DEV = "cuda"


@pytest.fixture(autouse=True)
def _kernels_by_device(kernel_backend):
    """CUDA tensors must take the Triton path by dispatch, not by force."""
    kernel_backend("auto")


def _cpu(t: torch.Tensor) -> torch.Tensor:
    torch.cuda.synchronize()
    return t.cpu()


# ----------------------------------------------------------------------------- selection
TOPK_CASES = [
    pytest.param(4096, 256, 41, 4, F32, "randn", id="b4096-nb256-k41-kx4-f32"),
    pytest.param(4096, 64, 410, 41, BF16, "randn", id="b4096-nb64-k410-kx41-bf16"),
    pytest.param(4096, 32, 41, 0, F16, "randn", id="b4096-nb32-k41-f16"),
    pytest.param(8192, 32, 82, 8, F32, "randn", id="b8192-nb32-k82-kx8-f32"),
    pytest.param(32768, 8, 328, 32, F32, "randn", id="b32768-nb8-k328-kx32-f32"),
    pytest.param(256, 512, 3, 1, F32, "randn", id="b256-nb512-k3-kx1-f32"),
    pytest.param(4096, 16, 41, 4, F32, "small_ints", id="b4096-ties-f32"),
    pytest.param(4096, 16, 41, 4, F32, "zeros", id="b4096-signed-zeros-f32"),
    pytest.param(4096, 16, 410, 0, F32, "nan_inf", id="b4096-nan-inf-f32"),
    pytest.param(1024, 4, 1024, 0, BF16, "randn", id="b1024-k-is-block-bf16"),
]


@pytest.mark.parametrize("block_size,n_blocks,k,k_explore,dtype,kind", TOPK_CASES)
def test_topk_matches_cpu_bitwise(block_size, n_blocks, k, k_explore, dtype, kind):
    n = block_size * n_blocks
    seed = zlib.crc32(f"cuda-topk-{block_size}-{n_blocks}-{k}-{k_explore}-{dtype}-{kind}".encode())
    score = make_scores(kind, n, dtype, seed)
    age = torch.randint(0, 6, (n,), generator=seeded("age", seed), dtype=torch.int32)
    age_arg = age if k_explore else None
    want = topk_torch.blockwise_topk(score, k, block_size, age=age_arg, k_explore=k_explore)
    s_dev, a_dev = score.to(DEV), age.to(DEV)
    got = kernels.blockwise_topk(s_dev, k, block_size, age=a_dev if k_explore else None,
                                 k_explore=k_explore)
    assert got.is_cuda and got.dtype == torch.int16 and got.shape == (n_blocks, k)
    got = _cpu(got)
    assert torch.equal(got, want), f"{int((got != want).any(1).sum())} blocks differ"
    assert (got[:, 1:] > got[:, :-1]).all(), "offsets not strictly ascending"
    assert torch.equal(_cpu(s_dev).view(torch.uint8), score.view(torch.uint8)), "score written"
    assert torch.equal(_cpu(a_dev), age), "age written"


# ----------------------------------------------------------------------- copies by mask
COPY_CASES = [
    pytest.param(4096, 128, 41, F32, BF16, id="b4096-nb128-k41-f32-to-bf16"),
    pytest.param(4096, 32, 410, BF16, F32, id="b4096-nb32-k410-bf16-to-f32"),
    pytest.param(32768, 4, 328, F32, F16, id="b32768-nb4-k328-f32-to-f16"),
    pytest.param(256, 300, 256, F16, F16, id="b256-nb300-kB-f16"),
]


@pytest.mark.parametrize("block_size,n_blocks,k,src_dtype,out_dtype", COPY_CASES)
def test_take_gather_scatter_match_cpu(block_size, n_blocks, k, src_dtype, out_dtype):
    gen = seeded("cuda-copy", block_size, n_blocks, k, src_dtype, out_dtype)
    n = n_blocks * block_size
    idx = random_mask(n_blocks, block_size, k, gen)
    src = (torch.randn(n, generator=gen) * 3).to(src_dtype)
    residual = torch.randn(n, generator=gen)
    values = torch.randn(n_blocks * k, generator=gen).to(out_dtype)
    i_dev = idx.to(DEV)

    want = ref.gather(src, idx, block_size, residual=residual, out_dtype=out_dtype)
    out = nan_empty(n_blocks * k, out_dtype, DEV)
    got = kernels.gather(src.to(DEV), i_dev, block_size, residual=residual.to(DEV), out=out,
                         out_dtype=out_dtype)
    assert got.data_ptr() == out.data_ptr()
    assert torch.equal(_cpu(got), want), "gather"

    s_cpu, s_dev = src.clone(), src.to(DEV, copy=True)
    want = ref.take_(s_cpu, idx, block_size, out_dtype=out_dtype)
    got = kernels.take_(s_dev, i_dev, block_size, out=nan_empty(n_blocks * k, out_dtype, DEV),
                        out_dtype=out_dtype)
    assert torch.equal(_cpu(got), want), "take_ values"
    assert torch.equal(_cpu(s_dev), s_cpu), "take_ zeroing"
    flat = flat_positions(idx, block_size)
    assert (s_cpu[flat] == 0).all()
    s_cpu, s_dev = src.clone(), src.to(DEV, copy=True)  # the 16-bit wire's take
    want = ref.take_(s_cpu, idx, block_size, out_dtype=out_dtype, keep_error=True)
    got = kernels.take_(s_dev, i_dev, block_size, out=nan_empty(n_blocks * k, out_dtype, DEV),
                        keep_error=True)
    assert torch.equal(_cpu(got), want), "take_ keep_error values"
    assert torch.equal(_cpu(s_dev), s_cpu), "take_ keep_error residual"

    d_cpu, d_dev = nan_empty(n, src_dtype), nan_empty(n, src_dtype, DEV)
    ref.scatter_(d_cpu, idx, block_size, values)
    kernels.scatter_(d_dev, i_dev, block_size, values.to(DEV))
    got = _cpu(d_dev)
    assert torch.equal(got.isnan(), d_cpu.isnan()), "scatter_ wrote outside the mask"
    assert torch.equal(got[flat], d_cpu[flat]), "scatter_ values"
    assert_cast_equal(got[flat], values, "scatter_ cast")


# -------------------------------------------------------------------------- arithmetic
@pytest.mark.parametrize("g_dtype,out_dtype,wd", [
    pytest.param(F32, BF16, 0.1, id="g-f32-out-bf16"),
    pytest.param(BF16, BF16, 0.0, id="g-bf16-out-bf16-wd0"),
    pytest.param(F16, F16, 0.01, id="g-f16-out-f16"),
])
@pytest.mark.parametrize("n", [pytest.param((1 << 22) + 777, id="n4M-tail")])
def test_dense_updates_match_float64(g_dtype, out_dtype, wd, n):
    gen = seeded("cuda-dense", g_dtype, out_dtype, wd, n)
    p0 = torch.randn(n, generator=gen)
    m0 = torch.randn(n, generator=gen) * 0.1
    v0 = torch.rand(n, generator=gen) * 0.1
    g = torch.randn(n, generator=gen).to(g_dtype)

    p, m = p0.to(DEV, copy=True), m0.to(DEV, copy=True)
    out = nan_empty(n, out_dtype, DEV)
    kernels.adams_dense_(p, m, g.to(DEV), weight_decay=wd, model_out=out, **HP)
    ep, em = adams_f64(p0, m0, g, HP["lr"], HP["beta1"], HP["beta2"], HP["eps"], wd)
    p, m, out = _cpu(p), _cpu(m), _cpu(out)
    assert_close(p, ep, F32, "adams p")
    assert_close(m, em, F32, "adams m")
    assert_cast_equal(out, p, "adams model_out")

    p, m, v = p0.to(DEV, copy=True), m0.to(DEV, copy=True), v0.to(DEV, copy=True)
    out = nan_empty(n, out_dtype, DEV)
    kernels.adamw_dense_(p, m, v, g.to(DEV), weight_decay=wd, step=7, model_out=out, **HP)
    ep, em, ev = adamw_f64(p0, m0, v0, g, HP["lr"], HP["beta1"], HP["beta2"], HP["eps"], wd, 7)
    p, out = _cpu(p), _cpu(out)
    assert_close(p, ep, F32, "adamw p")
    assert_close(_cpu(m), em, F32, "adamw m")
    assert_close(_cpu(v), ev, F32, "adamw v")
    assert_cast_equal(out, p, "adamw model_out")


@pytest.mark.parametrize("catchup", [None, 1.0, 0.5], ids=["plain", "catchup", "catchup-sqrt"])
@pytest.mark.parametrize("block_size,n_blocks,k,g_dtype,out_dtype", [
    pytest.param(4096, 256, 41, F32, BF16, id="b4096-nb256-k41"),
    pytest.param(4096, 64, 410, BF16, F32, id="b4096-nb64-k410"),
    pytest.param(32768, 8, 328, F32, F16, id="b32768-nb8-k328"),
])
def test_sparse_update_matches_float64(block_size, n_blocks, k, g_dtype, out_dtype, catchup):
    gen = seeded("cuda-sparse", block_size, n_blocks, k, g_dtype, out_dtype)
    n = n_blocks * block_size
    idx = random_mask(n_blocks, block_size, k, gen)
    p0 = torch.randn(n, generator=gen)
    m0 = torch.randn(n, generator=gen) * 0.1
    age0 = torch.randint(0, 200, (n,), generator=gen, dtype=torch.int32)
    g = torch.randn(n_blocks * k, generator=gen).to(g_dtype)
    p, m, age = p0.to(DEV, copy=True), m0.to(DEV, copy=True), age0.to(DEV, copy=True)
    out = nan_empty(n_blocks * k, out_dtype, DEV)
    kernels.adams_sparse_(p, m, age, g.to(DEV), idx.to(DEV), block_size, weight_decay=0.1,
                          model_out=out, catchup=catchup, **HP)
    after = (_cpu(p), _cpu(m), _cpu(age), _cpu(out))
    check_adams_sparse((p0, m0, age0), after, g, idx, block_size, HP, 0.1, catchup)


@pytest.mark.parametrize("dtype", [F32, BF16, F16], ids=["f32", "bf16", "f16"])
def test_grad_stats_match_float64(dtype):
    n = (1 << 22) + 333
    gen = seeded("cuda-stats", dtype)
    x = (torch.randn(n, generator=gen) * 3).to(dtype)
    s = _cpu(kernels.grad_stats(x.to(DEV)))
    assert s.dtype == F32 and s.shape == (2,)
    # a float32 sum of 4M terms: its rounding bound is ~sqrt(n) * 2^-24 = 1.2e-4 relative
    torch.testing.assert_close(s[0].double(), (x.double() ** 2).sum(), rtol=1e-4, atol=0)
    assert s[1].item() == 0
    bad = torch.randperm(n, generator=gen)[:9]
    x[bad[:3]] = float("nan")
    x[bad[3:6]] = float("inf")
    x[bad[6:]] = -float("inf")
    s = _cpu(kernels.grad_stats(x.to(DEV)))
    assert s[1].item() == 9 and not torch.isfinite(s[0])
    limit = 1.5 * float(x[torch.isfinite(x)].float().abs().max())
    x[bad[:3]] = 2 * limit
    s = _cpu(kernels.grad_stats(x.to(DEV), limit))
    assert s[1].item() == int((~(x.float().abs() <= limit)).sum()) == 9


@pytest.mark.parametrize("error_feedback", [True, False], ids=["ef", "no_ef"])
def test_noise_ema_matches_float64(error_feedback):
    n = (1 << 22) + 99
    gen = seeded("cuda-noise", error_feedback)
    buf, prev0 = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    age = torch.randint(0, 3, (n,), generator=gen, dtype=torch.int32)
    s2_0, s2w_0 = torch.rand(n, generator=gen), torch.rand(n, generator=gen)
    mu0 = torch.randn(n, generator=gen)
    prev, s2, s2w = prev0.to(DEV, copy=True), s2_0.to(DEV, copy=True), s2w_0.to(DEV, copy=True)
    mu = mu0.to(DEV, copy=True)
    kernels.noise_ema_(buf.to(DEV), prev, age.to(DEV), s2, s2w, beta=0.95,
                       error_feedback=error_feedback, mu=mu)
    want_s2, want_s2w, want_mu = noise_ema_f64(buf, prev0, age, s2_0, s2w_0, 0.95,
                                               error_feedback, mu0)
    assert_close(_cpu(s2), want_s2, F32, "s2")
    assert_close(_cpu(s2w), want_s2w, F32, "s2w")
    assert_close(_cpu(mu), want_mu, F32, "mu")
    assert torch.equal(_cpu(prev), buf)
    # a non-finite entry is no observation: s2, s2w and mu keep their values there
    s2_1, s2w_1, mu_1 = _cpu(s2), _cpu(s2w), _cpu(mu)
    bad = torch.randperm(n, generator=gen)[:5]
    buf[bad] = float("nan")
    kernels.noise_ema_(buf.to(DEV), prev, age.to(DEV), s2, s2w, beta=0.95,
                       error_feedback=error_feedback, mu=mu)
    s2_2, s2w_2, mu_2 = _cpu(s2), _cpu(s2w), _cpu(mu)
    assert torch.equal(s2_2[bad], s2_1[bad]) and torch.equal(s2w_2[bad], s2w_1[bad])
    assert torch.equal(mu_2[bad], mu_1[bad])
    assert bool(torch.isfinite(s2_2).all()) and bool(torch.isfinite(mu_2).all())


def test_gain_score_matches_float64():
    n = (1 << 22) + 99
    mu, s2, s2w, age = gain_inputs(seeded("cuda-gain"), n)
    out = kernels.gain_score(mu.to(DEV), s2.to(DEV), s2w.to(DEV), age.to(DEV), beta=0.95,
                             beta1=0.9, world=8)
    assert_gain_close(_cpu(out), mu, s2, s2w, age, 0.95, 0.9, 8)


def test_catchup_agree_matches_cpu():
    """The default's catch-up compiled, against the CPU twin at a realistic size: the same
    formulas in fp32 (erf, exp and the block RMS's summation order differ), ages and the
    untouched coordinates exact, model_out the exact cast of the new p."""
    block_size, n_blocks, k = 4096, 256, 41
    n = block_size * n_blocks
    gen = seeded("cuda-catchup")
    p0 = torch.randn(n, generator=gen)
    m0 = torch.randn(n, generator=gen) * 1e-2
    s2w = torch.rand(n, generator=gen) * 0.5 + 0.5
    s2 = (m0 ** 2 + torch.rand(n, generator=gen) * 1e-4) * s2w
    age0 = torch.randint(0, 200, (n,), generator=gen, dtype=torch.int32)
    idx = random_mask(n_blocks, block_size, k, gen)
    g = torch.randn(n_blocks * k, generator=gen) * 0.05
    hp = dict(lr=3e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    p, m, age = p0.to(DEV, copy=True), m0.to(DEV, copy=True), age0.to(DEV, copy=True)
    out = nan_empty(n_blocks * k, BF16, DEV)
    kernels.catchup_agree_(p, m, age, s2.to(DEV), s2w.to(DEV), g.to(DEV), idx.to(DEV),
                           block_size, **hp, world=8, trust=0.5, model_out=out)
    cp, cm, cage = p0.clone(), m0.clone(), age0.clone()
    kernels.catchup_agree_(cp, cm, cage, s2, s2w, g, idx, block_size, **hp, world=8,
                           trust=0.5)
    torch.testing.assert_close(_cpu(p), cp, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(_cpu(m), cm, rtol=1e-5, atol=1e-8)
    assert torch.equal(_cpu(age), cage)
    flat = flat_positions(idx, block_size)
    assert_cast_equal(_cpu(out), _cpu(p)[flat], "model_out")


def test_gain_topk_is_the_mask_of_the_score():
    """The fused mask against the score's mask on the GPU (one shared score helper: the same
    fp32 values), and against the CPU's (its own rounding: equal in almost every block)."""
    block_size, n_blocks, k, k_explore = 4096, 512, 41, 4
    n = block_size * n_blocks
    gen = seeded("cuda-gain-topk")
    mu, s2, s2w, age = gain_inputs(gen, n)
    prev = torch.randn(n, generator=gen) * 0.05
    kw = dict(beta=0.95, beta1=0.9, world=8)
    d = [t.to(DEV) for t in (mu, s2, s2w, age, prev)]
    fused = _cpu(kernels.gain_topk(*d[:4], k, block_size, k_explore=k_explore, prev=d[4],
                                   **kw))
    score = kernels.gain_score(*d[:4], prev=d[4], **kw)
    two = _cpu(kernels.blockwise_topk(score, k, block_size, age=d[3], k_explore=k_explore))
    rows = fused.long()
    assert bool((rows[:, 1:] > rows[:, :-1]).all())
    same = (fused == two).all(dim=1).float().mean().item()
    assert same >= 0.999, f"fused mask equals the score's in {same:.4f} of the blocks"
    cpu = kernels.gain_topk(mu, s2, s2w, age, k, block_size, k_explore=k_explore, prev=prev,
                            **kw)
    same_cpu = (fused == cpu).all(dim=1).float().mean().item()
    assert same_cpu >= 0.95, f"GPU and CPU masks equal in {same_cpu:.3f} of the blocks"


@pytest.mark.parametrize("residual", [False, True])
def test_noise_gain_topk_equals_the_ops_in_turn(residual):
    """The default's fused pass before the take against noise_ema_, the ages and gain_topk
    launched one after the other on the GPU (shared arithmetic helpers: the same fp32 values,
    up to the compiler's contractions), then against the CPU; the score with the wait
    (``residual``, the default's masks up to sparsity 0.974) and without."""
    block_size, n_blocks, k, k_explore = 4096, 512, 41, 4
    n = block_size * n_blocks
    gen = seeded("cuda-noise-gain-topk")
    mu, s2, s2w, age = gain_inputs(gen, n)
    buf, prev = torch.randn(n, generator=gen) * 0.05, torch.randn(n, generator=gen) * 0.05
    cur = random_mask(n_blocks, block_size, k, gen)
    kw = dict(beta=0.95, beta1=0.9, world=8)
    host = [buf, prev, age, s2, s2w, mu, cur]
    fused_kw = dict(kw, residual=residual)
    fused_in = [t.to(DEV) for t in host]
    turn_in = [t.to(DEV) for t in host]
    idx, waited = kernels.noise_gain_topk_(*fused_in, k, block_size, k_explore=k_explore,
                                           **fused_kw)
    b, pv, ag, a2, aw, am, c = turn_in
    kernels.noise_ema_(b, pv, ag, a2, aw, beta=0.95, error_feedback=True, mu=am)
    flat = flat_positions(cur, block_size).to(DEV)
    want_waited = ag[flat].clone()
    ag.add_(1).index_fill_(0, flat, 0)  # the step's ages, as torch ops
    want = kernels.gain_topk(am, a2, aw, ag, k, block_size, k_explore=k_explore,
                             prev=pv if residual else None, **kw)
    assert torch.equal(_cpu(waited), _cpu(want_waited))
    assert torch.equal(_cpu(fused_in[2]), _cpu(ag)), "ages"
    for name, x, y in (("s2", fused_in[3], a2), ("s2w", fused_in[4], aw), ("mu", fused_in[5], am),
                       ("prev", fused_in[1], pv)):
        torch.testing.assert_close(_cpu(x), _cpu(y), rtol=2e-7, atol=0, msg=name)
    same = (_cpu(idx) == _cpu(want)).all(dim=1).float().mean().item()
    assert same >= 0.999, f"fused mask equals the ops' in {same:.4f} of the blocks"
    cpu_idx, cpu_waited = kernels.noise_gain_topk_(*host, k, block_size, k_explore=k_explore,
                                                   **fused_kw)
    assert torch.equal(_cpu(waited), cpu_waited)
    same_cpu = (_cpu(idx) == cpu_idx).all(dim=1).float().mean().item()
    assert same_cpu >= 0.95, f"GPU and CPU masks equal in {same_cpu:.3f} of the blocks"


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_pack_unpack_match_cpu_bitwise(bits):
    n, group = 64 * 1000 + 64, 64
    gen = seeded("cuda-pack", bits)
    x = torch.randn(n, generator=gen)
    x[::97] = 0.0
    s = pack_mod.absmax_scales(x, group)
    s[3] = 0.0  # a group with scale 0 codes to 0
    want = pack_mod.pack_ref(x, s, group, bits)
    out = torch.full((pack_mod.packed_nbytes(n, bits),), 0xA5, dtype=torch.uint8, device=DEV)
    got = kernels.pack_values(x.to(DEV), s.to(DEV), group, bits, out=out)
    assert torch.equal(_cpu(got), want), f"{int((_cpu(got) != want).sum())} bytes differ"
    dec = kernels.unpack_values(got, s.to(DEV), group, bits, n, out=nan_empty(n, F32, DEV))
    assert torch.equal(_cpu(dec), pack_mod.unpack_ref(want, s, group, bits, n))


@pytest.mark.parametrize("n_blocks,block,k", [(64, 4096, 41), (16, 4096, 410), (5, 1024, 1000)],
                         ids=["k41-0.99", "k410-0.9", "k1000-odd"])
def test_take_pack8_matches_cpu_bitwise(n_blocks, block, k):
    # the 8-bit gradient wire's fused take against its torch twin
    gen = seeded("cuda-take-pack8", n_blocks, block, k)
    src = torch.randn(n_blocks * block, generator=gen) * torch.logspace(
        -4, 1, n_blocks).repeat_interleave(block)
    idx = random_mask(n_blocks, block, k, gen)
    src[:block] = 0.0  # a row whose scale is 0
    want_buf, want_codes = src.clone(), torch.empty(n_blocks * k, dtype=torch.uint8)
    want_scales = torch.empty(n_blocks)
    pack_mod.take_pack8_ref(want_buf, idx, block, want_codes, want_scales)
    buf = src.to(DEV)
    codes = torch.full((n_blocks * k,), 7, dtype=torch.uint8, device=DEV)
    scales = nan_empty(n_blocks, F32, DEV)
    kernels.take_pack8_(buf, idx.to(DEV), block, codes=codes, scales=scales)
    assert torch.equal(_cpu(scales), want_scales)
    assert torch.equal(_cpu(codes), want_codes), f"{int((_cpu(codes) != want_codes).sum())} differ"
    assert torch.equal(_cpu(buf), want_buf), "the residuals differ"


@pytest.mark.parametrize("n_rows,block,k", [(4096, 4096, 41), (512, 4096, 410), (64, 4096, 2048),
                                            (8, 32768, 328)])
def test_mask_rows_round_trip_and_match_cpu(n_rows, block, k):
    # the next mask's wire: Elias-Fano rows decoded by the kernel, bit for bit the torch twin's
    gen = seeded("cuda-mask", n_rows, block, k)
    idx = torch.stack([torch.randperm(block, generator=gen)[:k].sort().values
                       for _ in range(n_rows)]).to(torch.int16)
    packed = kernels.pack_mask(idx, block)  # CPU: the torch encoder
    got = kernels.pack_mask(idx.to(DEV), block)
    assert torch.equal(_cpu(got), packed)
    out = torch.full((2 * n_rows, k), -1, dtype=torch.int16, device=DEV)
    kernels.unpack_mask(torch.cat([got, got]), n_rows, block, out=out)
    assert torch.equal(_cpu(out), torch.cat([idx, idx]))


# --------------------------------------------------------------------------- optimizer
def _mlp(device: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(),
                               torch.nn.Linear(256, 16)).to(device)


def _train(device: str, steps: int, comm=None, sparsity: float = 0.99):
    """A SCAPE run on ``device``; returns (losses, params, masks after the first sparse
    step, bytes per step)."""
    model = _mlp(device)
    opt = scape.SCAPE(model.parameters(), lr=1e-2, sparsity=sparsity, block_size=256,
                      warmup_steps=3, comm=comm)
    w_true = torch.randn(64, 16, generator=torch.Generator().manual_seed(1)).to(device)
    losses, masks, nbytes = [], None, []
    for t in range(steps):
        x = torch.randn(128, 64, generator=torch.Generator().manual_seed(t)).to(device)
        loss = torch.nn.functional.mse_loss(model(x), torch.tanh(x @ w_true))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
        nbytes.append(sum(opt.last_step.bytes.values()))
        if t == 3:
            masks = [None if s is None else s.current.cpu() for s in opt.masks]
    params = torch.cat([q.detach().cpu().reshape(-1) for q in model.parameters()])
    return losses, params, masks, nbytes


def test_scape_on_cuda_tracks_the_cpu_run():
    l_cpu, p_cpu, m_cpu, b_cpu = _train("cpu", 60)
    l_gpu, p_gpu, m_gpu, b_gpu = _train(DEV, 60)
    assert b_gpu == b_cpu, "bytes per step differ between devices"
    # the dense warm-up steps agree to float32 rounding, the first sparse mask almost exactly
    torch.testing.assert_close(torch.tensor(l_gpu[:4]), torch.tensor(l_cpu[:4]), rtol=1e-4,
                               atol=0)
    for a, b in zip(m_cpu, m_gpu):
        if a is not None:
            same = (a == b).all(1).float().mean()
            assert same >= 0.95, f"only {same:.3f} of the first sparse masks' blocks agree"
    assert not torch.isnan(p_gpu).any()
    first, last = sum(l_gpu[:5]) / 5, sum(l_gpu[-5:]) / 5
    assert last < 0.75 * first, f"loss did not fall on CUDA: {first:.4f} -> {last:.4f}"
    assert abs(sum(l_gpu[-10:]) / sum(l_cpu[-10:]) - 1) < 0.05, (l_gpu[-10:], l_cpu[-10:])


def test_nccl_single_rank_equals_torch_communicator():
    pytest.importorskip("cupy", reason="NcclCommunicator needs cupy (the gpu extra)")
    from scape.comm import NcclCommunicator

    comm = NcclCommunicator(timeout=60.0)
    try:
        l_nccl, p_nccl, _, b_nccl = _train(DEV, 25, comm=comm)
    finally:
        comm.destroy()
    l_torch, p_torch, _, b_torch = _train(DEV, 25)
    assert b_nccl == b_torch
    assert torch.equal(p_nccl, p_torch), "a single-rank NCCL run must equal the torch one"
    assert l_nccl == l_torch


@pytest.mark.parametrize("update,launched", [
    (None, ("_noise_gain_topk_kernel", "_catchup_agree_kernel")),
    ("sqrt", ("_adams_sparse_kernel", "_blockwise_topk_kernel"))],
    ids=["default", "sqrt"])
def test_step_launches_triton_kernels_and_balances_nvtx(monkeypatch, update, launched):
    model = _mlp(DEV)
    opt = scape.SCAPE(model.parameters(), lr=1e-2, sparsity=0.99, block_size=256,
                      warmup_steps=1, **({"update": update} if update else {}))
    x = torch.randn(32, 64, device=DEV)

    def step():
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()

    step()  # the dense warm-up step
    step()
    torch.cuda.synchronize()
    # NVTX calls return nothing useful without a tool attached: count them instead
    ranges: list[str] = []
    pops = []
    push, pop = torch.cuda.nvtx.range_push, torch.cuda.nvtx.range_pop
    monkeypatch.setattr(torch.cuda.nvtx, "range_push", lambda nm: (ranges.append(nm), push(nm))[1])
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", lambda: (pops.append(1), pop())[1])
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        step()
        torch.cuda.synchronize()
    names = {e.name for e in prof.events()}
    for k in ("_take_kernel", *launched):
        assert any(k in nm for nm in names), f"{k} not launched; saw {sorted(names)}"
    assert len(ranges) == len(pops) > 0, (ranges, len(pops))
    assert set(ranges) <= set(PHASES), set(ranges) - set(PHASES)
    assert {"scape/take", "scape/reduce_scatter", "scape/update", "scape/all_gather"} <= set(ranges)
