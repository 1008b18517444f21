"""take_, gather, scatter_, adams_dense_, adams_sparse_, adamw_dense_, grad_stats: the Triton
kernels (through the interpreter on CPU) against the torch implementation and float64
references. Copies are bitwise; arithmetic is within the per-dtype tolerance table; every
output is pre-filled with NaN so an element the kernel forgot fails."""

from __future__ import annotations

import pytest
import torch
from conftest import nan_empty
from kernel_cases import (
    TOL,
    adams_f64,
    adamw_f64,
    assert_cast_equal,
    assert_close,
    assert_gain_close,
    check_adams_sparse,
    flat_positions,
    gain_inputs,
    gain_score_f64,
    noise_ema_f64,
    random_mask,
    seeded,
)

from scape import kernels
from scape.kernels import reference as ref

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
HP = dict(lr=3e-2, beta1=0.9, beta2=0.95, eps=1e-8)


@pytest.fixture(params=["triton", "torch"])
def backend(request, kernel_backend):
    """Every test runs on both paths of the public API."""
    kernel_backend(request.param)
    return request.param


def _outside(n: int, flat: torch.Tensor) -> torch.Tensor:
    keep = torch.ones(n, dtype=torch.bool)
    keep[flat] = False
    return keep


SPARSE_CASES = [
    pytest.param(256, 1, 1, F32, F32, id="b256-nb1-k1-f32"),
    pytest.param(256, 6, 26, F32, BF16, id="b256-nb6-k26-f32-to-bf16"),
    pytest.param(256, 3, 256, BF16, F32, id="b256-nb3-kB-bf16-to-f32"),
    pytest.param(256, 3, 26, F16, F16, id="b256-nb3-k26-f16"),
    pytest.param(256, 2, 26, BF16, F16, id="b256-nb2-k26-bf16-to-f16"),
    pytest.param(4096, 3, 410, F32, F32, id="b4096-nb3-k410-f32"),
    pytest.param(4096, 2, 41, BF16, BF16, id="b4096-nb2-k41-bf16"),
    pytest.param(4096, 1, 4096, F16, F32, id="b4096-nb1-kB-f16-to-f32"),
    pytest.param(32768, 2, 3, F32, F32, id="b32768-nb2-offset-32767"),
]


@pytest.mark.parametrize("block_size,n_blocks,k,src_dtype,out_dtype", SPARSE_CASES)
def test_take_gather_scatter(backend, block_size, n_blocks, k, src_dtype, out_dtype):
    gen = seeded("sparse", block_size, n_blocks, k, src_dtype, out_dtype)
    n = n_blocks * block_size
    idx = random_mask(n_blocks, block_size, k, gen)
    flat = flat_positions(idx, block_size)
    outside = _outside(n, flat)
    src = torch.randn(n, generator=gen).to(src_dtype)
    residual = torch.randn(n, generator=gen)
    before = src.clone()

    # gather: src (+ residual) in fp32, cast; inputs untouched
    out = nan_empty(n_blocks * k, out_dtype)
    got = kernels.gather(src, idx, block_size, out=out)
    assert got is out
    assert_cast_equal(out, before[flat], "gather")
    out = nan_empty(n_blocks * k, out_dtype)
    kernels.gather(src, idx, block_size, residual=residual, out=out)
    assert_cast_equal(out, before[flat].float() + residual[flat], "gather + residual")
    assert torch.equal(src, before)

    # take_: values out, zeros left behind, nothing else touched
    out = nan_empty(n_blocks * k, out_dtype)
    kernels.take_(src, idx, block_size, out=out)
    assert_cast_equal(out, before[flat], "take_ values")
    assert (src[flat] == 0).all()
    assert torch.equal(src[outside], before[outside])
    auto = kernels.take_(before.clone(), idx, block_size, out_dtype=out_dtype)
    assert auto.dtype == out_dtype and auto.shape == (n_blocks * k,)
    assert_cast_equal(auto, before[flat], "take_ allocated output")

    # take_(keep_error=True): the same values out, what the cast lost left behind
    kept = before.clone()
    out = nan_empty(n_blocks * k, out_dtype)
    kernels.take_(kept, idx, block_size, out=out, keep_error=True)
    assert_cast_equal(out, before[flat], "take_ keep_error values")
    lost = (before[flat].float() - out.float()).to(src_dtype)
    assert torch.equal(kept[flat], lost), "take_ keep_error: not the cast's error"
    assert torch.equal(kept[outside], before[outside])
    if src_dtype == F32:  # the error is exact: residual + value is the entry, bitwise
        assert torch.equal(kept[flat] + out.float(), before[flat])
        if out_dtype != F32:
            assert bool((kept[flat] != 0).any()), "a narrower cast lost nothing"
    if out_dtype == src_dtype:
        assert (kept[flat] == 0).all()

    # scatter_: exactly the mask's positions, cast on write
    values = torch.randn(n_blocks * k, generator=gen).to(out_dtype)
    dst = nan_empty(n, src_dtype)
    kernels.scatter_(dst, idx, block_size, values)
    assert_cast_equal(dst[flat], values, "scatter_")
    assert torch.isnan(dst[outside]).all(), "scatter_ wrote outside the mask"


