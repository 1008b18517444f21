"""Multi-process test harness: one real process per rank, gloo over a file store, and an
outer deadline so that a hang is a test failure, never a stuck CI.

    def _body(rank, world, x):            # module-level, so spawn can pickle it
        ...
        return something_picklable

    results = run_ranks(_body, 4, x, timeout=60)     # list indexed by rank

``run_ranks`` raises ``AssertionError`` with every failing rank's traceback, or
``TimeoutError`` (after killing every process) when the deadline passes. Tests that expect a
rank to die or raise use ``run_ranks_outcomes``, which returns what happened on each rank.
Tests that launch a launcher (torchrun, ``python -m bench.runner``) find its workers with
``descendants`` (its spawned ranks: ``spawned_ranks``) and ask ``running`` whether each is left.
"""

from __future__ import annotations

import dataclasses
import datetime
import multiprocessing as mp
import os
import queue
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any


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
    """The ``multiprocessing`` spawn children below ``pid`` (``bench.runner``'s ranks), not
    multiprocessing's resource tracker."""
    out = []
    for child in descendants(pid):
        try:
            with open(f"/proc/{child}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if b"spawn_main" in cmd and b"resource_tracker" not in cmd:
            out.append(child)
    return out


def running(pid: int) -> bool:
    """Whether ``pid`` is a live process (neither gone nor a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@dataclasses.dataclass
class RankOutcome:
    rank: int
    ok: bool                 # fn returned normally
    result: Any = None       # fn's return value when ok
    error: str | None = None  # traceback text when fn raised
    exc_type: str | None = None
    exitcode: int | None = None  # process exit code (None while running / unknown)


def _entry(rank: int, world: int, init_file: str, pg_timeout: float, env: dict[str, str],
           fn: Callable[..., Any], args: tuple, q: Any) -> None:
    os.environ.update(env)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        if world > 0:
            dist.init_process_group(
                "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                timeout=datetime.timedelta(seconds=pg_timeout),
            )
            # gloo's init can return on one rank while another is still connecting to it: a
            # rank whose fn needs no collective could then exit and close that connection
            # ("Connection closed by peer" in the other rank's init)
            dist.barrier()
        result = fn(rank, world, *args)
        q.put(RankOutcome(rank, True, result=result))
    except BaseException as e:  # noqa: BLE001 - report everything to the parent
        q.put(RankOutcome(rank, False, error=traceback.format_exc(), exc_type=type(e).__name__))
        raise SystemExit(1) from None
    finally:
        if world > 0 and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass


def run_ranks_outcomes(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 120.0,
                       pg_timeout: float = 30.0, env: dict[str, str] | None = None,
                       ) -> list[RankOutcome]:
    """Run ``fn(rank, world, *args)`` in ``world`` processes; return each rank's outcome.

    A rank that exits without reporting (killed, ``os._exit``) has ``ok=False`` and its exit
    code. Raises ``TimeoutError`` if any process is still alive after ``timeout`` seconds
    (all processes are killed first).
    """
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_entry, args=(r, world, init_file, pg_timeout, env or {}, fn,
                                             args, q), daemon=True)
            for r in range(world)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        outcomes: dict[int, RankOutcome] = {}
        while len(outcomes) < world:
            try:
                o = q.get(timeout=0.2)
                outcomes[o.rank] = o
            except queue.Empty:
                pass
            if all(not p.is_alive() for p in procs):
                # drain what the dead processes managed to report
                while True:
                    try:
                        o = q.get(timeout=0.5)
                        outcomes[o.rank] = o
                    except queue.Empty:
                        break
                break
            if time.monotonic() > deadline:
                for p in procs:
                    p.kill()
                raise TimeoutError(
                    f"{fn.__name__} on {world} ranks did not finish within {timeout:.0f} s; "
                    f"ranks that reported: {sorted(outcomes)}")
        for p in procs:
            p.join(timeout=max(1.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()
        result = []
        for r, p in enumerate(procs):
            o = outcomes.get(r, RankOutcome(r, False, error="rank exited without reporting"))
            o.exitcode = p.exitcode
            result.append(o)
        return result


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 120.0,
              pg_timeout: float = 30.0, env: dict[str, str] | None = None) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` ranks and return the results by rank.

    Every rank must return normally; otherwise ``AssertionError`` carries all tracebacks.
    """
    outcomes = run_ranks_outcomes(fn, world, *args, timeout=timeout, pg_timeout=pg_timeout,
                                  env=env)
    bad = [o for o in outcomes if not o.ok]
    if bad:
        msg = "\n".join(f"--- rank {o.rank} (exit {o.exitcode}) ---\n{o.error}" for o in bad)
        raise AssertionError(f"{len(bad)} of {world} ranks failed:\n{msg}")
    return [o.result for o in outcomes]
