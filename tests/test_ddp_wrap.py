"""A model wrapped in DistributedDataParallel: the first ``step()`` raises on every rank with
the fix, or, with ``scape.skip_ddp_allreduce``, trains bit for bit like the unwrapped model
(each rank its own data, so a DDP all-reduce left on would change the result; real gloo
ranks)."""

from __future__ import annotations

import pytest
import torch
from dist import run_ranks
from torch.nn.parallel import DistributedDataParallel as DDP

import scape


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.Tanh(), torch.nn.Linear(40, 6))


def _run(rank: int, mode: str, kind: str = "scape") -> list[list[float]] | str:
    model = _model()
    if kind == "scape":
        opt = scape.SCAPE(model.parameters(), lr=1e-2, sparsity=0.9, block_size=256,
                          warmup_steps=2)
    else:
        opt = scape.DiLoCo(model.parameters(), torch.optim.AdamW(model.parameters(), lr=1e-2),
                           sync_every=2)
    net: torch.nn.Module = model
    if mode != "plain":
        net = DDP(model, gradient_as_bucket_view=(mode == "bucket_view"))
        if mode == "skip":
            scape.skip_ddp_allreduce(net)
    for t in range(4):
        g = torch.Generator().manual_seed(10 * t + rank)
        net(torch.randn(8, 24, generator=g)).square().mean().backward()
        try:
            opt.step()
        except ValueError as e:
            return str(e)
        opt.zero_grad()
    return [p.detach().flatten().tolist() for p in model.parameters()]


def _body(rank: int, world: int, kind: str) -> dict:
    return {mode: _run(rank, mode, kind) for mode in ("plain", "wrapped", "bucket_view", "skip")}


@pytest.mark.parametrize("kind", ["scape", "diloco"])
def test_ddp_wrap_raises_or_is_made_safe(kind):
    res = run_ranks(_body, 2, kind, timeout=180)
    for r in res:
        for mode in ("wrapped", "bucket_view"):
            assert isinstance(r[mode], str) and "skip_ddp_allreduce" in r[mode], r[mode]
        assert "counts the error-feedback residual twice" in r["bucket_view"]
        assert r["skip"] == r["plain"]  # bit for bit the unwrapped run
    assert res[0]["plain"] == res[1]["plain"]


def test_skip_refuses_bucket_views_and_non_ddp():
    with pytest.raises(TypeError, match="DistributedDataParallel"):
        scape.skip_ddp_allreduce(torch.nn.Linear(2, 2))
