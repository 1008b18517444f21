"""The collective suite: real processes (tests/dist.py), 2, 3 and 4 ranks, every collective x
dtype against expected tensors built from every rank's inputs (all_to_all also in int8),
collectives in flight waited in reverse order, exact byte accounting, and every argument error
raised on every rank without desynchronising the group. Each spawned group runs the whole
suite (spawning costs seconds).

The suite runs on gloo (TorchCommunicator) everywhere and again on NcclCommunicator when at least
as many CUDA devices as ranks are present (skipped otherwise, with the reason).
"""

from __future__ import annotations

import pytest
import torch
from conftest import nan_empty
from dist import run_ranks

FLOATS = (torch.float32, torch.bfloat16, torch.float16)
INTS = (torch.int32, torch.int64, torch.uint8)
BITCAST = (torch.int16, torch.uint16)  # no reduction: all_gather, broadcast and all_to_all only
ALL_TO_ALL = FLOATS + INTS + BITCAST + (torch.int8,)
"""dtypes the all_to_all check moves (it copies bytes: any dtype, bit-exact)."""

TOL = {torch.float32: (2e-6, 1e-5), torch.float16: (1e-3, 1e-3), torch.bfloat16: (8e-3, 1e-2)}
"""(rtol, atol) for reductions; copies (all_gather, broadcast) must be bit-exact."""


