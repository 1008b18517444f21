"""A diagnostic hook: the owner's rule reads the whole batch's gradient, not its own share.

SCAPE's owner makes the next mask of its shard from statistics of its *own* gradient
(:func:`scape.rules.observe_local_moments`): on W ranks, of 1/W of the batch. This hook, for
``RunConfig.hooks`` (``{"bench.research.global_view:factory": {}}``), wraps the
optimizer's level (one level only) in one whose
:meth:`~GlobalView.own` is the mean of every rank's gradient buffer over the owner's shard (a
dense fp32 reduce-scatter at the start of every step, which the run's byte count includes) and
whose ``senders`` is 1, so the rule's statistics, its masks and its catch-ups' noise estimates
are those of one process fed the global batch, while what a step sends, and the residuals each
rank keeps, stay the W ranks' own. On one rank it changes nothing. It measures what the
owner's share of the batch costs (docs/research.md, "What the owner's share of the batch
costs"); it is not a way to train (its reduce-scatter is a dense step's gradient bytes).
"""

from __future__ import annotations

from typing import Any

import torch


class GlobalView:
    """The optimizer's own level (``opt.level``, one level only), but its rule observes the
    ranks' mean buffer over this rank's shard and its ``senders`` is 1."""

    def __init__(self, level: Any) -> None:
        self.inner = level

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    @property
    def senders(self) -> int:
        return 1

    def own(self, i: int, b: Any) -> torch.Tensor:
        out = torch.empty(b.shard_size, dtype=b.grad_flat.dtype, device=b.device)
        self.inner.comm.reduce_scatter(out, b.grad_flat, op="avg").wait()
        return out


class _Hook:
    """Nothing to do per step: the level is in place."""


def factory(cfg: Any, module: torch.nn.Module, opt: Any) -> _Hook:
    """``RunConfig.hooks`` factory: wrap ``opt``'s level in :class:`GlobalView`."""
    level = type(getattr(opt, "level", None)).__name__
    if level != "FlatLevel":
        raise ValueError("bench.research.global_view needs scape.SCAPE on one level, got "
                         f"{type(opt).__name__} with level {level}")
    opt.level = GlobalView(opt.level)
    return _Hook()
