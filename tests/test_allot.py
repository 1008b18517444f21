"""bench.research.allot: the automatic per-group split of one sparsity budget, made from
outside the optimizer (docs/research.md, hypothesis 16)."""

from __future__ import annotations

import math

import pytest
import torch
from dist import run_ranks

import bench.research.rules  # noqa: F401 (registers the research rules named below)
import scape
from bench.research import allot as al
from scape.comm import TorchCommunicator


def _random_groups(seed: int, n: int = 5):
    g = torch.Generator().manual_seed(seed)
    numels = {i: int(x) for i, x in enumerate(torch.randint(300, 50_000, (n,), generator=g))}
    agreement = {i: float(x) for i, x in enumerate(torch.rand(n, generator=g) * 0.9 + 0.05)}
    return agreement, numels


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("power", [0.0, 1.0, 2.0])
@pytest.mark.parametrize("sparsity", [0.9, 0.99])
def test_allot_keeps_the_budget_and_follows_agreement(seed, power, sparsity):
    agreement, numels = _random_groups(seed)
    split = al.allot(agreement, numels, sparsity, 4096, power=power)
    assert set(split) == set(numels)
    density = {g: 1.0 - s for g, s in split.items()}
    total = sum(numels.values())
    assert math.isclose(sum(numels[g] * density[g] for g in numels), (1 - sparsity) * total,
                        rel_tol=1e-9)
    assert all(1 / 4096 <= d <= 0.5 for d in density.values())
    if power == 0.0:
        assert all(math.isclose(s, sparsity, abs_tol=1e-12) for s in split.values())
    else:  # more agreement, more density (none clipped at these values)
        order = sorted(numels, key=agreement.__getitem__)
        assert all(density[a] < density[b] for a, b in zip(order, order[1:]))
        ratio = (agreement[order[-1]] / agreement[order[0]]) ** power
        assert math.isclose(density[order[-1]] / density[order[0]], ratio, rel_tol=1e-9)


def test_allot_water_fills_the_clipped_groups():
    agreement = {"head": 1.0, "blocks": 0.05, "tiny": 1e-4}
    numels = {"head": 1000, "blocks": 100_000, "tiny": 10_000}
    split = al.allot(agreement, numels, 0.95, 4096, power=2.0, max_density=0.5)
    density = {g: 1.0 - s for g, s in split.items()}
    assert density["head"] == pytest.approx(0.5)        # capped
    assert density["tiny"] == pytest.approx(1 / 4096)   # floored
    budget = 0.05 * sum(numels.values())
    assert sum(numels[g] * density[g] for g in numels) == pytest.approx(budget, rel=1e-12)
    assert 0.05 < density["blocks"] < 0.5                # took what the head could not


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("floor", [0.25, 0.5, 1.0])
def test_allot_floor_keeps_every_group_fed(seed, floor):
    """One extreme reading (a group 1,000x the rest) cannot starve the others below ``floor``
    of the overall density; the budget holds; ``floor=1`` is every group at ``sparsity``."""
    signal, numels = _random_groups(seed)
    signal[0] *= 1000.0
    free = al.allot(signal, numels, 0.99, 4096, power=1.0)
    split = al.allot(signal, numels, 0.99, 4096, power=1.0, floor=floor)
    density = {g: 1.0 - s for g, s in split.items()}
    assert min(1.0 - s for s in free.values()) < floor * 0.01  # the floor binds here
    assert all(d >= floor * 0.01 * (1 - 1e-12) for d in density.values())
    total = sum(numels.values())
    assert math.isclose(sum(numels[g] * density[g] for g in numels), 0.01 * total,
                        rel_tol=1e-9)
    assert density[0] == max(density.values())
    if floor == 1.0:
        assert all(math.isclose(s, 0.99, abs_tol=1e-12) for s in split.values())


