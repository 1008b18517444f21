"""``early_probe`` (:mod:`bench.research.probe`): it trains bit for bit as ``early``, and what
it records per block holds together (every send counted, steps taken never above steps asked,
a send cut only where the bound is below what was asked)."""

from __future__ import annotations

import json

import pytest
import torch

import bench.research.rules  # noqa: F401  (registers early_probe)
import scape
from bench.research import probe

LRS = [2e-2 * (i + 1) for i in range(4)] + [8e-2 - 1e-2 * (i + 1) for i in range(6)]
"""An lr that rises, then falls; large enough for the 1/8 bound to cut some sends."""


def _run(update: str, sparsity: float) -> tuple[list[torch.Tensor], scape.SCAPE]:
    torch.manual_seed(5)
    params = [torch.nn.Parameter(torch.randn(3 * 256)), torch.nn.Parameter(torch.randn(40, 9))]
    opt = scape.SCAPE(params, lr=LRS[0], sparsity=sparsity, block_size=256, warmup_steps=1,
                      weight_decay=0.1, update=update)
    opt.ramp_steps = 0  # the rule at ``sparsity`` from the first sparse step
    g = torch.Generator().manual_seed(2)
    for lr in LRS:
        opt.param_groups[0]["lr"] = lr
        for p in params:
            p.grad = torch.randn(p.shape, generator=g) * 0.1 + 0.05 * torch.sign(p.detach())
        opt.step()
    return [p.detach().clone() for p in params], opt


@pytest.mark.parametrize("sparsity", [0.9, 0.99])
def test_probe_trains_as_early_and_counts_every_send(sparsity, tmp_path, monkeypatch):
    monkeypatch.setenv("SCAPE_PROBE_DIR", str(tmp_path))
    monkeypatch.setattr(probe, "WINDOW", 3)
    monkeypatch.setattr(probe, "_STATE", {})
    early, _ = _run("early", sparsity)
    probed, opt = _run("early_probe", sparsity)
    assert all(torch.equal(a, b) for a, b in zip(early, probed))
    files = list(tmp_path.glob("*.jsonl"))
    assert len(files) == 1
    lines = [json.loads(x) for x in files[0].read_text().splitlines()]
    sparse_steps = len(LRS) - 1  # one dense step
    assert [ln["sparse_steps"] for ln in lines] == list(range(3, sparse_steps + 1, 3))
    n_blocks = opt.buckets[0].shard_size // 256
    k = opt.masks[0].wait().shape[1]
    for ln in lines:
        sent, asked, taken = (torch.tensor(ln[f]) for f in ("sent", "asked", "taken"))
        wait, cut = torch.tensor(ln["wait"]), torch.tensor(ln["cut"])
        assert sent.shape == (n_blocks,) and torch.all(sent == 3 * k)
        assert torch.all(wait >= sent) and torch.all(asked >= sent)  # a1 >= 1, asked >= 1
        assert torch.all(taken <= asked + 1e-6) and torch.all(asked <= wait + 1e-6)
        assert torch.all((cut >= 0) & (cut <= sent))
        assert torch.all((cut > 0) == (taken < asked - 1e-6))
    assert sum(sum(ln["cut"]) for ln in lines) > 0 or sparsity > 0.974  # the 1/8 bound binds


def test_summarize_maps_blocks_to_parameter_kinds():
    model = torch.nn.Module()
    model.tok_emb = torch.nn.Embedding(16, 32)  # 512 coordinates: blocks 0-1 of 256
    model.norm = torch.nn.LayerNorm(24)  # 48 at the start of block 2 ...
    model.head = torch.nn.Linear(32, 20, bias=False)  # ... whose other 208 are the head's
    line = {"rank": 0, "sparse_steps": 5, "numel": 1280, "sent": [2.0] * 5,
            "wait": [4.0, 4.0, 10.0, 10.0, 10.0], "asked": [2.0] * 5, "taken": [2.0] * 5,
            "cut": [0.0, 0.0, 1.0, 1.0, 2.0]}
    table = probe.summarize([line], model, world=1, block_size=256)
    assert set(table) == {"tok_emb", "head"}
    assert table["tok_emb"]["wait"] == [2.0] and table["tok_emb"]["cut"] == [0.0]
    assert table["head"]["wait"] == [5.0] and table["head"]["cut"] == [4.0 / 6.0]
