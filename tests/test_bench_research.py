"""Smokes of the convergence ablation and the step-compute benchmark (schemas checked), and
the null communicator they time with."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from bench.nullcomm import NullCommunicator

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(module: str, out: str, *extra: str) -> dict:
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-m", module, "--smoke", "--out", out, *extra],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with open(out) as f:
        return json.load(f)


def test_convergence_smoke(tmp_path):
    rep = _run("bench.convergence", str(tmp_path / "c.json"), "--check-world", "2")
    assert rep["schema"] == "scape.convergence/1"
    names = [r["variant"]["name"] for r in rep["results"]]
    assert names[0].startswith("dense-adams") and any(n.startswith("lazy@") for n in names)
    for r in rep["results"]:
        assert r["final_val_loss"] > 0 and r["ratio_to_dense"] > 0
        assert [s for s, _ in r["val_curve"]][-1] == rep["workload"]["steps"]
    sparse = [r for r in rep["results"] if r["variant"].get("sparsity", 0) > 0]
    assert sparse and all(sum(r["bytes_last_step"].values()) > 0 for r in sparse)
    # the single-process ablation equals the same run on 2 gloo ranks (the module's premise)
    check = rep["world_check"]
    assert check["world"] == 2 and abs(check["relative_difference"]) < 1e-3, check


def test_step_compute_smoke(tmp_path):
    rep = _run("bench.step_compute", str(tmp_path / "s.json"))
    assert rep["schema"] == "scape.step_compute/1"
    rows = {r["optimizer"]: r for r in rep["rows"]}
    assert set(rows) == {"dense_adams", "scape_0.9", "scape_0.99", "dist_adamw"}
    assert rows["dense_adams"]["dense_step"] and not rows["scape_0.99"]["dense_step"]
    assert rows["scape_0.99"]["bytes"] < rows["scape_0.9"]["bytes"] < rows["dense_adams"]["bytes"]
    assert all(r["median_s"] > 0 for r in rows.values())


@pytest.mark.parametrize("world,rank", [(1, 0), (4, 2)])
def test_null_communicator(world, rank):
    c = NullCommunicator(world, rank)
    x = torch.randn(6, generator=torch.Generator().manual_seed(world))
    out = torch.full((6 * world,), float("nan"))
    c.all_gather(out, x).wait()
    assert torch.equal(out.view(world, 6), x.expand(world, 6))
    rs = torch.full((6 // world if world < 6 else 1,), float("nan"))
    inp = torch.randn(rs.numel() * world)
    c.reduce_scatter(rs, inp).wait()
    assert torch.equal(rs, inp.view(world, -1)[rank])
    assert c.stats["all_gather"] == {"calls": 1, "bytes": out.nbytes}
    assert c.stats["reduce_scatter"] == {"calls": 1, "bytes": inp.nbytes}
    with pytest.raises(ValueError):
        c.all_gather(torch.empty(5), x)
