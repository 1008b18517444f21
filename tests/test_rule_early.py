"""The default rule, ``agree`` (the research's ``early``): it trains bit for bit as the
research rule it was measured as (``catchup_agree_trust28_gain_b98w``), its EMAs take 0.95
while the lr rises and 0.98 after, its catch-up is bounded at 1/8 of the block's RMS up to
sparsity 0.974 and at 1/2 above, and the lr state it reads is saved and restored with the
optimizer (state dict and checkpoint files), so a resumed run continues as the uninterrupted
one."""

from __future__ import annotations

import copy
import functools

import pytest
import torch

import bench.research.rules as research
import scape
from scape import rules

RISE_FALL = [1e-3 * (i + 1) for i in range(6)] + [6e-3 - 5e-4 * (i + 1) for i in range(8)]
"""An lr that rises for 6 steps, then falls: the EMAs' factor switches once."""


def _build(update: str, sparsity: float, lr: float) -> tuple[scape.SCAPE, list]:
    torch.manual_seed(3)
    p = torch.nn.Parameter(torch.randn(4096))
    q = torch.nn.Parameter(torch.randn(33, 31))  # a second bucket entry, padded
    opt = scape.SCAPE([p, q], lr=lr, sparsity=sparsity, block_size=256, warmup_steps=2,
                      weight_decay=0.1, update=update, max_grad_norm=1.0)
    opt.ramp_steps = 0  # the rule at ``sparsity`` from the first sparse step
    return opt, [p, q]


def _steps(opt: scape.SCAPE, params: list, lrs: list[float], g: torch.Generator) -> list:
    """One step at each lr of ``lrs``, gradients drawn from ``g``; every step's next mask."""
    p, q = params
    masks = []
    for lr in lrs:
        opt.param_groups[0]["lr"] = lr
        p.grad = torch.randn(4096, generator=g) * 0.1 + 0.05 * torch.sign(p.detach())
        q.grad = torch.randn(33, 31, generator=g)
        opt.step()
        m = opt.masks[0]
        masks.append(None if m.next is None else m.wait().clone())
    return masks


def _state(opt: scape.SCAPE, params: list, masks: list) -> dict:
    s = opt.shards[0]
    return {"p": params[0].detach().clone(), "q": params[1].detach().clone(),
            "m": s.m.clone(), "age": s.age.clone(), "masks": masks,
            **{k: v.clone() for k, v in s.extra.items()}}


def _run(update: str, lrs: list[float], sparsity: float) -> dict:
    opt, params = _build(update, sparsity, lrs[0])
    return _state(opt, params, _steps(opt, params, lrs, torch.Generator().manual_seed(11)))


def _same(a: dict, b: dict) -> bool:
    """Bit for bit: parameters, moments, ages, EMAs and every step's mask."""
    for name, x in a.items():
        if name == "masks":
            if not all((u is None and v is None) or (u is not None and v is not None
                                                      and torch.equal(u, v))
                       for u, v in zip(x, b[name])):
                return False
        elif not torch.equal(x, b[name]):
            return False
    return True


@pytest.mark.parametrize("sparsity", [0.97, 0.99])
def test_early_trains_as_the_research_rule(sparsity):
    """At 0.97 (the 1/8 bound) and 0.99 (the half bound), through the lr's rise and fall."""
    assert "agree" in rules.BUILTIN
    lrs = [10 * lr for lr in RISE_FALL]  # large enough for the bounds to bind
    # a fresh instance: the research rule keeps its lr state per shard itself
    rules.register("test-early-research", research.BetaAfterLrWarmup(
        0.5, 0.98, trust_dense=0.125).rule(), replace=True)
    early = _run("agree", lrs, sparsity)
    assert _same(_run("test-early-research", lrs, sparsity), early)
    assert torch.isfinite(early["p"]).all() and int((early["age"] == 0).sum()) > 0


@pytest.mark.parametrize("sparsity, trust", [(0.97, 0.125), (0.99, 0.5)])
def test_the_bound_while_the_lr_rises(sparsity, trust):
    """While the lr rises ``early`` is the fresh-gain rule at the EMAs' default factor with
    the catch-up bounded at ``trust`` of the block's RMS; not with the other bound."""
    rising = [2e-2 * (i + 1) for i in range(12)]
    for name, c in (("test-early-ref", trust), ("test-early-other", 0.75 - trust)):
        rules.register(name, rules.gain_selected(
            functools.partial(rules.catchup_agree, trust=c), rules.gain_score), replace=True)
    early = _run("agree", rising, sparsity)
    assert _same(_run("test-early-ref", rising, sparsity), early)
    assert not torch.equal(_run("test-early-other", rising, sparsity)["p"], early["p"])


