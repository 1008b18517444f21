"""HierarchicalCommunicator: two-level collectives equal the flat ones, in the group's rank
order, on real gloo processes (4 ranks as 2 nodes x 2), with bytes counted per level; the
two-level all_to_all also on ranks as threads (bench.engine.inprocess) in layouts that are not
square (2 nodes x 3, 3 nodes x 2), where a transposed segment order would show."""

from __future__ import annotations

import pytest
import torch
from conftest import nan_empty

from tests.dist import run_ranks

NODES, PER_NODE = 2, 2


def _mesh_comm():
    from torch.distributed.device_mesh import init_device_mesh

    from scape.comm import as_communicator

    mesh = init_device_mesh("cpu", (NODES, PER_NODE), mesh_dim_names=("replicate", "shard"))
    return mesh, as_communicator(mesh)


def _collectives(rank: int, world: int, seed: int) -> dict:
    import torch.distributed as dist

    from scape.comm import HierarchicalCommunicator, TorchCommunicator

    mesh, comm = _mesh_comm()
    assert isinstance(comm, HierarchicalCommunicator)
    flat = TorchCommunicator()
    node, place = divmod(rank, PER_NODE)  # the mesh's global rank is node * G + place
    me = comm.rank
    out: dict = {"me": me, "node": node, "place": place, "world": comm.world_size,
                 "global_ranks": comm.global_ranks()}
    g = torch.Generator().manual_seed(seed + me)  # indexed by the group's rank
    n = 6
    inp = torch.randn(n, generator=g)
    # every rank learns every rank's input in the group's order, through the flat group
    table = torch.empty(world, n)
    flat.all_gather(table.view(-1), torch.cat([inp])).wait()
    order = torch.empty(world, dtype=torch.int64)
    flat.all_gather(order, torch.tensor([me])).wait()
    by_me = torch.empty_like(table)
    by_me[order] = table
    comm.reset_stats()

    ag = torch.full((world * n,), float("nan"))
    w_ag = comm.all_gather(ag, inp)
    rs_in = torch.randn(world * 3, generator=g)
    rs_table = torch.empty(world, world * 3)
    flat.all_gather(rs_table.view(-1), rs_in).wait()
    rs_by_me = torch.empty_like(rs_table)
    rs_by_me[order] = rs_table
    rs = torch.full((3,), float("nan"))
    w_rs = comm.reduce_scatter(rs, rs_in, op="avg")
    ar = inp.clone()
    w_ar = comm.all_reduce(ar, op="sum")
    bc = inp.clone()
    w_bc = comm.broadcast(bc, src=3)
    a2a_in = torch.randint(-128, 128, (world * 5,), generator=g, dtype=torch.int8)
    a2a_table = torch.empty(world, world * 5, dtype=torch.int8)
    flat.all_gather(a2a_table.view(-1), a2a_in).wait()
    a2a_by_me = torch.empty_like(a2a_table)
    a2a_by_me[order] = a2a_table
    a2a = torch.full((world * 5,), -128, dtype=torch.int8)
    w_a2a = comm.all_to_all(a2a, a2a_in)
    for w in (w_a2a, w_bc, w_ar, w_rs, w_ag):  # waited in the reverse order of issue
        w.wait()
    out["ag_ok"] = torch.equal(ag.view(world, n), by_me)
    out["rs_err"] = float((rs - rs_by_me[:, me * 3:(me + 1) * 3].mean(0)).abs().max())
    out["ar_err"] = float((ar - by_me.sum(0)).abs().max())
    out["bc_ok"] = torch.equal(bc, by_me[3])
    out["a2a_ok"] = torch.equal(a2a.view(world, 5), a2a_by_me[:, me * 5:(me + 1) * 5])
    out["stats"] = {k: dict(v) for k, v in comm.stats.items()}
    comm.barrier()
    dist.barrier()
    return out


