"""Drift (scape.drift): the replicated forecast of unsent coordinates. Unit checks of its
state updates, then SCAPE with a drifting rule on real gloo ranks: identical models on every
rank, bytes of the plain formula, and bit-exact resume from ``state_dict()``."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist import run_ranks
from test_optimizer import _backward, _gather_cat, _grads, _params

import scape
from scape.drift import Drift, DriftSpec
from scape.optimizer import block_budget
from scape.rules import RULES


@pytest.mark.parametrize("gamma", [0.9, 0.99, 1.0])
def test_growth_is_the_geometric_sum(gamma):
    d = Drift(DriftSpec(gamma), torch.zeros(8))
    ages = torch.tensor([0, 1, 2, 5, 17, 100, 1000, 3], dtype=torch.int32)
    ref = torch.tensor([sum(gamma ** j for j in range(1, int(a) + 1)) for a in ages],
                       dtype=torch.float64)
    torch.testing.assert_close(d.growth(ages).double(), ref, rtol=2e-5, atol=1e-6)


def test_sync_and_apply():
    gen = torch.Generator().manual_seed(0)
    model = torch.randn(64, generator=gen)
    d = Drift(DriftSpec(0.9), model)
    anchor0 = model.clone()
    d.age.copy_(torch.randint(0, 9, (64,), generator=gen, dtype=torch.int32))
    age0 = d.age.clone()
    pos = torch.tensor([3, 10, 40])
    new = torch.randn(3, generator=gen)
    lr = 0.05
    d.sync_sparse(pos, new, lr)
    torch.testing.assert_close(d.vel[pos], (new - anchor0[pos]) / ((age0[pos] + 1) * lr))
    assert torch.equal(d.age[pos], torch.zeros(3, dtype=torch.int32))
    rest = torch.ones(64, dtype=torch.bool)
    rest[pos] = False
    assert torch.equal(d.age[rest], age0[rest] + 1) and bool((d.vel[rest] == 0).all())
    out = torch.full((64,), float("nan"))
    d.sync_dense(new.repeat(22)[:64], lr)  # every coordinate synced
    d.age.fill_(4)
    d.apply(out, lr)
    g4 = sum(0.9 ** j for j in range(1, 5))
    torch.testing.assert_close(out, d.anchor + lr * d.vel * g4)
    d.age[pos] = 0
    d.apply(out, lr)
    assert torch.equal(out[pos], d.anchor[pos])


def _drift_body(rank, world, update, steps, resume_at):
    block = 256
    sparsity = 0.9

    def build():
        params = _params(3)
        return params, scape.SCAPE(params, lr=1e-2, block_size=block, sparsity=sparsity,
                                   warmup_steps=2, update=update)

    params, opt = build()
    b = opt.buckets[0]
    k, _ = block_budget(sparsity, block, 0.1)
    K = (b.n_pad // block) * k
    saved = None
    traj = []
    for t in range(1, steps + 1):
        _backward(params, _grads(t, rank))
        opt.step()
        allp = _gather_cat(b.param_flat.view(torch.uint8), world).view(world, -1)
        assert bool((allp == allp[0]).all()), f"{update} step {t}: ranks differ"
        if not opt.last_step.dense:
            expect = {"reduce_scatter": K * 4, "all_gather": K * 6, "all_reduce": 8}
            assert opt.last_step.bytes == expect, (t, opt.last_step.bytes)
        traj.append(b.param_flat.clone())
        if t == resume_at:
            saved = (opt.state_dict(), [p.detach().clone() for p in params])
    # drifting: (almost) every coordinate moves at a sparse step, not only the mask's ~10%
    moved = float((traj[-1] != traj[-2])[: b.numel].float().mean())
    assert moved > 0.5 if RULES[update].drift else moved <= 1.0 - sparsity + 0.02, moved
    # resume: a fresh optimizer on the saved parameters and state continues bit-exactly
    assert saved is not None
    params2, opt2 = build()
    with torch.no_grad():
        for p, v in zip(params2, saved[1]):
            p.copy_(v)
    opt2.load_state_dict(saved[0])
    assert torch.equal(opt2.buckets[0].param_flat, traj[resume_at - 1])
    for t in range(resume_at + 1, steps + 1):
        _backward(params2, _grads(t, rank))
        opt2.step()
        assert torch.equal(opt2.buckets[0].param_flat, traj[t - 1]), f"resume differs at {t}"
    dist.barrier()
    return True


@pytest.mark.parametrize("update", ["drift_sqrt_accum", "drift_commit_sqrt_accum",
                                    "catchup_snr_accum"])
def test_drift_and_noise_rules_on_ranks(update):
    assert all(run_ranks(_drift_body, 2, update, 9, 5, timeout=240))
