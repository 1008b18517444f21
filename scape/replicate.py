"""Start every data-parallel rank from the same weights.

The optimizers check at construction that every rank's parameters are bitwise equal (one
all-gather of digests) and raise on every rank when they are not. A script that seeds each
rank differently, or loads weights on rank 0 only, calls :func:`broadcast_parameters` first,
as DDP does at wrap time.
"""

from __future__ import annotations

from typing import Any

import torch

from scape.comm import as_communicator


@torch.no_grad()
def broadcast_parameters(params: Any, *, src: int = 0, comm: Any = None) -> None:
    """Copy rank ``src``'s values of ``params`` (parameters, an iterable of them or a module)
    into every rank's, in place, over ``comm`` (as the optimizers' ``comm=``: None for the
    default process group, a ProcessGroup, a 1-D DeviceMesh or a Communicator). One
    broadcast per dtype; the version counters move, so an optimizer built earlier adopts the
    values at its next step."""
    if isinstance(params, torch.nn.Module):
        params = params.parameters()
    tensors = list(params)
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        raise TypeError("broadcast_parameters: params must be tensors or a module")
    c = as_communicator(comm)
    if not isinstance(src, int) or isinstance(src, bool) or not 0 <= src < c.world_size:
        raise ValueError(f"broadcast_parameters: src must be a rank in [0, {c.world_size}), "
                         f"got {src!r}")
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for group in by_dtype.values():
        flat = torch.cat([t.detach().reshape(-1) for t in group])
        c.broadcast(flat, src).wait()
        offset = 0
        for t in group:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()