def test_take_keep_error_nonfinite(backend):
    """An inf or NaN entry, and one the cast overflows, leave 0 behind (not inf or NaN)."""
    block_size, k = 256, 8
    idx = torch.arange(0, 2 * k, 2, dtype=torch.int16).view(1, k)
    src = torch.zeros(block_size)
    vals = [float("inf"), float("nan"), 1e6, -1e6, 1.0 + 2.0 ** -20, 3e-8, -float("inf"), 0.5]
    src[idx.long().view(-1)] = torch.tensor(vals)
    src[1] = 7.0  # outside the mask
    out = nan_empty(k, F16)
    kernels.take_(src, idx, block_size, out=out, keep_error=True)
    left = src[idx.long().view(-1)]
    assert torch.isfinite(left).all(), left
    assert left[:4].eq(0).all() and left[6:].eq(0).all()
    tiny = torch.tensor(3e-8)  # a subnormal in fp16
    assert left[4] == 2.0 ** -20 and left[5] == tiny - tiny.half().float() != 0
    assert out[2] == float("inf") and out[3] == -float("inf") and torch.isnan(out[1])
    assert src[1] == 7.0


DENSE_CASES = [
    pytest.param(F32, None, 0.0, id="g-f32-no-out-wd0"),
    pytest.param(F32, F32, 0.1, id="g-f32-out-f32"),
    pytest.param(BF16, BF16, 0.1, id="g-bf16-out-bf16"),
    pytest.param(F16, F16, 0.01, id="g-f16-out-f16"),
    pytest.param(BF16, F16, 0.0, id="g-bf16-out-f16-wd0"),
]


@pytest.mark.parametrize("g_dtype,out_dtype,wd", DENSE_CASES)
@pytest.mark.parametrize("n", [pytest.param(256, id="n256"), pytest.param(3 * 4096 + 768,
                                                                         id="n13056-tail")])
def test_adams_dense(backend, g_dtype, out_dtype, wd, n):
    gen = seeded("adams", g_dtype, out_dtype, wd, n)
    p0 = torch.randn(n, generator=gen)
    m0 = torch.randn(n, generator=gen) * 0.1
    g = torch.randn(n, generator=gen).to(g_dtype)
    p, m = p0.clone(), m0.clone()
    out = nan_empty(n, out_dtype) if out_dtype is not None else None
    kernels.adams_dense_(p, m, g, weight_decay=wd, model_out=out, **HP)
    ep, em = adams_f64(p0, m0, g, HP["lr"], HP["beta1"], HP["beta2"], HP["eps"], wd)
    assert_close(p, ep, F32, "p")
    assert_close(m, em, F32, "m")
    if out is not None:
        assert_cast_equal(out, p, "model_out")
    # the other path agrees with this one within the same tolerance
    p2, m2 = p0.clone(), m0.clone()
    ref.adams_dense_(p2, m2, g, weight_decay=wd, **HP)
    rtol, atol = TOL[F32]
    torch.testing.assert_close(p, p2, rtol=rtol, atol=atol)


