"""The research rule whose gain EMAs take another factor (``bench.research.rules.gain_rule_beta``):
at the library's factor it trains bit for bit as ``catchup_agree_trust2_gain``, and at another
factor its EMAs, masks and parameters differ, so the factor reaches both the observation and
the selection."""

from __future__ import annotations

import functools

import pytest
import torch

import scape
from scape import rules

research = pytest.importorskip("bench.research.rules")

SAME = "test-trust2-gain-beta-default"
rules.register(SAME, research.gain_rule_beta(0.5, rules.NOISE_BETA), replace=True)


def _run(update: str, lrs: list[float] | None = None, sparsity: float = 0.97) -> dict:
    """14 steps at lr 3e-3, or one step at each lr of ``lrs``, at ``sparsity``."""
    lrs = lrs or [3e-3] * 14
    torch.manual_seed(3)
    p = torch.nn.Parameter(torch.randn(4096))
    q = torch.nn.Parameter(torch.randn(33, 31))  # a second bucket entry, padded
    opt = scape.SCAPE([p, q], lr=lrs[0], sparsity=sparsity, block_size=256, warmup_steps=3,
                      update=update, max_grad_norm=1.0)
    opt.ramp_steps = 0  # the rules at ``sparsity`` from the first sparse step
    g = torch.Generator().manual_seed(11)
    masks = []
    for lr in lrs:
        opt.param_groups[0]["lr"] = lr
        p.grad = torch.randn(4096, generator=g) * 0.1 + 0.05 * torch.sign(p.detach())
        q.grad = torch.randn(33, 31, generator=g)
        opt.step()
        m = opt.masks[0]
        masks.append(None if m.next is None else m.wait().clone())
    s = opt.shards[0]
    return {"p": p.detach().clone(), "q": q.detach().clone(), "m": s.m.clone(),
            "age": s.age.clone(), "masks": masks, **{k: v.clone() for k, v in s.extra.items()}}


def _assert_same(ref: dict, other: dict) -> None:
    """Bit for bit: parameters, moments, ages, EMAs and every step's mask."""
    for name, a in ref.items():
        if name == "masks":
            assert all((x is None and y is None) or torch.equal(x, y)
                       for x, y in zip(a, other[name]))
        else:
            assert torch.equal(a, other[name]), name


def test_the_default_factor_trains_as_the_fresh_gain_rule():
    ref, same = _run("catchup_agree_trust2_gain"), _run(SAME)
    _assert_same(ref, same)
    assert int((ref["age"] == 0).sum()) > 0 and float(ref["mu"].abs().sum()) > 0


def test_another_factor_changes_the_emas_and_the_masks():
    ref, b90 = _run("catchup_agree_trust2_gain"), _run("catchup_agree_trust2_gain_b90")
    assert torch.isfinite(b90["p"]).all() and torch.isfinite(b90["mu"]).all()
    assert not torch.equal(ref["mu"], b90["mu"])
    assert not torch.equal(ref["s2w"], b90["s2w"])
    # s2w is the EMA's weight, 1 - beta^t after t observations: the factor shows in it
    t = 14
    assert torch.allclose(b90["s2w"], torch.full_like(b90["s2w"], 1 - 0.9 ** t), atol=1e-5)
    assert torch.allclose(ref["s2w"], torch.full_like(ref["s2w"], 1 - rules.NOISE_BETA ** t),
                          atol=1e-5)
    assert any(x is not None and not torch.equal(x, y)
               for x, y in zip(ref["masks"], b90["masks"]))
    assert not torch.equal(ref["p"], b90["p"])


def test_the_factor_after_the_lr_warmup_follows_the_lr():
    # a fresh instance per optimizer: the rule keeps its per-shard lr state
    rules.register("test-b98w", research.BetaAfterLrWarmup(0.5, 0.98).rule(), replace=True)
    rising = [1e-3 * (i + 1) for i in range(12)]
    ref, warm = _run("catchup_agree_trust2_gain", rising), _run("test-b98w", rising)
    _assert_same(ref, warm)  # while the lr rises: the default's factor
    rules.register("test-b98w", research.BetaAfterLrWarmup(0.5, 0.98).rule(), replace=True)
    flat = _run("test-b98w", [3e-3] * 12)
    # dense steps 1-3 and sparse steps 4-5 observe at 0.95 (the first update saw the lr rise
    # from nothing, and the EMAs read it a step late); steps 6-12 at 0.98
    want = 1 - rules.NOISE_BETA ** 5 * 0.98 ** 7
    assert torch.allclose(flat["s2w"], torch.full_like(flat["s2w"], want), atol=1e-6)
    assert torch.isfinite(flat["p"]).all() and not torch.equal(flat["p"], ref["p"])


