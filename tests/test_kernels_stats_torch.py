"""The CPU paths of noise_ema_ and gain_score (kernels/stats_torch.py): the slices are bitwise
the torch twins of kernels/reference.py (many slices, a short tail, non-finite entries in
some slices only); the ``SCAPE_KERNELS=compile`` forms are within fp32 rounding of them."""

from __future__ import annotations

import pytest
import torch
from conftest import nan_empty
from kernel_cases import gain_inputs, seeded

from scape import kernels
from scape.kernels import reference as ref
from scape.kernels import stats_torch


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


def noise_inputs(gen, n):
    buf, prev = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    age = torch.randint(0, 3, (n,), generator=gen, dtype=torch.int32)
    s2, s2w = torch.rand(n, generator=gen), torch.rand(n, generator=gen)
    mu = torch.randn(n, generator=gen)
    return buf, prev, age, s2, s2w, mu


SIZES = [pytest.param(96, id="n96-one-slice"), pytest.param(64 * 11 + 48, id="n752-tail")]


@pytest.mark.parametrize("with_mu", [False, True], ids=["s2", "s2+mu"])
@pytest.mark.parametrize("error_feedback", [True, False], ids=["ef", "no_ef"])
@pytest.mark.parametrize("n", SIZES)
def test_noise_ema_slices_are_the_twin_bitwise(monkeypatch, n, error_feedback, with_mu):
    monkeypatch.setattr(stats_torch, "SLICE", 64)
    gen = seeded("noise-slices", n, error_feedback, with_mu)
    buf, prev, age, s2, s2w, mu = noise_inputs(gen, n)
    buf[5], buf[n - 3] = float("nan"), float("inf")  # in the first and the last slice
    want = [t.clone() for t in (prev, s2, s2w, mu)]
    got = [t.clone() for t in (prev, s2, s2w, mu)]
    ref.noise_ema_(buf, want[0], age, want[1], want[2], beta=0.95,
                   error_feedback=error_feedback, mu=want[3] if with_mu else None)
    stats_torch.noise_ema_(buf, got[0], age, got[1], got[2], beta=0.95,
                           error_feedback=error_feedback, mu=got[3] if with_mu else None)
    for name, a, b in zip(("prev", "s2", "s2w", "mu"), got, want):
        assert torch.equal(bits(a), bits(b)), name
    assert not torch.equal(got[1], s2), "s2 did not move: the test cannot tell"
    assert got[1][5] == s2[5] and got[1][n - 3] == s2[n - 3], "a non-finite entry observed"


@pytest.mark.parametrize("with_prev", [False, True], ids=["ema", "ema+wait"])
@pytest.mark.parametrize("n", SIZES)
def test_gain_score_slices_are_the_twin_bitwise(monkeypatch, n, with_prev):
    monkeypatch.setattr(stats_torch, "SLICE", 64)
    gen = seeded("gain-slices", n, with_prev)
    mu, s2, s2w, age = gain_inputs(gen, n)
    prev = torch.randn(n, generator=gen) if with_prev else None
    want = ref.gain_score(mu, s2, s2w, age, span=39.0, var_m_scale=0.013, prev=prev)
    out = nan_empty(n)
    got = stats_torch.gain_score(mu, s2, s2w, age, span=39.0, var_m_scale=0.013, prev=prev,
                                 out=out)
    assert got is out
    assert torch.equal(bits(got), bits(want))
    assert bool((want > 0).any()) and bool((want == 0).any())


def test_gain_score_out_is_written_and_returned(kernel_backend):
    """The public op with ``out=``: the same values as without, in the buffer given."""
    kernel_backend("torch")
    gen = seeded("gain-out")
    n = 4096 + 17
    mu, s2, s2w, age = gain_inputs(gen, n)
    prev = torch.randn(n, generator=gen)
    kw = dict(beta=0.95, beta1=0.9, world=4, prev=prev)
    out = nan_empty(n)
    assert kernels.gain_score(mu, s2, s2w, age, **kw, out=out) is out
    assert torch.equal(out, kernels.gain_score(mu, s2, s2w, age, **kw))
    with pytest.raises(ValueError, match="out must have 4113 elements"):
        kernels.gain_score(mu, s2, s2w, age, **kw, out=torch.empty(n - 1))
    with pytest.raises(TypeError, match="out must have dtype torch.float32"):
        kernels.gain_score(mu, s2, s2w, age, **kw, out=torch.empty(n, dtype=torch.float64))


@pytest.mark.slow
def test_compiled_forms_within_fp32_rounding_of_the_twins(kernel_backend):
    """``SCAPE_KERNELS=compile``: one fused loop each (torch.compile); the same values as the
    twins up to fp32 rounding (the gain's signal is a difference of squares, so its
    tolerance is that of tests/test_kernels_ops.py against float64)."""
    kernel_backend("compile")
    gen = seeded("compiled")
    n = 3 * 1024 + 77
    buf, prev, age, s2, s2w, mu = noise_inputs(gen, n)
    buf[9] = float("nan")
    want = [t.clone() for t in (prev, s2, s2w, mu)]
    got = [t.clone() for t in (prev, s2, s2w, mu)]
    ref.noise_ema_(buf, want[0], age, want[1], want[2], beta=0.95, error_feedback=True,
                   mu=want[3])
    kernels.noise_ema_(buf, got[0], age, got[1], got[2], beta=0.95, error_feedback=True,
                       mu=got[3])
    assert torch.equal(bits(got[0]), bits(buf))
    for a, b in zip(got[1:], want[1:]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        assert a[9] == b[9], "a non-finite entry observed"
    g_mu, g_s2, g_s2w, g_age = gain_inputs(gen, n)
    kw = dict(beta=0.95, beta1=0.9, world=8, prev=prev)
    out = nan_empty(n)
    kernels.gain_score(g_mu, g_s2, g_s2w, g_age, **kw, out=out)
    kernel_backend("torch")
    torch.testing.assert_close(out, kernels.gain_score(g_mu, g_s2, g_s2w, g_age, **kw),
                               rtol=1e-4, atol=1e-6)
