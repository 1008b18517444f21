"""``python -m bench.gpu``: W ranks as threads of one process on one device. The in-process
communicator passes the collective suite of tests/test_comm.py against hand computation (W=3
and 8); W=4 threads train the same parameters as W=4 gloo processes (tests/dist.py) to fp32
rounding, dense and at 0.9 and 0.99 over 20 steps; the smoke runs end to end in a subprocess
under a deadline (the plan line first, every row in report.json); a row past its deadline
stops every rank at the same evaluation."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import test_comm
import torch
from dist import run_ranks

from bench.engine.inprocess import InProcessGroup, run_threads
from bench.gpu import PRESETS, plain_plot, plan_steps, run_config, train_rank
from bench.workloads.data import load_packages
from scape.comm import CommError

ROOT = Path(__file__).resolve().parent.parent
SPARSITIES = (0.0, 0.9, 0.99)
STEPS = 20


def _suite(rank: int, comm, world: int) -> dict:
    dev, suite = comm.device, test_comm
    report = {"errors_first": suite._check_errors(comm, rank, world, dev)}
    report["collectives"] = suite._check_every_collective(comm, rank, world, dev)
    report["all_to_all"] = suite._check_all_to_all(comm, rank, world, dev)
    suite._check_in_flight_reverse(comm, rank, world, dev)
    suite._check_stats(comm, rank, world, dev)
    report["errors_last"] = suite._check_errors(comm, rank, world, dev)
    comm.barrier()
    return report


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world", [3, 8])
def test_inprocess_collective_suite(world):
    reports = run_threads(_suite, world, world, timeout=30)
    for r in reports:
        assert r["collectives"] == 8 * (1 + world) + 3 * 5 + 3 * 3
        assert r["all_to_all"] == len(test_comm.ALL_TO_ALL) * 2
        assert r["errors_first"] == r["errors_last"] == test_comm.BAD_CALLS


@pytest.mark.timeout(30)
def test_a_failing_rank_aborts_the_others():
    def body(rank: int, comm) -> None:
        if rank == 1:
            raise ValueError("rank 1 fails")
        comm.all_reduce(torch.ones(3), op="sum").wait()

    with pytest.raises(RuntimeError, match="rank 1 of 3 failed: ValueError: rank 1 fails") as e:
        run_threads(body, 3, timeout=20)
    assert isinstance(e.value.__cause__, ValueError)
    group = InProcessGroup(2, timeout=0.2)
    with pytest.raises(CommError, match="all_reduce failed on rank 0"):
        group.communicators()[0].all_reduce(torch.ones(1)).wait()  # rank 1 never comes


def _configs() -> list[dict]:
    p = dataclasses.replace(PRESETS["smoke"], world=4, batch=2, eval_every=STEPS)
    return [dataclasses.asdict(run_config(f"s{s}", s, p, STEPS, "cpu",
                                          {"block_size": 256, "warmup_steps": 3}))
            for s in SPARSITIES]


def _corpus():
    return load_packages(PRESETS["smoke"].corpus)


def _gloo_rank(rank: int, world: int, configs: list[dict]) -> list:
    from scape.comm import TorchCommunicator

    comm = TorchCommunicator(timeout=60.0)
    # numpy arrays: a tensor would travel as a file descriptor, lost if the rank exits first
    return [train_rank(rank, comm, cfg, _corpus(), return_params=True)["params"].numpy()
            for cfg in configs]


def _thread_rank(rank: int, comm, configs: list[dict]) -> list[torch.Tensor]:
    return [train_rank(rank, comm, cfg, _corpus(), return_params=True)["params"]
            for cfg in configs]


@pytest.mark.timeout(240)
def test_threads_train_what_gloo_processes_train():
    configs = _configs()
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # (as each gloo process runs)
    try:
        threads = run_threads(_thread_rank, 4, configs, timeout=120)
    finally:
        torch.set_num_threads(before)
    procs = [[torch.from_numpy(a) for a in r] for r in run_ranks(_gloo_rank, 4, configs,
                                                                  timeout=200)]
    start = torch.cat([p.detach().reshape(-1) for p in
                       __import__("bench.workloads.llama", fromlist=["make_model"])
                       .make_model("tiny").parameters()])
    for i, sparsity in enumerate(SPARSITIES):
        for rank in range(4):  # every replica the same, on either side
            assert torch.equal(threads[rank][i], threads[0][i]), (sparsity, rank)
            assert torch.equal(procs[rank][i], procs[0][i]), (sparsity, rank)
        a, b = threads[0][i], procs[0][i]
        assert not torch.isnan(a).any()
        moved = (a - start).abs().max().item()
        assert moved > 1e-3, f"sparsity {sparsity}: the parameters did not train ({moved})"
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6,
                                   msg=lambda m, s=sparsity: f"sparsity {s}: {m}")


@pytest.mark.timeout(60)
def test_a_deadline_stops_every_rank_at_the_same_evaluation():
    p = dataclasses.replace(PRESETS["smoke"], world=2, eval_every=3)
    cfg = dataclasses.asdict(run_config("t", 0.99, p, 12, "cpu", {"warmup_steps": 2}))
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        past = run_threads(train_rank, 2, cfg, _corpus(), 2, time.monotonic() - 1, timeout=30)
        ahead = run_threads(train_rank, 2, cfg, _corpus(), 0, time.monotonic() + 600,
                            timeout=30)
    finally:
        torch.set_num_threads(before)
    assert [(r["steps"], r["truncated"]) for r in past] == [(3, True), (3, True)]
    assert [v[0] for v in past[0]["val_curve"]] == [3] and len(past[0]["records"]) == 3
    assert len(past[0]["phases"]) == 2  # the timed steps still run after a truncated run
    assert [(r["steps"], r["truncated"]) for r in ahead] == [(12, False), (12, False)]
    assert [v[0] for v in ahead[0]["val_curve"]] == [3, 6, 9, 12]


@pytest.mark.timeout(200)
def test_smoke_end_to_end(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    out = tmp_path / "gpu"
    proc = subprocess.run([sys.executable, "-m", "bench.gpu", "--smoke", "--out", str(out)],
                          cwd=ROOT, env=env, timeout=180, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("plan: tiny GPT, 119,104 parameters; W=8 ranks as threads"), lines
    assert any(ln.startswith("plan: 40 steps x 3 optimizers") for ln in lines), lines
    report = json.loads((out / "report.json").read_text())
    assert report["schema"] == "scape.gpu/1"
    assert [r["name"] for r in report["rows"]] == ["adams", "scape-0.99", "scape-0.9"]
    corpus = report["corpus"]
    assert corpus["val_files"] > 0 and corpus["val_bytes"] > 0 and len(corpus["val_sha256"]) == 64
    for r in report["rows"]:
        assert r["steps"] == 40 and not r["truncated"] and r["replicas_agree"], r["name"]
        assert r["final_val_loss"] < 5.6, r  # ln 256 = 5.55 at the start
        ph = r["phases_median"]
        assert ph["step_s"] > 0 and ph["comm_s"] > 0 and ph["fwd_bwd_s"] > 0
        assert len(r["phases"]) == PRESETS["smoke"].timed_steps
        for one in r["phases"]:  # the phases add up to the step
            assert abs(one["fwd_bwd_s"] + one["local_s"] + one["comm_s"] - one["step_s"]) < 1e-6
    dense, sparse = report["rows"][0], report["rows"][1]
    assert sparse["bytes_per_step_per_rank"] < dense["bytes_per_step_per_rank"] / 10
    assert (out / "report.md").read_text().startswith("# W=8 ranks on one device")
    # the same --out again: every row kept, nothing retrained
    again = subprocess.run([sys.executable, "-m", "bench.gpu", "--smoke", "--out", str(out)],
                           cwd=ROOT, env=env, timeout=60, capture_output=True, text=True)
    assert again.returncode == 0, again.stdout + again.stderr
    assert again.stdout.count("done before, kept") == 3, again.stdout


def test_the_plan_scales_steps_down_to_the_budget_never_up():
    p = PRESETS["gpu"]
    cal = {"step_s": 0.2, "eval_s": 1.0, "setup_s": 10.0, "wall_s": 12.0}
    roomy = plan_steps(p, cal, budget_s=10_000, rows=3, spent_s=0)
    assert roomy["target_steps"] == roomy["steps"] == 1000 and not roomy["scaled_down"]
    assert roomy["tokens_per_optimizer"] == 1000 * 8 * 4 * 1024 >= 30_000_000
    tight = plan_steps(p, cal, budget_s=400, rows=3, spent_s=30)
    assert tight["scaled_down"] and 100 < tight["steps"] < 1000
    assert tight["estimated_s"] <= 400 - 30


def test_loss_png_without_matplotlib(tmp_path):
    rows = [{"val_curve": [[10, 5.0], [20, 4.0]]}, {"val_curve": [[10, 5.1], [20, 4.4]]}]
    plain_plot(rows, tmp_path / "loss.png")
    data = (tmp_path / "loss.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
