"""Multi-process test harness: one real process per rank, gloo over a file store, and an
outer deadline so that a hang is a test failure, never a stuck CI (the benchmarks' launcher,
:mod:`bench.engine.launch`, with one torch thread per rank).

    def _body(rank, world, x):            # module-level, so the ranks can unpickle it
        ...
        return something_picklable

    results = run_ranks(_body, 4, x, timeout=60)     # list indexed by rank

``run_ranks`` raises ``AssertionError`` with every failing rank's traceback, or
``TimeoutError`` (after killing every process) when the deadline passes. Tests that expect a
rank to die or raise use ``run_ranks_outcomes``, which returns what happened on each rank.
Tests that launch a launcher (torchrun, ``python -m bench.engine.runner``) find its workers with
``descendants`` (its ranks: ``spawned_ranks``) and ask ``running`` whether each is left.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from bench.engine.launch import RankOutcome, Ranks, launch

__all__ = ["RankOutcome", "descendants", "run_ranks", "run_ranks_outcomes", "running",
           "spawned_ranks"]


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``, from Linux's ``/proc`` (a launcher's workers may sit in
    sessions of their own, where a signal to its process group does not reach them)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        try:
            with open(f"/proc/{d}/stat") as f:
                children.setdefault(int(f.read().rsplit(")", 1)[1].split()[1]), []).append(int(d))
        except (OSError, ValueError, IndexError):
            continue
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def spawned_ranks(pid: int) -> list[int]:
    """The ranks below ``pid`` (``bench.engine.runner``'s): ``multiprocessing``'s spawn
    children, or the children of the forkserver it started; neither the forkserver itself nor
    multiprocessing's resource tracker."""
    out = []
    for child in descendants(pid):
        cmd = _cmdline(child)
        if b"spawn_main" in cmd and b"resource_tracker" not in cmd:
            out.append(child)
        elif b"multiprocessing.forkserver" in cmd and \
                b"multiprocessing.forkserver" in _cmdline(_parent(child)):
            out.append(child)
    return out


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def _parent(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return -1


def running(pid: int) -> bool:
    """Whether ``pid`` is a live process (neither gone nor a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def run_ranks_outcomes(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 120.0,
                       pg_timeout: float = 30.0, env: dict[str, str] | None = None,
                       start: str = "forkserver") -> list[RankOutcome]:
    """Run ``fn(rank, world, *args)`` in ``world`` processes; return each rank's outcome
    (:class:`bench.engine.launch.RankOutcome`).

    A rank that exits without reporting (killed, ``os._exit``) has ``ok=False`` and its exit
    code. Raises ``TimeoutError`` if any process is still alive after ``timeout`` seconds
    (all processes are killed first). ``start``: ``Ranks.start`` (``"spawn"`` for a variable
    in ``env`` that torch reads at import).
    """
    spec = Ranks(world=world, timeout_s=timeout, pg_timeout_s=pg_timeout, threads=1,
                 env={"OMP_NUM_THREADS": "1", **(env or {})},
                 label=f"{getattr(fn, '__name__', 'fn')} on {world} ranks", start=start)
    return launch(fn, spec, *args)


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 120.0,
              pg_timeout: float = 30.0, env: dict[str, str] | None = None,
              start: str = "forkserver") -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` ranks and return the results by rank.

    Every rank must return normally; otherwise ``AssertionError`` carries all tracebacks.
    """
    outcomes = run_ranks_outcomes(fn, world, *args, timeout=timeout, pg_timeout=pg_timeout,
                                  env=env, start=start)
    bad = [o for o in outcomes if not o.ok]
    if bad:
        msg = "\n".join(f"--- rank {o.rank} (exit {o.exitcode}) ---\n{o.error}" for o in bad)
        raise AssertionError(f"{len(bad)} of {world} ranks failed:\n{msg}")
    return [o.result for o in outcomes]
