"""bench.research.global_view: the owner's rule observes the ranks' mean buffer over its shard
(and ``hp["world"]`` 1); on one rank the hook changes nothing; on two ranks the first
observation is the mean of both ranks' gradients, and the replicas stay identical."""

from __future__ import annotations

import hashlib

import torch
from dist import run_ranks

import scape
from bench.research import global_view
from scape.rules.estimators import NOISE_BETA


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 96), torch.nn.Linear(96, 40))


def _train(opt: scape.SCAPE, model: torch.nn.Module, rank: int, steps: int) -> list[str]:
    hashes = []
    for t in range(steps):
        x = torch.randn(6, 32, generator=torch.Generator().manual_seed(1000 * t + rank))
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        opt.finish_param_sync()
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        hashes.append(hashlib.sha256(flat.numpy().tobytes()).hexdigest())
    return hashes


def test_on_one_rank_it_changes_nothing():
    runs = []
    for hooked in (False, True):
        model = _model()
        opt = scape.SCAPE(model.parameters(), lr=1e-2, sparsity=0.9, block_size=256)
        if hooked:
            global_view.factory(None, model, opt)
            assert isinstance(opt.level, global_view.GlobalView)
        runs.append(_train(opt, model, 0, 8))
    assert runs[0] == runs[1]


def _two_ranks(rank: int, world: int) -> dict:
    model = _model()
    opt = scape.SCAPE(model.parameters(), lr=1e-2, sparsity=0.9, block_size=256)
    global_view.factory(None, model, opt)
    x = torch.randn(6, 32, generator=torch.Generator().manual_seed(rank))
    model(x).square().mean().backward()
    b = opt.buckets[0]
    mine = b.grad_flat.detach().clone()  # this rank's gradient, before the step observes it
    every = [torch.full_like(mine, float("nan")) for _ in range(world)]
    torch.distributed.all_gather(every, mine)
    opt.step()
    opt.zero_grad()
    mu = opt.shards[0].extra["mu"].clone()
    expect = (1.0 - NOISE_BETA) * torch.stack(every).mean(0)[b.shard]
    return {"close": torch.allclose(mu, expect, rtol=1e-6, atol=1e-9),
            "own_only": torch.allclose(mu, (1.0 - NOISE_BETA) * mine[b.shard]),
            "hashes": _train(opt, model, rank, 6)}


def test_on_two_ranks_the_owner_observes_the_mean_and_replicas_agree():
    ranks = run_ranks(_two_ranks, 2, timeout=240)
    for r in ranks:
        assert r["close"], "the first observation is the ranks' mean gradient"
        assert not r["own_only"], "and not the owner's own"
        assert r["hashes"] == ranks[0]["hashes"], "replicas differ"