def test_the_factor_follows_the_lr():
    """``s2w`` is the EMAs' weight, ``1 - prod(beta)`` over the observed steps: rising, every
    step at 0.95; flat, 0.95 through the two dense steps and the first two sparse ones (the
    first update sees the lr rise from nothing, the EMAs read it a step late), 0.98 after."""
    rising = _run("agree", [1e-3 * (i + 1) for i in range(12)], 0.97)["s2w"]
    flat = _run("agree", [3e-3] * 12, 0.97)["s2w"]
    want_rising = 1 - rules.NOISE_BETA ** 12
    want_flat = 1 - rules.NOISE_BETA ** 4 * rules.STEADY_BETA ** 8
    assert torch.allclose(rising, torch.full_like(rising, want_rising), atol=1e-6)
    assert torch.allclose(flat, torch.full_like(flat, want_flat), atol=1e-6)


def _resumed(how: str, at: int, tmp_path) -> dict:
    """``RISE_FALL`` with the optimizer rebuilt from a save after step ``at``."""
    g = torch.Generator().manual_seed(11)
    opt, params = _build("early", 0.97, RISE_FALL[0])
    masks = _steps(opt, params, RISE_FALL[:at], g)
    if how == "state_dict":
        saved = copy.deepcopy(opt.state_dict())
    else:
        path = scape.save_checkpoint(opt, tmp_path / "ckpt")
    opt, params = _build("early", 0.97, RISE_FALL[0])
    with torch.no_grad():
        for p in params:  # the load must bring the weights back
            p.fill_(float("nan"))
    if how == "state_dict":
        opt.load_state_dict(saved)
    else:
        assert scape.load_checkpoint(opt, path) == at
    masks += _steps(opt, params, RISE_FALL[at:], g)  # the same generator, carried on
    return _state(opt, params, masks)


@pytest.mark.parametrize("how", ["state_dict", "files"])
def test_a_resumed_run_keeps_the_lr_state(how, tmp_path, monkeypatch):
    """Saved after the lr's peak (step 8 of 14), loaded into a new optimizer: the rest trains
    as the uninterrupted run; a load that forgot the peak would take the EMAs back to 0.95
    for a step, and that run differs (the check can fail)."""
    whole = _run("agree", RISE_FALL, 0.97)
    opt, params = _build("early", 0.97, RISE_FALL[0])
    _steps(opt, params, RISE_FALL[:8], torch.Generator().manual_seed(11))
    counters = opt.counters()
    assert counters["lr_peak"]["0"] == max(RISE_FALL[:8]) and counters["lr_rose"]["0"] == 0
    assert _same(whole, _resumed(how, 8, tmp_path / "a"))
    monkeypatch.setattr(rules, "load_lr_counters", lambda *a: None)
    assert not _same(whole, _resumed(how, 8, tmp_path / "b"))


def test_a_state_dict_without_the_lr_state_loads_as_at_construction():
    """A state saved before the lr state existed (no such counters) loads, into an optimizer
    whose shards have seen a peak: they start as a new optimizer's, no peak and the lr taken
    as rising; the rest of the state loads as saved."""
    opt, params = _build("early", 0.97, 1e-3)
    _steps(opt, params, [1e-3, 2e-3, 3e-3, 2e-3], torch.Generator().manual_seed(11))
    saved = copy.deepcopy(opt.state_dict())
    saved["param_groups"][0]["scape"]["counters"] = {}
    other, other_params = _build("early", 0.97, 1e-3)
    _steps(other, other_params, [5e-3] * 4, torch.Generator().manual_seed(12))
    assert all(s.lr_peak == 5e-3 and not s.lr_rose for s in other.shards)
    other.load_state_dict(saved)
    assert all(s.lr_peak == 0.0 and s.lr_rose for s in other.shards)
    assert torch.equal(other_params[0], params[0]) and torch.equal(other.shards[0].m,
                                                                   opt.shards[0].m)
