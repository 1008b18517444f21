"""Communication layer (imported as ``scape.comm``): one ``Communicator`` protocol and two
backends, ``TorchCommunicator`` (torch.distributed: gloo on CPU, nccl on GPU) and
``NcclCommunicator`` (NCCL through CuPy, on its own CUDA stream).

cupy is imported only when an ``NcclCommunicator`` is constructed.
"""

from __future__ import annotations

import datetime
from typing import Any

from .base import CommError, Communicator, Work
from .hierarchical import HierarchicalCommunicator
from .nccl_backend import NcclCommunicator
from .torch_backend import TorchCommunicator

__all__ = ["Communicator", "Work", "TorchCommunicator", "NcclCommunicator", "CommError",
           "HierarchicalCommunicator", "init_communicator", "init_hierarchical",
           "as_communicator"]

BACKENDS = ("auto", "torch", "nccl")


def init_communicator(backend: str = "auto", *, group: Any = None,
                      timeout: datetime.timedelta | float | None = None) -> Communicator:
    """Build a communicator on ``group`` (default: the default process group).

    ``"auto"`` picks ``"nccl"`` when CUDA and cupy with NCCL are present, else ``"torch"``.
    ``"torch"`` is ``TorchCommunicator`` (single-rank when torch.distributed is not initialized);
    ``"nccl"`` is ``NcclCommunicator`` and raises ``ImportError``/``RuntimeError`` saying what
    is missing when it cannot run here.
    """
    if backend not in BACKENDS:
        raise ValueError(f"init_communicator: backend must be one of {BACKENDS}, "
                         f"got {backend!r}")
    if backend == "auto":
        backend = "nccl" if _nccl_usable() else "torch"
    if backend == "torch":
        return TorchCommunicator(group, timeout)
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("init_communicator: backend='nccl' needs a CUDA device, and "
                           "torch.cuda.is_available() is False; use backend='torch'")
    kwargs: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
    return NcclCommunicator(group, **kwargs)  # type: ignore[return-value]


def as_communicator(comm: Any) -> Communicator:
    """What an optimizer's ``comm=`` may be, as a :class:`Communicator`: ``None`` (the default
    process group; a single rank without torch.distributed), a ``Communicator``, a
    ``torch.distributed.ProcessGroup`` or a one-dimensional ``DeviceMesh`` (its group, as
    FSDP2 takes the data-parallel dimension: ``mesh["dp"]``)."""
    if comm is None:
        return TorchCommunicator()
    if isinstance(comm, Communicator):
        return comm
    import torch.distributed as dist

    if dist.is_available() and isinstance(comm, dist.ProcessGroup):
        return TorchCommunicator(comm)
    if type(comm).__name__ == "DeviceMesh" and hasattr(comm, "get_group"):
        if comm.ndim == 2:
            return init_hierarchical(comm, "torch")
        if comm.ndim != 1:
            raise ValueError(f"comm: a DeviceMesh with {comm.ndim} dimensions; pass the "
                             "data-parallel dimensions: one (for example mesh['dp']) or two, "
                             "replicate across nodes outermost and shard inside a node (for "
                             "example mesh['dp_replicate', 'dp_shard'])")
        return TorchCommunicator(comm.get_group())
    raise TypeError("comm must be None, a scape.comm.Communicator, a torch.distributed "
                    "ProcessGroup or a DeviceMesh of the data-parallel dimensions; got "
                    f"{type(comm).__name__}")


def init_hierarchical(mesh: Any, backend: str = "auto", *,
                      timeout: datetime.timedelta | float | None = None
                      ) -> HierarchicalCommunicator:
    """A :class:`HierarchicalCommunicator` on a two-dimensional ``DeviceMesh``: dimension 0
    across nodes (FSDP2's *replicate*, outermost), dimension 1 inside a node (*shard*). Each
    level gets its own communicator of ``backend`` (as :func:`init_communicator`: with
    ``"nccl"``, one NCCL communicator per level)."""
    if getattr(mesh, "ndim", None) != 2 or not hasattr(mesh, "get_group"):
        raise ValueError("init_hierarchical: expected a two-dimensional DeviceMesh "
                         "(replicate across nodes, shard inside a node), got "
                         f"{type(mesh).__name__} with ndim={getattr(mesh, 'ndim', None)}")
    inter = init_communicator(backend, group=mesh.get_group(0), timeout=timeout)
    intra = init_communicator(backend, group=mesh.get_group(1), timeout=timeout)
    return HierarchicalCommunicator(intra=intra, inter=inter)


def _nccl_usable() -> bool:
    import torch

    if not torch.cuda.is_available():
        return False
    try:
        from .nccl_backend import import_nccl

        import_nccl()
    except ImportError:
        return False
    return True
