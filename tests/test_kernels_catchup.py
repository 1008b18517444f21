"""catchup_agree_ (the default rule's catch-up at the mask): the Triton kernel (through the
interpreter on CPU) and the torch twin against a float64 formula written from the docstring,
against each other, and the twin bit for bit against the rule's generic torch form
(``scape.rules.catchup_snr(..., agree=True)``). Invariants: nothing outside the mask moves,
ages reset at the mask and advance elsewhere, ``model_out`` is the cast of the new ``p``."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import nan_empty
from kernel_cases import assert_cast_equal, flat_positions, random_mask, seeded

from scape import kernels, rules
from scape.rules import ShardState

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16


@pytest.fixture(params=["triton", "torch"])
def backend(request, kernel_backend):
    kernel_backend(request.param)
    return request.param


def catchup_f64(p0, m0, age0, s2, s2w, g, flat, block_size, k, hp, world, trust):
    """The docstring's formulas in float64 at the mask: (p, m)."""
    lr, b1, b2, eps, wd = (hp[x] for x in ("lr", "beta1", "beta2", "eps", "weight_decay"))
    p, m = p0.double()[flat], m0.double()[flat]
    a1 = age0.double()[flat] + 1
    gbar = g.double() / a1
    v = b2 * m ** 2 + (1 - b2) * gbar ** 2
    sigma2 = (s2.double()[flat] / s2w.double()[flat].clamp(min=1e-12) - m ** 2).clamp(min=0)
    sigma2 = sigma2 / world + 1e-30
    mu2 = (gbar ** 2 - sigma2 / a1).clamp(min=0)
    n = (a1 * torch.special.erf((mu2 / (2 * sigma2 * (1 - b1) / (1 + b1))).sqrt())).clamp(min=1)
    if trust is not None and lr > 0:
        rms = p0.double().view(-1, block_size).pow(2).mean(dim=1).sqrt()
        reach = (trust * rms / lr).repeat_interleave(k)
        n = torch.minimum(n, torch.maximum(a1.sqrt(), reach))
    keep = b1 ** a1
    m_new = keep * m + (1 - keep) * gbar
    p_new = p * (1 - lr * wd) ** a1 - lr * n * m_new / (v.sqrt() + eps)
    return p_new, m_new


def shard_inputs(gen, n):
    """A shard as the default rule leaves it: weights O(1), a first moment, the owner's
    second moment at or above m^2 (some pure signal, some noise), ages 0-199."""
    p = torch.randn(n, generator=gen)
    m = torch.randn(n, generator=gen) * 1e-2
    s2w = torch.rand(n, generator=gen) * 0.5 + 0.5
    s2 = (m ** 2 + torch.rand(n, generator=gen) * 1e-4) * s2w
    s2[::9] = (m[::9] ** 2) * s2w[::9]  # no noise: the full catch-up
    age = torch.randint(0, 200, (n,), generator=gen, dtype=torch.int32)
    return p, m, age, s2, s2w


CASES = [
    pytest.param(256, 3, 1, F32, F32, 0.5, 0.0, id="b256-nb3-k1"),
    pytest.param(256, 5, 26, BF16, BF16, 0.5, 0.1, id="b256-nb5-k26-bf16-wd"),
    pytest.param(256, 2, 256, F32, F16, None, 0.0, id="b256-nb2-kB-notrust-f16"),
    pytest.param(4096, 3, 41, F32, BF16, 0.25, 0.1, id="b4096-nb3-k41-bf16"),
    pytest.param(4096, 1, 410, BF16, F32, 0.5, 0.0, id="b4096-nb1-k410-bf16g"),
    pytest.param(32768, 1, 3, F32, F32, 0.5, 0.0, id="b32768-nb1-offset-32767"),
]


