"""The one launcher of multi-rank runs: W processes, a process group over a file store, an
outer deadline, and every process killed on the way out, whatever happens.

    outcomes = launch(fn, Ranks(world=4, timeout_s=120), x)   # fn(rank, world, x) per rank
    results = [o.result for o in outcomes]                     # if every o.ok

The ranks fork from a server process that imported torch once for the driver
(``Ranks.start="forkserver"``, where the platform has it), so a launch costs W forks, not W
interpreters importing torch (several seconds of CPU a rank); ``"spawn"`` starts each from a
fresh interpreter. Either way a rank starts from the driver's environment at the launch, then
``Ranks.env``. Each rank enters its network namespace first (``Ranks.netns``: the emulated nodes of
:mod:`bench.engine.netns_nodes`), asks the kernel to end it with the driver (Linux), sets its torch
threads, joins the process group (gloo, or NCCL with rank r on GPU r), runs ``fn(rank,
world, *args)`` and reports what it returned, or its traceback, through a pipe of its own
whose only writer it is (the driver closes its copy once the rank started): a rank killed in
the middle of a message leaves the driver an end of file, not a read that waits forever, as a
queue's shared pipe would. A rank may send progress to the driver with :func:`progress`
(``Ranks.on_progress`` receives it).

The driver raises ``TimeoutError`` after killing every rank when ``timeout_s`` passes;
interrupted (Ctrl-C, or SIGTERM on the main thread) it kills every rank before the exception
leaves it. With ``fail_fast`` it stops at the first rank that fails (its peers would wait on
it until their collectives time out); otherwise it waits for every rank's outcome, so that a
test can check what each rank raised.

Used by :func:`bench.engine.runner.run`, :func:`bench.comm_bench.run_world` and ``tests/dist.py``.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import datetime
import multiprocessing as mp
import os
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection, wait
from typing import Any

__all__ = ["RankOutcome", "Ranks", "end_with_parent", "launch", "progress", "sigterm_unwinds"]


@dataclasses.dataclass
class Ranks:
    """How to launch W ranks."""

    world: int
    """Processes to spawn, one per rank (>= 1)."""
    timeout_s: float = 120.0
    """Outer deadline of the whole launch: past it every rank is killed."""
    pg_timeout_s: float | None = None
    """The process group's own timeout (default: ``timeout_s``)."""
    backend: str = "gloo"
    """``"gloo"``, or ``"nccl"`` (rank r on GPU ``r % device_count``)."""
    threads: int | None = None
    """torch threads per rank (default: the cores divided among the ranks)."""
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    """Environment variables set in every rank, over the driver's, before anything else runs
    in it. With ``start="forkserver"`` torch was imported before (in the server, with the
    driver's environment at its first launch): a variable that torch reads only at import
    (``TORCH_CPP_LOG_LEVEL``) needs ``start="spawn"``."""
    start: str = "forkserver"
    """``"forkserver"``: ranks fork from one server per driver that imported torch (module
    docstring; ``"spawn"`` where the platform has no forkserver), or ``"spawn"``: a fresh
    interpreter per rank."""
    netns: list[str] | None = None
    """Per rank, the network namespace it enters first (:mod:`bench.engine.netns_nodes`); its gloo
    then uses the namespace's node interface."""
    fail_fast: bool = False
    """Stop at the first failing rank instead of waiting for every outcome."""
    label: str = "run"
    """What error messages call the launch."""
    on_progress: Callable[[int, Any], None] | None = None
    """Called in the driver with ``(rank, obj)`` for each :func:`progress` of a rank."""

    def __post_init__(self) -> None:
        if not isinstance(self.world, int) or self.world < 1:
            raise ValueError(f"Ranks.world must be an int >= 1, got {self.world!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"Ranks.timeout_s must be > 0, got {self.timeout_s!r}")
        if self.start not in ("forkserver", "spawn"):
            raise ValueError(f"Ranks.start must be 'forkserver' or 'spawn', got {self.start!r}")
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"Ranks.backend must be 'gloo' or 'nccl', got {self.backend!r}")
        if self.netns is not None and len(self.netns) != self.world:
            raise ValueError(f"Ranks.netns names {len(self.netns)} namespaces for "
                             f"{self.world} ranks (one per rank)")


