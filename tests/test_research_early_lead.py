"""The research rule ``early_lead``: ``early`` whose sent coordinates are put ahead of their
catch-up along their new step (``extra["lead"]``, taken off again at the next send). With no
lead it is ``early`` bit for bit; the offset points along the descent step (against the
moment), stays within ``early``'s bound, and changes only where a step sent."""

from __future__ import annotations

import copy

import pytest
import torch

import bench.research.rules as research
from scape import rules
from tests.test_rule_early import RISE_FALL, _build, _run, _same, _state, _steps


def _without_lead(state: dict) -> dict:
    return {k: v for k, v in state.items() if k != "lead"}


@pytest.mark.parametrize("sparsity", [0.97, 0.99])
def test_no_lead_is_early(sparsity):
    lrs = [10 * lr for lr in RISE_FALL]  # large enough for the bounds to bind
    zero = _run("early_lead0", lrs, sparsity)
    assert not zero["lead"].any()
    assert _same(_without_lead(zero), _run("early", lrs, sparsity))


@pytest.mark.parametrize("sparsity", [0.9, 0.97])
def test_the_lead_follows_the_step(sparsity):
    lrs = [10 * lr for lr in RISE_FALL]
    opt, params = _build("early_lead", sparsity, lrs[0])
    gen = torch.Generator().manual_seed(11)
    _steps(opt, params, lrs[:-1], gen)
    shard = opt.shards[0]
    before = shard.extra["lead"].clone()
    age = shard.age.clone()
    _steps(opt, params, lrs[-1:], gen)
    lead, sent = shard.extra["lead"], shard.age == 0
    assert torch.equal(lead[~sent], before[~sent])  # only the sent coordinates move
    assert lead[sent].count_nonzero() > 0.5 * int(sent.sum())
    assert (lead[sent] * shard.m[sent] <= 0).all()  # along the descent step
    bs = opt.block_size
    rms = shard.master.view(-1, bs).square().mean(dim=1).sqrt().repeat_interleave(bs)
    bound = rules.trust_bound(opt.masks[0].wait().shape[-1], bs) * rms
    assert (lead.abs() <= bound * (1 + 1e-5) + 1e-12)[sent].all()
    assert int((age[sent] > 0).sum()) > 0  # some of them had waited
    assert not _same(_without_lead(_run("early_lead", lrs, sparsity)),
                     _run("early", lrs, sparsity))


def test_the_offset_is_saved():
    """The offset is rule state (``extra``): a state dict carries it, and a run resumed from
    one continues as the uninterrupted run, bit for bit."""
    assert rules.get("early_lead").extra == rules.GAIN_STATE + ("lead",)
    assert 0.0 < research.LEAD <= 1.0
    lrs = [10 * lr for lr in RISE_FALL]
    whole, params = _build("early_lead", 0.97, lrs[0])
    gen = torch.Generator().manual_seed(11)
    _steps(whole, params, lrs[:8], gen)
    saved, at = copy.deepcopy(whole.state_dict()), [p.detach().clone() for p in params]
    state = torch.get_rng_state(), gen.get_state()
    masks = _steps(whole, params, lrs[8:], gen)
    assert whole.shards[0].extra["lead"].any()
    resumed, params2 = _build("early_lead", 0.97, lrs[0])
    with torch.no_grad():
        for p, v in zip(params2, at):
            p.copy_(v)
    resumed.load_state_dict(saved)
    torch.set_rng_state(state[0])
    gen.set_state(state[1])
    masks2 = _steps(resumed, params2, lrs[8:], gen)
    assert _same(_state(resumed, params2, masks2), _state(whole, params, masks))
