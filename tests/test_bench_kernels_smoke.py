"""The kernel micro-benchmarks still run: bench/bench_kernels.py at n = 2^16 with timing
disabled (SCAPE_BENCH_SMOKE=1), in a child process under a deadline."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_kernels_smoke():
    env = {k: v for k, v in os.environ.items() if k not in ("SCAPE_KERNELS",)}
    env["SCAPE_BENCH_SMOKE"] = "1"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "bench/bench_kernels.py", "--benchmark-disable", "-q",
         "-p", "no:cacheprovider"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    tail = (proc.stdout + proc.stderr)[-3000:]
    assert proc.returncode == 0, tail
    assert " passed" in proc.stdout and "failed" not in proc.stdout, tail
