"""gain_topk (the default rule's mask, score and selection fused): the Triton kernel (through
the interpreter on CPU) takes exactly the mask of blockwise_topk over gain_score on the same
backend, the CPU path that of the plain torch twins, ties and the explore part included; the
rule's ``select`` is the mask its ``score`` would give."""

from __future__ import annotations

import pytest
import torch
from conftest import nan_empty
from kernel_cases import brute_topk, gain_inputs, seeded

from bench.research import rules as research_rules
from scape import kernels, rules
from scape.kernels import reference as ref
from scape.rules import ShardState

CASES = [
    pytest.param(256, 3, 5, 1, True, id="b256-nb3-k5-x1-wait"),
    pytest.param(256, 2, 256, 0, False, id="b256-nb2-kB"),
    pytest.param(1024, 3, 11, 0, False, id="b1024-nb3-k11-ema"),
    pytest.param(4096, 2, 41, 4, True, id="b4096-nb2-k41-x4-wait"),
    pytest.param(8192, 1, 82, 8, True, id="b8192-nb1-k82-x8-wait"),
]


def _inputs(block_size, n_blocks, with_prev, key):
    gen = seeded("gain-topk", block_size, n_blocks, with_prev, key)
    n = block_size * n_blocks
    mu, s2, s2w, age = gain_inputs(gen, n)
    age[: n // 3] = age[: n // 3] % 4  # many equal ages: ties in the explore part
    prev = torch.randn(n, generator=gen) * 0.05 if with_prev else None
    return mu, s2, s2w, age, prev


@pytest.mark.parametrize("block_size,n_blocks,k,k_explore,with_prev", CASES)
def test_gain_topk_is_the_mask_of_the_score(kernel_backend, block_size, n_blocks, k, k_explore,
                                            with_prev):
    mu, s2, s2w, age, prev = _inputs(block_size, n_blocks, with_prev, k)
    before = [t.clone() for t in (mu, s2, s2w, age)]
    kw = dict(beta=0.95, beta1=0.9, world=4, prev=prev)
    got = {}
    for mode in ("triton", "torch"):
        kernel_backend(mode)
        score = kernels.gain_score(mu, s2, s2w, age, **kw)
        want = kernels.blockwise_topk(score, k, block_size, age=age if k_explore else None,
                                      k_explore=k_explore)
        got[mode] = kernels.gain_topk(mu, s2, s2w, age, k, block_size, k_explore=k_explore,
                                      **kw)
        assert got[mode].dtype == torch.int16 and got[mode].shape == (n_blocks, k)
        assert torch.equal(got[mode], want), f"{mode}: not the mask of the score"
    # the CPU path against the plain twins and a brute force selection
    span, scale = (1 + 0.95) / (1 - 0.95), (1 - 0.9) / (1 + 0.9) / 4
    score = ref.gain_score(mu, s2, s2w, age, span=span, var_m_scale=scale, prev=prev)
    assert torch.equal(got["torch"], ref.blockwise_topk(
        score, k, block_size, age=age if k_explore else None, k_explore=k_explore))
    assert torch.equal(got["torch"], brute_topk(score, k, block_size,
                                                age if k_explore else None, k_explore))
    rows = got["triton"].long()
    assert bool((rows[:, 1:] > rows[:, :-1]).all()), "offsets ascending and distinct"
    assert bool((score == 0).any()), "no ties at zero: the test cannot tell"
    assert all(torch.equal(a, b) for a, b in zip((mu, s2, s2w, age), before)), "inputs written"


def test_gain_topk_writes_the_score_into_out_on_the_two_kernel_path(kernel_backend):
    kernel_backend("torch")
    mu, s2, s2w, age, prev = _inputs(512, 3, True, "out")
    out = nan_empty(mu.numel())
    kernels.gain_topk(mu, s2, s2w, age, 7, 512, k_explore=1, beta=0.95, beta1=0.9, world=2,
                      prev=prev, out=out)
    assert torch.equal(out, kernels.gain_score(mu, s2, s2w, age, beta=0.95, beta1=0.9,
                                               world=2, prev=prev))


def test_gain_topk_validates():
    mu, s2, s2w, age, _ = _inputs(256, 2, False, "validate")
    kw = dict(beta=0.95, beta1=0.9, world=2)
    with pytest.raises(ValueError, match="k_explore must be in"):
        kernels.gain_topk(mu, s2, s2w, age, 3, 256, k_explore=4, **kw)
    with pytest.raises(ValueError, match="world must be an int >= 1"):
        kernels.gain_topk(mu, s2, s2w, age, 3, 256, beta=0.95, beta1=0.9, world=0)
    with pytest.raises(TypeError, match="age must have dtype torch.int32"):
        kernels.gain_topk(mu, s2, s2w, age.float(), 3, 256, **kw)
    with pytest.raises(ValueError, match="mu must have a positive multiple of block_size"):
        kernels.gain_topk(mu[:300], s2[:300], s2w[:300], age[:300], 3, 256, **kw)


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("rule", ["auto", "robust"])
@pytest.mark.parametrize("sparsity", [0.9, 0.99])
def test_rule_select_is_its_score_mask(kernel_backend, backend, rule, sparsity):
    """The research's ``auto`` and ``robust`` make their masks through ``select``; it gives
    the mask that ``blockwise_topk`` takes from their ``score``, which reads the mask's
    budget: the fresh gain above sparsity 0.974, the gain with the wait up to it
    (``reads_wait``)."""
    kernel_backend(backend)
    r = rules.get(rule)
    assert r.select is research_rules.gain_select_auto
    assert r.score is research_rules.gain_score_auto
    mu, s2, s2w, age, prev = _inputs(1024, 3, True, rule)
    shard = ShardState(master=torch.zeros_like(mu), m=torch.zeros_like(mu), age=age,
                       extra={"mu": mu, "s2": s2, "s2w": s2w, "prev": prev})
    hp = dict(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0, world=4)
    k, k_explore = rules.block_budget(sparsity, 1024, r.explore)
    idx = r.select(shard, hp, k, k_explore, 1024)
    score = r.score(shard, dict(hp, k=k, block_size=1024)).clone()
    want = rules.gain_score_residual if sparsity < 0.974 else rules.gain_score
    assert torch.equal(score, want(shard, hp))
    assert torch.equal(idx, kernels.blockwise_topk(score, k, 1024, age=age,
                                                   k_explore=k_explore))
    other = rules.gain_score if sparsity < 0.974 else rules.gain_score_residual
    assert not torch.equal(idx, kernels.blockwise_topk(other(shard, hp).clone(), k, 1024,
                                                       age=age, k_explore=k_explore))
