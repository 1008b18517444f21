"""The launcher of every multi-rank run (``bench.engine.launch``): outcomes by rank, progress
to the driver, a rank that dies without a word, fail-fast, and no process left behind after
a deadline."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist
from dist import descendants, running

from bench.engine.launch import Ranks, launch, progress


def _report_pid_then(rank, world, what, pid_dir):
    with open(os.path.join(pid_dir, str(rank)), "w") as f:
        f.write(str(os.getpid()))
    if what == "progress":
        for i in range(3):
            progress((rank, i))
        t = torch.tensor([float(rank)])
        dist.all_reduce(t)
        return float(t)
    if what == "exit" and rank == 1:
        os._exit(7)
    if what == "raise" and rank == 0:
        raise KeyError("rank 0 gave up")
    if what in ("raise", "hang"):
        time.sleep(120)
    return rank


def _pids(d):
    return [int(open(os.path.join(d, f)).read()) for f in sorted(os.listdir(d))]


def test_progress_reaches_the_driver_and_results_come_by_rank(tmp_path):
    seen = []
    spec = Ranks(world=3, timeout_s=60, threads=1, on_progress=lambda r, x: seen.append((r, x)))
    out = launch(_report_pid_then, spec, "progress", str(tmp_path))
    assert [o.result for o in out] == [3.0, 3.0, 3.0] and all(o.ok for o in out)
    assert all(o.exitcode == 0 for o in out)
    assert sorted(seen) == [(r, (r, i)) for r in range(3) for i in range(3)]
    assert not any(running(p) for p in _pids(tmp_path))


def test_a_rank_that_dies_without_a_word_is_reported_with_its_exit_code(tmp_path):
    out = launch(_report_pid_then, Ranks(world=2, timeout_s=60, threads=1), "exit",
                 str(tmp_path))
    assert out[0].ok and out[0].result == 0
    assert not out[1].ok and out[1].exitcode == 7 and "without reporting" in out[1].error


def test_fail_fast_stops_at_the_first_failure_and_kills_the_rest(tmp_path):
    t0 = time.monotonic()
    out = launch(_report_pid_then, Ranks(world=2, timeout_s=100, threads=1, fail_fast=True),
                 "raise", str(tmp_path))
    assert time.monotonic() - t0 < 60  # rank 1 sleeps 120 s: it was killed, not awaited
    assert not out[0].ok and out[0].exc_type == "KeyError" and "rank 0 gave up" in out[0].error
    assert not out[1].ok and out[1].exc_type is None
    assert not any(running(p) for p in _pids(tmp_path))


def test_the_deadline_kills_every_rank(tmp_path):
    before = set(descendants(os.getpid()))
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="did not finish within 12 s"):  # the ranks sleep
        launch(_report_pid_then, Ranks(world=2, timeout_s=12, threads=1), "hang",  # 120 s
               str(tmp_path))
    assert time.monotonic() - t0 < 60
    left = [p for p in set(descendants(os.getpid())) - before if running(p)]
    assert left == [] and not any(running(p) for p in _pids(tmp_path))


@pytest.mark.parametrize("kw, match", [
    (dict(world=0), "world must be an int >= 1"),
    (dict(world=2, timeout_s=0), "timeout_s must be > 0"),
    (dict(world=2, backend="mpi"), "backend must be"),
    (dict(world=2, netns=["a"]), "one per rank"),
    (dict(world=2, start="fork"), "start must be"),
])
def test_bad_specs_raise(kw, match):
    with pytest.raises(ValueError, match=match):
        Ranks(**kw)


def _killed_mid_message(rank, world):
    progress("first")  # the driver's on_progress then sleeps, reading nothing meanwhile
    import signal
    import threading
    threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGKILL)).start()
    progress(b"x" * (16 << 20))  # more than a pipe holds: the rank dies in the middle of it
    time.sleep(60)


def test_a_rank_killed_in_the_middle_of_a_message_does_not_hang_the_driver():
    """A message cut off by the sender's death is an end of file for the driver, not a read
    that waits for bytes that will never come (as a queue's pipe, whose writer the driver
    itself holds, was): ``launch`` returns, the rank reported as exited without a word."""
    import threading

    seen, done = [], []

    def slow(rank, obj):
        seen.append(obj if isinstance(obj, str) else len(obj))
        time.sleep(1.5)

    def drive():
        done.append(launch(_killed_mid_message, Ranks(world=1, timeout_s=120, threads=1,
                                                       on_progress=slow)))

    t = threading.Thread(target=drive, daemon=True)
    t.start()
    t.join(timeout=60)  # the deadline of this test: a hang fails it
    assert done, "launch did not return after its rank was killed mid-message"
    (out,) = done[0]
    assert not out.ok and out.exitcode == -9 and "without reporting" in out.error
    assert seen == ["first"]


def _environment(rank, world, names):
    import sys

    return {n: os.environ.get(n) for n in names}, os.getppid(), "triton" in sys.modules


@pytest.mark.parametrize("start", ["forkserver", "spawn"])
def test_a_rank_starts_from_the_drivers_environment_at_the_launch(monkeypatch, start):
    """What the driver's environment holds when it launches (not when a forkserver started),
    then ``Ranks.env`` over it; a variable the driver dropped is gone; nothing of SCAPE or
    triton was imported before the rank's own code (its kernels read ``TRITON_INTERPRET``
    from the rank's environment)."""
    names = ["SCAPE_LAUNCH_A", "SCAPE_LAUNCH_B", "SCAPE_LAUNCH_GONE"]
    monkeypatch.setenv("SCAPE_LAUNCH_GONE", "1")
    launch(_environment, Ranks(world=1, timeout_s=60, threads=1, start=start), names)
    monkeypatch.delenv("SCAPE_LAUNCH_GONE")  # after any server started
    monkeypatch.setenv("SCAPE_LAUNCH_A", "driver")
    monkeypatch.setenv("SCAPE_LAUNCH_B", "driver")
    out = launch(_environment, Ranks(world=2, timeout_s=60, threads=1, start=start,
                                     env={"SCAPE_LAUNCH_B": "env"}), names)
    assert all(o.ok for o in out), [o.error for o in out]
    for o in out:
        seen, parent, triton = o.result
        assert seen == {"SCAPE_LAUNCH_A": "driver", "SCAPE_LAUNCH_B": "env",
                        "SCAPE_LAUNCH_GONE": None}
        assert not triton
        assert (parent == os.getpid()) == (start == "spawn")  # forked: the server's child