def test_two_level_collectives_match_flat():
    res = run_ranks(_collectives, NODES * PER_NODE, 7, timeout=120)
    mes = sorted(r["me"] for r in res)
    assert mes == [0, 1, 2, 3]
    for r in res:
        # the group's rank is place * R + node: the R ranks of one place are neighbours
        assert r["me"] == r["place"] * NODES + r["node"]
        assert r["world"] == 4
        assert r["ag_ok"] and r["bc_ok"] and r["a2a_ok"]
        assert r["rs_err"] < 1e-6 and r["ar_err"] < 1e-5
        # global_ranks()[me] is this process's global rank
        assert r["global_ranks"][r["me"]] == r["node"] * PER_NODE + r["place"]
        s = r["stats"]
        f32 = 4
        # all_gather of 6 values: across nodes R*6 held, inside the node W*6
        assert s["inter/all_gather"]["bytes"] == NODES * 6 * f32
        assert s["intra/all_gather"]["bytes"] == 4 * 6 * f32
        # reduce_scatter of W*3 values: inside the node all of them, across nodes R*3
        assert s["intra/reduce_scatter"]["bytes"] == 4 * 3 * f32
        assert s["inter/reduce_scatter"]["bytes"] == NODES * 3 * f32
        assert s["intra/all_reduce"]["bytes"] == s["inter/all_reduce"]["bytes"] == 6 * f32
        assert s["intra/broadcast"]["calls"] == s["inter/broadcast"]["calls"] == 1
        # all_to_all of W*5 int8: the whole payload at both levels
        assert s["intra/all_to_all"] == s["inter/all_to_all"] == {"calls": 1, "bytes": 4 * 5}


