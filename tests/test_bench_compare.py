"""The main job's pieces: the raw-gradient top-k baseline against a from-scratch reference on
2 ranks, the run engine's configuration, schedule and byte accounting, and the compare table."""

from __future__ import annotations

import argparse
import json
import math

import numpy as np
import pytest
import torch
from dist import run_ranks

import bench.research  # noqa: F401 (registers the research rows named below)
from bench.compare import QUALITY, make_configs, resolve_device, sync_warnings
from bench.compare_report import (
    evaluate_targets,
    formula_bytes,
    headline,
    quality_table,
    render_markdown,
    speed_table,
)
from bench.engine.rows import ROWS, resolve
from bench.engine.runner import RunConfig, lr_at, summarize
from bench.engine.topk_baseline import TopKAdamS

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
    pytest.param("group_sparsity", {"lm_head": 0.9}, "unknown group 'lm_head'", id="group-name"),
    pytest.param("group_sparsity", {"head": 0.9}, "group 'head' needs an untied model",
                 id="group-head-tied"),
    pytest.param("group_sparsity", {"embed": 1.0}, r"sparsity\['embed'\] must be in \[0, 1\)",
                 id="group-value"),
])
def test_runconfig_validation(field, value, match):
    with pytest.raises(ValueError, match=match):
        RunConfig(**{field: value})
    with pytest.raises(ValueError, match="group_sparsity applies to the scape"):
        RunConfig(optimizer="adams", group_sparsity={"embed": 0.9})


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


def _fake_run(name: str, loss: float | None, nbytes: float, step_s: float) -> dict:
    fields = resolve(name)[1]
    return {"name": name, "config": {"optimizer": fields["optimizer"],
                                     "sparsity": fields["sparsity"]}, "params": 1000,
            "final_val_loss": loss, "val_curve": [] if loss is None else [[4, loss]],
            "bytes_per_step_total": nbytes, "bytes_per_step_mean_all_steps": nbytes,
            "median_step_s": step_s, "median_wait_s": step_s / 3,
            "median_compute_s": step_s * 2 / 3, "timing_window": [2, 4],
            "step_s": [9.0, step_s, step_s, step_s], "n_pad": None, "phases": [],
            "optimizer_settings": {}}


def test_compare_tables_targets_and_headline():
    gen = torch.Generator().manual_seed(9)
    names = ["adams", "scape-0.99", "topk-0.99", "compute_only"]
    v = (torch.rand(len(names), 3, generator=gen) + 0.5).tolist()
    quality = [_fake_run(n, a, c * 1e4, b) for n, (a, b, c) in zip(names[:3], v)]
    speed = [_fake_run(n, a, c * 1e4, b) for n, (a, b, c) in zip(names, v)]
    q = {row["name"]: row for row in quality_table(quality)}
    s = {row["name"]: row for row in speed_table(speed, world=4)}
    assert q["adams"]["val_ratio_to_adams"] == 1.0
    assert q["scape-0.99"]["val_ratio_to_adams"] == pytest.approx(v[1][0] / v[0][0])
    assert s["scape-0.99"]["bytes_ratio_to_adams"] == pytest.approx(v[1][2] / v[0][2])
    assert s["scape-0.99"]["speedup_over_adams"] == pytest.approx(v[0][1] / v[1][1])
    assert s["compute_only"]["step_ratio_to_compute_only"] == 1.0
    assert s["scape-0.99"]["bytes_formula"] is None  # no layout in the record
    targets = {t["target"].split(" <")[0].split(" >")[0]: t
               for t in evaluate_targets(list(q.values()), list(s.values()))}
    step = targets["scape-0.99 step time / compute_only"]
    assert step["value"] == pytest.approx(v[1][1] / v[3][1])
    assert step["met"] == (step["value"] <= 1.15)
    loss = targets["scape-0.99 val loss / topk-0.99 val loss"]
    assert loss["value"] == pytest.approx(v[1][0] / v[2][0])
    assert targets["scape-0.9 val loss / adams val loss"]["met"] is None  # not run
    report = {"quality": {"table": list(q.values()), "workload": {"steps": 600}},
              "speed": {"table": list(s.values()), "link": {"requested": "100mbit"}},
              "update": "agree"}
    head = headline(report)
    assert head["loss_ratio"] == q["scape-0.99"]["val_ratio_to_adams"]
    assert head["speedup"] == s["scape-0.99"]["speedup_over_adams"]
    assert f"1/{v[0][2] / v[1][2]:.1f} of dense" in head["text"]
    assert "after 600 steps" in head["text"] and "on a 100mbit link" in head["text"]
    assert "no headline" in headline({"quality": None, "speed": None})["text"]


