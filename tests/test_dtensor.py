"""Parameters sharded by FSDP2 (``fully_shard``, DTensors) are refused at construction with a
``TypeError`` that says so, on every rank, before any value is read (reading one mixed a
DTensor with a plain tensor inside the agreement digest and raised torch's ``RuntimeError``)."""

from __future__ import annotations

import pytest
import torch
from dist import run_ranks


def _build(rank, world, which):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import scape

    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp_replicate", "dp_shard"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    for layer in model:
        fully_shard(layer, mesh=mesh["dp_shard"])
    fully_shard(model, mesh=mesh["dp_shard"])
    cls = {"scape": scape.SCAPE, "adamw": scape.DistributedAdamW}[which]
    try:
        cls(model.parameters(), lr=3e-3, comm=mesh["dp_replicate"])
    except Exception as e:  # noqa: BLE001 - the test checks which
        return type(e).__name__, str(e)
    return None


@pytest.mark.parametrize("which", ["scape", "adamw"])
def test_fsdp2_parameters_are_refused_clearly_on_every_rank(which):
    out = run_ranks(_build, 2, which, timeout=120)
    for r in out:
        assert r is not None, "a DTensor parameter was accepted"
        kind, msg = r
        assert kind == "TypeError", r
        assert "DTensor" in msg and "fully_shard" in msg, r
    assert out[0] == out[1]
