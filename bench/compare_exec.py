"""Running the main job's plan: one ``python -m bench.engine.runner`` subprocess per run (inside a
shaped network namespace when asked), and one progress line with an ETA for the whole plan.

The ETA comes from a cost model per step that the runs themselves calibrate: every run
belongs to a class (the quality leg; the speed leg's dense rows, which wait on the shaped
link; its sparse rows), each class starts from a guess (:func:`bench.compare._guess`), and
each step a run reports replaces its class's estimate by the rate measured in that run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import queue
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any, TextIO

from bench.engine.run_config import RunConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STARTUP_S = 8.0
"""Estimated seconds to start a run (interpreter, W spawned ranks, corpus) before step 1."""
_PROGRESS = re.compile(r"step (\d+)/(\d+)")


@contextlib.contextmanager
def _launcher(cmd: list[str], bandwidth: str | None) -> Iterator[list[str]]:
    if bandwidth is None:
        yield cmd
    else:
        from bench.engine.netns import shaped_command

        with shaped_command(cmd, bandwidth) as wrapped:
            yield wrapped


def run_env(device: str, bandwidth: str | None) -> dict[str, str]:
    """The subprocess environment: this checkout first on ``PYTHONPATH``; on CUDA behind a
    shaped link, NCCL confined to sockets on the loopback (else NVLink or shared memory
    would carry the traffic past the shaping)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    if device == "cuda" and bandwidth is not None:
        env.update(NCCL_SOCKET_IFNAME="lo", NCCL_P2P_DISABLE="1", NCCL_SHM_DISABLE="1",
                   NCCL_IB_DISABLE="1")
    return env


def run_one(cfg: RunConfig, out_path: str, bandwidth: str | None,
            on_step: Any = None) -> dict[str, Any]:
    """Run ``cfg`` through ``python -m bench.engine.runner`` (in a shaped namespace if asked) and
    return its result. ``on_step(done, total)`` is called on each progress line; without it
    the run's output is echoed (every 10th step line)."""
    cmd = [sys.executable, "-m", "bench.engine.runner", "--config",
           json.dumps(dataclasses.asdict(cfg)), "--out", out_path]
    tail: list[str] = []
    with _launcher(cmd, bandwidth) as argv:
        proc = subprocess.Popen(argv, cwd=ROOT, env=run_env(cfg.device, bandwidth),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        lines: queue.Queue[str | None] = queue.Queue()

        def pump() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                lines.put(line)
            lines.put(None)

        threading.Thread(target=pump, daemon=True).start()
        deadline = time.monotonic() + cfg.timeout_s + 60
        while True:
            try:
                line = lines.get(timeout=0.5)
            except queue.Empty:
                if time.monotonic() > deadline:
                    proc.kill()
                    raise TimeoutError(f"{cfg.label}: no result within {cfg.timeout_s + 60:.0f}"
                                       " s; killed") from None
                continue
            if line is None:
                break
            tail = (tail + [line.rstrip()])[-40:]
            m = _PROGRESS.search(line)
            if m and on_step is not None:
                on_step(int(m.group(1)), int(m.group(2)))
            elif on_step is None and (m is None or int(m.group(1)) % 10 == 0) \
                    and "USDT" not in line:
                print(line.rstrip(), flush=True)
        rc = proc.wait()
    if rc != 0 or not os.path.exists(out_path):
        raise RuntimeError(f"{cfg.label} failed (exit {rc}); last output:\n" + "\n".join(tail))
    with open(out_path) as f:
        return json.load(f)  # type: ignore[no-any-return]


@dataclasses.dataclass
class Planned:
    """One run of the plan, for the progress line."""

    leg: str
    cfg: RunConfig
    kind: str
    """Cost class: runs of one class cost about the same per step."""
    done: int = 0
    finished: bool = False


class Tracker:
    """A progress bar over the whole plan, with elapsed time and an ETA.

    On a terminal one line is redrawn in place; otherwise (CI logs, pipes) a line is printed
    at most every ``every_s`` seconds and whenever a run starts or ends."""

    def __init__(self, plan: list[Planned], guess_s: dict[str, float],
                 stream: TextIO | None = None, every_s: float = 15.0) -> None:
        self.plan, self.rate = plan, dict(guess_s)
        self.stream = stream or sys.stdout
        self.tty = self.stream.isatty()
        self.every_s, self.last_print = every_s, -1e9
        self.started = time.monotonic()
        self.current: Planned | None = None
        self._first: tuple[float, int] | None = None

    def remaining_s(self) -> float:
        left = 0.0
        for p in self.plan:
            if p.finished:
                continue
            startup = 0.0 if p is self.current and p.done else STARTUP_S
            left += startup + (p.cfg.steps - p.done) * self.rate[p.kind]
        return left

    def fraction(self) -> float:
        elapsed = time.monotonic() - self.started
        return elapsed / max(1e-9, elapsed + self.remaining_s())

    def start(self, p: Planned) -> None:
        self.current, self._first = p, None
        self.show(force=True)

    def step(self, done: int, total: int) -> None:
        """Run ``self.current`` reached step ``done``: its class's rate is re-measured from
        the first step line it printed (start-up is not a step)."""
        p = self.current
        assert p is not None
        now = time.monotonic()
        if self._first is None:
            self._first = (now, done)
        elif done > self._first[1]:
            self.rate[p.kind] = (now - self._first[0]) / (done - self._first[1])
        p.done = done
        self.show()

    def finish(self, p: Planned) -> None:
        p.done, p.finished = p.cfg.steps, True
        self.show(force=True)

    def line(self) -> str:
        frac = self.fraction()
        bar = "#" * int(24 * frac) + "." * (24 - int(24 * frac))
        runs = f"run {min(len(self.plan), sum(q.finished for q in self.plan) + 1)}/" \
            f"{len(self.plan)}"
        what = "" if self.current is None else \
            f" | {self.current.leg} {self.current.cfg.label} step " \
            f"{self.current.done}/{self.current.cfg.steps}"
        return (f"[{bar}] {100 * frac:3.0f}% {_clock(time.monotonic() - self.started)} elapsed,"
                f" ETA {_clock(self.remaining_s())} | {runs}{what}")

    def show(self, force: bool = False) -> None:
        now = time.monotonic()
        if self.tty:
            self.stream.write("\r\033[K" + self.line())
            self.stream.flush()
        elif force or now - self.last_print >= self.every_s:
            self.stream.write(self.line() + "\n")
            self.stream.flush()
            self.last_print = now

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


def _clock(seconds: float) -> str:
    s = max(0, int(round(seconds)))
    return f"{s // 60}:{s % 60:02d}"