def _threads_all_to_all(nodes: int, per_node: int) -> list[dict]:
    """``nodes * per_node`` ranks as threads, each level an in-process group: rank (place a,
    node b) has intra = place a of node b's group, inter = node b of place a's group."""
    import threading

    from bench.engine.inprocess import InProcessGroup
    from scape.comm import HierarchicalCommunicator

    intra = [InProcessGroup(per_node, timeout=30).communicators() for _ in range(nodes)]
    inter = [InProcessGroup(nodes, timeout=30).communicators() for _ in range(per_node)]
    world, results, errors = nodes * per_node, {}, []

    def body(a: int, b: int) -> None:
        try:
            comm = HierarchicalCommunicator(intra=intra[b][a], inter=inter[a][b])
            me = comm.rank
            works, outs = [], []
            for salt, (dtype, m) in enumerate(((torch.float32, 3), (torch.bfloat16, 1),
                                               (torch.int8, 4), (torch.uint8, 2))):
                inp = _a2a_data(me, salt, dtype, world * m)
                out = nan_empty((world * m,), dtype)
                works.append(comm.all_to_all(out, inp))
                outs.append((salt, dtype, m, inp, out))
            for w in reversed(works):
                w.wait()
            results[me] = {"place": a, "node": b, "outs": outs,
                           "stats": {k: dict(v) for k, v in comm.stats.items()}}
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)
            for g in intra[b] + inter[a]:
                g.group.abort()

    threads = [threading.Thread(target=body, args=(a, b), daemon=True)
               for a in range(per_node) for b in range(nodes)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    return [results[r] for r in range(world)]


def _a2a_data(me: int, salt: int, dtype: torch.dtype, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * salt + me)
    if dtype.is_floating_point:
        return torch.randn(n, generator=g).to(dtype)
    lo, hi = (-128, 128) if dtype == torch.int8 else (0, 256)
    return torch.randint(lo, hi, (n,), generator=g, dtype=dtype)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("nodes,per_node", [(2, 3), (3, 2), (1, 3), (3, 1)])
def test_two_level_all_to_all_in_group_order(nodes, per_node):
    world = nodes * per_node
    res = _threads_all_to_all(nodes, per_node)
    for me, r in enumerate(res):
        assert me == r["place"] * nodes + r["node"]
        total = 0
        for salt, dtype, m, inp, out in r["outs"]:
            expected = torch.cat([_a2a_data(src, salt, dtype, world * m)[me * m:(me + 1) * m]
                                  for src in range(world)])
            assert torch.equal(out, expected), (nodes, per_node, me, dtype)
            assert torch.equal(inp, _a2a_data(me, salt, dtype, world * m)), "inp modified"
            total += inp.nbytes
        s = r["stats"]
        assert s["intra/all_to_all"] == s["inter/all_to_all"] == {"calls": 4, "bytes": total}


def test_mesh_of_three_dimensions_is_refused():
    from scape.comm import as_communicator

    class FakeMesh:  # what as_communicator reads of a DeviceMesh
        ndim = 3

        def get_group(self, dim: int = 0):
            raise AssertionError("not reached")

    FakeMesh.__name__ = "DeviceMesh"
    with pytest.raises(ValueError, match="replicate across nodes outermost"):
        as_communicator(FakeMesh())


def test_init_hierarchical_refuses_a_flat_mesh():
    from scape.comm import init_hierarchical

    with pytest.raises(ValueError, match="two-dimensional DeviceMesh"):
        init_hierarchical(object())


def _nccl_without_gpu(rank: int, world: int) -> str:
    from torch.distributed.device_mesh import init_device_mesh

    from scape.comm import init_hierarchical

    mesh = init_device_mesh("cpu", (NODES, PER_NODE), mesh_dim_names=("replicate", "shard"))
    try:
        init_hierarchical(mesh, "nccl")
    except (RuntimeError, ImportError) as e:
        return str(e)
    return "built"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error where CUDA is absent")
def test_nccl_levels_without_a_gpu_say_what_is_missing():
    # the layout is backend-agnostic (the gloo test above); NCCL needs a GPU per rank
    for msg in run_ranks(_nccl_without_gpu, NODES * PER_NODE, timeout=120):
        assert "CUDA" in msg or "cupy" in msg


def _nccl_levels(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from scape.comm import init_hierarchical

    torch.cuda.set_device(rank)
    mesh = init_device_mesh("cpu", (NODES, PER_NODE), mesh_dim_names=("replicate", "shard"))
    comm = init_hierarchical(mesh, "nccl")
    inp = torch.full((5,), float(comm.rank), device="cuda")
    out = torch.full((world * 5,), float("nan"), device="cuda")
    comm.all_gather(out, inp).wait()
    torch.cuda.synchronize()
    return {"ok": bool((out.view(world, 5)[:, 0].cpu() == torch.arange(world)).all()),
            "stats": {k: dict(v) for k, v in comm.stats.items()}}


@pytest.mark.skipif(torch.cuda.device_count() < NODES * PER_NODE,
                    reason=f"NCCL on two levels needs {NODES * PER_NODE} CUDA devices, found "
                           f"{torch.cuda.device_count()}")
def test_nccl_levels_all_gather_in_group_order():
    for r in run_ranks(_nccl_levels, NODES * PER_NODE, timeout=180):
        assert r["ok"]
        assert r["stats"]["inter/all_gather"]["bytes"] == NODES * 5 * 4


def _torchtitan_mesh(rank: int, world: int) -> tuple[int, int, int]:
    from torch.distributed.device_mesh import init_device_mesh

    from scape.comm import HierarchicalCommunicator, as_communicator

    mesh = init_device_mesh("cpu", (NODES, PER_NODE, 1),
                            mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
    comm = as_communicator(mesh["dp_replicate", "dp_shard"])  # the mesh a trainer has
    assert isinstance(comm, HierarchicalCommunicator)
    return comm.rank, comm.nodes, comm.per_node


def test_a_torchtitan_style_mesh_gives_its_data_parallel_dimensions():
    for rank, (me, nodes, per_node) in enumerate(run_ranks(_torchtitan_mesh, 4, timeout=120)):
        node, place = divmod(rank, PER_NODE)
        assert (nodes, per_node) == (NODES, PER_NODE)
        assert me == place * NODES + node
