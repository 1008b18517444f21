"""``opt.last_step``: what the most recent ``step()`` did, shared by every optimizer here."""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass
class StepInfo:
    """A small record of the last optimizer step (``opt.last_step``).

    Tensors stay on the device (no host sync): call ``float(info.grad_norm)`` to read one.
    """

    step: int = 0
    """1-based count of steps taken (skipped steps included)."""
    dense: bool = True
    """True when the step synchronised every coordinate (dense mode, warm-up, refresh)."""
    skipped: bool = False
    """True when a non-finite gradient made every rank skip the step."""
    grad_norm: torch.Tensor | None = None
    """Norm of the synchronized gradient before clipping (0-dim tensor), if computed."""
    bytes: dict[str, int] = dataclasses.field(default_factory=dict)
    """Payload bytes this step put on the wire, by collective (from ``comm.stats``)."""
    mask_size: int = 0
    """Number of coordinates synchronized this step (K for a sparse step, N_pad if dense)."""
