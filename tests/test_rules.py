"""Sparse-step rules: each against a float64 re-derivation, plus the invariants every rule
must keep (only mask coordinates change; ages reset at the mask and grow elsewhere)."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import nan_empty

from bench.research.rules import TrustFollowsLr, agree_trust_rule  # registers the research rules
from scape.rules import (
    NOISE_BETA,
    NOISE_STATE,
    RULES,
    ShardState,
    accumulated_score,
    catchup_agree,
    catchup_mean,
    catchup_snr,
    lazy,
    observe_local_noise,
)

catchup_agree_cap = RULES["catchup_agree_cap_accum"].update
catchup_agree_sqrt = RULES["catchup_agree_sqrt_accum"].update
catchup_agree_trust = RULES["catchup_agree_trust_accum"].update
catchup_agree_trust2 = RULES["catchup_agree_trust2_accum"].update
catchup_agree_trust4 = RULES["catchup_agree_trust4_accum"].update
catchup_snr_sqrt = RULES["catchup_snr_sqrt_accum"].update

BLOCK = 256
HP = dict(lr=3e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)


def _shard(seed: int, n_blocks: int = 3, max_age: int = 50,
           extra: tuple[str, ...] = ()) -> ShardState:
    g = torch.Generator().manual_seed(seed)
    n = n_blocks * BLOCK
    return ShardState(master=torch.randn(n, generator=g), m=torch.randn(n, generator=g) * 0.1,
                      age=torch.randint(0, max_age, (n,), generator=g, dtype=torch.int32),
                      extra={k: torch.rand(n, generator=g) * 0.1 + 0.01 for k in extra})


def _mask(seed: int, n_blocks: int, k: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randperm(BLOCK, generator=g)[:k].sort().values for _ in range(n_blocks)]
    return torch.stack(rows).to(torch.int16)


def _flat(idx: torch.Tensor) -> torch.Tensor:
    return (torch.arange(idx.shape[0])[:, None] * BLOCK + idx.long()).view(-1)


def _clone(s: ShardState) -> ShardState:
    return ShardState(s.master.clone(), s.m.clone(), s.age.clone(),
                      {k: v.clone() for k, v in s.extra.items()})


@pytest.mark.parametrize("name", sorted(RULES))
@pytest.mark.parametrize("k", [1, 13], ids=["k1", "k13"])
def test_rule_invariants(name, k):
    rule = RULES[name]
    s = _shard(1, extra=rule.extra)
    before = _clone(s)
    idx = _mask(2, 3, k)
    g = torch.randn(3 * k, generator=torch.Generator().manual_seed(3))
    out = nan_empty(3 * k, torch.bfloat16)
    rule.update(s, g, idx, BLOCK, HP, out)
    flat = _flat(idx)
    outside = torch.ones(s.master.numel(), dtype=torch.bool)
    outside[flat] = False
    assert torch.equal(s.master[outside], before.master[outside])
    assert torch.equal(s.m[outside], before.m[outside])
    assert torch.equal(s.age[outside], before.age[outside] + 1)
    assert bool((s.age[flat] == 0).all())
    assert not bool(out.isnan().any())
    assert torch.equal(out, s.master[flat].to(torch.bfloat16))
    assert bool((s.master[flat] != before.master[flat]).all())
    if rule.score is None:
        score = s.m
    else:
        score = rule.score(s, dict(HP, k=k, block_size=BLOCK)) if rule.score_reads_hp \
            else rule.score(s)
    assert score.shape == s.m.shape and bool(score.isfinite().all())


def _catchup_f64(p, m, a, g, hp, power=1.0):
    a1 = a.double() + 1
    mean = g.double() / a1
    v = hp["beta2"] * m.double() ** 2 + (1 - hp["beta2"]) * mean ** 2
    d = hp["beta1"] ** a1
    m_new = d * m.double() + (1 - d) * mean
    p_new = p.double() * (1 - hp["lr"] * hp["weight_decay"]) ** a1
    p_new = p_new - hp["lr"] * a1 ** power * m_new / (v.sqrt() + hp["eps"])
    return p_new, m_new


@pytest.mark.parametrize("power", [1.0, 0.5], ids=["mean", "sqrt"])
def test_catchup_matches_float64(power):
    s = _shard(4)
    before = _clone(s)
    idx = _mask(5, 3, 20)
    flat = _flat(idx)
    g = torch.randn(60, generator=torch.Generator().manual_seed(6))
    catchup_mean(s, g, idx, BLOCK, HP, nan_empty(60), power=power)
    p_ref, m_ref = _catchup_f64(before.master[flat], before.m[flat], before.age[flat], g, HP,
                                power)
    torch.testing.assert_close(s.master[flat].double(), p_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(s.m[flat].double(), m_ref, rtol=1e-5, atol=1e-7)


def test_catchup_mean_at_age_zero_is_lazy():
    """With nothing missed (age 0) replaying one step is exactly the lazy AdamS step."""
    s1 = _shard(7, max_age=1)
    s1.age.zero_()
    s2 = _clone(s1)
    idx = _mask(8, 3, 9)
    g = torch.randn(27, generator=torch.Generator().manual_seed(9))
    o1, o2 = nan_empty(27), nan_empty(27)
    catchup_mean(s1, g, idx, BLOCK, HP, o1)
    lazy(s2, g, idx, BLOCK, HP, o2)
    torch.testing.assert_close(s1.master, s2.master, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(s1.m, s2.m, rtol=1e-6, atol=5e-8)  # a few fp32 ulps
    assert torch.equal(s1.age, s2.age)


def test_accumulated_score_orders_by_mass():
    s = _shard(10)
    sc = accumulated_score(s)
    torch.testing.assert_close(sc, s.m * (s.age.float() + 1))
    mag = s.m.abs()  # the magnitude the mask ranks is bitwise addcmul(|m|, |m|, age)
    assert torch.equal(sc.abs(), mag.addcmul(mag, s.age))
    # a coordinate with half |m| but three times the age outranks the other
    s.m[:2] = torch.tensor([1.0, -0.5])
    s.age[:2] = torch.tensor([1, 5], dtype=torch.int32)
    sc = accumulated_score(s)
    assert sc[1].abs() > sc[0].abs()


def _snr_f64(s, flat, g, hp, floor, agree=False, cap=1.0, trust=None):
    """catchup_snr (and the catchup_agree family) re-derived in float64 from their
    docstrings."""
    p, m = s.master[flat].double(), s.m[flat].double()
    a1 = s.age[flat].double() + 1
    gbar = g.double() / a1
    sigma2 = ((s.extra["s2"][flat].double() / s.extra["s2w"][flat].double()) - m ** 2)
    sigma2 = sigma2.clamp(min=0) / hp.get("world", 1) + 1e-30
    mu2 = (gbar ** 2 - sigma2 / a1).clamp(min=0)
    r = mu2 * a1 / sigma2
    frac = (r / (1 + r)).sqrt()
    if agree:
        sigma_m = (sigma2 * (1 - hp["beta1"]) / (1 + hp["beta1"])).sqrt()
        frac = torch.special.erf(mu2.sqrt() / (sigma_m * math.sqrt(2)))
    steps = torch.maximum(a1 * frac, a1 ** floor)
    steps = torch.minimum(steps, a1 ** cap)
    if trust is not None:
        rms = s.master.double().view(-1, BLOCK).pow(2).mean(dim=1).sqrt()
        reach = rms[flat // BLOCK] * trust / hp["lr"]
        steps = torch.minimum(steps, torch.maximum(a1.sqrt(), reach))
    v = hp["beta2"] * m ** 2 + (1 - hp["beta2"]) * gbar ** 2
    d = hp["beta1"] ** a1
    m_new = d * m + (1 - d) * gbar
    p_new = p * (1 - hp["lr"] * hp["weight_decay"]) ** a1
    return p_new - hp["lr"] * steps * m_new / (v.sqrt() + hp["eps"]), m_new


@pytest.mark.parametrize("beta1", [0.9, 0.0], ids=["b1_0.9", "b1_0"])
@pytest.mark.parametrize("floor", [0.0, 0.5], ids=["floor1", "floor_sqrt"])
@pytest.mark.parametrize("world", [1, 4], ids=["W1", "W4"])
def test_catchup_snr_matches_float64(floor, world, beta1):
    s = _shard(11, extra=NOISE_STATE)
    before = _clone(s)
    idx = _mask(12, 3, 20)
    flat = _flat(idx)
    g = torch.randn(60, generator=torch.Generator().manual_seed(13)) * 3
    hp = dict(HP, world=world, beta1=beta1)
    catchup_snr(s, g, idx, BLOCK, hp, nan_empty(60), floor=floor)
    p_ref, m_ref = _snr_f64(before, flat, g, hp, floor)
    torch.testing.assert_close(s.master[flat].double(), p_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(s.m[flat].double(), m_ref, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("rule,floor", [(catchup_agree, 0.0), (catchup_agree_sqrt, 0.5)],
                         ids=["agree", "agree_sqrt"])
@pytest.mark.parametrize("beta1", [0.9, 0.0], ids=["b1_0.9", "b1_0"])
@pytest.mark.parametrize("world", [1, 4], ids=["W1", "W4"])
def test_catchup_agree_matches_float64(world, beta1, rule, floor):
    s = _shard(21, extra=NOISE_STATE)
    s.extra["s2"].mul_(0.05)  # noise comparable to the means: fractions well inside (0, 1)
    before = _clone(s)
    idx = _mask(22, 3, 20)
    flat = _flat(idx)
    g = torch.randn(60, generator=torch.Generator().manual_seed(23)) * 3
    hp = dict(HP, world=world, beta1=beta1)
    rule(s, g, idx, BLOCK, hp, nan_empty(60))
    p_ref, m_ref = _snr_f64(before, flat, g, hp, floor, agree=True)
    torch.testing.assert_close(s.master[flat].double(), p_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(s.m[flat].double(), m_ref, rtol=1e-5, atol=1e-7)
    moved = (s.master[flat].double() - before.master[flat].double()).abs()
    assert bool((moved > 0).all())


def _binding_case(seed: int):
    """A shard whose blocks' weight RMS is 1, 0.01 and 0.1 with little noise (so the agreement
    rule catches up fully and a trust bound binds in some blocks), a mask and its gradient:
    ``(shard, a copy of it, idx, g)``."""
    s = _shard(seed, extra=NOISE_STATE)
    s.extra["s2"].mul_(1e-4)
    s.master.view(3, BLOCK).mul_(torch.tensor([[1.0], [0.01], [0.1]]))
    idx = _mask(seed + 1, 3, 20)
    g = torch.randn(60, generator=torch.Generator().manual_seed(seed + 2)) * 3
    return s, _clone(s), idx, g


@pytest.mark.parametrize("rule,bound", [
    (catchup_agree_cap, dict(cap=0.5)),
    (catchup_agree_trust, dict(trust=1.0)),
    (catchup_agree_trust2, dict(trust=0.5)),
    (catchup_agree_trust4, dict(trust=0.25)),
], ids=["cap", "trust", "trust2", "trust4"])
def test_bounded_agree_matches_float64(rule, bound):
    """The bounded agreement rules against float64; with little noise the agreement rule
    catches up fully, so the bound binds: per block the weights' RMS is 1, 0.01 and 0.1, and
    the trust bound ``rms / lr`` falls above, below and inside the range of ``a + 1``."""
    s, before, idx, g = _binding_case(31)
    flat = _flat(idx)
    hp = dict(HP, world=4, weight_decay=0.0)
    rule(s, g, idx, BLOCK, hp, nan_empty(60))
    p_ref, m_ref = _snr_f64(before, flat, g, hp, 0.0, agree=True, **bound)
    torch.testing.assert_close(s.master[flat].double(), p_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(s.m[flat].double(), m_ref, rtol=1e-5, atol=1e-7)
    free = _clone(before)
    catchup_agree(free, g, idx, BLOCK, hp, nan_empty(60))
    moved = (s.master[flat] - before.master[flat]).abs()
    moved_free = (free.master[flat] - before.master[flat]).abs()
    assert bool((moved <= moved_free * (1 + 1e-5) + 1e-9).all()), "a bound moved further"
    assert bool((moved < 0.9 * moved_free).any()), "the bound never bound"
    assert bool(torch.isclose(moved, moved_free, rtol=1e-5).any()), "the bound always bound"
    assert torch.equal(s.m[flat], free.m[flat])  # only the step length differs


@pytest.mark.parametrize("c", [0.3, 0.5, 0.25, 2.0])
def test_agree_trust_rule_is_the_trust_rule_at_any_bound(c):
    """``agree_trust_rule(c)`` is the named rule at its bound (bit for bit) and the float64
    reference at any other; it keeps the same state, so a rule may be swapped mid-run."""
    s, before, idx, g = _binding_case(41)
    hp = dict(HP, world=4, weight_decay=0.0)
    rule = agree_trust_rule(c)
    rule.update(s, g, idx, BLOCK, hp, nan_empty(60))
    named = {0.5: "catchup_agree_trust2_accum", 0.25: "catchup_agree_trust4_accum"}.get(c)
    if named is not None:
        ref = _clone(before)
        RULES[named].update(ref, g, idx, BLOCK, hp, nan_empty(60))
        assert torch.equal(s.master, ref.master) and torch.equal(s.m, ref.m)
    p_ref, m_ref = _snr_f64(before, _flat(idx), g, hp, 0.0, agree=True, trust=c)
    torch.testing.assert_close(s.master[_flat(idx)].double(), p_ref, rtol=1e-5, atol=1e-6)
    base = RULES["catchup_agree_trust2_accum"]
    assert (rule.extra, rule.score, rule.observe, rule.reset) == (
        base.extra, base.score, base.observe, base.reset)
    for bad in (0.0, -1.0, float("nan"), "0.5", True):
        with pytest.raises(ValueError, match="agree_trust_rule"):
            agree_trust_rule(bad)


@pytest.mark.parametrize("ratio,c", [(1.0, 0.5), (2.0, 0.375), (1e3, 0.25 + 0.25e-3)])
def test_trustlr_bound_follows_the_lr(ratio, c):
    """``catchup_agree_trustlr``: ``c = 1/4 + 1/4 * lr / lr_peak`` with ``lr_peak`` the largest
    lr the shard was stepped with, bit for bit the rule at that fixed bound."""
    s, before, idx, g = _binding_case(51)
    hp = dict(HP, world=4, weight_decay=0.0)
    rule = TrustFollowsLr()
    rule(s, g, idx, BLOCK, dict(hp, lr=ratio * HP["lr"]), nan_empty(60))  # sets the peak
    for t, t0 in ((s.master, before.master), (s.m, before.m), (s.age, before.age)):
        t.copy_(t0)  # the same shard (the peak is kept per shard), its state as before
    rule(s, g, idx, BLOCK, hp, nan_empty(60))
    ref = _clone(before)
    agree_trust_rule(c).update(ref, g, idx, BLOCK, hp, nan_empty(60))
    assert torch.equal(s.master, ref.master) and torch.equal(s.m, ref.m)
    if c != 0.5:
        half = _clone(before)
        RULES["catchup_agree_trust2_accum"].update(half, g, idx, BLOCK, hp, nan_empty(60))
        assert not torch.equal(s.master, half.master)  # the bound binds somewhere


@pytest.mark.parametrize("quiet_rule,noisy_rule,floor_power", [
    (catchup_snr, catchup_snr_sqrt, 0.5),
    (catchup_agree, catchup_agree, 0.0),
    (catchup_agree_sqrt, catchup_agree_sqrt, 0.5),
], ids=["snr", "agree", "agree_sqrt"])
def test_noise_sized_catchup_limits(quiet_rule, noisy_rule, floor_power):
    """No noise: full catch-up (catchup_mean). Pure noise (a zero mean arrived): the floor,
    i.e. the square-root rule for catchup_snr_sqrt and catchup_agree_sqrt and one step for
    catchup_agree, however long the wait."""
    idx = _mask(14, 3, 16)
    flat = _flat(idx)
    g = torch.randn(48, generator=torch.Generator().manual_seed(15))
    quiet = _shard(16, extra=NOISE_STATE)
    quiet.extra["s2"].copy_(quiet.m.square())  # local variance s2 - m^2 = 0
    quiet.extra["s2w"].fill_(1.0)
    ref = _clone(quiet)
    quiet_rule(quiet, g, idx, BLOCK, HP, nan_empty(48))
    catchup_mean(ref, g, idx, BLOCK, HP, nan_empty(48))
    torch.testing.assert_close(quiet.master, ref.master, rtol=1e-6, atol=1e-6)
    noisy = _shard(17, extra=NOISE_STATE)
    noisy.extra["s2"].fill_(1e6)
    noisy.extra["s2w"].fill_(1.0)
    ref = _clone(noisy)
    noisy_rule(noisy, g * 1e-6, idx, BLOCK, HP, nan_empty(48))
    catchup_mean(ref, g * 1e-6, idx, BLOCK, HP, nan_empty(48), power=floor_power)
    torch.testing.assert_close(noisy.master, ref.master, rtol=1e-6, atol=1e-6)
    assert bool((quiet.master[flat] != noisy.master[flat]).any())
    assert bool((noisy.age[flat] == 0).all()) and bool((quiet.age[flat] == 0).all())


@pytest.mark.parametrize("error_feedback", [True, False], ids=["ef", "no_ef"])
def test_observe_local_noise_recovers_each_step_gradient(error_feedback):
    """Simulated buffer: residual (what the last take left) + this step's gradient. The
    observer must average the squares of the step gradients alone."""
    n, gen = 2 * BLOCK, torch.Generator().manual_seed(18)
    s = _shard(19, n_blocks=2, extra=NOISE_STATE)
    for k in NOISE_STATE:
        s.extra[k].zero_()
    s.age.zero_()  # as after dense warm-up: nothing pending
    residual = torch.zeros(n)
    ema, w = torch.zeros(n, dtype=torch.float64), 0.0
    for _ in range(6):
        step_grad = torch.randn(n, generator=gen)
        buf = residual + step_grad
        observe_local_noise(s, buf.clone(), error_feedback)
        ema = NOISE_BETA * ema + (1 - NOISE_BETA) * step_grad.double() ** 2
        w = NOISE_BETA * w + (1 - NOISE_BETA)
        idx = _mask(int(torch.randint(0, 1000, (1,), generator=gen)), 2, 7)
        flat = _flat(idx)
        residual = buf.clone() if error_feedback else torch.zeros(n)
        residual[flat] = 0.0  # the take
        s.age.add_(1)
        s.age[flat] = 0
    torch.testing.assert_close(s.extra["s2"].double(), ema, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(s.extra["s2w"].double(), torch.full_like(ema, w))
