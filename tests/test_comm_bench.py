"""bench/comm_bench.py --smoke runs end to end and writes the documented JSON schema."""

from __future__ import annotations

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_comm_bench_smoke(tmp_path):
    out = tmp_path / "comm_bench.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-m", "bench.comm_bench", "--smoke", "--out", str(out),
                        "--timeout", "90"], capture_output=True, text=True, timeout=150,
                       cwd=REPO, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["benchmark"] == "comm_bench" and report["smoke"] is True
    assert report["backend"] == "gloo" and report["host"]["torch"]
    rows = report["results"]
    assert {(row["world"], row["op"]) for row in rows} == {(2, "all_gather"),
                                                           (2, "reduce_scatter")}
    assert sorted({row["bytes"] for row in rows}) == [1024, 65536]
    for row in rows:
        assert row["reps"] >= 3
        assert 0 < row["seconds_min"] <= row["seconds_median"]
        assert abs(row["algbw_Bps"] - row["bytes"] / row["seconds_median"]) < 1e-6 * row[
            "algbw_Bps"]
        assert abs(row["busbw_Bps"] - row["algbw_Bps"] / 2) < 1e-6 * row["algbw_Bps"]
    assert {o["op"] for o in report["overlap"]} == {"all_gather", "reduce_scatter"}
    for o in report["overlap"]:
        assert o["t_comm"] > 0 and o["t_compute"] > 0 and o["t_both"] > 0
        expected = (o["t_comm"] + o["t_compute"] - o["t_both"]) / o["t_comm"]
        assert abs(o["hidden_fraction"] - expected) < 1e-9
    assert "| payload |" in r.stdout and "W=2" in r.stderr
