"""``bench.lr_sweep --jobs``: runs at once give the runs one at a time gives, and stopping the
sweep stops every run it started."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from dist import running, spawned_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, PYTHONPATH=ROOT)
PLAN = ["--smoke", "--workloads", "gpt", "--optimizers", "adams", "scape-0.99", "--lrs", "1e-3"]


def _sweep(out, *extra: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bench.lr_sweep", *PLAN, "--out", str(out),
                           *extra], cwd=ROOT, env=ENV, timeout=timeout, capture_output=True,
                          text=True)


@pytest.mark.timeout(600)
def test_two_at_once_give_the_runs_one_at_a_time_gives(tmp_path):
    one = _sweep(tmp_path / "one.json")
    assert one.returncode == 0, one.stderr[-2000:]
    two = _sweep(tmp_path / "two.json", "--jobs", "2")
    assert two.returncode == 0, two.stderr[-2000:]
    assert "2 runs at once" in two.stdout and "2 runs at once" not in one.stdout
    a = json.loads((tmp_path / "one.json").read_text())
    b = json.loads((tmp_path / "two.json").read_text())
    assert a["complete"] and b["complete"] and len(a["runs"]) == len(b["runs"]) == 2
    by_key = {(r["optimizer"], r["lr"], r["seed"]): r for r in a["runs"]}
    for r in b["runs"]:
        ref = by_key.pop((r["optimizer"], r["lr"], r["seed"]))
        assert r["ranks_agree"] and r["steps"] == ref["steps"]
        # the same arithmetic where both ran one thread per rank (a 2- or 3-core machine);
        # elsewhere --jobs 2 gives each rank fewer threads than --jobs 1, so allow rounding
        assert r["final_val_loss"] == pytest.approx(ref["final_val_loss"], rel=1e-4)
        assert r["bytes_per_step"] == ref["bytes_per_step"]
    assert not by_key


def test_jobs_below_one_is_refused(tmp_path):
    proc = _sweep(tmp_path / "x.json", "--jobs", "0", timeout=60)
    assert proc.returncode == 2 and "--jobs must be >= 1" in proc.stderr


def _tgkill(pid: int, sig: int) -> None:
    """``sig`` to a thread of ``pid`` other than its main thread (the kernel may deliver a
    process's signal to any of its threads)."""
    import ctypes
    tids = [int(t) for t in os.listdir(f"/proc/{pid}/task") if int(t) != pid]
    assert tids, "the sweep has no thread but its main one"
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.syscall(234, pid, tids[0], sig) == 0  # SYS_tgkill on x86-64


def _sigint_as_in_a_terminal() -> None:
    """The sweep's SIGINT as a terminal's Ctrl-C finds it: a suite started in the background
    (``cmd &``, ``nohup``) runs with SIGINT ignored, which its children would inherit, and
    Python then installs no ``KeyboardInterrupt`` for it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("sig, to_thread", [(signal.SIGTERM, False), (signal.SIGINT, False),
                                            (signal.SIGINT, True)])
def test_stopping_the_sweep_stops_every_run_it_started(tmp_path, sig, to_thread):
    """Two long runs at once; a signal once both have their ranks (``to_thread``: delivered
    to another thread than the main one): the sweep exits within seconds and no rank of
    either run is left training."""
    log = tmp_path / "log"  # a file, not a pipe: orphaned ranks would hold a pipe open
    with open(log, "wb") as f:
        proc = subprocess.Popen([sys.executable, "-m", "bench.lr_sweep", *PLAN, "--steps",
                                 "100000", "--jobs", "2", "--out", str(tmp_path / "x.json")],
                                cwd=ROOT, env=ENV, stdout=f, stderr=subprocess.STDOUT,
                                preexec_fn=_sigint_as_in_a_terminal)
    ranks: set[int] = set()
    try:
        deadline = time.monotonic() + 120
        while len(ranks) < 4 and time.monotonic() < deadline:  # 2 runs x 2 ranks (smoke W=2)
            time.sleep(0.5)
            ranks = set(spawned_ranks(proc.pid))
        assert len(ranks) >= 4, f"the ranks did not start: {ranks}"
        time.sleep(3.0)  # training
        assert proc.poll() is None
        if to_thread:
            _tgkill(proc.pid, sig)
        else:
            proc.send_signal(sig)
        code = proc.wait(timeout=60)
        assert code != 0, log.read_text()[-2000:]
        gone = time.monotonic() + 10
        while any(map(running, ranks)) and time.monotonic() < gone:
            time.sleep(0.2)
        assert not [k for k in ranks if running(k)], log.read_text()[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for k in ranks:  # a failed run of this test leaves no rank behind either
            if running(k):
                os.kill(k, signal.SIGKILL)