def rank_data(rank: int, dtype: torch.dtype, shape: tuple[int, ...], salt: int) -> torch.Tensor:
    """What ``rank`` contributes: fresh random values from a seed of (salt, rank), so every
    rank can rebuild every other rank's input to compute expected results independently."""
    g = torch.Generator().manual_seed(7919 * salt + rank)
    if dtype == torch.float32:
        return torch.randn(shape, generator=g)
    if dtype.is_floating_point:  # half-integers in [-16, 16): sums over 4 ranks stay exact
        return (torch.randint(-32, 32, shape, generator=g) / 2).to(dtype)
    if dtype == torch.uint8:  # sums over 4 ranks stay below 256
        return torch.randint(0, 60, shape, generator=g, dtype=torch.uint8)
    if dtype == torch.int8:  # the full range: sign bits matter
        return torch.randint(-128, 128, shape, generator=g, dtype=torch.int8)
    if dtype == torch.int16:  # the full range: sign bits and both bytes matter
        return torch.randint(-(2**15), 2**15, shape, generator=g, dtype=torch.int32).to(dtype)
    if dtype == torch.uint16:
        return torch.randint(-(2**15), 2**15, shape, generator=g,
                             dtype=torch.int32).to(torch.int16).view(torch.uint16)
    if dtype == torch.int64:  # values beyond 32 bits
        return torch.randint(-(2**40), 2**40, shape, generator=g, dtype=torch.int64)
    return torch.randint(-(10**6), 10**6, shape, generator=g, dtype=dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact equality (NaN-safe), for any dtype."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def assert_reduced(out: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """``out`` equals ``expected`` (computed in float64/int64): exactly for integers, within
    the dtype's tolerance for floats; never NaN."""
    if out.dtype.is_floating_point:
        rtol, atol = TOL[out.dtype]
        assert not torch.isnan(out).any(), f"{what}: unwritten (NaN) elements"
        torch.testing.assert_close(out.double().cpu(), expected.double(), rtol=rtol, atol=atol,
                                   msg=lambda m: f"{what}: {m}")
    else:
        assert torch.equal(out.cpu(), expected.to(out.dtype)), f"{what}: {out} != {expected}"


def make_comm(backend: str, rank: int):
    if backend == "nccl":
        from scape.comm import NcclCommunicator

        torch.cuda.set_device(rank)
        return NcclCommunicator(timeout=60.0)
    from scape.comm import TorchCommunicator

    return TorchCommunicator(timeout=30.0)


def _host(t: torch.Tensor) -> torch.Tensor:
    return t.cpu()


# -- the per-rank suite ----------------------------------------------------------------------
def _check_every_collective(comm, rank: int, world: int, dev: torch.device) -> int:
    """Every collective x dtype; returns the number of checks made."""
    checks = 0
    for salt, dtype in enumerate(FLOATS + INTS + BITCAST):
        n = 37  # odd, not a multiple of anything
        # all_gather: inp (n,), out (world, n) pre-filled with NaN / min
        inp = rank_data(rank, dtype, (n,), salt).to(dev)
        out = nan_empty((world, n), dtype, dev)
        comm.all_gather(out, inp).wait()
        torch.cuda.synchronize() if dev.type == "cuda" else None
        expected = torch.stack([rank_data(r, dtype, (n,), salt) for r in range(world)])
        assert same_bits(_host(out), expected), f"all_gather {dtype}"
        assert same_bits(_host(inp), rank_data(rank, dtype, (n,), salt)), "inp modified"
        # broadcast from every rank in turn, 2-D tensor
        for src in range(world):
            t = rank_data(rank, dtype, (3, 5), 100 + salt).to(dev)
            comm.broadcast(t, src).wait()
            torch.cuda.synchronize() if dev.type == "cuda" else None
            assert same_bits(_host(t), rank_data(src, dtype, (3, 5), 100 + salt)), \
                f"broadcast {dtype} src {src}"
        checks += 1 + world
        if dtype in BITCAST:
            continue
        # reduce_scatter: inp (world * m,), out (m,)
        m = 11
        ops = ("sum", "avg") if dtype.is_floating_point else ("sum",)
        for op in ops:
            inp = rank_data(rank, dtype, (world * m,), 200 + salt).to(dev)
            out = nan_empty((m,), dtype, dev)
            comm.reduce_scatter(out, inp, op=op).wait()
            torch.cuda.synchronize() if dev.type == "cuda" else None
            full = torch.stack([rank_data(r, dtype, (world * m,), 200 + salt)
                                for r in range(world)])
            full = full.double() if dtype.is_floating_point else full.long()
            total = full.sum(0)[rank * m:(rank + 1) * m]
            assert_reduced(out, total / world if op == "avg" else total,
                           f"reduce_scatter {op} {dtype}")
            assert same_bits(_host(inp), rank_data(rank, dtype, (world * m,), 200 + salt))
            checks += 1
        # all_reduce in place, 2-D
        for op in ops + ("max",):
            t = rank_data(rank, dtype, (4, 6), 300 + salt).to(dev)
            comm.all_reduce(t, op=op).wait()
            torch.cuda.synchronize() if dev.type == "cuda" else None
            full = torch.stack([rank_data(r, dtype, (4, 6), 300 + salt) for r in range(world)])
            full = full.double() if dtype.is_floating_point else full.long()
            expected = {"sum": full.sum(0), "avg": full.sum(0) / world,
                        "max": full.max(0).values}[op]
            assert_reduced(t, expected, f"all_reduce {op} {dtype}")
            checks += 1
    return checks


def _check_all_to_all(comm, rank: int, world: int, dev: torch.device) -> int:
    """all_to_all x dtype: segment ``r`` of ``out`` is segment ``rank`` of rank r's ``inp``,
    bit-exact, every element written (``out`` pre-filled with NaN / min), ``inp`` untouched;
    returns the number of checks made."""
    checks = 0
    for salt, dtype in enumerate(ALL_TO_ALL):
        for m in (1, 13):  # one element per rank; an odd segment
            shape = (world * m,)
            inp = rank_data(rank, dtype, shape, 500 + 10 * salt + m).to(dev)
            out = nan_empty(shape, dtype, dev)
            comm.all_to_all(out, inp).wait()
            torch.cuda.synchronize() if dev.type == "cuda" else None
            expected = torch.cat([rank_data(r, dtype, shape, 500 + 10 * salt + m)
                                  [rank * m:(rank + 1) * m] for r in range(world)])
            assert same_bits(_host(out), expected), f"all_to_all {dtype} m={m}"
            assert same_bits(_host(inp), rank_data(rank, dtype, shape, 500 + 10 * salt + m)), \
                f"all_to_all {dtype}: inp modified"
            checks += 1
    return checks


def _check_in_flight_reverse(comm, rank: int, world: int, dev: torch.device) -> None:
    """Eight collectives of different kinds in flight at once, waited in reverse order."""
    n = 1000
    ag_in = rank_data(rank, torch.float32, (n,), 400).to(dev)
    ag_out = nan_empty((world * n,), torch.float32, dev)
    rs_in = rank_data(rank, torch.bfloat16, (world * n,), 401).to(dev)
    rs_out = nan_empty((n,), torch.bfloat16, dev)
    ar = rank_data(rank, torch.int64, (n,), 402).to(dev)
    bc = rank_data(rank, torch.int16, (n,), 403).to(dev)
    ag8_in = rank_data(rank, torch.uint8, (n,), 404).to(dev)
    ag8_out = nan_empty((world, n), torch.uint8, dev)
    rs32_in = rank_data(rank, torch.float32, (world * n,), 405).to(dev)
    rs32_out = nan_empty((n,), torch.float32, dev)
    a2a_in = rank_data(rank, torch.bfloat16, (world * n,), 406).to(dev)
    a2a_out = nan_empty((world * n,), torch.bfloat16, dev)
    a2a8_in = rank_data(rank, torch.int8, (world * n,), 407).to(dev)
    a2a8_out = nan_empty((world * n,), torch.int8, dev)
    works = [comm.all_gather(ag_out, ag_in), comm.reduce_scatter(rs_out, rs_in, op="avg"),
             comm.all_to_all(a2a_out, a2a_in),
             comm.all_reduce(ar, op="max"), comm.broadcast(bc, world - 1),
             comm.all_gather(ag8_out, ag8_in), comm.reduce_scatter(rs32_out, rs32_in, op="sum"),
             comm.all_to_all(a2a8_out, a2a8_in)]
    for w in reversed(works):
        w.wait()
    for w in works:
        w.wait()  # idempotent
    torch.cuda.synchronize() if dev.type == "cuda" else None
    assert all(w.is_completed() for w in works)

    def every(salt, dtype, shape):
        return torch.stack([rank_data(r, dtype, shape, salt) for r in range(world)])

    assert same_bits(_host(ag_out), every(400, torch.float32, (n,)).reshape(-1))
    rs = every(401, torch.bfloat16, (world * n,)).double().sum(0)[rank * n:(rank + 1) * n]
    assert_reduced(rs_out, rs / world, "in flight reduce_scatter avg")
    assert_reduced(ar, every(402, torch.int64, (n,)).max(0).values, "in flight all_reduce max")
    assert same_bits(_host(bc), rank_data(world - 1, torch.int16, (n,), 403))
    assert same_bits(_host(ag8_out), every(404, torch.uint8, (n,)))
    rs32 = every(405, torch.float32, (world * n,)).double().sum(0)[rank * n:(rank + 1) * n]
    assert_reduced(rs32_out, rs32, "in flight reduce_scatter sum")
    for salt, dtype, got in ((406, torch.bfloat16, a2a_out), (407, torch.int8, a2a8_out)):
        sent = every(salt, dtype, (world * n,)).view(world, world, n)  # [from, to]
        assert same_bits(_host(got), sent[:, rank].reshape(-1)), f"in flight a2a {dtype}"


def _check_stats(comm, rank: int, world: int, dev: torch.device) -> None:
    """``stats`` equals the payload definition, counted here from the tensors themselves."""
    comm.reset_stats()
    assert all(v == {"calls": 0, "bytes": 0} for v in comm.stats.values())
    assert set(comm.stats) == {"all_gather", "reduce_scatter", "all_reduce", "broadcast",
                               "all_to_all"}
    expected = {op: {"calls": 0, "bytes": 0} for op in comm.stats}
    works = []
    for i, dtype in enumerate((torch.float32, torch.bfloat16, torch.int16, torch.int64)):
        k = 5 + 3 * i
        inp = torch.zeros(k, dtype=dtype, device=dev)
        out = torch.zeros(world * k, dtype=dtype, device=dev)
        works.append(comm.all_gather(out, inp))
        expected["all_gather"]["calls"] += 1
        expected["all_gather"]["bytes"] += out.nbytes
        works.append(comm.broadcast(inp, 0))
        expected["broadcast"]["calls"] += 1
        expected["broadcast"]["bytes"] += inp.nbytes
        a2a_in = torch.zeros(world * (k + 1), dtype=dtype, device=dev)
        works.append(comm.all_to_all(torch.zeros_like(a2a_in), a2a_in))
        expected["all_to_all"]["calls"] += 1
        expected["all_to_all"]["bytes"] += a2a_in.nbytes  # what this rank sends
        if dtype != torch.int16:
            works.append(comm.reduce_scatter(inp, out, op="sum"))
            expected["reduce_scatter"]["calls"] += 1
            expected["reduce_scatter"]["bytes"] += out.nbytes
            works.append(comm.all_reduce(out, op="max"))
            expected["all_reduce"]["calls"] += 1
            expected["all_reduce"]["bytes"] += out.nbytes
    for w in works:
        w.wait()
    assert {op: dict(v) for op, v in comm.stats.items()} == expected
    comm.reset_stats()
    assert all(v == {"calls": 0, "bytes": 0} for v in comm.stats.values())


def _check_errors(comm, rank: int, world: int, dev: torch.device) -> int:
    """Every bad call raises on this rank before enqueueing (stats untouched); afterwards a
    correct collective still works, so no rank went out of step."""
    f32 = lambda *s: torch.zeros(*s, device=dev)  # noqa: E731
    other = torch.device("meta") if dev.type == "cpu" else torch.device("cpu")
    bad_calls = [
        (ValueError, lambda: comm.all_gather(f32(world * 4 + 1), f32(4))),
        (ValueError, lambda: comm.all_gather(f32(world * 4).half(), f32(4))),
        (ValueError, lambda: comm.all_gather(torch.zeros(world * 4, device=other), f32(4))),
        (ValueError, lambda: comm.all_gather(f32(world * 4),
                                             torch.zeros(4, device=other))),
        (ValueError, lambda: comm.all_gather(f32(world * 4, 2)[:, 0], f32(4))),
        (TypeError, lambda: comm.all_gather([0.0] * world, f32(1))),
        (ValueError, lambda: comm.reduce_scatter(f32(4), f32(world * 4 - 1))),
        (ValueError, lambda: comm.reduce_scatter(f32(4).double(), f32(world * 4))),
        (ValueError, lambda: comm.reduce_scatter(
            torch.zeros(4, dtype=torch.int16, device=dev),
            torch.zeros(world * 4, dtype=torch.int16, device=dev), op="sum")),
        (ValueError, lambda: comm.reduce_scatter(f32(4), f32(world * 4), op="max")),
        (ValueError, lambda: comm.reduce_scatter(
            torch.zeros(4, dtype=torch.int32, device=dev),
            torch.zeros(world * 4, dtype=torch.int32, device=dev), op="avg")),
        (ValueError, lambda: comm.all_reduce(torch.zeros(4, dtype=torch.int16, device=dev))),
        (ValueError, lambda: comm.all_reduce(f32(4), op="prod")),
        (ValueError, lambda: comm.all_reduce(f32(4), op="SUM")),
        (ValueError, lambda: comm.broadcast(f32(4), world)),
        (ValueError, lambda: comm.broadcast(f32(4), -1)),
        (TypeError, lambda: comm.broadcast(f32(4), "0")),
        (TypeError, lambda: comm.broadcast(f32(4), 0.0)),
        (ValueError, lambda: comm.all_to_all(f32(world * 4 + 1), f32(world * 4 + 1))),
        (ValueError, lambda: comm.all_to_all(f32(world * 4), f32(world * 8))),
        (ValueError, lambda: comm.all_to_all(f32(world * 4).bfloat16(), f32(world * 4))),
        (ValueError, lambda: comm.all_to_all(
            torch.zeros(world * 4, dtype=torch.int8, device=dev),
            torch.zeros(world * 4, dtype=torch.uint8, device=dev))),
        (ValueError, lambda: comm.all_to_all(f32(world * 4), f32(world * 4, 2)[:, 0])),
        (ValueError, lambda: comm.all_to_all(f32(world, 4), f32(world, 4))),
        (ValueError, lambda: comm.all_to_all(torch.zeros(world * 4, device=other),
                                             f32(world * 4))),
        (TypeError, lambda: comm.all_to_all(f32(world * 4), [0.0] * (world * 4))),
    ]
    before = {op: dict(v) for op, v in comm.stats.items()}
    for i, (exc, call) in enumerate(bad_calls):
        try:
            call()
        except exc as e:
            assert str(e), f"bad call {i}: empty message"
        else:
            raise AssertionError(f"bad call {i} did not raise {exc.__name__}")
    assert {op: dict(v) for op, v in comm.stats.items()} == before, "a bad call was counted"
    t = torch.full((3,), float(rank + 1), device=dev)
    comm.all_reduce(t, op="sum").wait()
    torch.cuda.synchronize() if dev.type == "cuda" else None
    assert t.cpu().tolist() == [world * (world + 1) / 2] * 3
    return len(bad_calls)


def _suite(rank: int, world: int, backend: str) -> dict:
    comm = make_comm(backend, rank)
    assert (comm.rank, comm.world_size) == (rank, world)
    dev = comm.device
    report = {"errors_first": _check_errors(comm, rank, world, dev)}
    report["collectives"] = _check_every_collective(comm, rank, world, dev)
    report["all_to_all"] = _check_all_to_all(comm, rank, world, dev)
    _check_in_flight_reverse(comm, rank, world, dev)
    _check_stats(comm, rank, world, dev)
    report["errors_last"] = _check_errors(comm, rank, world, dev)
    comm.barrier()
    if hasattr(comm, "destroy"):
        comm.destroy()
    return report


BAD_CALLS = 26
"""Bad calls of ``_check_errors``: 18 of the four older collectives, 8 of all_to_all."""

BACKENDS = [pytest.param("gloo", id="gloo"), pytest.param("nccl", id="nccl", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("world", [2, 3, 4])
def test_collective_suite(world, backend):
    if backend == "nccl":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count < world:
            pytest.skip(f"NcclCommunicator suite needs {world} CUDA devices, found {count}")
        pytest.importorskip("cupy", reason="NcclCommunicator needs cupy (the gpu extra)")
    reports = run_ranks(_suite, world, backend, timeout=150, pg_timeout=30)
    assert len(reports) == world
    for r in reports:
        # copies: 8 dtypes x (all_gather + world broadcasts); reductions: 3 floats x 5 + 3 ints x 3
        assert r["collectives"] == 8 * (1 + world) + 3 * 5 + 3 * 3
        assert r["all_to_all"] == len(ALL_TO_ALL) * 2  # 9 dtypes x 2 segment sizes
        assert r["errors_first"] == r["errors_last"] == BAD_CALLS
