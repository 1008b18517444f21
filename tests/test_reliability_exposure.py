"""Promise 15 (issue 6): what scape exposes.

- scape opens no listening socket: in each rank of a gloo group initialized from a *file* store
  (so torch runs no TCP store), the TCP LISTEN sockets this process owns (/proc/net/tcp and
  tcp6, matched to /proc/self/fd by inode) are the same before and after building the
  optimizer, training, saving and loading a checkpoint. The process group's own gloo sockets
  are torch's and are there before. A socket opened on purpose is seen (the probe works).
- The NCCL unique id never appears in logs, output, reprs or attributes: an
  ``NcclCommunicator`` built on a stand-in library (no GPU here) exchanges a stand-in id over
  gloo with ``TORCH_DISTRIBUTED_DEBUG=DETAIL``, Python logging at DEBUG and file descriptors 1
  and 2 captured; the id (hex or bytes) is nowhere in what was captured, yet both ranks handed
  the same id to the library.
"""

from __future__ import annotations

import contextlib
import io as io_bytes
import logging
import os
import random
import socket
import tempfile
import threading

import torch
import torch.distributed as dist
from dist import run_ranks
from reliability_common import make_model, make_opt, train_step

import scape


def _listening() -> set[tuple[str, str]]:
    """(table, local address) of every TCP socket in LISTEN state that this process owns."""
    mine = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            mine.add(target[8:-1])
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue
        for line in open(table).read().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in mine:  # 0A: TCP_LISTEN
                out.add((table, f[1]))
    return out


def _sockets_body(rank, world, root):
    dist.barrier()  # the process group is fully up: its own sockets exist now
    before = _listening()
    model = make_model()
    opt = make_opt(model)
    for t in range(1, 6):
        train_step(model, opt, t, rank)
    scape.save_checkpoint(opt, root)
    scape.load_checkpoint(opt, root)
    train_step(model, opt, 6, rank)
    after = _listening()
    # the probe sees a listening socket when there is one
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    probe.listen()
    seen = _listening() - after
    probe.close()
    return sorted(before), sorted(after), len(seen)


def test_scape_opens_no_listening_socket(tmp_path):
    for before, after, seen in run_ranks(_sockets_body, 2, str(tmp_path), timeout=120):
        assert after == before, f"new listening sockets: {set(after) - set(before)}"
        assert seen == 1


class _FakeNccl:
    """Stands in for cupy.cuda.nccl: makes a stand-in id and records what it is handed."""

    class NcclError(Exception):
        pass

    def __init__(self, uid: bytes) -> None:
        self.uid = uid
        self.handed: list[bytes] = []
        fake = self

        class Comm:
            def __init__(self, world, unique_id, rank):
                fake.handed.append(bytes(unique_id))

            def check_async_error(self):
                return None

            def abort(self):
                return None

        self.NcclCommunicator = Comm

    def get_unique_id(self) -> bytes:
        return self.uid


class _NoDevice:
    def __init__(self, *args, **kwargs) -> None:
        self.cuda_stream = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _unique_id_body(rank, world):
    from scape.comm import nccl_backend as nb

    uid = random.Random(2024).randbytes(nb.NCCL_UNIQUE_ID_BYTES)
    lib = _FakeNccl(uid if rank == 0 else b"\0" * nb.NCCL_UNIQUE_ID_BYTES)
    nb.import_nccl = lambda: lib
    torch.cuda.is_available = lambda: True
    torch.cuda.current_device = lambda: 0
    torch.cuda.device = _NoDevice
    torch.cuda.Stream = _NoDevice
    log = io_bytes.StringIO()
    handler = logging.StreamHandler(log)
    logging.getLogger().addHandler(handler)
    logging.getLogger().setLevel(logging.DEBUG)
    with tempfile.TemporaryFile(mode="w+b") as captured:
        saved = [os.dup(1), os.dup(2)]
        os.dup2(captured.fileno(), 1)
        os.dup2(captured.fileno(), 2)
        try:
            with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
                comm = nb.NcclCommunicator(timeout=30.0)
                text = repr(comm) + str(vars(comm)) + str(comm.stats)
                logging.getLogger("scape").debug("built %r", comm)
                comm.destroy()
        finally:
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
        captured.seek(0)
        fds = captured.read()
    threads = [t.name for t in threading.enumerate() if t.name == "scape-nccl-watchdog"]
    return lib.handed, uid, log.getvalue() + text, fds, threads


def test_nccl_unique_id_never_logged():
    results = run_ranks(_unique_id_body, 2, timeout=120,
                        env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL", "TORCH_CPP_LOG_LEVEL": "INFO",
                             "NCCL_DEBUG": "INFO"}, start="spawn")
    uid = results[0][1]
    for handed, _, text, fds, threads in results:
        assert handed == [uid], "the library was not handed rank 0's id"
        assert not threads  # destroy() stopped the watchdog
        for needle in (uid.hex(), uid.hex().upper(), repr(uid)[2:-1], str(list(uid))[1:40]):
            assert needle not in text, "the unique id appears in logs or reprs"
        assert uid not in fds and uid.hex().encode() not in fds
    assert any(results[r][2] for r in (0, 1))  # something was captured at all