@dataclasses.dataclass
class RankOutcome:
    """What one rank did."""

    rank: int
    ok: bool
    """Whether ``fn`` returned normally."""
    result: Any = None
    """``fn``'s return value, when ``ok``."""
    error: str | None = None
    """The traceback, when ``fn`` raised (or why nothing was reported)."""
    exc_type: str | None = None
    exitcode: int | None = None
    """The process's exit code (None while it ran on past the driver: killed)."""


_PIPE: Connection | None = None
_RANK = -1


def progress(obj: Any) -> None:
    """From inside a launched rank: send ``obj`` to the driver's ``Ranks.on_progress``."""
    if _PIPE is not None:
        _PIPE.send(("progress", _RANK, obj))


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def end_with_parent(parent: int) -> None:
    """On Linux, have the kernel SIGKILL this process when its parent ends, however it ends: a
    SIGKILL of the driver runs none of its cleanup, and its ranks would run on. The parent is
    ``parent`` (the driver), or the forkserver the driver started, which exits when the driver
    does. Exits at once if the parent or the driver is already gone. Elsewhere a no-op."""
    if not sys.platform.startswith("linux"):
        return
    forked_by = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        return  # not allowed here (a sandbox): the driver's own cleanup is all there is
    if os.getppid() != forked_by or not _alive(parent):  # it ended before the prctl
        os._exit(1)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _rank_entry(rank: int, spec: dict[str, Any], init_file: str, parent: int,
                environ: dict[str, str], fn: Callable[..., Any], args: tuple,
                conn: Connection) -> None:
    global _PIPE, _RANK
    _PIPE, _RANK = conn, rank
    end_with_parent(parent)
    os.environ.clear()  # a forked rank holds the server's environment, not the driver's
    os.environ.update(environ)
    os.environ.update(spec["env"])
    world = spec["world"]
    if spec["netns"] is not None:
        from bench.engine import netns_nodes

        netns_nodes.enter(spec["netns"][rank])
        os.environ["GLOO_SOCKET_IFNAME"] = netns_nodes.NODE_IF
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    threads = spec["threads"] or max(1, (os.cpu_count() or 1) // world)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    try:
        if spec["backend"] == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(
            spec["backend"], init_method=f"file://{init_file}", rank=rank, world_size=world,
            timeout=datetime.timedelta(seconds=spec["pg_timeout_s"] or spec["timeout_s"]))
        # gloo's init can return on one rank while another is still connecting to it: a
        # rank whose fn needs no collective could then exit and close that connection
        dist.barrier()
        result = fn(rank, world, *args)
        conn.send(("result", rank, result))  # in the pipe before any teardown below
    except BaseException as e:  # noqa: BLE001 - report everything to the driver
        conn.send(("error", rank, (traceback.format_exc(), type(e).__name__)))
        raise SystemExit(1) from None
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def sigterm_unwinds() -> Iterator[None]:
    """Within: SIGTERM raises ``SystemExit`` (as Ctrl-C raises ``KeyboardInterrupt``), so the
    launcher's cleanup (or a caller's) kills its ranks; by default SIGTERM ends this process at
    once and the spawned ranks, orphaned, run on. A no-op off the main thread (only it takes
    signals)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def launch(fn: Callable[..., Any], spec: Ranks, *args: Any) -> list[RankOutcome]:
    """Run ``fn(rank, world, *args)`` on ``spec.world`` spawned ranks (module docstring);
    return each rank's outcome, by rank. ``fn`` and ``args`` must pickle (a module-level
    function); what ``fn`` returns must pickle by value (numpy arrays, not tensors, whose
    shared memory can go with the exiting rank)."""
    world = spec.world
    ctx = _context(spec.start)
    pipes = [ctx.Pipe(duplex=False) for _ in range(world)]  # (driver's end, rank's end)
    raw = {k: v for k, v in dataclasses.asdict(spec).items() if k != "on_progress"}
    outcomes: dict[int, RankOutcome] = {}
    with tempfile.TemporaryDirectory(prefix="scape-ranks-") as tmp, sigterm_unwinds():
        init_file = os.path.join(tmp, "store")
        environ = dict(os.environ)
        procs = [ctx.Process(target=_rank_entry, args=(r, raw, init_file, os.getpid(), environ,
                                                        fn, args, pipes[r][1]), daemon=True)
                 for r in range(world)]
        readers = [reader for reader, _ in pipes]
        for p, (_, writer) in zip(procs, pipes):
            p.start()
            writer.close()  # the rank holds the only writer: its death is an end of file
        deadline = time.monotonic() + spec.timeout_s
        failed = False
        finished = False  # the loop ended by itself (not a deadline, Ctrl-C or SIGTERM)
        try:
            while len(outcomes) < world and not (failed and spec.fail_fast):
                got = _receive(readers, 0.2)
                for msg in got:
                    failed |= _record(msg, outcomes, spec)
                if got:
                    continue
                if all(not p.is_alive() for p in procs):
                    while got := _receive(readers, 0.5):  # what the exited ranks reported
                        for msg in got:
                            failed |= _record(msg, outcomes, spec)
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"{spec.label}: {world} ranks did not finish within "
                        f"{spec.timeout_s:.0f} s; ranks that reported: {sorted(outcomes)}; "
                        "all ranks were killed")
            finished = True
        finally:
            done = len(outcomes) == world and all(o.ok for o in outcomes.values())
            for p in procs:  # the ranks that report are let end by themselves, the others
                p.join(timeout=0.0 if not finished or (failed and spec.fail_fast)  # killed
                       else max(0.0, min(10.0, deadline - time.monotonic())) if done
                       else max(1.0, deadline - time.monotonic()))
                if p.is_alive():
                    p.kill()
                    p.join()
            for reader, _ in pipes:
                reader.close()
    out = []
    for r, p in enumerate(procs):
        o = outcomes.get(r, RankOutcome(r, False, error="rank exited without reporting"))
        o.exitcode = p.exitcode
        out.append(o)
    return out


FORKSERVER_PRELOAD = ["bench.engine.preload"]
"""What the forkserver imports before it forks a rank (:mod:`bench.engine.preload`: torch)."""


def _context(start: str) -> Any:
    """The multiprocessing context of ``Ranks.start``; the forkserver's preload is set before
    its first use (the server is the process's one, started at its first launch)."""
    if start == "forkserver" and "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(FORKSERVER_PRELOAD)
        return ctx
    return mp.get_context("spawn")


def _receive(readers: list[Connection], timeout: float) -> list[tuple[str, int, Any]]:
    """The messages ready on ``readers`` within ``timeout`` s (empty if none); a reader at its
    end of file (its rank exited or was killed, even in the middle of a message) is closed and
    dropped from ``readers``."""
    out: list[tuple[str, int, Any]] = []
    for reader in wait(readers, timeout=timeout):
        assert isinstance(reader, Connection)
        try:
            out.append(reader.recv())
        except (EOFError, OSError):
            readers.remove(reader)
            reader.close()
    return out


def _record(msg: tuple[str, int, Any], outcomes: dict[int, RankOutcome], spec: Ranks) -> bool:
    """Take one message of a rank: its result, its error (returns True) or its progress."""
    kind, rank, payload = msg
    if kind == "result":
        outcomes[rank] = RankOutcome(rank, True, result=payload)
    elif kind == "error":
        outcomes[rank] = RankOutcome(rank, False, error=payload[0], exc_type=payload[1])
        return True
    elif spec.on_progress is not None:
        spec.on_progress(rank, payload)
    return False
