"""The product surface of ``update=``: the four built-in rules, the registration API that
research rules plug in through, and the rule fields that replaced optimizer arguments."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

import scape
from scape import rules


def _opt(update: str, seed: int = 0, n: int = 2048) -> tuple[torch.nn.Parameter, scape.SCAPE]:
    torch.manual_seed(seed)
    p = torch.nn.Parameter(torch.randn(n))
    return p, scape.SCAPE([p], lr=1e-3, sparsity=0.9, block_size=256, warmup_steps=2,
                          update=update)


def _train(p: torch.nn.Parameter, opt: scape.SCAPE, steps: int, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        p.grad = torch.randn(p.shape, generator=g) + 0.1
        opt.step()
    opt.finish_param_sync()


def test_constructor_surface():
    """At most 14 keyword arguments (the 12 of the surface before the start took the run's
    length, ``total_steps``, and the parameter wire its dtype, ``param_comm_dtype``) and a
    docstring of at most 30 lines that names every one."""
    sig = inspect.signature(scape.SCAPE.__init__)
    kw = [n for n, p in sig.parameters.items() if p.kind is inspect.Parameter.KEYWORD_ONLY]
    assert len(kw) <= 14, kw
    doc = inspect.getdoc(scape.SCAPE) or ""
    assert len(doc.splitlines()) <= 30, len(doc.splitlines())
    for name in kw:
        assert f"{name}:" in doc, name


def test_builtin_rules():
    assert rules.BUILTIN == ("agree", "sqrt", "lazy")
    for name in rules.BUILTIN:
        p, opt = _opt(name)
        assert opt.rule is rules.RULES[name] and opt.update == name
        assert set(opt.shards[0].extra) == set(opt.rule.extra)
        before = p.detach().clone()
        _train(p, opt, 6)
        assert not opt.last_step.dense and bool(torch.isfinite(p).all())
        assert not torch.equal(p.detach(), before)
    assert rules.RULES["agree"].extra == rules.GAIN_STATE  # 16 B per coordinate
    assert rules.RULES["sqrt"].extra == () and rules.RULES["lazy"].extra == ()


def test_register_and_use_a_rule():
    """A registered rule is used by name: a copy of ``lazy`` trains bit for bit like ``lazy``;
    ``explore`` and ``error_feedback`` are the rule's."""
    name = "test-lazy-copy"
    rules.register(name, dataclasses.replace(rules.RULES["lazy"]), replace=True)
    p1, a = _opt("lazy")
    p2, b = _opt(name)
    _train(p1, a, 6)
    _train(p2, b, 6)
    assert torch.equal(p1.detach(), p2.detach())
    quiet = "test-lazy-noef-explore0"
    rules.register(quiet, dataclasses.replace(rules.RULES["lazy"], explore=0.0,
                                             error_feedback=False), replace=True)
    p3, c = _opt(quiet)
    assert (c.explore, c.error_feedback) == (0.0, False)
    _train(p3, c, 6)
    assert float(c.buckets[0].grad_flat.abs().max()) == 0.0  # nothing kept for later
    assert c.masks[0].k_explore == 0 and a.masks[0].k_explore == round(0.1 * a.masks[0].k)


@pytest.mark.parametrize("args,err,words", [
    (("agree", rules.RULES["lazy"]), ValueError, "built-in"),
    (("has space", rules.RULES["lazy"]), ValueError, "without spaces"),
    (("", rules.RULES["lazy"]), ValueError, "without spaces"),
    (("x", "lazy"), TypeError, "scape.rules.Rule"),
])
def test_register_rejects_bad_input(args, err, words):
    with pytest.raises(err, match=words):
        rules.register(*args)


def test_register_refuses_to_overwrite_silently():
    rules.register("test-dup", rules.RULES["sqrt"], replace=True)
    rules.register("test-dup", rules.RULES["sqrt"])  # the same rule again: a no-op
    with pytest.raises(ValueError, match="already registered"):
        rules.register("test-dup", rules.RULES["lazy"])


@pytest.mark.parametrize("fields,err,words", [
    (dict(explore=1.5), ValueError, "Rule.explore"),
    (dict(explore=True), ValueError, "Rule.explore"),
    (dict(error_feedback=1), TypeError, "Rule.error_feedback"),
    (dict(extra=["prev"]), TypeError, "Rule.extra"),
    (dict(score=3), TypeError, "Rule.score"),
])
def test_rule_fields_are_validated(fields, err, words):
    with pytest.raises(err, match=words):
        rules.Rule(rules.lazy, **fields)


def test_unknown_rule_names_the_known_ones():
    with pytest.raises(ValueError, match="Invalid update rule: 'adam'.*'agree'"):
        scape.SCAPE([torch.nn.Parameter(torch.zeros(4))], lr=1e-3, update="adam")


@pytest.mark.parametrize("kw", ["explore", "error_feedback", "split", "split_every"])
def test_research_arguments_are_not_constructor_arguments(kw):
    with pytest.raises(TypeError, match=kw):
        scape.SCAPE([torch.nn.Parameter(torch.zeros(4))], lr=1e-3, **{kw: 0.1})


def test_research_names_are_aliases_of_the_builtins():
    """The research name of a built-in rule is the same rule object (same numerics); the
    research rules ``auto`` and ``robust`` switch between are rules of their own."""
    import bench.research.rules  # noqa: F401 (registers them)

    assert rules.RULES["catchup_sqrt_accum"] is rules.RULES["sqrt"]
    for name in ("catchup_agree_trust2_gainr", "catchup_agree_trust4_gainr",
                 "catchup_agree_trust2_gain", "catchup_agree_trust4_gain"):
        assert all(rules.RULES[name] is not rules.RULES[b] for b in rules.BUILTIN), name