@pytest.mark.parametrize("g_dtype,out_dtype,wd", DENSE_CASES)
@pytest.mark.parametrize("step", [1, 10])
def test_adamw_dense(backend, g_dtype, out_dtype, wd, step):
    n = 3 * 4096 + 768
    gen = seeded("adamw", g_dtype, out_dtype, wd, step)
    p0 = torch.randn(n, generator=gen)
    m0 = torch.randn(n, generator=gen) * 0.1
    v0 = torch.rand(n, generator=gen) * 0.01
    g = torch.randn(n, generator=gen).to(g_dtype)
    p, m, v = p0.clone(), m0.clone(), v0.clone()
    out = nan_empty(n, out_dtype) if out_dtype is not None else None
    kernels.adamw_dense_(p, m, v, g, weight_decay=wd, step=step, model_out=out, **HP)
    ep, em, ev = adamw_f64(p0, m0, v0, g, HP["lr"], HP["beta1"], HP["beta2"], HP["eps"], wd,
                           step)
    assert_close(p, ep, F32, "p")
    assert_close(m, em, F32, "m")
    assert_close(v, ev, F32, "v")
    if out is not None:
        assert_cast_equal(out, p, "model_out")


def test_adamw_dense_torch_path_is_bitwise_torch_adamw(kernel_backend):
    kernel_backend("torch")
    gen = seeded("adamw-bitwise")
    n = 4096 + 256
    param = torch.nn.Parameter(torch.randn(n, generator=gen))
    opt = torch.optim.AdamW([param], lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05,
                            foreach=False)
    p, m, v = param.detach().clone(), torch.zeros(n), torch.zeros(n)
    for step in range(1, 4):
        g = torch.randn(n, generator=gen)
        param.grad = g.clone()
        opt.step()
        kernels.adamw_dense_(p, m, v, g, lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8,
                             weight_decay=0.05, step=step)
        assert torch.equal(p, param.detach()), f"step {step}"


SPARSE_UPDATE_CASES = [
    pytest.param(256, 1, 1, F32, F32, 0.1, id="b256-nb1-k1"),
    pytest.param(256, 5, 26, BF16, BF16, 0.1, id="b256-nb5-k26-bf16"),
    pytest.param(256, 2, 256, F16, F16, 0.0, id="b256-nb2-kB-f16-wd0"),
    pytest.param(4096, 3, 410, F32, BF16, 0.1, id="b4096-nb3-k410"),
    pytest.param(4096, 2, 41, BF16, F32, 0.05, id="b4096-nb2-k41"),
    pytest.param(32768, 1, 2, F32, F32, 0.1, id="b32768-offset-32767"),
]


@pytest.mark.parametrize("catchup", [None, 1.0, 0.5], ids=["plain", "catchup", "catchup-sqrt"])
@pytest.mark.parametrize("block_size,n_blocks,k,g_dtype,out_dtype,wd", SPARSE_UPDATE_CASES)
def test_adams_sparse(backend, block_size, n_blocks, k, g_dtype, out_dtype, wd, catchup):
    gen = seeded("adams_sparse", block_size, n_blocks, k, g_dtype, out_dtype, wd)
    n = n_blocks * block_size
    idx = random_mask(n_blocks, block_size, k, gen)
    p0 = torch.randn(n, generator=gen)
    m0 = torch.randn(n, generator=gen) * 0.1
    age0 = torch.randint(0, 200, (n,), generator=gen, dtype=torch.int32)
    g = torch.randn(n_blocks * k, generator=gen).to(g_dtype)
    p, m, age = p0.clone(), m0.clone(), age0.clone()
    out = nan_empty(n_blocks * k, out_dtype)
    kernels.adams_sparse_(p, m, age, g, idx, block_size, weight_decay=wd, model_out=out,
                          catchup=catchup, **HP)
    check_adams_sparse((p0, m0, age0), (p, m, age, out), g, idx, block_size, HP, wd, catchup)