@pytest.mark.parametrize("kwargs, match", [
    (dict(sparsity=0.0), "sparsity must be > 0"),
    (dict(sparsity=1.0), "sparsity"),
    (dict(power=-1.0), "power must be a finite float >= 0"),
    (dict(power=float("nan")), "power must be a finite float >= 0"),
    (dict(max_density=0.005), "max_density"),
    (dict(floor=1.5), "floor must be a float in \\[0, 1\\]"),
    (dict(signal={0: 0.5}), "must name the same groups"),
    (dict(signal={0: 0.5, 1: -0.1}), r"signal\[1\] must be a finite float >= 0"),
    (dict(signal={0: 0.5, 1: float("inf")}), r"signal\[1\] must be a finite float >= 0"),
])
def test_allot_rejects_bad_input(kwargs, match):
    args = dict(signal={0: 0.5, 1: 0.2}, numels={0: 10, 1: 20}, sparsity=0.99,
                block_size=256)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        al.allot(**args)


def _two_param_opt(update: str = "catchup_agree_trust2_accum", seed: int = 0):
    torch.manual_seed(seed)
    steady = torch.nn.Parameter(torch.randn(3000))
    noisy = torch.nn.Parameter(torch.randn(5000))
    vec = torch.nn.Parameter(torch.randn(10))
    opt = scape.SCAPE([{"params": [steady]}, {"params": [noisy]},
                       {"params": [vec], "sparsity": 0.0}],
                      lr=1e-3, sparsity=0.99, block_size=256, warmup_steps=30, update=update)
    return opt, steady, noisy, vec


def test_group_agreement_tells_signal_from_noise():
    opt, steady, noisy, vec = _two_param_opt()
    g = torch.Generator().manual_seed(1)
    direction = torch.randn(steady.numel(), generator=g)
    for _ in range(25):  # dense warm-up steps: every coordinate is observed and synced
        steady.grad = direction.clone()                      # the same gradient every step
        noisy.grad = torch.randn(noisy.numel(), generator=g)  # zero-mean noise
        vec.grad = torch.randn(vec.numel(), generator=g)
        opt.step()
    a = al.group_agreement(opt)
    assert set(a) == {0, 1}  # the dense group takes no part
    assert a[0] > 0.95
    assert 0.35 < a[1] < 0.65  # |m| / sigma_m of pure noise is |N(0, 1)|: mean erf = 0.5
    assert al.group_numels(opt) == {0: 3000, 1: 5000}
    split = al.allot(a, al.group_numels(opt), 0.99, opt.block_size, power=1.0)
    al.apply_allotment(opt, split)
    assert opt.param_groups[0]["sparsity"] < 0.99 < opt.param_groups[1]["sparsity"]
    assert opt.param_groups[2]["sparsity"] == 0.0
    steady.grad, noisy.grad, vec.grad = torch.ones(3000), torch.ones(5000), torch.ones(10)
    opt.step()  # the optimizer takes the new split


def test_group_agreement_needs_the_noise_state():
    opt, *_ = _two_param_opt(update="catchup_sqrt_accum")
    with pytest.raises(ValueError, match="keeps the local noise estimate"):
        al.group_agreement(opt)


def _ranks_body(rank: int, world: int) -> dict:
    comm = TorchCommunicator()
    torch.manual_seed(0)  # the same parameters on every rank
    steady = torch.nn.Parameter(torch.randn(3000))
    noisy = torch.nn.Parameter(torch.randn(5000))
    opt = scape.SCAPE([{"params": [steady]}, {"params": [noisy]}], lr=1e-3, sparsity=0.99,
                      block_size=256, warmup_steps=30, comm=comm)
    g = torch.Generator().manual_seed(10 + rank)  # each rank its own noise
    direction = torch.randn(steady.numel(), generator=torch.Generator().manual_seed(5))
    for _ in range(12):
        steady.grad = direction + 0.01 * torch.randn(steady.numel(), generator=g)
        noisy.grad = torch.randn(noisy.numel(), generator=g)
        opt.step()
    got = al.group_agreement(opt)
    # the same statistic from every rank's shard, gathered and computed in one place
    ref = {}
    for b, s in zip(opt.buckets, opt.shards):
        parts = {}
        for name, t in (("m", s.m), ("s2", s.extra["s2"]), ("s2w", s.extra["s2w"])):
            every = torch.full((world * t.numel(),), float("nan"))
            comm.all_gather(every, t.contiguous()).wait()
            parts[name] = every[:b.numel]
        s2 = parts["s2"] / parts["s2w"].clamp(min=1e-12)
        var_m = ((s2 - parts["m"] ** 2).clamp(min=0) / world * (0.1 / 1.9)).double() + 1e-30
        ref[b.group] = float(torch.special.erf(parts["m"].abs().double()
                                               / (2 * var_m).sqrt()).mean())
    return {"got": got, "ref": ref}


