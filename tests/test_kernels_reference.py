"""The torch implementations (the CPU path and the ground truth) against independent
references: brute-force selection and float64 formulas."""

from __future__ import annotations

import zlib

import pytest
import torch
from kernel_cases import adams_f64, adamw_f64, assert_close, brute_topk, flat_positions

from scape.kernels import reference as ref

B = 256


def _scores(kind: str, n: int, gen: torch.Generator) -> torch.Tensor:
    if kind == "randn":
        return torch.randn(n, generator=gen)
    if kind == "small_ints":
        return torch.randint(-3, 4, (n,), generator=gen).float()
    if kind == "zeros":
        x = torch.zeros(n)
        x[torch.rand(n, generator=gen) < 0.5] = -0.0
        return x
    x = torch.randn(n, generator=gen)
    pick = torch.rand(n, generator=gen)
    x[pick < 0.1] = float("nan")
    x[(pick >= 0.1) & (pick < 0.15)] = float("inf")
    x[(pick >= 0.15) & (pick < 0.2)] = -float("inf")
    return x


@pytest.mark.parametrize("kind", ["randn", "small_ints", "zeros", "nan_inf"])
@pytest.mark.parametrize("k,k_explore", [(1, 0), (26, 0), (26, 3), (26, 26), (B, 0), (B, 7)])
def test_blockwise_topk_matches_brute_force(kind, k, k_explore):
    gen = torch.Generator().manual_seed(zlib.crc32(f"{kind}-{k}-{k_explore}".encode()))
    n = 3 * B
    score = _scores(kind, n, gen)
    age = torch.randint(0, 5, (n,), generator=gen, dtype=torch.int32)
    idx = ref.blockwise_topk(score, k, B, age=age, k_explore=k_explore)
    assert idx.dtype == torch.int16 and idx.shape == (3, k)
    assert torch.equal(idx, brute_topk(score, k, B, age, k_explore))
    assert (idx[:, 1:] > idx[:, :-1]).all(), "offsets must be strictly ascending per row"


def test_take_gather_scatter_roundtrip():
    gen = torch.Generator().manual_seed(1)
    n, k = 4 * B, 20
    src = torch.randn(n, generator=gen)
    idx = ref.blockwise_topk(torch.randn(n, generator=gen), k, B)
    flat = flat_positions(idx, B)
    before = src.clone()
    res = torch.randn(n, generator=gen)
    g = ref.gather(src, idx, B, residual=res, out_dtype=torch.float64)
    assert torch.equal(g, (before[flat] + res[flat]).double()), "sum in fp32, then cast"
    assert torch.equal(src, before), "gather must not modify src"
    vals = ref.take_(src, idx, B, out_dtype=torch.bfloat16)
    assert torch.equal(vals, before[flat].bfloat16())
    assert (src[flat] == 0).all()
    untouched = torch.ones(n, dtype=torch.bool)
    untouched[flat] = False
    assert torch.equal(src[untouched], before[untouched])
    dst = torch.full((n,), float("nan"), dtype=torch.float16)
    ref.scatter_(dst, idx, B, vals)
    assert torch.equal(dst[flat], vals.half())
    assert torch.isnan(dst[untouched]).all(), "scatter_ wrote outside the mask"


@pytest.mark.parametrize("gdtype", [torch.float32, torch.bfloat16])
def test_adams_dense_and_sparse_match_float64(gdtype):
    gen = torch.Generator().manual_seed(2)
    n, k = 2 * B, 30
    hp = dict(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    p, m = torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 0.1
    g = torch.randn(n, generator=gen).to(gdtype)
    p1, m1 = p.clone(), m.clone()
    out = torch.full((n,), float("nan"), dtype=torch.bfloat16)
    ref.adams_dense_(p1, m1, g, model_out=out, **hp)
    ep, em = adams_f64(p, m, g, hp["lr"], 0.9, 0.95, 1e-8, 0.1)
    assert_close(p1, ep, torch.float32, "p")
    assert_close(m1, em, torch.float32, "m")
    assert torch.equal(out, p1.bfloat16())

    age = torch.randint(0, 50, (n,), generator=gen, dtype=torch.int32)
    idx = ref.blockwise_topk(torch.randn(n, generator=gen), k, B)
    flat = flat_positions(idx, B)
    gc = torch.randn(2 * k, generator=gen).to(gdtype)
    p2, m2, a2 = p.clone(), m.clone(), age.clone()
    outc = torch.full((2 * k,), float("nan"))
    ref.adams_sparse_(p2, m2, a2, gc, idx, B, model_out=outc, **hp)
    ep, em = adams_f64(p[flat], m[flat], gc, hp["lr"], 0.9, 0.95, 1e-8, 0.1, age=age[flat])
    assert_close(p2[flat], ep, torch.float32, "p masked")
    assert_close(m2[flat], em, torch.float32, "m masked")
    assert torch.equal(outc, p2[flat])
    rest = torch.ones(n, dtype=torch.bool)
    rest[flat] = False
    assert torch.equal(p2[rest], p[rest]) and torch.equal(m2[rest], m[rest])
    assert (a2[flat] == 0).all() and torch.equal(a2[rest], age[rest] + 1)


@pytest.mark.parametrize("step", [1, 7])
def test_adamw_dense_is_torch_adamw(step):
    gen = torch.Generator().manual_seed(3)
    n = B
    hp = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)
    p = torch.randn(n, generator=gen)
    ours = (p.clone(), torch.zeros(n), torch.zeros(n))
    param = torch.nn.Parameter(p.clone())
    opt = torch.optim.AdamW([param], foreach=False, **hp)
    for t in range(1, step + 1):
        g = torch.randn(n, generator=gen)
        m_old, v_old, p_old = ours[1].clone(), ours[2].clone(), ours[0].clone()
        param.grad = g.clone()
        opt.step()
        ref.adamw_dense_(*ours, g, lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8,
                         weight_decay=0.05, step=t)
        assert torch.equal(ours[0], param.detach()), f"step {t}: not bitwise torch AdamW"
        ep, _, _ = adamw_f64(p_old, m_old, v_old, g, 1e-2, 0.9, 0.99, 1e-8, 0.05, t)
        assert_close(ours[0], ep, torch.float32, "p vs float64")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_grad_stats(dtype):
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(4 * B, generator=gen).to(dtype)
    s = ref.grad_stats(x)
    assert s.dtype == torch.float32 and s.shape == (2,)
    assert_close(s[0], (x.double() ** 2).sum(), torch.float32, "sum of squares")
    assert s[1] == 0
    x[[3, 100, 900]] = torch.tensor([float("nan"), float("inf"), -float("inf")]).to(dtype)
    s = ref.grad_stats(x)
    assert s[1] == 3 and not torch.isfinite(s[0])
