"""Smokes of the end-to-end benchmarks (tiny model, a few steps, W=2, plain loopback): each
script runs as the user runs it, in a subprocess under a deadline, and its outputs' schema
and byte accounting are checked against the library's own step records."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(args: list[str], timeout: float) -> str:
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, env=env, timeout=timeout,
                          capture_output=True, text=True)
    assert proc.returncode == 0, f"{args} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def _library_bytes(sparsity: float, world: int, group_sparsity: dict[str, float] | None = None,
                   update: str = "agree") -> tuple[int, int]:
    """(dense step, steady sparse step) bytes of scape.SCAPE on the tiny model's param groups,
    from ``opt.last_step.bytes`` with a counting communicator playing rank 0 of ``world``."""
    from bench.engine.nullcomm import NullCommunicator
    from bench.engine.optimizers import Spec, build
    from bench.workloads.gpt import GPT, get_config, param_groups

    model = GPT(get_config("tiny"), seed=0)
    groups = param_groups(model, 0.1, group_sparsity)
    for g in groups:
        g.pop("name")
    spec = Spec(lr=1e-3, sparsity=sparsity, kwargs={"warmup_steps": 1, "update": update})
    opt = build("scape" if sparsity else "adams", groups, spec, NullCommunicator(world, 0))
    opt.attach(model)  # as the jobs do: the default rule sets the embedding matrices apart
    opt.ramp_steps = 0  # the steady sparse step, not one on the start's ramp
    x = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    sizes = []
    for _ in range(3):
        model.loss(x, x).backward()
        opt.step()
        sizes.append(sum(opt.last_step.bytes.values()))
    return sizes[0], sizes[2]


RUN_KEYS = {"schema", "name", "config", "optimizer_settings", "params", "final_val_loss",
            "val_curve", "train_curve",
            "timing_window", "median_step_s", "median_wait_s", "median_compute_s",
            "median_compute_s_by_rank", "step_s", "bytes_per_step", "bytes_per_step_total",
            "bytes_per_step_mean_all_steps", "bytes_by_step", "bytes_last_step", "dense_steps",
            "collectives_per_step",
            "phases", "hooks", "wall_s", "train_wall_s",
            "param_sha256", "param_sha256_ranks_agree", "n_pad", "mask_rows", "device",
            "max_rss_mb_by_rank",
            "link_tx_per_step_by_node"}
QUALITY_ROWS = ["adams", "adamw_ddp", "scape-0.9", "scape-0.99", "scape-0.99-wire8", "topk-0.99"]


@pytest.mark.timeout(300)
def test_compare_quick(tmp_path):
    """`python -m bench.compare --quick`: both legs, the headline first, the documented
    report, every row's bytes equal to the library's own record and to the formula."""
    from bench.engine.netns import available

    out = tmp_path / "out"
    stdout = _run(["bench.compare", "--quick", "--profile", "--out", str(out)], timeout=280)
    report = json.loads((out / "report.json").read_text())
    assert report["schema"] == "scape.compare/2"
    env = report["environment"]
    assert env["torch"] == torch.__version__ and env["cpus"] == os.cpu_count()
    assert env["device"] == "cpu" and "no CUDA GPU" in stdout
    assert env["git_revision"] is None or len(env["git_revision"]) == 40
    # the speed leg's link: shaped and its delivered rate measured where this machine can
    link = report["speed"]["link"]
    if available()[0]:
        assert link["requested"] == "100mbit"
        assert 0.8 < link["delivered_bps"] / link["requested_bps"] < 1.1, link
    else:
        assert link["requested"] is None and "not available" in stdout
    quality, speed = report["quality"], report["speed"]
    assert [r["name"] for r in quality["runs"]] == QUALITY_ROWS
    assert [r["name"] for r in speed["runs"]] == QUALITY_ROWS + ["compute_only"]
    steps = quality["workload"]["steps"]
    assert report["params"] == quality["runs"][0]["params"]
    for r in quality["runs"] + speed["runs"]:
        assert set(r) == RUN_KEYS and r["schema"] == "scape.run/1"
        assert len(r["param_sha256"]) == 64
        if r["name"] != "compute_only":  # the floor's ranks exchange nothing
            assert r["param_sha256_ranks_agree"], r["name"]
            assert 0 < r["final_val_loss"] < 6
        assert all(t > 0 for t in r["step_s"])
        assert 0 <= r["median_wait_s"] <= r["median_step_s"]
    for r in quality["runs"]:
        assert r["val_curve"][-1][0] == steps == len(r["train_curve"])
        assert r["final_val_loss"] == r["val_curve"][-1][1]
    # every optimizer trained on the same data: the first step's loss is the same
    assert len({round(r["train_curve"][0], 5) for r in quality["runs"] + speed["runs"]}) == 1
    # the quality leg runs the library's defaults; the speed leg shortens the warm-up only
    by_q = {r["name"]: r for r in quality["runs"]}
    by_s = {r["name"]: r for r in speed["runs"]}
    assert by_q["scape-0.99"]["optimizer_settings"] == {
        "update": "agree", "explore": 0.1, "warmup_steps": quality["workload"]["warmup_steps"],
        "ramp_steps": 0, "total_steps": quality["workload"]["steps"], "dense_every": 0,
        "error_feedback": True, "block_size": 4096}  # 5 dense steps of 30: no ramp fits
    assert by_s["scape-0.99"]["optimizer_settings"]["warmup_steps"] == 2
    # bytes: DDP counts 2 x its fp32 gradient buckets; SCAPE's equal the library's own record
    world = speed["workload"]["world"]
    sparse99 = _library_bytes(0.99, world)[1]
    assert by_s["adamw_ddp"]["bytes_per_step_total"] == 2 * 4 * report["params"]
    assert by_s["adams"]["bytes_per_step_total"] == _library_bytes(0.0, world)[0]
    assert by_s["scape-0.99"]["bytes_per_step_total"] == sparse99
    assert by_s["compute_only"]["bytes_per_step_total"] == sparse99
    table = {t["name"]: t for t in speed["table"]}
    for name in QUALITY_ROWS:  # the formula, from the layout alone, matches the counters
        assert table[name]["bytes_formula"] == table[name]["bytes_per_step"], name
        assert table[name]["bytes_ratio_to_formula"] == 1.0
    assert table["compute_only"]["bytes_formula"] is None
    assert table["adams"]["speedup_over_adams"] == 1.0
    assert table["compute_only"]["step_ratio_to_compute_only"] == 1.0
    assert table["scape-0.99"]["speedup_over_adams"] == pytest.approx(
        by_s["adams"]["median_step_s"] / by_s["scape-0.99"]["median_step_s"])
    q = {t["name"]: t for t in quality["table"]}
    assert q["adams"]["val_ratio_to_adams"] == 1.0
    assert q["scape-0.99"]["val_ratio_to_adams"] == pytest.approx(
        by_q["scape-0.99"]["final_val_loss"] / by_q["adams"]["final_val_loss"])
    # the headline: SCAPE-0.99's three numbers, printed before the table
    head = report["headline"]
    assert head["loss_ratio"] == q["scape-0.99"]["val_ratio_to_adams"]
    assert head["bytes_ratio"] == table["scape-0.99"]["bytes_ratio_to_adams"]
    assert head["speedup"] == table["scape-0.99"]["speedup_over_adams"]
    assert stdout.index(head["text"]) < stdout.index("| optimizer |")
    # --quick is a smoke: it says so first and judges no target
    assert report["quick"] is True and report["targets"] == []
    assert head["text"].startswith("--quick is a smoke") and "judges nothing" in head["text"]
    md = (out / "report.md").read_text()
    assert "None judged" in md and "**no**" not in md
    # a progress line with an ETA; profiler ranges of every SCAPE phase in the speed leg
    assert "ETA" in stdout and "elapsed" in stdout
    for name in ("scape-0.99", "compute_only"):
        assert set(report["profile_phases"][name]) >= {
            "scape/take", "scape/reduce_scatter", "scape/update", "scape/mask",
            "scape/all_gather", "scape/mask_sync"}
    assert "topk/select" in report["profile_phases"]["topk-0.99"]
    for f in ("report.md", "loss.png", "bytes.png", "steps.png"):
        assert (out / f).stat().st_size > 0
    md = (out / "report.md").read_text()
    assert md.index(head["text"]) < md.index("| optimizer |") < md.index("## Speed leg")


def _sparseloco_bytes_per_step(params: int, world: int, sync_every: int, density: float,
                               bits: int, block: int = 4096) -> float:
    """README's SparseLoCo formula: a rank's record is ``4 * n_blocks + 2 * K +
    ceil(K * bits / 8)`` bytes, ``comm.stats`` counts ``W`` records per sync, / H per step."""
    n_blocks = -(-params // block)
    k = n_blocks * max(1, round(density * block))
    record = 4 * n_blocks + 2 * k + -(-k * bits // 8)
    return world * record / sync_every


@pytest.mark.timeout(150)
def test_compare_local_step_rows_smoke(tmp_path):
    out = tmp_path / "out"
    steps = 8
    stdout = _run(["bench.compare", "--quick", "--leg", "speed", "--speed-steps", str(steps),
                   "--bandwidth", "none", "--optimizers", "adams", "scape-0.99-embed0.9",
                   json.dumps({"name": "sparseloco-h4-d0.03", "optimizer": "sparseloco",
                               "optimizer_kwargs": {"sync_every": 4, "density": 0.03,
                                                    "value_bits": 2}}),
                   json.dumps({"name": "diloco-h3", "optimizer": "diloco",
                               "optimizer_kwargs": {"sync_every": 3}}),
                   "--out", str(out)], timeout=130)
    report = json.loads((out / "report.json").read_text())
    assert report["schema"] == "scape.compare/2" and report["quality"] is None
    leg = report["speed"]
    assert leg["link"]["requested"] is None
    by = {r["name"]: r for r in leg["runs"]}
    assert list(by) == ["adams", "scape-0.99-embed0.9", "sparseloco-h4-d0.03", "diloco-h3"]
    world, params = leg["workload"]["world"], report["params"]
    assert world == 2
    for r in leg["runs"]:
        assert set(r) == RUN_KEYS and r["val_curve"][-1][0] == steps
        assert 0 < r["final_val_loss"] < 6
    # the embedding split: its own group at 0.9 with the library's default rule; more bytes
    # than every group at 0.99, exactly the library's record
    emb = by["scape-0.99-embed0.9"]
    assert emb["config"]["group_sparsity"] == {"embed": 0.9}
    assert "update" not in emb["config"]["optimizer_kwargs"]
    _, embed = _library_bytes(0.99, world, {"embed": 0.9})
    assert emb["bytes_per_step_total"] == embed > _library_bytes(0.99, world)[1]
    assert by["sparseloco-h4-d0.03"]["config"]["optimizer_kwargs"] == {
        "sync_every": 4, "density": 0.03, "value_bits": 2}
    # nothing moves between syncs: the per-step median is 0, the mean is the sync's share
    sl, dl = by["sparseloco-h4-d0.03"], by["diloco-h3"]
    assert sl["bytes_per_step_total"] == 0 and dl["bytes_per_step_total"] == 0
    assert sl["bytes_per_step_mean_all_steps"] == pytest.approx(
        _sparseloco_bytes_per_step(params, world, 4, 0.03, 2), rel=1e-12)
    # DiLoCo: 8 * N_pad per sync (N_pad: N padded to a multiple of W); 8 steps hold 2 syncs
    # of H = 3, so the mean covers an incomplete period and the run warns about it
    n_pad = -(-params // world) * world
    assert dl["bytes_per_step_mean_all_steps"] == pytest.approx(
        (steps // 3) * 8 * n_pad / steps, rel=1e-12)
    (warning,) = report["warnings"]
    assert "diloco-h3" in warning and "not a multiple of H=3" in warning and warning in stdout
    table = {t["name"]: t for t in leg["table"]}
    assert table["scape-0.99-embed0.9"]["bytes_formula"] is None  # a per-group split
    dense = by["adams"]["bytes_per_step_total"]
    assert table["adams"]["bytes_basis"] == "median" and table["adams"]["bytes_per_step"] == dense
    for name in ("sparseloco-h4-d0.03", "diloco-h3"):
        row = table[name]
        assert row["bytes_basis"] == "mean_all_steps"
        assert row["bytes_per_step"] == by[name]["bytes_per_step_mean_all_steps"]
        assert row["bytes_ratio_to_adams"] == pytest.approx(row["bytes_per_step"] / dense)
        assert row["mean_step_s"] > 0
    md = (out / "report.md").read_text()
    assert f"| {int(table['diloco-h3']['bytes_per_step']):,} * |" in md
    assert "not the per-step median" in md


@pytest.mark.timeout(120)
def test_step_time_smoke(tmp_path):
    out = tmp_path / "step_time.json"
    _run(["bench.step_time", "--smoke", "--optimizers", "scape-0.99", "--out", str(out)],
         timeout=100)
    rep = json.loads(out.read_text())
    assert rep["schema"] == "scape.step_time/1"
    assert rep["workload"]["world"] == 2
    (cell,) = rep["cells"]
    assert cell["optimizer"] == "scape-0.99" and cell["rate"] == "unshaped"
    assert cell["ratio_to_compute_only"] == pytest.approx(
        cell["median_step_s"] / rep["compute_only_step_s"])
    assert 0 <= cell["median_wait_s"] <= cell["median_step_s"]
    assert os.path.exists(tmp_path / "step_time_runs" / "scape-0.99@unshaped.json")


@pytest.mark.timeout(120)
def test_step_time_latency_smoke(tmp_path):
    out = tmp_path / "step_time.json"
    _run(["bench.step_time", "--smoke", "--delays", "5ms", "--optimizers", "scape-0.99",
          "--out", str(out)], timeout=100)
    rep = json.loads(out.read_text())
    (cell,) = rep["cells"]
    assert rep["latency"] == "netem" or rep["latency"].startswith("modelled")
    assert cell["rate"] in ("1gbit+5ms", "+5ms (modelled)")
    assert cell["collectives_per_step"] == 2  # a sparse step's two, riding the scalars
    assert cell["median_step_s"] >= 2 * (rep["workload"]["world"] - 1) * 0.005


@pytest.mark.timeout(60)
def test_comm_volume_smoke(tmp_path):
    from bench.projection import MODELS

    out = tmp_path / "cv.json"
    _run(["bench.comm_volume", "--smoke", "--out", str(out)], timeout=50)
    rep = json.loads(out.read_text())
    assert rep["schema"] == "scape.comm_volume/1"
    assert all(c["check_ok"] for c in rep["calibration"])
    rows = {r["sparsity"]: r for r in rep["rows"]}
    assert set(rows) == {0.0, 0.9, 0.99}
    n = MODELS["GPT-345M"].n_params()
    dense = rows[0.0]
    assert dense["n_params"] == n and dense["world"] == 8
    assert dense["n_pad"] % (8 * rep["block_size"]) == 0 and 0 <= dense["n_pad"] - n < 8 * 4096
    # bf16 both ways: 2 + 2 bytes per padded coordinate, plus the 8-byte scalar all-reduce
    assert dense["bytes_per_step"] == 4 * dense["n_pad"] + 8
    for sp in (0.9, 0.99):
        r = rows[sp]
        assert r["k"] == r["n_pad"] // 4096 * max(1, round((1 - sp) * 4096))
        # bf16 values both ways, each of the 8 ranks' mask rows in Elias-Fano code (44 bytes
        # a row of 41 at 0.99, 269 of 410 at 0.9), and the scalars riding in the two
        # collectives: every rank's count (bf16) and sum of squares (fp32)
        k_b = max(1, round((1 - sp) * 4096))
        row = {41: 44, 410: 269}[k_b]
        assert r["bytes_per_step"] == r["k"] * (2 + 2) + r["k"] // k_b * row + 8 * (2 + 4)
        assert r["bytes_per_step"] == pytest.approx(r["design_formula"], abs=8 * 6)


@pytest.mark.timeout(120)
def test_compare_failed_run_says_what_is_kept(tmp_path):
    """A run that fails (here: past its deadline) stops the job with the run's error and says
    where the finished runs' results are."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-m", "bench.compare", "--quick", "--leg", "speed",
                           "--bandwidth", "none", "--optimizers", "adams", "--timeout", "0.5",
                           "--out", str(tmp_path / "out")], cwd=ROOT, env=env, timeout=100,
                          capture_output=True, text=True)
    assert proc.returncode != 0
    assert "stopped: 0 of 1 runs finished; their results are in" in proc.stdout
    assert "adams failed" in proc.stderr and not (tmp_path / "out" / "report.json").exists()
