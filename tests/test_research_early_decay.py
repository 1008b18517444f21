"""The research rule ``early_decay``: ``early`` whose catch-up bound widens as the lr falls
from its peak, ``c = min(1, c_early * lr_peak / lr)``. At a flat lr, and while the lr rises, it
is ``early`` bit for bit; once the lr falls its catch-up is ``catchup_agree`` at that bound."""

from __future__ import annotations

import copy

import pytest
import torch

import bench.research.rules as research
from scape import rules
from scape.rules.catchups import catchup_agree
from tests.test_rule_early import RISE_FALL, _build, _run, _same, _steps


@pytest.mark.parametrize("sparsity", [0.97, 0.99])
def test_flat_lr_is_early(sparsity):
    """At a flat lr the peak is the lr: the bound is ``early``'s, every step."""
    lrs = [0.05] * 10  # large enough for the bounds to bind
    assert _same(_run("early_decay", lrs, sparsity), _run("early", lrs, sparsity))


@pytest.mark.parametrize(("sparsity", "scale"), [(0.97, 10), (0.99, 30)])
def test_falling_lr_widens_the_bound(sparsity, scale):
    """Through the rise both agree; once the lr falls the bound widens and they part."""
    lrs = [scale * lr for lr in RISE_FALL]  # large enough for the bound to bind
    rise = lrs[:6]
    assert _same(_run("early_decay", rise, sparsity), _run("early", rise, sparsity))
    assert not _same(_run("early_decay", lrs, sparsity), _run("early", lrs, sparsity))


@pytest.mark.parametrize(("sparsity", "base"), [(0.97, rules.TRUST[0]),
                                                (0.99, rules.TRUST[1])])
@pytest.mark.parametrize("frac", [1.0, 0.7, 0.3, 0.05])
def test_bound_follows_the_peak(sparsity, base, frac):
    """One update at ``frac`` of the peak lr equals ``catchup_agree`` at ``min(1, base/frac)``
    (and at ``base`` where ``frac`` is 1), on the same state: parameters, moment, ages."""
    peak = 0.04
    opt, params = _build("early", sparsity, peak)
    _steps(opt, params, [peak] * 6, torch.Generator().manual_seed(5))  # sparse, at the peak
    shard = opt.shards[0]
    assert shard.lr_peak == peak
    k, bs = opt.masks[0].wait().shape[-1], opt.block_size
    n_blocks = shard.master.numel() // bs
    gen = torch.Generator().manual_seed(9)
    idx = torch.stack([torch.randperm(bs, generator=gen)[:k] for _ in range(n_blocks)])
    idx = idx.sort(dim=1).values.to(torch.int16)
    hp = {"lr": peak * frac, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8,
          "weight_decay": 0.1, "world": 1}
    # waits of 40 steps, weights whose RMS puts ``early``'s bound at 8 of the 41 steps
    # (above the floor of sqrt(41)), a sum of 41 gradients: the bound binds where it can
    shard.age.fill_(40)
    shard.master.mul_(8 * hp["lr"] / base / shard.master.square().mean().sqrt())
    g = torch.randn(idx.numel(), generator=gen).add_(1.0).mul_(41 * 0.3)
    a, b = copy.deepcopy(shard), copy.deepcopy(shard)
    a.saw_lr(hp["lr"])
    b.saw_lr(hp["lr"])
    out_a = torch.full((idx.numel(),), float("nan"))
    out_b = out_a.clone()
    research.early_decay_update(a, g, idx, bs, hp, out_a)
    trust = base if frac == 1.0 else min(research.TRUST_DECAY_CAP, base / frac)
    catchup_agree(b, g, idx, bs, hp, out_b, trust=trust)
    assert not out_a.isnan().any()
    for x, y in [(a.master, b.master), (a.m, b.m), (a.age, b.age), (out_a, out_b)]:
        assert torch.equal(x, y)
    # the bound binds at some coordinate: the rule at ``base`` moves differently
    c = copy.deepcopy(shard)
    c.saw_lr(hp["lr"])
    catchup_agree(c, g, idx, bs, hp, torch.empty_like(out_a), trust=base)
    assert torch.equal(c.master, a.master) == (trust == base)
