"""``NcclCommunicator``: the Communicator protocol on NCCL through CuPy (``cupy.cuda.nccl``).

The NCCL library is the one from the ``nvidia-nccl-cu12`` wheel: ``cupy.cuda.nccl`` preloads
``nvidia/nccl/lib/libnccl.so.2`` from site-packages when it is imported (cupy's
``_environment._get_nccl_from_wheel``), so no system NCCL is needed. cupy is imported lazily,
only when a communicator is constructed, and only inside ``scape.comm``.

Launch with ``torchrun`` (or anything that initializes ``torch.distributed``): rank 0 makes the
NCCL unique id and broadcasts its 128 bytes over a gloo (CPU) group; every rank then creates its
NCCL communicator under its device context. Call ``torch.cuda.set_device(local_rank)`` first.
Without torch.distributed it is a single-rank communicator.

Streams and events (one dedicated non-blocking stream per communicator)::

    caller stream  ──[writes inp]──●ready──────[independent compute]──────⧗done──[reads out]──
                                   │                                      ▲
    comm stream    ───────────────⧗ready──[ncclAllGather(inp → out)]──●done
                                                                          │
    watchdog       ─── polls done.query() and ncclCommGetAsyncError every 50 ms;
                       aborts the communicator when done is late by more than timeout

    ● event record   ⧗ stream waits on the event (no host synchronization anywhere)

A collective first makes the comm stream wait on the caller's current stream (so it sees the
caller's writes), enqueues the NCCL call on the comm stream, marks every tensor it touches with
``record_stream`` (the caching allocator will not hand their memory to another stream before the
collective completes) and records ``done``. ``Work.wait()`` makes the caller's current stream
wait on ``done`` and returns at once. The ``Work`` and the watchdog's list also keep the tensors
referenced until ``done`` has completed.

Errors: every library call goes through ``_check``, which turns ``NcclError`` into ``CommError``
with NCCL's own error string. A watchdog thread polls asynchronous errors and the completion of
every pending collective; a collective not complete within ``timeout`` (or an async error)
aborts the communicator (``ncclCommAbort``, which also unblocks the hung kernels) and every later
call, ``wait()`` and ``is_completed()`` raises ``CommError``. ``destroy()`` aborts rather than
waits. The unique id is never stored, logged or shown in a repr.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist

from .base import CommError, Communicator, CompletedWork, Work

GPU_EXTRA_HINT = 'pip install "scape-optim[gpu]"'

NCCL_UNIQUE_ID_BYTES = 128
"""Size of ``ncclUniqueId`` (NCCL_UNIQUE_ID_BYTES in nccl.h)."""

DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)
WATCHDOG_INTERVAL_S = 0.05

NCCL_DTYPES: dict[torch.dtype, str] = {
    torch.float32: "NCCL_FLOAT32",
    torch.float64: "NCCL_FLOAT64",
    torch.float16: "NCCL_FLOAT16",
    torch.bfloat16: "NCCL_BFLOAT16",
    torch.int8: "NCCL_INT8",
    torch.uint8: "NCCL_UINT8",
    torch.int32: "NCCL_INT32",
    torch.int64: "NCCL_INT64",
    torch.uint32: "NCCL_UINT32",
    torch.uint64: "NCCL_UINT64",
}
"""torch dtype -> ``cupy.cuda.nccl`` constant name: the dtypes NCCL carries and reduces."""

NCCL_OPS: dict[str, str] = {"sum": "NCCL_SUM", "avg": "NCCL_AVG", "max": "NCCL_MAX"}
"""Reduction op name -> ``cupy.cuda.nccl`` constant name."""


def import_nccl() -> ModuleType:
    """``cupy.cuda.nccl``, or ``ImportError`` naming the ``gpu`` extra."""
    try:
        from cupy.cuda import nccl
    except ImportError as e:
        raise ImportError(f"NcclCommunicator needs cupy with NCCL (the gpu extra): "
                          f"{GPU_EXTRA_HINT}; the import failed with: {e}") from e
    if not getattr(nccl, "available", False):
        raise ImportError(f"NcclCommunicator: cupy found no NCCL library; {GPU_EXTRA_HINT} "
                          f"installs nvidia-nccl-cu12")
    return nccl


def nccl_dtype(nccl: Any, dtype: torch.dtype, reduce: bool) -> tuple[int, int]:
    """``(NCCL datatype, elements per torch element)`` for moving ``dtype``.

    A dtype NCCL lacks travels as bytes (``ncclUint8``, ``itemsize`` elements per element) when
    ``reduce`` is False (all_gather, broadcast, all_to_all); for a reduction it raises
    ``ValueError``.
    """
    name = NCCL_DTYPES.get(dtype)
    if name is not None:
        return int(getattr(nccl, name)), 1
    if reduce:
        names = ", ".join(str(d).removeprefix("torch.") for d in NCCL_DTYPES)
        raise ValueError(f"NCCL cannot reduce {dtype}; reducible dtypes: {names}")
    return int(nccl.NCCL_UINT8), dtype.itemsize


def nccl_op(nccl: Any, op: str) -> int:
    """The NCCL reduction op for ``op`` (``"sum"``, ``"avg"``, ``"max"``); ``ValueError`` else."""
    name = NCCL_OPS.get(op)
    if name is None:
        raise ValueError(f"NCCL reduction op must be one of {tuple(NCCL_OPS)}, got {op!r}")
    return int(getattr(nccl, name))


def broadcast_unique_id(unique_id: bytes | None, group: dist.ProcessGroup | None = None,
                        src: int = 0) -> bytes:
    """Broadcast the NCCL unique id from group rank ``src`` over a gloo (CPU) ``group``.

    Rank ``src`` passes the 128 id bytes, the others pass ``None``; every rank gets the bytes.
    """
    rank = dist.get_rank(group)
    buf = torch.zeros(NCCL_UNIQUE_ID_BYTES, dtype=torch.uint8)
    if rank == src:
        if not isinstance(unique_id, bytes | bytearray):
            raise TypeError(f"broadcast_unique_id: rank {src} must pass the id as bytes, got "
                            f"{type(unique_id).__name__}")
        if len(unique_id) != NCCL_UNIQUE_ID_BYTES:
            raise ValueError(f"broadcast_unique_id: the id must be {NCCL_UNIQUE_ID_BYTES} "
                             f"bytes, got {len(unique_id)}")
        buf.copy_(torch.frombuffer(bytearray(unique_id), dtype=torch.uint8))
    global_src = src if group is None else dist.get_global_rank(group, src)
    dist.broadcast(buf, global_src, group=group)
    return buf.numpy().tobytes()


class _NcclWork(Work):
    """One enqueued NCCL collective: its completion event and the tensors it uses."""

    def __init__(self, comm: NcclCommunicator, op: str, done: torch.cuda.Event,
                 keep: tuple[torch.Tensor, ...]):
        self.comm = comm
        self.op = op
        self.step = comm.step
        self.done = done
        self.keep: tuple[torch.Tensor, ...] | None = keep
        self.enqueued_at = time.monotonic()

    def wait(self) -> None:
        self.comm._raise_if_failed(self.op)
        torch.cuda.current_stream(self.comm.device).wait_event(self.done)

    def is_completed(self) -> bool:
        self.comm._raise_if_failed(self.op)
        return bool(self.done.query())


class NcclCommunicator(Communicator):
    """The Communicator protocol on NCCL (CuPy), on one dedicated CUDA stream.

    Args:
        group: torch.distributed group whose ranks form the NCCL communicator (default: the
            default group). The unique id travels over it if its backend includes gloo, else
            over a new gloo group with the same ranks. Single-rank if torch.distributed is not
            initialized.
        device: this rank's CUDA device (default: the current device).
        timeout: a collective not complete this long after it was enqueued aborts the
            communicator (``timedelta`` or seconds).
    """

    def __init__(self, group: dist.ProcessGroup | None = None,
                 device: torch.device | str | int | None = None,
                 timeout: datetime.timedelta | float = DEFAULT_TIMEOUT):
        self._nccl = import_nccl()
        self._comm: Any = None
        self._watchdog: threading.Thread | None = None
        self._init_stats()
        if isinstance(timeout, datetime.timedelta):
            self.timeout_s = timeout.total_seconds()
        elif isinstance(timeout, int | float) and not isinstance(timeout, bool):
            self.timeout_s = float(timeout)
        else:
            raise TypeError(f"NcclCommunicator: timeout must be a timedelta or seconds, got "
                            f"{type(timeout).__name__}")
        if not self.timeout_s > 0:
            raise ValueError(f"NcclCommunicator: timeout must be positive, got {timeout!r}")
        if device is not None:
            dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(
                device)
            if dev.type != "cuda":
                raise ValueError(f"NcclCommunicator: device must be a CUDA device, got {dev}")
        if not torch.cuda.is_available():
            raise RuntimeError("NcclCommunicator needs a CUDA device and "
                               "torch.cuda.is_available() is False; use TorchCommunicator")
        index = torch.cuda.current_device() if device is None or dev.index is None else dev.index
        self.device = torch.device("cuda", index)

        distributed = dist.is_available() and dist.is_initialized()
        if group is not None and not distributed:
            raise ValueError("NcclCommunicator: a group was given but torch.distributed is "
                             "not initialized")
        self._failure: CommError | None = None
        if distributed:
            self.rank = dist.get_rank(group)
            self.world_size = dist.get_world_size(group)
            id_group = group if "gloo" in str(dist.get_backend(group)) else dist.new_group(
                ranks=None if group is None else dist.get_process_group_ranks(group),
                backend="gloo")
            unique_id = broadcast_unique_id(
                self._new_unique_id() if self.rank == 0 else None, id_group)
        else:
            self.rank, self.world_size = 0, 1
            unique_id = self._new_unique_id()
        with torch.cuda.device(self.device):
            self._comm = self._check("init", self._nccl.NcclCommunicator,
                                     self.world_size, unique_id, self.rank)
            # torch creates its streams with cudaStreamNonBlocking.
            self._stream = torch.cuda.Stream(self.device)
        del unique_id
        self._pending: list[_NcclWork] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._watchdog = threading.Thread(target=self._watch, name="scape-nccl-watchdog",
                                          daemon=True)
        self._watchdog.start()

    def __repr__(self) -> str:
        return (f"NcclCommunicator(rank={self.rank}, world_size={self.world_size}, "
                f"device={self.device}, timeout={self.timeout_s:g}s)")

    def _reducible_dtypes(self) -> tuple[torch.dtype, ...]:
        return tuple(NCCL_DTYPES)

    # -- collectives -----------------------------------------------------------------------
    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> Work:
        self._check_all_gather(out, inp)
        dtype, per = nccl_dtype(self._nccl, inp.dtype, reduce=False)
        self._count("all_gather", out.nbytes)
        return self._launch("all_gather", (out, inp), lambda comm, stream: comm.allGather(
            inp.data_ptr(), out.data_ptr(), inp.numel() * per, dtype, stream))

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, op: str = "avg") -> Work:
        self._check_reduce_scatter(out, inp, op)
        dtype, _ = nccl_dtype(self._nccl, out.dtype, reduce=True)
        nop = nccl_op(self._nccl, op)
        self._count("reduce_scatter", inp.nbytes)
        return self._launch("reduce_scatter", (out, inp), lambda comm, stream:
                            comm.reduceScatter(inp.data_ptr(), out.data_ptr(), out.numel(),
                                               dtype, nop, stream))

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor) -> Work:
        """One NCCL group (``ncclGroupStart``/``ncclGroupEnd``) of a send of segment ``r`` of
        ``inp`` and a receive into segment ``r`` of ``out`` for every rank ``r`` (itself
        included), on the comm stream."""
        self._check_all_to_all(out, inp)
        dtype, per = nccl_dtype(self._nccl, inp.dtype, reduce=False)
        m = inp.numel() // self.world_size
        count, seg = m * per, m * inp.element_size()
        nccl, world = self._nccl, self.world_size
        self._count("all_to_all", inp.nbytes)

        def call(comm: Any, stream: int) -> None:
            src, dst = inp.data_ptr(), out.data_ptr()
            nccl.groupStart()
            try:
                for peer in range(world):
                    comm.send(src + peer * seg, count, dtype, peer, stream)
                    comm.recv(dst + peer * seg, count, dtype, peer, stream)
            finally:
                nccl.groupEnd()

        return self._launch("all_to_all", (out, inp), call)

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> Work:
        self._check_all_reduce(t, op)
        dtype, _ = nccl_dtype(self._nccl, t.dtype, reduce=True)
        nop = nccl_op(self._nccl, op)
        self._count("all_reduce", t.nbytes)
        return self._launch("all_reduce", (t,), lambda comm, stream: comm.allReduce(
            t.data_ptr(), t.data_ptr(), t.numel(), dtype, nop, stream))

    def broadcast(self, t: torch.Tensor, src: int) -> Work:
        self._check_broadcast(t, src)
        dtype, per = nccl_dtype(self._nccl, t.dtype, reduce=False)
        self._count("broadcast", t.nbytes)
        return self._launch("broadcast", (t,), lambda comm, stream: comm.broadcast(
            t.data_ptr(), t.data_ptr(), t.numel() * per, dtype, src, stream))

    def barrier(self) -> None:
        """An all_reduce of one int32 on the comm stream, then a host wait on its event
        (bounded by the watchdog's timeout). Not counted in ``stats``."""
        flag = torch.zeros(1, dtype=torch.int32, device=self.device)
        dtype = int(self._nccl.NCCL_INT32)
        work = self._launch("barrier", (flag,), lambda comm, stream: comm.allReduce(
            flag.data_ptr(), flag.data_ptr(), 1, dtype, int(self._nccl.NCCL_SUM), stream))
        while not work.is_completed():
            time.sleep(0.001)

    def destroy(self) -> None:
        """Stop the watchdog and abort the NCCL communicator (never blocks on a peer)."""
        if self._watchdog is not None:
            self._stop.set()
            if self._watchdog is not threading.current_thread():
                self._watchdog.join(timeout=1.0)
            self._watchdog = None
        self._abort()
        if self._failure is None:
            self._failure = CommError("destroy", self.rank, self.step,
                                      "the communicator was destroyed")

    # -- internals -------------------------------------------------------------------------
    def _new_unique_id(self) -> bytes:
        uid = self._check("get_unique_id", self._nccl.get_unique_id)
        if isinstance(uid, tuple):  # older cupy: a tuple of signed chars
            uid = bytes(c % 256 for c in uid)
        return bytes(uid)

    def _check(self, op: str, fn: Callable[..., Any], *args: Any) -> Any:
        """Call the library; an ``NcclError`` becomes ``CommError`` with NCCL's string."""
        try:
            return fn(*args)
        except self._nccl.NcclError as e:
            raise CommError(op, getattr(self, "rank", -1), getattr(self, "_step", None),
                            f"NCCL: {e}") from e

    def _raise_if_failed(self, op: str) -> None:
        failure = self._failure
        if failure is not None:
            raise CommError(op, self.rank, self.step,
                            f"the communicator is aborted ({failure})") from failure

    def _launch(self, op: str, tensors: tuple[torch.Tensor, ...],
                call: Callable[[Any, int], None]) -> Work:
        self._raise_if_failed(op)
        if all(t.numel() == 0 for t in tensors):
            return CompletedWork()
        caller = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(caller)  # event recorded on caller, waited on by comm stream
        with torch.cuda.device(self.device):
            self._check(op, call, self._comm, self._stream.cuda_stream)
        for t in tensors:
            t.record_stream(self._stream)
        done = torch.cuda.Event()
        done.record(self._stream)
        work = _NcclWork(self, op, done, tensors)
        with self._lock:
            self._pending.append(work)
        return work

    def _watch(self) -> None:
        """Poll async errors and pending collectives; abort on error or timeout."""
        while not self._stop.wait(WATCHDOG_INTERVAL_S):
            comm = self._comm
            if comm is None:  # aborted or destroyed
                return
            try:
                self._check("async", comm.check_async_error)
            except CommError as e:
                self._fail(e)
                return
            now = time.monotonic()
            with self._lock:
                still = []
                for work in self._pending:
                    if work.done.query():
                        work.keep = None
                    elif now - work.enqueued_at > self.timeout_s:
                        late = work
                        break
                    else:
                        still.append(work)
                else:
                    self._pending = still
                    continue
            self._fail(CommError(late.op, self.rank, late.step,
                                 f"not complete within the timeout of {self.timeout_s:g} s; "
                                 f"the communicator was aborted"))
            return

    def _fail(self, error: CommError) -> None:
        if self._failure is None:
            self._failure = error
        self._abort()

    def _abort(self) -> None:
        comm, self._comm = self._comm, None
        if comm is not None:
            try:
                with torch.cuda.device(self.device):
                    comm.abort()
            except Exception:  # noqa: BLE001 - aborting is best effort by definition
                pass
