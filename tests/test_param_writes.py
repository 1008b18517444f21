"""Parameters written outside the optimizer after it was built (``model.load_state_dict``,
in-place edits) are adopted as the new master weights, on real gloo ranks, in both sync modes
(waited in ``step()``, and through ``attach``), across dense and sparse steps."""

from __future__ import annotations

import pytest
import torch
from dist import run_ranks

import scape


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.Tanh(), torch.nn.Linear(40, 6))


def _step(model, opt, t: int, rank: int) -> None:
    g = torch.Generator().manual_seed(100 * t + rank)
    model(torch.randn(8, 24, generator=g)).square().mean().backward()
    opt.step()
    opt.zero_grad()


def _body(rank: int, world: int, attach: bool, write_at: int) -> list[list[float]]:
    model = _model()
    opt = scape.SCAPE(model.parameters(), lr=1e-3, sparsity=0.9, block_size=256,
                      warmup_steps=2)
    if attach:
        opt.attach(model)
    for t in range(1, 7):
        if t == write_at:  # every rank loads the same weights, as from a checkpoint
            loaded = {k: torch.full_like(v, 0.25) for k, v in model.state_dict().items()}
            model.load_state_dict(loaded)
            for g in opt.param_groups:
                g["lr"] = 1e-7
        _step(model, opt, t, rank)
    opt.finish_param_sync()
    for b, s in zip(opt.buckets, opt.shards):  # the rank's shard was adopted (padding: 0)
        real = max(0, min(b.shard_size, b.numel - b.shard_start))
        assert float((s.master[:real] - 0.25).abs().max()) < 1e-4
        assert not bool(s.master[real:].any())
    return [p.detach().flatten().tolist() for p in model.parameters()]


@pytest.mark.parametrize("attach", [False, True], ids=["waited", "attached"])
@pytest.mark.parametrize("write_at", [2, 5], ids=["before_dense_step", "before_sparse_step"])
def test_written_weights_are_adopted_on_every_rank(attach, write_at):
    res = run_ranks(_body, 2, attach, write_at, timeout=120)
    assert res[0] == res[1]  # the replicas agree
    for p in res[0]:
        assert max(abs(x - 0.25) for x in p) < 1e-4  # trained from the written weights


def test_unwritten_parameters_keep_the_optimizer_values():
    """No write, no adoption: the master weights stay the optimizer's fp32 values (a bf16
    model would otherwise lose their low bits at every step)."""
    model = _model().to(torch.bfloat16)
    opt = scape.SCAPE(model.parameters(), lr=1e-3, sparsity=0.9, block_size=256,
                      warmup_steps=2)
    for t in range(1, 6):
        g = torch.Generator().manual_seed(t)
        model(torch.randn(8, 24, generator=g).bfloat16()).float().square().mean().backward()
        opt.step()
    master = opt.shards[0].master
    assert not torch.equal(master, master.to(torch.bfloat16).float())  # fp32 bits kept


def test_model_moved_after_construction_keeps_training():
    """``model.to("cpu:0")`` after building the optimizer (as the Hugging Face Trainer does)
    copies the parameters out of the optimizer's buffer: the next step puts them back and
    trains them, bit for bit like a run without the move."""
    runs = []
    for move in (False, True):
        model = _model()
        opt = scape.SCAPE(model.parameters(), lr=1e-2, sparsity=0.9, block_size=256,
                          warmup_steps=2)
        if move:
            model.to("cpu:0")
            flat = opt.buckets[0].param_flat
            assert model[0].weight.data_ptr() != flat.data_ptr()  # really copied out
        for t in range(1, 6):
            _step(model, opt, t, 0)
        runs.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    assert model[0].weight.data_ptr() == opt.buckets[0].param_flat.data_ptr()


def test_model_moved_to_another_dtype_raises_with_the_fix():
    model = _model()
    opt = scape.SCAPE(model.parameters(), lr=1e-2, sparsity=0.9, block_size=256,
                      warmup_steps=2)
    model.to(torch.float64)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    with pytest.raises(ValueError, match="before building the optimizer"):
        opt.step()


def test_attached_model_state_dict_is_current():
    """With ``attach``, ``model.state_dict()`` right after ``step()`` (before any forward)
    holds the parameters of that step, not the ones before it."""
    model = _model()
    opt = scape.SCAPE(model.parameters(), lr=1e-2, sparsity=0.9, block_size=256,
                      warmup_steps=2)
    opt.attach(model)
    for t in range(1, 5):
        g = torch.Generator().manual_seed(t)
        model(torch.randn(8, 24, generator=g)).square().mean().backward()
        opt.step()
        saved = {k: v.clone() for k, v in model.state_dict().items()}
        s = opt.shards[0]
        flat = torch.cat([saved[k].reshape(-1) for k in ("0.weight", "0.bias", "2.weight",
                                                          "2.bias")])
        assert torch.equal(flat, s.master[:flat.numel()]), t  # one rank owns everything