def test_group_agreement_is_global_and_the_same_on_every_rank():
    res = run_ranks(_ranks_body, 2, timeout=120)
    assert res[0]["got"] == res[1]["got"]
    for g, ref in res[0]["ref"].items():
        assert res[0]["got"][g] == pytest.approx(ref, abs=1e-5)
    assert res[0]["got"][0] > 0.9 > res[0]["got"][1]


@pytest.mark.parametrize("sparse_steps", [0, 30])
def test_agreement_meter_tells_signal_from_noise(sparse_steps):
    """Fresh agreement: near 1 for a steady gradient, near 0 for noise, dense steps or sparse
    (where ``m`` of unsent coordinates goes stale and the meter must not)."""
    opt, steady, noisy, vec = _two_param_opt()
    meter = al.AgreementMeter(opt)
    with pytest.raises(RuntimeError, match="observe"):
        meter.agreement()
    g = torch.Generator().manual_seed(2)
    direction = torch.randn(steady.numel(), generator=g)
    for _ in range(30 + sparse_steps):  # 30 dense warm-up steps, then sparse ones
        steady.grad = direction.clone()
        noisy.grad = torch.randn(noisy.numel(), generator=g)
        vec.grad = torch.randn(vec.numel(), generator=g)
        meter.observe()
        opt.step()
    assert opt.last_step.dense == (sparse_steps == 0)
    a = meter.agreement()
    assert set(a) == {0, 1}
    assert a[0] > 0.95
    assert a[1] < 0.3  # the EMA's own noise is taken out: pure noise reads low


@pytest.mark.parametrize("sparse_steps", [0, 30])
@pytest.mark.parametrize("scale", [1.0, 4.0])
def test_agreement_meter_gain_carries_the_gradient_scale(sparse_steps, scale):
    """Gain of a steady gradient is its mean ``|g|`` (scaled with it, where agreement is not);
    of pure noise near 0; dense steps or sparse."""
    opt, steady, noisy, vec = _two_param_opt()
    meter = al.AgreementMeter(opt)
    with pytest.raises(RuntimeError, match="observe"):
        meter.gain()
    g = torch.Generator().manual_seed(4)
    direction = scale * torch.randn(steady.numel(), generator=g)
    for _ in range(30 + sparse_steps):
        steady.grad = direction.clone()
        noisy.grad = scale * torch.randn(noisy.numel(), generator=g)
        vec.grad = torch.randn(vec.numel(), generator=g)
        meter.observe()
        opt.step()
    gain, agree = meter.gain(), meter.agreement()
    assert set(gain) == {0, 1} and all(v >= 0 and math.isfinite(v) for v in gain.values())
    assert gain[0] == pytest.approx(float(direction.abs().mean()), rel=1e-3)
    assert gain[1] < 0.15 * gain[0]  # noise of the same size moves the loss little
    assert agree[0] > 0.95  # agreement cannot tell the scales apart


def test_agreement_meter_rejects_bad_input():
    opt, *_ = _two_param_opt(update="catchup_sqrt_accum")
    with pytest.raises(ValueError, match="keeps the local noise estimate"):
        al.AgreementMeter(opt)
    opt, *_ = _two_param_opt()
    with pytest.raises(ValueError, match="beta"):
        al.AgreementMeter(opt, beta=1.0)


def test_agreement_meter_leaves_a_non_finite_step_out():
    opt, steady, noisy, vec = _two_param_opt()
    meter = al.AgreementMeter(opt)
    g = torch.Generator().manual_seed(3)
    direction = torch.randn(steady.numel(), generator=g)
    for step in range(30):
        steady.grad = direction.clone()
        if step == 20:
            steady.grad[7] = float("nan")  # the step is skipped on every rank
        noisy.grad = torch.randn(noisy.numel(), generator=g)
        vec.grad = torch.randn(vec.numel(), generator=g)
        meter.observe()
        opt.step()
    assert all(bool(torch.isfinite(mu).all()) for mu in meter.mu if mu is not None)
    a = meter.agreement()
    assert a[0] > 0.95 and a[1] < 0.3
