"""DTensor parameters (FSDP2's ``fully_shard``, tensor parallelism): the optimizer on their
local shards.

A model sharded by FSDP2 over ``mesh["dp_shard"]`` holds on each rank one shard of every
parameter (a ``DTensor`` whose local tensor FSDP2 all-gathers before each forward and
whose gradient it reduce-scatters after each backward). The ranks of ``mesh["dp_replicate"]``
hold the same shard: they are a data-parallel group over it, and the optimizer, built with
``comm=mesh["dp_replicate"]``, runs its step among them on the local shards exactly as it
runs on whole parameters among plain data-parallel ranks. What differs:

- the buffers copy the local shards (FSDP2 keeps its own storage, which it all-gathers
  from); the step's new values are written back into the local shards once they are
  complete on this rank (:meth:`scape.buffers.Bucket.publish`);
- each gradient FSDP2 assigns is added into the gradient buffer by a post-accumulate-grad
  hook (FSDP2 runs those hooks) and released;
- what is summed over the whole model (the gradient norm that clipping reads, the count of
  non-finite entries that skips a step) is summed over the parameters' mesh too
  (:meth:`ShardMesh.all_reduce_`), a parameter replicated over a mesh dimension (tensor
  parallel's replicated weights) counted once (:func:`norm_weight`).

The parameters' mesh and ``comm`` must not share a rank but this one: the checks of
:func:`inspect` refuse HSDP (FSDP2 already all-reducing across replicas) and a ``comm`` that
overlaps the shard mesh, naming what to pass instead.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch


def _dtensor_type() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed has none
        return None
    return DTensor


_DTENSOR = _dtensor_type()


def is_dtensor(t: Any) -> bool:
    return _DTENSOR is not None and isinstance(t, _DTENSOR)


def local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (a plain tensor: itself), outside autograd: in-place
    writes to it are what FSDP2 all-gathers next."""
    return t._local_tensor if is_dtensor(t) else t  # type: ignore[attr-defined]


def norm_weight(p: torch.Tensor) -> float:
    """What one rank's copy of ``p`` counts for in a sum over the mesh: 1 over the number
    of ranks that hold the same values (the sizes of the dimensions ``p`` is replicated
    over)."""
    if not is_dtensor(p):
        return 1.0
    mesh = p.device_mesh  # type: ignore[attr-defined]
    copies = math.prod(mesh.size(d) for d, pl in enumerate(p.placements)  # type: ignore[attr-defined]
                       if pl.is_replicate())
    return 1.0 / copies


def known_ranks(comm: Any) -> list[int] | None:
    """The global ranks of ``comm``'s members in its rank order, where ``comm`` says which
    they are (a two-level communicator, or one on a torch.distributed group); else None."""
    import torch.distributed as dist

    if hasattr(comm, "global_ranks"):  # two levels (scape.comm.HierarchicalCommunicator)
        return list(comm.global_ranks())
    group = getattr(comm, "group", None)
    if group is None or not dist.is_initialized():
        return None
    return [dist.get_global_rank(group, r) for r in range(comm.world_size)]


def global_ranks(comm: Any) -> list[int]:
    """:func:`known_ranks`, or ``0 .. world_size - 1`` (the default group's) where ``comm``
    does not say."""
    ranks = known_ranks(comm)
    return list(range(comm.world_size)) if ranks is None else ranks


class ShardMesh:
    """The mesh the DTensor parameters are sharded over, as the optimizer uses it."""

    def __init__(self, mesh: Any) -> None:
        self.mesh = mesh
        self.groups = [mesh.get_group(d) for d in range(mesh.ndim)]
        self.coordinate = tuple(mesh.get_coordinate() or ())
        """This rank's place in the mesh: which shard it holds."""
        self.ranks = sorted(int(r) for r in mesh.mesh.flatten().tolist())

    def all_reduce_(self, t: torch.Tensor) -> None:
        """Sum ``t`` in place over every rank of the mesh (one all-reduce per dimension)."""
        import torch.distributed as dist

        for g in self.groups:
            dist.all_reduce(t, group=g)


def inspect(params: Sequence[torch.Tensor], comm: Any) -> ShardMesh | None:
    """The mesh of DTensor ``params`` (None: plain tensors); ``ValueError``/``TypeError``
    if the optimizer cannot run over them with ``comm``, saying what to pass instead."""
    dts = [p for p in params if is_dtensor(p)]
    if not dts:
        return None
    if len(dts) != len(params):
        raise TypeError(
            f"{len(dts)} of {len(params)} parameters are DTensors: shard every parameter "
            "(fully_shard each block and then the root module, as torchtitan does) or none")
    mesh = dts[0].device_mesh  # type: ignore[attr-defined]
    for p in dts:
        if p.device_mesh != mesh:  # type: ignore[attr-defined]
            raise ValueError("the DTensor parameters lie on different device meshes; shard "
                             "them all over one mesh (mesh['dp_shard'], or its product with "
                             "mesh['tp'])")
        for pl in p.placements:  # type: ignore[attr-defined]
            if not (pl.is_shard() or pl.is_replicate()):
                raise ValueError(f"a DTensor parameter has placement {pl}; the optimizer "
                                 "takes Shard and Replicate placements")
    if hasattr(comm, "global_ranks"):
        raise ValueError("two levels (a two-dimensional comm=) with DTensor parameters: "
                         "FSDP2 is the level inside the node; pass comm=mesh['dp_replicate']")
    shard_mesh = ShardMesh(mesh)
    import torch.distributed as dist

    me, members = dist.get_rank(), known_ranks(comm)  # (a comm that does not say which
    shared = sorted(set(members or ()) & set(shard_mesh.ranks) - {me})  # ranks: unchecked)
    if shared:
        if mesh.ndim > 1 and all(p.placements[0].is_replicate() for p in dts):  # type: ignore[attr-defined]
            raise ValueError(
                "the parameters are sharded by FSDP2 with a replicate dimension (HSDP: "
                "fully_shard(..., mesh=mesh['dp_replicate', 'dp_shard'])), so FSDP2 "
                "all-reduces across the replicas itself; give fully_shard mesh['dp_shard'] "
                "only and the optimizer comm=mesh['dp_replicate']")
        raise ValueError(
            f"comm= shares ranks {shared} with the mesh the parameters are sharded over: "
            "comm must be the ranks that hold the same shard (comm=mesh['dp_replicate'] "
            "when fully_shard got mesh['dp_shard'])")
    return shard_mesh