@pytest.mark.parametrize("opt, sparsity, expected", [
    ("adamw_ddp", 0.0, 2 * 4 * 70_000),
    ("adams", 0.0, 8 * 81_920 + 8),
    ("dist_adamw", 0.0, 8 * 81_920 + 8),
    # 20 blocks of 4096; k_b = round_half_up(0.01 * 4096) = 41; 0.9: 410; 8 bytes of values
    # per entry, and each of the 4 ranks' 5 mask rows in Elias-Fano code (k_b = 41: 6 low
    # bits each and 41 + 63 bitmap bits, 350 bits -> 44 bytes a row; 410: 3 low bits and
    # 410 + 511, 2151 bits -> 269 bytes), and each rank's count and sum of squares (4 * 8)
    ("scape", 0.99, 20 * 41 * 8 + 4 * 5 * 44 + 4 * 8),
    ("scape", 0.9, 20 * 410 * 8 + 4 * 5 * 269 + 4 * 8),
    ("topk", 0.99, 4 * 20 * 41 * 6),
])
def test_formula_bytes(opt, sparsity, expected):
    run = {"config": {"optimizer": opt, "sparsity": sparsity, "group_sparsity": None},
           "params": 70_000, "n_pad": 81_920,
           "optimizer_settings": {"block_size": 4096, "explore": 0.1} if opt != "topk"
           else {"block_size": 4096}}
    assert formula_bytes(run, world=4) == expected
    run["config"]["group_sparsity"] = {"embed": 0.9}
    if opt == "scape":
        assert formula_bytes(run, world=4) is None  # a split has no single K
        run["config"].update(group_sparsity=None,
                             optimizer_kwargs={"grad_comm_dtype": "bfloat16"})
        assert formula_bytes(run, world=4) is None  # nor a 16-bit wire (not in the formula)


@pytest.mark.parametrize("grad8, param8, sparsity", [(True, False, 0.99), (False, True, 0.9),
                                                     (True, True, 0.99)])
def test_formula_bytes_of_the_8bit_wires_is_what_a_step_sends(grad8, param8, sparsity):
    """The report's formula against ``opt.last_step.bytes`` of a real sparse step (W=2
    gloo ranks, two buckets with ``attach``): they agree to the byte."""
    from bench.engine.runner import RunConfig, run

    kw = {"warmup_steps": 1}
    kw |= {"grad_comm_dtype": "int8"} if grad8 else {}
    kw |= {"param_comm_dtype": "int8"} if param8 else {}
    cfg = RunConfig(optimizer="scape", sparsity=sparsity, model="tiny", world=2, steps=4,
                    batch=2, seq=32, lr=1e-3, optimizer_kwargs=kw, eval_every=4,
                    eval_seqs=2, log_every=0, timeout_s=240.0, imports=[])
    result = run(cfg)
    sent = sum(result["bytes_last_step"].values())
    assert result["dense_steps"] == 1 and len(result["mask_rows"]) >= 2
    assert formula_bytes(result, world=2) == sent
    plain = {**result, "config": {**result["config"], "optimizer_kwargs": {}}}
    fp32 = formula_bytes(plain, world=2)
    assert fp32 > sent  # every 8-bit leg sends fewer bytes


