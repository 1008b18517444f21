"""The main job's pieces: the raw-gradient top-k baseline against a from-scratch reference on
2 ranks, the run engine's configuration, schedule and byte accounting, and the compare table."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from dist import run_ranks

from bench.compare import build_table, evaluate_targets, parse_name
from bench.runner import RunConfig, lr_at, summarize
from bench.topk_baseline import TopKAdamS

SIZES = (700, 1300, 45)  # three parameters; the buffer is padded to a multiple of W*B
BLOCK = 256
SPARSITY = 0.95
STEPS = 4
HP = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _params() -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(123)
    return [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in SIZES]


def _grads(rank: int, step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * rank + step)
    return [torch.randn(n, generator=gen) for n in SIZES]


def _topk_body(rank: int, world: int, warmup: int) -> dict:
    from scape.comm import TorchCommunicator

    params = _params()
    opt = TopKAdamS(params, sparsity=SPARSITY, block_size=BLOCK, warmup_steps=warmup,
                    comm=TorchCommunicator(timeout=30), **HP)
    out: dict = {"params": [], "residual": [], "bytes": [], "k": opt.k,
                 "n_pad": opt.buckets[0].n_pad}
    for step in range(STEPS):
        for p, g in zip(params, _grads(rank, step)):
            p.grad.add_(g)  # p.grad is a view into the flat buffer: backward's behaviour
        opt.step()
        opt.zero_grad()
        # numpy arrays pickle by value (tensors would travel as shared-memory handles)
        out["params"].append(torch.cat([p.detach().flatten() for p in params]).numpy().copy())
        out["residual"].append(opt.buckets[0].grad_flat.numpy().copy())
        out["bytes"].append(dict(opt.last_step.bytes))
    return out


def _reference(world: int, n_pad: int, k: int, warmup: int) -> list[torch.Tensor]:
    """Float64 replay: per rank top-k of |grad + residual| by torch.topk, averaged sum,
    AdamS (DESIGN §1) on every coordinate."""
    n = sum(SIZES)
    p = torch.cat([t.detach().flatten() for t in _params()]).double()
    p = torch.cat([p, torch.zeros(n_pad - n, dtype=torch.float64)])
    m = torch.zeros(n_pad, dtype=torch.float64)
    residual = [torch.zeros(n_pad, dtype=torch.float64) for _ in range(world)]
    b1, b2 = HP["betas"]
    out = []
    for step in range(STEPS):
        g = torch.zeros(n_pad, dtype=torch.float64)
        for r in range(world):
            buf = residual[r] + torch.cat([torch.cat(_grads(r, step)).double(),
                                           torch.zeros(n_pad - n, dtype=torch.float64)])
            if step < warmup:
                g += buf / world
                residual[r] = torch.zeros_like(buf)
                continue
            blocks = buf.view(-1, BLOCK)
            top = blocks.abs().topk(k, dim=1).indices
            sent = torch.zeros_like(blocks).scatter_(1, top, blocks.gather(1, top))
            g += sent.view(-1) / world
            residual[r] = (blocks - sent).view(-1)
        v = b2 * m * m + (1 - b2) * g * g
        m = b1 * m + (1 - b1) * g
        p = p - HP["lr"] * (m / (v.sqrt() + HP["eps"]) + HP["weight_decay"] * p)
        out.append(p[:n].clone())
    return out


@pytest.mark.parametrize("warmup", [pytest.param(0, id="sparse"),
                                    pytest.param(1, id="dense-warmup-then-sparse")])
def test_topk_baseline_matches_reference(warmup):
    world = 2
    res = run_ranks(_topk_body, world, warmup, timeout=120)
    for r in res:
        r["params"] = [torch.from_numpy(a) for a in r["params"]]
        r["residual"] = [torch.from_numpy(a) for a in r["residual"]]
    k, n_pad = res[0]["k"], res[0]["n_pad"]
    assert k == max(1, round((1 - SPARSITY) * BLOCK))
    assert n_pad % (world * BLOCK) == 0 and n_pad >= sum(SIZES)
    ref = _reference(world, n_pad, k, warmup)
    n_blocks = n_pad // BLOCK
    for step in range(STEPS):
        # every rank holds the same parameters, bit for bit
        assert torch.equal(res[0]["params"][step], res[1]["params"][step])
        torch.testing.assert_close(res[0]["params"][step][:sum(SIZES)].double(), ref[step],
                                   rtol=1e-5, atol=1e-6)
        if step < warmup:
            assert res[0]["bytes"][step] == {"reduce_scatter": n_pad * 4, "all_gather": n_pad * 4}
            for r in range(world):
                assert not res[r]["residual"][step].any()
        else:
            # one all-gather of W * K (fp32 value + int16 offset) pairs
            assert res[0]["bytes"][step] == {"all_gather": world * n_blocks * k * 6}
            # error feedback: a sparse step takes exactly k coordinates per block, so at most
            # BLOCK - k residual entries per block can be non-zero
            for r in range(world):
                nz = (res[r]["residual"][step].view(n_blocks, BLOCK) != 0).sum(1)
                assert int(nz.max()) <= BLOCK - k


def test_topk_baseline_validation():
    p = [torch.nn.Parameter(torch.zeros(10))]
    with pytest.raises(ValueError, match="sparsity.*got 1.0"):
        TopKAdamS(p, lr=1e-3, sparsity=1.0)
    with pytest.raises(ValueError, match="block_size.*got 300"):
        TopKAdamS(p, lr=1e-3, block_size=300)
    with pytest.raises(ValueError, match="warmup_steps.*got -1"):
        TopKAdamS(p, lr=1e-3, warmup_steps=-1)
    with pytest.raises(ValueError, match="learning rate.*got 0"):
        TopKAdamS(p, lr=0)


@pytest.mark.parametrize("field, value, match", [
    pytest.param("optimizer", "sgd", "optimizer must be one of", id="optimizer"),
    pytest.param("world", 0, "world must be a positive int, got 0", id="world"),
    pytest.param("sparsity", 1.0, r"sparsity must be in \[0, 1\), got 1.0", id="sparsity"),
    pytest.param("seq", 4096, "seq must be <= the small preset's seq_len 128", id="seq"),
    pytest.param("model", "huge", "model must be one of", id="model"),
    pytest.param("timing_skip", 100, r"timing_skip must be in \[0, steps=100\)", id="skip"),
])
def test_runconfig_validation(field, value, match):
    with pytest.raises(ValueError, match=match):
        RunConfig(**{field: value})


def test_runconfig_json_round_trip_and_unknown_field():
    cfg = RunConfig(optimizer="topk", sparsity=0.9, optimizer_kwargs={"warmup_steps": 3},
                    steps=10)
    import dataclasses
    import json

    again = RunConfig.from_dict(json.loads(json.dumps(dataclasses.asdict(cfg))))
    assert again == cfg and again.label == "topk-0.9" and again.skip == 5
    with pytest.raises(ValueError, match=r"unknown fields \['stepz'\]"):
        RunConfig.from_dict({"stepz": 3})


@pytest.mark.parametrize("steps", [10, 60, 1000])
def test_lr_schedule_warmup_then_cosine_to_ten_percent(steps):
    cfg = RunConfig(steps=steps, lr=2e-3, warmup_frac=0.05)
    lrs = [lr_at(s, cfg) for s in range(steps)]
    warm = max(1, int(0.05 * steps))
    assert all(b > a for a, b in zip(lrs[:warm], lrs[1:warm]))  # rising
    assert math.isclose(max(lrs), 2e-3)
    assert all(b <= a + 1e-15 for a, b in zip(lrs[warm:], lrs[warm + 1:]))  # then falling
    assert lrs[-1] >= 0.1 * 2e-3 and lrs[-1] < 0.1 * 2e-3 + 0.9 * 2e-3 * (1 - math.cos(
        math.pi / max(1, steps - warm))) / 2 + 1e-12


def _fake_rank(step_s: list[float], wait_s: list[float], nbytes: list[dict]) -> dict:
    return {"records": [{"step_s": s, "wait_s": w, "bytes": b, "train_loss": 1.0,
                         "dense": i < 2}
                        for i, (s, w, b) in enumerate(zip(step_s, wait_s, nbytes))],
            "val_curve": [(5, 2.0)], "params": 100, "wall_s": 1.0, "phases": []}


def test_summarize_uses_the_steady_window():
    gen = torch.Generator().manual_seed(5)
    steps = 9
    step_s = (torch.rand(steps, generator=gen) + 0.5).tolist()
    wait_s = (torch.rand(steps, generator=gen) * 0.4).tolist()
    nbytes = [{"reduce_scatter": 1000, "all_gather": 1000}] * 2 + \
        [{"reduce_scatter": 10, "all_gather": 15, "all_reduce": 8}] * (steps - 2)
    cfg = RunConfig(steps=steps, world=2, timing_skip=3)
    ranks = [_fake_rank(step_s, wait_s, nbytes), _fake_rank(step_s[::-1], wait_s, nbytes)]
    s = summarize(cfg, ranks, 2.0)
    window = slice(3, steps)
    assert s["median_step_s"] == pytest.approx(float(np.median(step_s[window])))
    compute = [a - b for a, b in zip(step_s[window], wait_s[window])]
    assert s["median_compute_s"] == pytest.approx(float(np.median(compute)))
    assert s["bytes_per_step"] == {"reduce_scatter": 10, "all_gather": 15, "all_reduce": 8}
    assert s["bytes_per_step_total"] == 33
    assert s["bytes_per_step_mean_all_steps"] == pytest.approx(
        sum(sum(b.values()) for b in nbytes) / steps)
    assert s["timing_window"] == [4, steps] and s["dense_steps"] == 2


def test_compare_table_and_targets():
    gen = torch.Generator().manual_seed(9)
    names = ["adams", "scape-0.99", "topk-0.99", "compute_only"]
    vals = torch.rand(len(names), 3, generator=gen) + 0.5
    runs = [{"name": n, "config": {"optimizer": parse_name(n)[0], "sparsity": parse_name(n)[1]},
             "final_val_loss": None if n == "compute_only" else float(v[0]),
             "bytes_per_step_total": float(v[1]) * 1e4, "median_step_s": float(v[2]),
             "median_compute_s": float(v[2]) / 2} for n, v in zip(names, vals)]
    table = {row["name"]: row for row in build_table(runs)}
    assert table["adams"]["val_ratio_to_adams"] == 1.0
    assert table["scape-0.99"]["bytes_ratio_to_adams"] == pytest.approx(
        runs[1]["bytes_per_step_total"] / runs[0]["bytes_per_step_total"])
    assert table["compute_only"]["step_ratio_to_compute_only"] == 1.0
    assert table["compute_only"]["val_ratio_to_adams"] is None
    targets = {t["target"].split(" <")[0].split(" >")[0]: t for t in evaluate_targets(runs)}
    step = targets["scape-0.99 step time / compute_only"]
    assert step["value"] == pytest.approx(runs[1]["median_step_s"] / runs[3]["median_step_s"])
    assert step["met"] == (step["value"] <= 1.15)
    assert targets["scape-0.9 val loss / adams val loss"]["met"] is None  # not run


@pytest.mark.parametrize("name, expected", [("scape-0.9", ("scape", 0.9)),
                                            ("adamw_ddp", ("adamw_ddp", 0.0)),
                                            ("compute_only", ("compute_only", 0.99))])
def test_parse_name(name, expected):
    assert parse_name(name) == expected


def test_parse_name_rejects():
    with pytest.raises(ValueError, match="unknown optimizer 'sgd'"):
        parse_name("sgd")
    with pytest.raises(ValueError, match="needs a sparsity"):
        parse_name("scape")
