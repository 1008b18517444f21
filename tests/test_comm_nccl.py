"""NcclCommunicator on a machine without GPUs: lazy import, the ImportError without cupy, the
dtype and op tables, the unique-id broadcast through gloo, argument validation, and the
arguments each collective hands to NCCL (recorded by a stand-in library object). The collective
suite itself re-runs on NCCL in tests/test_comm.py when enough GPUs are present."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest
import torch
from dist import run_ranks

import scape.comm.nccl_backend as nb
from scape.comm import CommError, NcclCommunicator

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# ncclDataType_t and ncclRedOp_t as nccl.h numbers them (the reference the tables must match)
NCCL_H_DTYPES = {"NCCL_INT8": 0, "NCCL_UINT8": 1, "NCCL_INT32": 2, "NCCL_UINT32": 3,
                 "NCCL_INT64": 4, "NCCL_UINT64": 5, "NCCL_FLOAT16": 6, "NCCL_FLOAT32": 7,
                 "NCCL_FLOAT64": 8, "NCCL_BFLOAT16": 9}
NCCL_H_OPS = {"NCCL_SUM": 0, "NCCL_PROD": 1, "NCCL_MAX": 2, "NCCL_MIN": 3, "NCCL_AVG": 4}
NCCL_H_SIZES = {"INT8": 1, "UINT8": 1, "INT32": 4, "UINT32": 4, "INT64": 8, "UINT64": 8,
                "FLOAT16": 2, "FLOAT32": 4, "FLOAT64": 8, "BFLOAT16": 2}


def _python(code: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=REPO, env=env)


def test_import_does_not_load_cupy():
    r = _python("import sys, scape.comm\n"
                "from scape.comm import NcclCommunicator, init_communicator\n"
                "assert 'cupy' not in sys.modules, 'cupy imported'\n"
                "assert not any(m.startswith('cupy') for m in sys.modules)\n"
                "print('clean')")
    assert r.returncode == 0 and "clean" in r.stdout, r.stderr


def test_missing_cupy_names_gpu_extra():
    r = _python("import sys\n"
                "sys.modules['cupy'] = None  # as if cupy were not installed\n"
                "from scape.comm import NcclCommunicator, TorchCommunicator, init_communicator\n"
                "try:\n"
                "    NcclCommunicator()\n"
                "except ImportError as e:\n"
                "    print('MSG', e)\n"
                "import torch\n"
                "if not torch.cuda.is_available():\n"
                "    assert isinstance(init_communicator(), TorchCommunicator)\n"
                "    print('AUTO torch')\n")
    assert r.returncode == 0, r.stderr
    assert 'MSG NcclCommunicator needs cupy' in r.stdout
    assert 'pip install "scape-optim[gpu]"' in r.stdout
    if not torch.cuda.is_available():
        assert "AUTO torch" in r.stdout


def test_tables_match_nccl_h():
    nccl = nb.import_nccl()
    for dtype, name in nb.NCCL_DTYPES.items():
        code, per = nb.nccl_dtype(nccl, dtype, reduce=True)
        assert (code, per) == (NCCL_H_DTYPES[name], 1), name
        assert getattr(nccl, name) == NCCL_H_DTYPES[name]
        assert torch.empty(0, dtype=dtype).element_size() == NCCL_H_SIZES[
            name.removeprefix("NCCL_")], f"{dtype} and {name} differ in size"
    for op, name in nb.NCCL_OPS.items():
        assert nb.nccl_op(nccl, op) == NCCL_H_OPS[name] == getattr(nccl, name)
    # what NCCL lacks travels as bytes for copies, and is refused for reductions
    for dtype in (torch.int16, torch.uint16, torch.bool, torch.float8_e4m3fn, torch.complex64):
        assert nb.nccl_dtype(nccl, dtype, reduce=False) == (
            NCCL_H_DTYPES["NCCL_UINT8"], torch.empty(0, dtype=dtype).element_size())
        with pytest.raises(ValueError, match="cannot reduce"):
            nb.nccl_dtype(nccl, dtype, reduce=True)
    for op in ("min", "prod", "SUM", None):
        with pytest.raises(ValueError, match="reduction op"):
            nb.nccl_op(nccl, op)


def test_constructor_validation():
    with pytest.raises(ValueError, match="timeout"):
        NcclCommunicator(timeout=-1.0)
    with pytest.raises(TypeError, match="timeout"):
        NcclCommunicator(timeout="10")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="CUDA device"):
        NcclCommunicator(device="cpu")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="TorchCommunicator"):
            NcclCommunicator()


# -- the unique id through gloo --------------------------------------------------------------
def _share_ids(rank: int, world: int) -> dict:
    import torch.distributed as dist

    nccl = nb.import_nccl()
    stand_in = random.Random(1234).randbytes(nb.NCCL_UNIQUE_ID_BYTES)
    got = nb.broadcast_unique_id(stand_in if rank == 0 else None)
    # a real id from the library (no GPU needed to make one), from the last rank
    real = nccl.get_unique_id() if rank == world - 1 else None
    got_real = nb.broadcast_unique_id(real, None, src=world - 1)
    # a subgroup without rank 0: group rank 0 is global rank 1
    sub = dist.new_group([1, 2], backend="gloo")
    got_sub = None
    if rank in (1, 2):
        sub_id = random.Random(99).randbytes(nb.NCCL_UNIQUE_ID_BYTES)
        got_sub = nb.broadcast_unique_id(sub_id if rank == 1 else None, sub)
    # a malformed id is refused on the sending rank before anything is sent
    errors = []
    if rank == 0:
        for bad in (b"x" * 127, "not bytes"):
            try:
                nb.broadcast_unique_id(bad)  # type: ignore[arg-type]
            except (ValueError, TypeError) as e:
                errors.append(type(e).__name__)
    dist.barrier()
    return {"got": got, "got_real": got_real, "real": real, "got_sub": got_sub,
            "errors": errors}


def test_unique_id_broadcast_over_gloo():
    res = run_ranks(_share_ids, 3, timeout=90)
    stand_in = random.Random(1234).randbytes(nb.NCCL_UNIQUE_ID_BYTES)
    assert all(r["got"] == stand_in for r in res)
    real = res[2]["real"]
    assert isinstance(real, bytes) and len(real) == nb.NCCL_UNIQUE_ID_BYTES
    assert all(r["got_real"] == real for r in res)
    sub_id = random.Random(99).randbytes(nb.NCCL_UNIQUE_ID_BYTES)
    assert [r["got_sub"] for r in res] == [None, sub_id, sub_id]
    assert res[0]["errors"] == ["ValueError", "TypeError"]


# -- collectives up to the library call ------------------------------------------------------
class _RecordingLibrary:
    """Stands in for cupy's NcclCommunicator: records each call's arguments."""

    def __init__(self):
        self.calls: list[tuple] = []

    def __getattr__(self, name):
        return lambda *args: self.calls.append((name, *args))


class _RecordingModule:
    """Stands in for ``cupy.cuda.nccl``: its constants and errors, with ``groupStart`` and
    ``groupEnd`` recorded in the library's list (so the order of a group's calls shows)."""

    def __init__(self, nccl, lib: _RecordingLibrary):
        self._nccl, self._lib = nccl, lib

    def __getattr__(self, name):
        return getattr(self._nccl, name)

    def groupStart(self):  # noqa: N802 - cupy's name
        self._lib.calls.append(("groupStart",))

    def groupEnd(self):  # noqa: N802 - cupy's name
        self._lib.calls.append(("groupEnd",))


def _offline_comm(world: int, rank: int):
    """An NcclCommunicator without a GPU: CPU tensors, and a launcher that hands each call to a
    recording library instead of a stream. Everything before the library call is the real
    code path: validation, table look-ups, byte accounting, pointers and counts."""
    comm = NcclCommunicator.__new__(NcclCommunicator)
    comm._init_stats()
    comm.rank, comm.world_size, comm.device = rank, world, torch.device("cpu")
    comm._failure = None
    lib = _RecordingLibrary()
    comm._nccl = _RecordingModule(nb.import_nccl(), lib)

    def launch(op, tensors, call):
        comm._raise_if_failed(op)
        call(lib, 77)
        return None

    comm._launch = launch
    return comm, lib


def test_collective_arguments_reach_the_library():
    world, rank = 4, 1
    comm, lib = _offline_comm(world, rank)
    nccl = comm._nccl
    inp = torch.zeros(5, dtype=torch.int16)
    out = torch.zeros(world * 5, dtype=torch.int16)
    comm.all_gather(out, inp)
    assert lib.calls[-1] == ("allGather", inp.data_ptr(), out.data_ptr(), 10,
                             nccl.NCCL_UINT8, 77)  # int16 travels as 2 bytes per element
    rs_in = torch.zeros(world * 3, dtype=torch.bfloat16)
    rs_out = torch.zeros(3, dtype=torch.bfloat16)
    comm.reduce_scatter(rs_out, rs_in)
    assert lib.calls[-1] == ("reduceScatter", rs_in.data_ptr(), rs_out.data_ptr(), 3,
                             nccl.NCCL_BFLOAT16, nccl.NCCL_AVG, 77)
    t = torch.zeros(6, dtype=torch.int64)
    comm.all_reduce(t, op="max")
    assert lib.calls[-1] == ("allReduce", t.data_ptr(), t.data_ptr(), 6, nccl.NCCL_INT64,
                             nccl.NCCL_MAX, 77)
    b = torch.zeros(7, dtype=torch.float16)
    comm.broadcast(b, 3)
    assert lib.calls[-1] == ("broadcast", b.data_ptr(), b.data_ptr(), 7, nccl.NCCL_FLOAT16,
                             3, 77)
    assert {op: dict(v) for op, v in comm.stats.items()} == {
        "all_gather": {"calls": 1, "bytes": out.nbytes},
        "reduce_scatter": {"calls": 1, "bytes": rs_in.nbytes},
        "all_reduce": {"calls": 1, "bytes": t.nbytes},
        "broadcast": {"calls": 1, "bytes": b.nbytes},
        "all_to_all": {"calls": 0, "bytes": 0}}


def test_all_to_all_is_one_group_of_sends_and_receives():
    world, rank, m = 3, 1, 5
    comm, lib = _offline_comm(world, rank)
    nccl = comm._nccl
    sent = 0
    # native dtypes as themselves; int16 (NCCL lacks it) as 2 bytes per element
    for dtype, code, per in ((torch.bfloat16, nccl.NCCL_BFLOAT16, 1),
                             (torch.int8, nccl.NCCL_INT8, 1), (torch.uint8, nccl.NCCL_UINT8, 1),
                             (torch.int16, nccl.NCCL_UINT8, 2)):
        lib.calls.clear()
        inp = torch.zeros(world * m, dtype=dtype)
        out = torch.zeros(world * m, dtype=dtype)
        comm.all_to_all(out, inp)
        seg = m * inp.element_size()
        expected: list[tuple] = [("groupStart",)]
        for peer in range(world):  # segment peer of inp to peer, of out from peer
            expected += [("send", inp.data_ptr() + peer * seg, m * per, code, peer, 77),
                         ("recv", out.data_ptr() + peer * seg, m * per, code, peer, 77)]
        assert lib.calls == expected + [("groupEnd",)], dtype
        sent += inp.nbytes
    assert comm.stats["all_to_all"] == {"calls": 4, "bytes": sent}


def test_all_to_all_closes_its_group_when_a_call_fails():
    comm, lib = _offline_comm(2, 0)

    class Failing(_RecordingLibrary):
        def recv(self, *args):
            raise RuntimeError("recv refused")

    failing = Failing()
    failing.calls = lib.calls

    def launch(op, tensors, call):
        call(failing, 77)

    comm._launch = launch
    with pytest.raises(RuntimeError, match="recv refused"):
        comm.all_to_all(torch.zeros(4), torch.zeros(4))
    assert lib.calls[0] == ("groupStart",) and lib.calls[-1] == ("groupEnd",)


def test_bad_arguments_never_reach_the_library():
    world = 2
    comm, lib = _offline_comm(world, 0)
    f32 = torch.zeros
    bad_calls = [
        (ValueError, lambda: comm.all_gather(f32(world * 4 + 1), f32(4))),
        (ValueError, lambda: comm.all_gather(f32(world * 4).half(), f32(4))),
        (ValueError, lambda: comm.all_gather(f32(world * 4, device="meta"), f32(4))),
        (ValueError, lambda: comm.reduce_scatter(f32(4), f32(world * 4 - 1))),
        (ValueError, lambda: comm.reduce_scatter(torch.zeros(4, dtype=torch.int16),
                                                 torch.zeros(8, dtype=torch.int16), "sum")),
        (ValueError, lambda: comm.reduce_scatter(f32(4), f32(world * 4), op="max")),
        (ValueError, lambda: comm.all_reduce(torch.zeros(4, dtype=torch.uint16))),
        (ValueError, lambda: comm.all_reduce(f32(4), op="min")),
        (ValueError, lambda: comm.all_reduce(f32(4, 2)[:, 0])),
        (ValueError, lambda: comm.broadcast(f32(4), world)),
        (TypeError, lambda: comm.broadcast(f32(4), None)),
        (TypeError, lambda: comm.all_reduce(4.0)),
        (ValueError, lambda: comm.all_to_all(f32(world * 4 + 1), f32(world * 4 + 1))),
        (ValueError, lambda: comm.all_to_all(f32(world * 4), f32(world * 4 + 2))),
        (ValueError, lambda: comm.all_to_all(f32(world * 4).half(), f32(world * 4))),
        (ValueError, lambda: comm.all_to_all(f32(world * 4, 2)[:, 0], f32(world * 4))),
        (ValueError, lambda: comm.all_to_all(f32(world, 4), f32(world, 4))),
        (ValueError, lambda: comm.all_to_all(f32(world * 4, device="meta"), f32(world * 4))),
        (TypeError, lambda: comm.all_to_all(f32(world * 4), None)),
    ]
    for i, (exc, call) in enumerate(bad_calls):
        with pytest.raises(exc):
            call()
        assert lib.calls == [], f"bad call {i} reached the library"
    assert all(v == {"calls": 0, "bytes": 0} for v in comm.stats.values())


def test_failed_communicator_refuses_collectives():
    comm, lib = _offline_comm(2, 1)
    comm.set_step(12)
    comm._failure = CommError("all_gather", 1, 11, "not complete within the timeout of 5 s")
    with pytest.raises(CommError, match="all_reduce failed on rank 1, step 12: the "
                                        "communicator is aborted"):
        comm.all_reduce(torch.zeros(2))
    assert lib.calls == []


def test_repr():
    comm, _ = _offline_comm(2, 0)
    comm.timeout_s = 30.0
    assert repr(comm) == "NcclCommunicator(rank=0, world_size=2, device=cpu, timeout=30s)"


@pytest.mark.gpu
def test_single_gpu_round_trip():
    """One process, one GPU: a single-rank NCCL communicator on its own stream."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device, found none")
    comm = NcclCommunicator(timeout=30.0)
    try:
        x = torch.randn(1000, device="cuda")
        out = torch.full((1000,), float("nan"), device="cuda")
        w = comm.all_gather(out, x)
        w.wait()
        torch.cuda.synchronize()
        assert w.is_completed() and torch.equal(out, x)
        t = x.clone()
        comm.all_reduce(t, op="avg").wait()
        torch.cuda.synchronize()
        torch.testing.assert_close(t, x)
        comm.barrier()
    finally:
        comm.destroy()