def test_resolve_device_without_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert resolve_device("cpu", 4)[0] == "cpu"
    device, note = resolve_device("auto", 4)
    assert device == "cpu" and "no CUDA GPU here" in note and "run on the CPU" in note
    with pytest.raises(ValueError, match="--device cuda needs one GPU per rank \\(4\\), found 0"):
        resolve_device("cuda", 4)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("auto", 4) == ("cpu", "note: 2 CUDA GPUs for 4 ranks here: both legs "
                                         "run on the CPU (gloo, the kernels' torch path)")
    assert resolve_device("auto", 2)[0] == "cuda"


def test_plan_legs_applies_the_command_line():
    from bench.compare import QUALITY, SPEED, main, plan_legs

    ap_args = dict(quick=False, world=None, model=None, batch=None, lr=None, steps=None,
                   speed_steps=None, leg="both")
    legs = plan_legs(argparse.Namespace(**ap_args))
    assert legs == {"quality": QUALITY, "speed": SPEED}
    assert QUALITY["steps"] >= 600 and QUALITY["warmup_steps"] is None  # library default
    legs = plan_legs(argparse.Namespace(**dict(ap_args, steps=1200, speed_steps=3, lr=1e-3,
                                               world=2, leg="both")))
    assert legs["quality"]["steps"] == 1200 and legs["quality"]["eval_every"] == 200
    assert legs["speed"]["steps"] == 3 and legs["speed"]["warmup_steps"] == 0
    assert {w["lr"] for w in legs.values()} == {1e-3} and {w["world"] for w in legs.values()} == {2}
    assert list(plan_legs(argparse.Namespace(**dict(ap_args, leg="speed")))) == ["speed"]
    with pytest.raises(SystemExit):  # a bad row name is an argparse error, before any run
        main(["--optimizers", "sgd", "--out", "/nonexistent/x"])


def test_tracker_eta_calibrates_from_measured_steps(monkeypatch):
    import io

    from bench import compare_exec

    clock = [100.0]
    monkeypatch.setattr(compare_exec.time, "monotonic", lambda: clock[0])
    cfgs = make_configs(["adams", "scape-0.99"], dict(model="tiny", world=2, steps=10, batch=2,
                        seq=64, lr=1e-3, warmup_steps=2, eval_every=10, eval_seqs=4),
                        None, None, 60.0)
    plan = [compare_exec.Planned("quality", c, "quality") for c in cfgs]
    stream = io.StringIO()
    t = compare_exec.Tracker(plan, {"quality": 1.0}, stream=stream, every_s=0)
    startup = compare_exec.STARTUP_S
    assert t.remaining_s() == pytest.approx(2 * (startup + 10))
    t.start(plan[0])
    clock[0] += 5.0
    t.step(1, 10)
    clock[0] += 4 * 0.5
    t.step(5, 10)  # measured: 0.5 s per step from step 1 to 5
    assert t.rate["quality"] == pytest.approx(0.5)
    assert t.remaining_s() == pytest.approx(5 * 0.5 + startup + 10 * 0.5)
    t.finish(plan[0])
    assert t.remaining_s() == pytest.approx(startup + 10 * 0.5)
    lines = stream.getvalue().splitlines()
    assert lines and all("ETA" in line and "elapsed" in line for line in lines)
    assert "quality adams step 5/10" in lines[-2]


@pytest.mark.parametrize("name, expected", [
    ("scape-0.9", {"optimizer": "scape", "sparsity": 0.9}),
    ("adamw_ddp", {"optimizer": "adamw_ddp", "sparsity": 0.0}),
    ("compute_only", {"optimizer": "compute_only", "sparsity": 0.99}),
    ("sparseloco-h8-d0.01", {"optimizer": "sparseloco", "sparsity": 0.0, "optimizer_kwargs":
                             {"sync_every": 8, "density": 0.01, "value_bits": 2}}),
    ("diloco-h32", {"optimizer": "diloco", "sparsity": 0.0,
                    "optimizer_kwargs": {"sync_every": 32}}),
    ("scape-0.99-embed0.9", {"optimizer": "scape", "sparsity": 0.99,
                             "group_sparsity": {"embed": 0.9}}),
    ("scape-0.99@robust", {"optimizer": "scape", "sparsity": 0.99,
                           "optimizer_kwargs": {"update": "robust", "warmup_steps": 20}})])
