"""A gain rule's shard pass before the take (``Rule.observe_select``, one kernel on a
GPU): an optimizer that makes the next mask there ends every step bitwise where the same rule
made in three passes ends (state, ages, masks, parameters), on the torch and the Triton path,
on one rank and on two, through a skipped step; a rule whose update ignores the advanced ages
is refused."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from dist import run_ranks

import scape
from bench.research.rules import AUTO
from scape import rules
from scape.comm import TorchCommunicator
from scape.kernels import adams_sparse_
from scape.rules import builtin

UNFUSED = "auto-in-three-passes"
rules.register(UNFUSED, dataclasses.replace(AUTO, observe_select=None),
               replace=True)
BY_SCORE = "auto-by-score"
rules.register(BY_SCORE, dataclasses.replace(AUTO, observe_select=None,
                                             select=None), replace=True)


def _run(update: str, steps: int, comm=None, rank: int = 0, nan_at: int = 7,
         sparsity: float = 0.97) -> dict:
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(4096))
    q = torch.nn.Parameter(torch.randn(33, 31))  # a second bucket entry, padded
    opt = scape.SCAPE([p, q], lr=3e-3, sparsity=sparsity, block_size=256, warmup_steps=3,
                      update=update, max_grad_norm=1.0, comm=comm)
    opt.ramp_steps = 0  # the rule at ``sparsity`` from the first sparse step
    g = torch.Generator().manual_seed(100 + rank)
    masks = []
    for t in range(1, steps + 1):
        p.grad = torch.randn(4096, generator=g) * 0.1 + 0.05 * torch.sign(p.detach())
        q.grad = torch.randn(33, 31, generator=g)
        if t == nan_at and rank == 0:
            p.grad[17] = float("nan")
        opt.step()
        assert opt.last_step.skipped == (t == nan_at)
        m = opt.masks[0]
        masks.append(None if m.next is None else m.wait().clone())
    s = opt.shards[0]
    return {"p": p.detach().clone(), "q": q.detach().clone(), "m": s.m.clone(),
            "age": s.age.clone(), **{k: v.clone() for k, v in s.extra.items()},
            "masks": masks}


@pytest.mark.parametrize("sparsity", [0.97, 0.99])  # the masks with and without the wait
@pytest.mark.parametrize("mode", ["torch", "triton"])
def test_fused_step_equals_three_passes(monkeypatch, kernel_backend, mode, sparsity):
    kernel_backend(mode)
    calls = []
    fused_op = builtin.noise_gain_topk_  # what observe_select_gain calls
    monkeypatch.setattr(builtin, "noise_gain_topk_",
                        lambda *a, **kw: calls.append(kw["residual"]) or fused_op(*a, **kw))
    fused = _run("auto", 12, sparsity=sparsity)
    assert calls == [sparsity < 0.974] * (12 - 3), "the fused pass runs on every sparse " \
        "step (the skipped one's ages are put back)"
    three = _run(UNFUSED, 12, sparsity=sparsity)
    assert len(calls) == 12 - 3
    for name in fused:
        if name == "masks":
            continue
        torch.testing.assert_close(fused[name], three[name], rtol=0, atol=0, msg=name)
    assert all((a is None and b is None) or torch.equal(a, b)
               for a, b in zip(fused["masks"], three["masks"]))
    assert int((fused["age"] == 0).sum()) > 0 and float(fused["mu"].abs().sum()) > 0


def _ranks_body(rank: int, world: int) -> dict:
    out = {}
    for update in ("auto", UNFUSED):
        r = _run(update, 10, TorchCommunicator(), rank, nan_at=6)
        out[update] = {k: v.numpy() for k, v in r.items() if k != "masks"}
    return out


def test_fused_step_equals_three_passes_on_two_ranks():
    res = run_ranks(_ranks_body, 2, timeout=120)
    for r in res:
        for name, a in r["auto"].items():
            assert (a == r[UNFUSED][name]).all(), name
    assert (res[0]["auto"]["p"] == res[1]["auto"]["p"]).all()


@pytest.mark.parametrize("rule,trust", [("auto", 2), ("robust", 4)])
@pytest.mark.parametrize("sparsity,twin,other", [(0.99, "gain", "gainr"),
                                                 (0.97, "gainr", "gain")])
def test_the_builtin_masks_read_the_wait_from_one_39th_of_a_block(rule, trust, sparsity, twin,
                                                                  other):
    """``auto`` and ``robust`` train bit for bit as the research rule with the fresh gain
    above sparsity 0.974 (3 of 256 per block at 0.99) and as the one with the summed wait up
    to it (8 of 256 at 0.97), and the two differ, so the switch is what the test sees."""
    import bench.research.rules  # noqa: F401 (registers the twins)

    k99, k97 = (rules.block_budget(s, 256, 0.1)[0] for s in (0.99, 0.97))
    assert not rules.reads_wait(k99, 256) and rules.reads_wait(k97, 256)
    got = _run(rule, 10, sparsity=sparsity)
    want = _run(f"catchup_agree_trust{trust}_{twin}", 10, sparsity=sparsity)
    for name in ("p", "q", "m", "age", "mu", "s2", "s2w", "prev"):
        assert torch.equal(got[name], want[name]), name
    assert all((a is None and b is None) or torch.equal(a, b)
               for a, b in zip(got["masks"], want["masks"]))
    assert not torch.equal(got["p"], _run(f"catchup_agree_trust{trust}_{other}", 10,
                                          sparsity=sparsity)["p"])


@pytest.mark.parametrize("sparsity", [0.97, 0.99])
def test_auto_without_select_masks_by_its_score_alike(sparsity):
    """A copy of ``auto`` without ``select`` (its masks ``blockwise_topk`` of ``Rule.score``)
    trains bit for bit as ``auto`` on both sides of the switch: the score reads the mask's
    budget as the fused selection does."""
    got, want = _run(BY_SCORE, 10, sparsity=sparsity), _run("auto", 10, sparsity=sparsity)
    for name in ("p", "q", "m", "age", "mu", "s2", "s2w", "prev"):
        assert torch.equal(got[name], want[name]), name
    assert all((a is None and b is None) or torch.equal(a, b)
               for a, b in zip(got["masks"], want["masks"]))


def test_update_that_ignores_the_advanced_ages_is_refused():
    def plain_update(shard, g, idx, block_size, hp, model_out):
        adams_sparse_(shard.master, shard.m, shard.age, g, idx, block_size, lr=hp["lr"],
                      beta1=hp["beta1"], beta2=hp["beta2"], eps=hp["eps"],
                      weight_decay=hp["weight_decay"], model_out=model_out)

    rules.register("fused-but-plain", dataclasses.replace(AUTO,
                                                          update=plain_update), replace=True)
    with pytest.raises(RuntimeError, match="did not take shard.age_at_mask"):
        _run("fused-but-plain", 6, nan_at=-1)
