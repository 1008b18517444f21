"""SparseLoCo and DiLoCo skip a sync on every rank when any rank's pseudo-gradient is
non-finite: ``theta_synced``, the error feedback and the outer momentum are unchanged, every
rank's parameters go back to ``theta_synced``, no byte is added, and the next sync trains on."""

from __future__ import annotations

import pytest
import torch
from dist import run_ranks

import scape

H = 2


def _build(kind: str, model: torch.nn.Module):
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if kind == "sparseloco":
        return scape.SparseLoCo(model.parameters(), inner, sync_every=H, density=0.05,
                                block_size=256)
    return scape.DiLoCo(model.parameters(), inner, sync_every=H)


def _body(rank: int, world: int, kind: str, bad_rank: int) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    opt = _build(kind, model)
    out: dict = {"skipped": [], "bytes": []}
    for t in range(1, 4 * H + 1):
        g = torch.Generator().manual_seed(100 * t + rank)
        model(torch.randn(8, 16, generator=g)).square().mean().backward()
        if t == 2 * H and rank == bad_rank:  # a bad batch on one rank: NaN in its gradient
            model[0].weight.grad[0, 0] = float("nan")
        if t == 2 * H:
            synced = opt.synced.clone()
            outer = {k: v.clone() for k, v in opt._outer_state().items()}
            ef = getattr(opt, "error_feedback", None)
            ef = None if ef is None else ef.clone()
        opt.step()
        opt.zero_grad()
        if t % H == 0:
            out["skipped"].append(opt.last_step.skipped)
            out["bytes"].append(opt.last_step.bytes)
        if t == 2 * H:
            assert torch.equal(opt.synced, synced)
            assert all(torch.equal(v, outer[k]) for k, v in opt._outer_state().items())
            if ef is not None:
                assert torch.equal(opt.error_feedback, ef)
            local = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            assert torch.equal(local, opt.synced[:local.numel()])
    assert all(bool(torch.isfinite(p).all()) for p in opt.synced.reshape(1, -1))
    out["synced"] = opt.synced.tolist()
    return out


@pytest.mark.parametrize("kind", ["sparseloco", "diloco"])
def test_nonfinite_pseudo_gradient_skips_the_sync_on_every_rank(kind):
    res = run_ranks(_body, 2, kind, 1, timeout=120)
    for r in res:
        assert r["skipped"] == [False, True, False, False]
        assert r["bytes"][1] == r["bytes"][0]  # no extra byte, the same collectives
    assert res[0]["synced"] == res[1]["synced"]