@pytest.mark.parametrize("block_size,n_blocks,k,g_dtype,out_dtype,trust,wd", CASES)
def test_catchup_agree_matches_float64(backend, block_size, n_blocks, k, g_dtype, out_dtype,
                                       trust, wd):
    gen = seeded("catchup", block_size, n_blocks, k, g_dtype, out_dtype, trust, wd)
    n = n_blocks * block_size
    p0, m0, age0, s2, s2w = shard_inputs(gen, n)
    idx = random_mask(n_blocks, block_size, k, gen)
    # the sum of a+1 steps of a gradient: a steady part (1e-2) and noise
    flat = flat_positions(idx, block_size)
    a1 = age0[flat].float() + 1
    g = (a1 * 1e-2 * torch.randn(flat.numel(), generator=gen).sign()
         + a1.sqrt() * 1e-2 * torch.randn(flat.numel(), generator=gen)).to(g_dtype)
    hp = dict(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=wd)
    p, m, age = p0.clone(), m0.clone(), age0.clone()
    s2_in, s2w_in, g_in = s2.clone(), s2w.clone(), g.clone()
    out = nan_empty(flat.numel(), out_dtype)
    kernels.catchup_agree_(p, m, age, s2, s2w, g, idx, block_size, **hp, world=4, trust=trust,
                           model_out=out)
    ep, em = catchup_f64(p0, m0, age0, s2, s2w, g, flat, block_size, k, hp, 4, trust)
    # erf of a ratio of differences: a few more fp32 ulps than a plain AdamS step
    torch.testing.assert_close(p[flat].double(), ep, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(m[flat].double(), em, rtol=1e-5, atol=1e-8)
    assert_cast_equal(out, p[flat], "model_out")
    outside = torch.ones(n, dtype=torch.bool)
    outside[flat] = False
    assert torch.equal(p[outside], p0[outside]) and torch.equal(m[outside], m0[outside])
    assert bool((age[flat] == 0).all()) and torch.equal(age[outside], age0[outside] + 1)
    assert torch.equal(s2, s2_in) and torch.equal(s2w, s2w_in) and torch.equal(g, g_in)
    # the step moved each coordinate against its new moment (decay aside), and by at most
    # a+1 normalized steps (|m_new| / (sqrt(v) + eps) <= 1 / sqrt(1 - b2))
    moved = p[flat].double() - p0[flat].double() * (1 - hp["lr"] * wd) ** a1.double()
    assert bool((moved * em.sign() <= 1e-7).all())
    bound = hp["lr"] * a1.double() / math.sqrt(1 - hp["beta2"])
    assert bool((moved.abs() <= bound * (1 + 1e-4) + 1e-7).all())
    if trust is not None:  # and by at most max(sqrt(a+1), trust * rms / lr) steps
        rms = p0.double().view(-1, block_size).pow(2).mean(dim=1).sqrt().repeat_interleave(k)
        steps = torch.maximum(a1.double().sqrt(), trust * rms / hp["lr"])
        assert bool((moved.abs() <= bound / a1.double() * steps * (1 + 1e-4) + 1e-7).all())


def test_catchup_agree_triton_matches_torch_twin(kernel_backend):
    """The kernel against the CPU path on one input: the same formulas in fp32, differing only
    in rounding order (erf, exp and the RMS's summation)."""
    gen = seeded("catchup-twin")
    block_size, n_blocks, k = 512, 7, 37
    n = n_blocks * block_size
    state = shard_inputs(gen, n)
    idx = random_mask(n_blocks, block_size, k, gen)
    g = torch.randn(n_blocks * k, generator=gen) * 0.05
    hp = dict(lr=3e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.05)
    got = {}
    for mode in ("triton", "torch"):
        kernel_backend(mode)
        p, m, age, s2, s2w = (t.clone() for t in state)
        out = nan_empty(n_blocks * k)
        kernels.catchup_agree_(p, m, age, s2, s2w, g, idx, block_size, **hp, world=8,
                               trust=0.5, model_out=out)
        got[mode] = (p, m, age, out)
    for a, b in zip(got["triton"], got["torch"]):
        if a.dtype == torch.int32:
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("trust", [None, 0.5, 0.0])
def test_twin_is_the_generic_rule_bit_for_bit(kernel_backend, trust):
    """``rules.catchup_agree`` (the fused op) and ``rules.catchup_snr(agree=True)`` (the torch
    ops the rule was written in) agree bitwise on the CPU."""
    kernel_backend("torch")
    gen = seeded("catchup-generic", trust)
    block_size, n_blocks, k = 1024, 5, 11
    n = n_blocks * block_size
    state = shard_inputs(gen, n)
    idx = random_mask(n_blocks, block_size, k, gen)
    g = torch.randn(n_blocks * k, generator=gen) * 0.05
    hp = dict(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, world=4)
    res = []
    for fn in (lambda s, o: rules.catchup_snr(s, g, idx, block_size, hp, o, agree=True,
                                              trust=trust),
               lambda s, o: rules.catchup_agree(s, g, idx, block_size, hp, o, trust=trust)):
        p, m, age, s2, s2w = (t.clone() for t in state)
        shard = ShardState(master=p, m=m, age=age, extra={"s2": s2, "s2w": s2w})
        out = nan_empty(n_blocks * k, BF16)
        fn(shard, out)
        res.append((p, m, age, out))
    for a, b in zip(*res):
        assert torch.equal(a, b)
    assert not torch.equal(res[0][0], state[0]), "nothing moved: the test cannot tell"


def test_catchup_agree_validates(backend):
    p = torch.zeros(512)
    age = torch.zeros(512, dtype=torch.int32)
    idx = torch.zeros(2, 1, dtype=torch.int16)
    g = torch.zeros(2)
    hp = dict(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0)
    call = lambda **kw: kernels.catchup_agree_(  # noqa: E731
        kw.get("p", p), p.clone(), kw.get("age", age.clone()), p.clone(), p.clone(),
        kw.get("g", g), idx, 256, **{**hp, **kw.get("hp", {})}, world=kw.get("world", 2),
        trust=kw.get("trust", 0.5))
    with pytest.raises(TypeError, match="age must have dtype torch.int32"):
        call(age=torch.zeros(512))
    with pytest.raises(ValueError, match="g must have 2 elements"):
        call(g=torch.zeros(3))
    with pytest.raises(ValueError, match="world must be an int >= 1"):
        call(world=0)
    with pytest.raises(ValueError, match="trust must be None or a finite float >= 0"):
        call(trust=math.inf)
    with pytest.raises(ValueError, match="Invalid lr"):
        call(hp={"lr": -1.0})