def test_rows_are_looked_up_by_name(name, expected):
    assert resolve(name) == (name, expected)


def test_rows_as_json_or_toml(tmp_path):
    """A row not in the table comes as JSON, inline or in a file, or as TOML: the same fields,
    the name its own; ``sparsity`` 0 by default for an optimizer that sends everything."""
    row = {"name": "scape-0.95-ramp", "optimizer": "scape", "sparsity": 0.95,
           "optimizer_kwargs": {"update": "early"}, "group_sparsity": {"embed": 0.5},
           "sparsity_ramp": [0.5, 20]}
    want = ("scape-0.95-ramp", {k: v for k, v in row.items() if k != "name"}
            | {"sparsity_ramp": (0.5, 20)})
    assert resolve(json.dumps(row)) == want
    (tmp_path / "row.json").write_text(json.dumps(row))
    assert resolve(str(tmp_path / "row.json")) == want
    (tmp_path / "row.toml").write_text(
        'name = "scape-0.95-ramp"\noptimizer = "scape"\nsparsity = 0.95\n'
        'sparsity_ramp = [0.5, 20]\ngroup_sparsity = {embed = 0.5}\n'
        'optimizer_kwargs = {update = "early"}\n')
    assert resolve(str(tmp_path / "row.toml")) == want
    assert resolve('{"name": "d", "optimizer": "dist_adamw"}') == (
        "d", {"optimizer": "dist_adamw", "sparsity": 0.0})
    w = dict(model="tiny", world=2, steps=6, batch=2, seq=64, lr=3e-3, warmup_steps=2,
             eval_every=3, eval_seqs=4)
    (cfg,) = make_configs([json.dumps(row)], w, None, None, 60.0)
    assert (cfg.name, cfg.sparsity, cfg.sparsity_ramp) == ("scape-0.95-ramp", 0.95, (0.5, 20))
    assert cfg.optimizer_kwargs == {"warmup_steps": 2, "update": "early"}  # the row's own wins
    assert cfg.group_sparsity == {"embed": 0.5}


def test_embed_row_sets_the_embedding_group():
    w = dict(model="tiny", world=2, steps=6, batch=2, seq=64, lr=3e-3, warmup_steps=2,
             eval_every=3, eval_seqs=4)
    plain, split = make_configs(["scape-0.99", "scape-0.99-embed0.9"], w, None, None, 60.0)
    assert plain.group_sparsity is None and split.group_sparsity == {"embed": 0.9}
    assert split.sparsity == plain.sparsity == 0.99 and split.name == "scape-0.99-embed0.9"
    for bad, match in (({"embed": 1.5}, r"must be in \[0, 1\)"),):
        with pytest.raises(ValueError, match=match):
            make_configs([json.dumps({"name": "x", "optimizer": "scape", "sparsity": 0.99,
                                      "group_sparsity": bad})], w, None, None, 60.0)
    with pytest.raises(ValueError, match="group_sparsity applies to the scape and "
                                         "compute_only rows"):
        make_configs([json.dumps({"name": "x", "optimizer": "topk", "sparsity": 0.99,
                                  "group_sparsity": {"embed": 0.9}})], w, None, None, 60.0)


