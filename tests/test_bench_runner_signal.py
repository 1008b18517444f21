"""``bench.engine.runner.run`` ends its ranks when its process is told to stop: a SIGTERM to a
``python -m bench.engine.runner`` (as a job scheduler or ``kill`` sends) used to end the driver at
once and leave its spawned ranks training on under init; a SIGKILL (``kill -9``, the OOM
killer), which no handler sees, still does without the kernel's parent-death signal."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from dist import running, spawned_ranks

ROOT = Path(__file__).resolve().parents[1]
CONFIG = {"optimizer": "adams", "model": "tiny", "world": 2, "steps": 100000, "batch": 2,
          "seq": 32, "eval_every": 100000, "eval_seqs": 4, "threads": 1, "log_every": 0,
          "timeout_s": 600}

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_signal_ends_every_rank(tmp_path, sig):
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    log = tmp_path / "stderr"  # a file, not a pipe: orphaned ranks would hold a pipe open
    with open(log, "wb") as err:
        driver = subprocess.Popen([sys.executable, "-m", "bench.engine.runner", "--config",
                                   json.dumps(CONFIG)], cwd=ROOT, env=env,
                                  stdout=subprocess.DEVNULL, stderr=err)
    ranks: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while len(ranks) < CONFIG["world"]:  # the ranks are spawned inside run()
            assert driver.poll() is None, log.read_text()[-2000:]
            assert time.monotonic() < deadline, "the ranks never started"
            time.sleep(0.2)
            ranks = spawned_ranks(driver.pid)
        ranks = [r for r in ranks if running(r)]
        driver.send_signal(sig)
        code = driver.wait(timeout=60)
        deadline = time.monotonic() + 30
        while any(map(running, ranks)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(map(running, ranks)), f"ranks {ranks} still run after the driver ended"
        want = 128 + sig if sig == signal.SIGTERM else -sig  # SIGKILL: no handler runs
        assert code == want, (code, log.read_text()[-2000:])
    finally:
        for r in ranks:
            try:
                os.kill(r, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if driver.poll() is None:
            driver.kill()
            driver.wait()