@pytest.mark.parametrize("dtype", [F32, BF16, F16], ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("n", [pytest.param(256, id="n256"),
                               pytest.param(5 * 4096 + 256, id="n20736-multi-tile")])
def test_grad_stats(backend, dtype, n):
    gen = seeded("stats", dtype, n)
    x = (torch.randn(n, generator=gen) * 3).to(dtype)
    s = kernels.grad_stats(x)
    assert s.dtype == F32 and s.shape == (2,)
    torch.testing.assert_close(s[0].double(), (x.double() ** 2).sum(), rtol=1e-5, atol=0)
    assert s[1].item() == 0
    bad = torch.randperm(n, generator=gen)[:7]
    x[bad[:3]] = float("nan")
    x[bad[3:5]] = float("inf")
    x[bad[5:]] = -float("inf")
    s = kernels.grad_stats(x)
    assert s[1].item() == 7
    assert not torch.isfinite(s[0])


@pytest.mark.parametrize("dtype", [F32, BF16, F16], ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("n", [pytest.param(256, id="n256"),
                               pytest.param(5 * 4096 + 256, id="n20736-multi-tile")])
def test_grad_stats_limit(backend, dtype, n):
    """``limit`` also counts the finite entries past it, at either sign, and no entry within
    it; the sum of squares is the same as without it."""
    gen = seeded("stats-limit", dtype, n)
    x = (torch.randn(n, generator=gen) * 3).to(dtype)
    limit = 4.0 * float(x.float().abs().max())
    plain = kernels.grad_stats(x)
    s = kernels.grad_stats(x, limit)
    assert s[1].item() == 0 and torch.equal(s[0], plain[0])
    at = torch.randperm(n, generator=gen)[:9]
    x[at[:3]] = 2 * limit
    x[at[3:5]] = -3 * limit
    x[at[5]] = limit  # at the limit: within it
    x[at[6]] = float("nan")
    x[at[7]] = float("inf")
    x[at[8]] = -limit
    assert float(x[at[:5]].float().abs().min()) > limit  # in the dtype, still past it
    s = kernels.grad_stats(x, limit)
    want = int((~(x.float().abs() <= limit)).sum())
    assert want == 7 and s[1].item() == want
    assert kernels.grad_stats(x)[1].item() == 2  # without it, the non-finite ones alone


def test_grad_stats_is_deterministic(backend):
    x = torch.randn(9 * 4096, generator=seeded("stats-det"))
    a, b = kernels.grad_stats(x), kernels.grad_stats(x)
    assert torch.equal(a, b)


@pytest.mark.parametrize("with_mu", [False, True], ids=["s2", "s2+mu"])
@pytest.mark.parametrize("error_feedback", [True, False], ids=["ef", "no_ef"])
@pytest.mark.parametrize("n", [pytest.param(256, id="n256"),
                               pytest.param(3 * 2048 + 77, id="n6221-tail")])
def test_noise_ema(backend, n, error_feedback, with_mu):
    gen = seeded("noise", n, error_feedback, with_mu)
    buf = torch.randn(n, generator=gen)
    prev0 = torch.randn(n, generator=gen)
    age = torch.randint(0, 3, (n,), generator=gen, dtype=torch.int32)  # a third synced
    s2_0 = torch.rand(n, generator=gen)
    s2w_0 = torch.rand(n, generator=gen)
    mu0 = torch.randn(n, generator=gen) if with_mu else None
    prev, s2, s2w = prev0.clone(), s2_0.clone(), s2w_0.clone()
    mu = None if mu0 is None else mu0.clone()
    buf_before, age_before = buf.clone(), age.clone()
    kernels.noise_ema_(buf, prev, age, s2, s2w, beta=0.95, error_feedback=error_feedback,
                       mu=mu)
    want = noise_ema_f64(buf, prev0, age, s2_0, s2w_0, 0.95, error_feedback, mu0)
    assert_close(s2, want[0], F32, "s2")
    assert_close(s2w, want[1], F32, "s2w")
    if mu is not None:
        assert_close(mu, want[2], F32, "mu")
        # the EMA of the local gradient: mu moved toward it wherever the two differed
        local = buf - torch.where(age == 0, 0.0, prev0) if error_feedback else buf
        moved = (mu - mu0).sign() == (local - mu0).sign()
        assert bool(moved[(local - mu0).abs() > 1e-3].all())
    assert torch.equal(prev, buf), "prev must become buf"
    assert torch.equal(buf, buf_before) and torch.equal(age, age_before), "inputs written"


@pytest.mark.parametrize("with_prev", [False, True], ids=["ema", "ema+wait"])
@pytest.mark.parametrize("world", [1, 8])
@pytest.mark.parametrize("n", [pytest.param(256, id="n256"),
                               pytest.param(3 * 2048 + 77, id="n6221-tail")])
def test_gain_score(backend, n, world, with_prev):
    gen = seeded("gain", n, world, with_prev)
    mu, s2, s2w, age = gain_inputs(gen, n)
    prev = torch.randn(n, generator=gen) * 2 if with_prev else None
    if prev is not None:
        prev[::7] = 0.0  # with the EMA's mean 0 there: no signal at all
    before = [t.clone() for t in (mu, s2, s2w, age)]
    out = nan_empty(n)
    out.copy_(kernels.gain_score(mu, s2, s2w, age, beta=0.95, beta1=0.9, world=world,
                                 prev=prev))
    assert not bool(out.isnan().any()), "score not written"
    assert_gain_close(out, mu, s2, s2w, age, 0.95, 0.9, world, prev)
    assert all(torch.equal(a, b) for a, b in zip((mu, s2, s2w, age), before)), "inputs written"
    # invariants: at least the signal (age 0 below; the wait's mean needs age > 0, so
    # there the comparison is at the same cover: age from the same inputs), at most
    # (age + 1) times it; 0 where the mean is 0
    assert bool((out >= 0).all())
    if prev is None:
        sig = gain_score_f64(mu, s2, s2w, torch.zeros_like(age), 0.95, 0.9, world)
        assert bool((out.double() >= sig * (1 - 1e-5)).all())
        assert bool((out.double() <= sig * (age.double() + 1) * (1 + 1e-5)).all())
    assert bool((out[::7] == 0).all())


def test_gain_score_empty(backend):
    e = torch.empty(0)
    out = kernels.gain_score(e, e, e, torch.empty(0, dtype=torch.int32), beta=0.95, beta1=0.9,
                             world=2)
    assert out.shape == (0,) and out.dtype == torch.float32


def test_noise_ema_ignores_non_finite_entries(backend):
    """A NaN or inf in the buffer (a step about to be skipped) is no observation: ``s2``,
    ``s2w`` and ``mu`` keep their values there, the rest update, ``prev`` still becomes ``buf``."""
    n = 2 * 2048 + 5
    gen = seeded("noise-nonfinite")
    buf, prev = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    age = torch.ones(n, dtype=torch.int32)
    s2, s2w = torch.rand(n, generator=gen), torch.rand(n, generator=gen)
    mu = torch.randn(n, generator=gen)
    bad = torch.randperm(n, generator=gen)[:9]
    buf[bad[:3]], buf[bad[3:6]], prev[bad[6:]] = float("nan"), float("inf"), -float("inf")
    s2_0, s2w_0, mu_0 = s2.clone(), s2w.clone(), mu.clone()
    kernels.noise_ema_(buf, prev, age, s2, s2w, beta=0.95, error_feedback=True, mu=mu)
    good = torch.ones(n, dtype=torch.bool)
    good[bad] = False
    assert torch.equal(s2[bad], s2_0[bad]) and torch.equal(s2w[bad], s2w_0[bad])
    assert torch.equal(mu[bad], mu_0[bad])
    assert bool(torch.isfinite(s2).all()) and bool(torch.isfinite(s2w).all())
    assert bool(torch.isfinite(mu).all())
    assert bool((s2w[good] != s2w_0[good]).all())
    assert torch.equal(prev.view(torch.int32), buf.view(torch.int32))