@pytest.mark.parametrize("spec, match", [
    pytest.param("sgd", "unknown row 'sgd'", id="unknown-name"),
    pytest.param("scape-0.97", "unknown row 'scape-0.97'", id="names-are-not-parsed"),
    pytest.param('{"optimizer": "scape"}', "an object with a 'name'", id="no-name"),
    pytest.param('{"name": "x", "optimizer": "sgd"}', "optimizer must be one of",
                 id="unknown-optimizer"),
    pytest.param('{"name": "x", "optimizer": "scape", "lr": 1}', r"unknown fields \['lr'\]",
                 id="a-job-field"),
    pytest.param('{"name": "x", "optimizer": "scape", "optimizer_kwargs": {"update": "nope"}}',
                 "unknown rule 'nope'", id="unknown-rule"),
    pytest.param('{"name": "a/b", "optimizer": "adams"}', "without '/'", id="slash"),
    pytest.param('{"name": "x", "optimizer": ', "not valid JSON", id="bad-json"),
])
def test_rows_refused(spec, match):
    with pytest.raises(ValueError, match=match):
        resolve(spec)


def test_every_row_of_the_table_is_valid():
    for name in ROWS:
        fields = resolve(name)[1]
        RunConfig(**fields, model="llama-tiny", world=2, imports=[])  # (an untied head)


def test_make_configs_local_rows_and_sync_warnings():
    w = dict(QUALITY, steps=40)
    four_bit = json.dumps({"name": "sparseloco-h8-d0.03-b4", "optimizer": "sparseloco",
                           "optimizer_kwargs": {"sync_every": 8, "density": 0.03,
                                                "value_bits": 4}})
    cfgs = make_configs(["adams", four_bit, "diloco-h32"], w, None, None, 60.0)
    assert [c.optimizer for c in cfgs] == ["adams", "sparseloco", "diloco"]
    assert cfgs[1].optimizer_kwargs == {"sync_every": 8, "density": 0.03, "value_bits": 4}
    assert cfgs[2].optimizer_kwargs == {"sync_every": 32} and cfgs[2].sparsity == 0.0
    assert cfgs[1].label == "sparseloco-h8-d0.03-b4"
    # 40 steps: a multiple of 8, not of 32 (the last sync is at step 32, 8 steps before)
    (warning,) = sync_warnings(cfgs)
    assert "diloco-h32" in warning and "not a multiple of H=32" in warning
    assert "8 steps after the last sync (step 32)" in warning
    assert sync_warnings(make_configs(["diloco-h8"], w, None, None, 60.0)) == []


def test_compare_table_uses_the_mean_bytes_of_local_step_rows():
    gen = torch.Generator().manual_seed(11)
    v = (torch.rand(3, 3, generator=gen) + 0.5).tolist()
    names = ["adams", "sparseloco-h8-d0.01", "diloco-h8"]
    runs = []
    for n, (a, b, c) in zip(names, v):
        r = _fake_run(n, a, 0.0 if n != "adams" else c * 1e6, b)
        r.update(step_s=[9.0, b, 2 * b, 3 * b],
                 bytes_per_step_mean_all_steps=c * 1e3 if n != "adams" else c * 1e6)
        runs.append(r)
    table = {row["name"]: row for row in speed_table(runs, world=2)}
    assert table["adams"]["bytes_basis"] == "median"
    for n, r in zip(names[1:], runs[1:]):
        row = table[n]
        assert row["bytes_basis"] == "mean_all_steps"
        assert row["bytes_per_step"] == r["bytes_per_step_mean_all_steps"]
        assert row["bytes_ratio_to_adams"] == pytest.approx(
            r["bytes_per_step_mean_all_steps"] / runs[0]["bytes_per_step_total"])
        assert row["mean_step_s"] == pytest.approx(2 * r["median_step_s"])  # steps 2..4
        assert row["bytes_ratio_to_formula"] is None
    from bench.compare import SPEED, build_report

    env = {"cpus_usable": 2, "torch": "t", "device_name": "cpu", "git_revision": None}
    report = build_report([], {"speed": dict(SPEED)}, {"speed": runs}, env,
                          {"requested": None, "label": "unshaped loopback"}, ["warning: x"],
                          1.0, False)
    md = render_markdown(report)
    assert md.count(" * |") == 4 and "not the per-step median" in md and "warning: x" in md
    assert md.startswith(f"# bench.compare\n\n**{report['headline']['text']}**")
