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
    """Gradient norm before clipping (0-dim tensor). With clipping on (``max_grad_norm`` or
    ``opt.clip_grad_norm_``) the dense-comparable norm on every step: exact on a dense step,
    estimated on a sparse one (:func:`scape.grad_watch.clip_norm`). Without clipping, the norm
    of what the step synchronized: on a sparse step, the sent coordinates only; there it
    travels with the parameter values (no collective of its own), so it is written when they
    land: before ``step()`` returns, or after ``opt.attach(model)`` at the next forward or
    ``opt.finish_param_sync()`` (NaN until then, and on a skipped step)."""
    bytes: dict[str, int] = dataclasses.field(default_factory=dict)
    """Payload bytes this step put on the wire, by collective (from ``comm.stats``)."""
    collectives: int = 0
    """Collectives this step launched (every op, ``comm.stats`` calls)."""
    mask_size: int = 0
    """Number of coordinates synchronized this step (K for a sparse step, N_pad if dense)."""

    def level_bytes(self, level: str) -> int | None:
        """Payload bytes of one level with a two-level communicator (``"intra"``: inside the
        node, ``"inter"``: across nodes; ``comm.stats`` keys ``"<level>/<op>"``); None with
        a flat one."""
        keys = [k for k in self.bytes if "/" in k]
        if not keys:
            return None
        return sum(v for k, v in self.bytes.items() if k.startswith(level + "/"))

    @property
    def intra_bytes(self) -> int | None:
        """Payload bytes inside the node this step (two levels; None when flat)."""
        return self.level_bytes("intra")

    @property
    def inter_bytes(self) -> int | None:
        """Payload bytes across nodes this step (two levels; None when flat)."""
        return self.level_bytes("inter")