@pytest.mark.parametrize("rule, ref_name, sparsity", [
    (lambda: research.BetaAfterLrWarmup(0.5, 0.98, wait=True).rule(), "auto", 0.97),
    (lambda: research.BetaAfterLrWarmup(0.25, 0.98).rule(), "catchup_agree_trust4_gain", 0.97),
    (lambda: research.BetaAfterLrWarmup(0.5, 0.98, trust_dense=0.25).rule(),
     "catchup_agree_trust4_gain", 0.97),
    (lambda: research.BetaAfterLrWarmup(0.5, 0.98, trust_dense=0.25).rule(),
     "catchup_agree_trust2_gain", 0.99)])
def test_the_variants_while_the_lr_rises(rule, ref_name, sparsity):
    """``wait=True`` (``auto_b98w``) masks as ``auto`` (at 0.97 it reads the summed wait), the
    quarter bound (``catchup_agree_trust4_gain_b98w``) moves as ``catchup_agree_trust4_gain``,
    and ``trust24`` as the quarter bound at 0.97 and the half bound at 0.99 (3 of each 256
    sent: above 0.974): bit for bit while the lr rises; at a flat lr each leaves its
    reference."""
    assert {"auto_b98w", "catchup_agree_trust4_gain_b98w",
            "catchup_agree_trust24_gain_b98w"} <= set(rules.RULES)
    # an lr large enough for the catch-up's bound to bind (the two bounds differ: below)
    rising = [2e-2 * (i + 1) for i in range(12)]
    rules.register("test-b98w-variant", rule(), replace=True)
    ref = _run(ref_name, rising, sparsity)
    _assert_same(ref, _run("test-b98w-variant", rising, sparsity))
    other = "catchup_agree_trust2_gain" if "trust4" in ref_name else "catchup_agree_trust4_gain"
    assert not torch.equal(ref["p"], _run(other, rising, sparsity)["p"])
    rules.register("test-b98w-variant", rule(), replace=True)
    flat = _run("test-b98w-variant", [0.1] * 12, sparsity)
    ref = _run(ref_name, [0.1] * 12, sparsity)
    assert torch.isfinite(flat["p"]).all() and not torch.equal(flat["p"], ref["p"])


@pytest.mark.parametrize("name, trust", [("catchup_agree_trust26_gain_b98w", 1 / 6),
                                         ("catchup_agree_trust28_gain_b98w", 0.125),
                                         ("catchup_agree_trust2cap_gain_b98w", 0.0)])
def test_the_tighter_bounds_up_to_0974(name, trust):
    """``trust26``, ``trust28`` and ``trust2cap`` at 0.97 (a mask of at least 1/39 of each
    block) move as the fresh-gain rule with the bound at 1/6 or 1/8 of the block RMS or at zero
    (no catch-up above ``sqrt(a + 1)`` steps) while the lr rises, bit for bit, and not as the
    quarter bound."""
    assert name in rules.RULES
    registered = research.RESEARCH_RULES[name].update.__self__  # the BetaAfterLrWarmup
    assert (registered.trust, registered.trust_dense, registered.beta) == (0.5, trust, 0.98)
    rules.register("test-tight-ref", rules.gain_selected(
        functools.partial(rules.catchup_agree, trust=trust), rules.gain_score), replace=True)
    rising = [2e-2 * (i + 1) for i in range(12)]
    ref = _run("test-tight-ref", rising, 0.97)
    # a fresh instance of the rule: it keeps its per-shard lr state
    rules.register("test-tight", research.BetaAfterLrWarmup(
        0.5, 0.98, trust_dense=trust).rule(), replace=True)
    _assert_same(ref, _run("test-tight", rising, 0.97))
    assert not torch.equal(ref["p"], _run("catchup_agree_trust4_gain", rising, 0.97)["p"])
