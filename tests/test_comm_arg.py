"""``comm=`` takes what torch users hold (a ProcessGroup, a 1-D DeviceMesh) as well as a
Communicator, and :func:`scape.broadcast_parameters` starts every rank from rank 0's weights
(the construction check then passes), on real gloo ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist import run_ranks

import scape
from scape.comm import TorchCommunicator, as_communicator


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(12, 20), torch.nn.Linear(20, 3))
    m[1].to(torch.bfloat16)
    return m


def _body(rank: int, world: int, kind: str) -> list[list[float]]:
    from torch.distributed.device_mesh import init_device_mesh

    if kind == "group":
        comm = dist.new_group(list(range(world)))
    elif kind == "mesh":
        comm = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))["dp"]
    else:
        comm = None
    model = _model(seed=rank)  # every rank its own init
    with pytest.raises(ValueError, match="param_values"):
        scape.SCAPE(model.parameters(), lr=1e-2, block_size=256, comm=comm)
    scape.broadcast_parameters(model, comm=comm)
    ref = _model(seed=0)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))
    opt = scape.SCAPE(model.parameters(), lr=1e-2, sparsity=0.9, block_size=256,
                      warmup_steps=1, comm=comm)
    assert opt.comm.world_size == world and opt.comm.rank == rank
    for t in range(3):
        g = torch.Generator().manual_seed(10 * t + rank)
        x = torch.randn(4, 12, generator=g)
        model[1](model[0](x).bfloat16()).float().square().mean().backward()
        opt.step()
    return [p.detach().float().flatten().tolist() for p in model.parameters()]


@pytest.mark.parametrize("kind", ["default", "group", "mesh"])
def test_comm_argument_and_broadcast(kind):
    res = run_ranks(_body, 2, kind, timeout=120)
    assert res[0] == res[1]


def test_as_communicator_rejects_what_it_cannot_use():
    assert isinstance(as_communicator(None), TorchCommunicator)
    c = TorchCommunicator()
    assert as_communicator(c) is c
    with pytest.raises(TypeError, match="ProcessGroup"):
        as_communicator("gloo")
    with pytest.raises(ValueError, match="src must be a rank"):
        scape.broadcast_parameters([torch.zeros(3)], src=1)
