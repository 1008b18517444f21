"""``NcclCommunicator``: the Communicator protocol on NCCL through CuPy (``cupy.cuda.nccl``).

cupy is imported lazily, only when a communicator is constructed, so ``import scape.comm`` works
on machines without it.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

GPU_EXTRA_HINT = 'pip install "scape-optim[gpu]"'


def import_nccl() -> ModuleType:
    """``cupy.cuda.nccl``, or ``ImportError`` naming the ``gpu`` extra."""
    try:
        from cupy.cuda import nccl
    except ImportError as e:
        raise ImportError(f"NcclCommunicator needs cupy with NCCL (the gpu extra): "
                          f"{GPU_EXTRA_HINT}; import failed with: {e}") from e
    if not getattr(nccl, "available", False):
        raise ImportError(f"NcclCommunicator: cupy found no NCCL library; {GPU_EXTRA_HINT} "
                          f"installs nvidia-nccl-cu12")
    return nccl


class NcclCommunicator:
    """Not yet implemented in this revision (the torch backend is the working one)."""

    def __init__(self, *args: Any, **kwargs: Any):
        import_nccl()
        raise NotImplementedError("NcclCommunicator is not implemented yet; use "
                                  "TorchCommunicator")
