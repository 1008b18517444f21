"""The optimizer state of the shard a rank owns (:class:`ShardState`), what every rule reads and
writes, and the lr counters that go with it (saved per param group with a checkpoint)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch


@dataclasses.dataclass
class ShardState:
    """Optimizer state of the shard a rank owns (length S each)."""

    master: torch.Tensor
    m: torch.Tensor
    age: torch.Tensor
    extra: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    work: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict, repr=False)
    """Buffers a rule reuses from step to step (its score): not state, never saved."""
    age_at_mask: torch.Tensor | None = dataclasses.field(default=None, repr=False)
    """Within a step whose ages ``observe_select`` advanced already: the ages its mask's
    entries had before (int32, compact), for the update; None otherwise."""
    lr_peak: float = 0.0
    """The largest lr a sparse update of this shard has taken (0 before the first)."""
    lr_rose: bool = True
    """Whether the last sparse update's lr was above every earlier one's (the lr's warm-up;
    True before the first). The optimizer keeps both (:meth:`saw_lr`, before ``update``) and
    saves them per param group with its counters (:func:`lr_counters`)."""

    def tensors(self) -> dict[str, torch.Tensor]:
        """The shard-sized state besides :attr:`extra`, by the names a checkpoint record
        (:func:`scape.checkpoint.sharded_state`) gives it."""
        return {"master": self.master, "m": self.m, "age": self.age}

    def saw_lr(self, lr: float) -> None:
        """A sparse update at ``lr``: :attr:`lr_rose` and :attr:`lr_peak` follow it."""
        self.lr_rose, self.lr_peak = lr > self.lr_peak, max(self.lr_peak, lr)

    def buffer(self, name: str) -> torch.Tensor:
        """The fp32 shard-sized buffer ``work[name]``, allocated on first use."""
        t = self.work.get(name)
        if t is None or t.numel() != self.master.numel() or t.device != self.master.device:
            t = self.work[name] = torch.empty_like(self.master)
        return t



def lr_counters(shards: list[ShardState], groups: list[int]) -> dict[str, dict[str, Any]]:
    """:attr:`ShardState.lr_peak` and :attr:`~ShardState.lr_rose` per param group (the
    shards of a group see the same lrs; ``groups[i]`` is shard ``i``'s), for checkpoints.
    Keyed by the group's index as a string: DCP stores a dict's keys as strings, and an int
    key would come back as a second entry beside the fresh optimizer's own."""
    peak: dict[str, Any] = {}
    rose: dict[str, Any] = {}
    for s, g in zip(shards, groups):
        peak.setdefault(str(g), s.lr_peak)
        rose.setdefault(str(g), int(s.lr_rose))
    return {"lr_peak": peak, "lr_rose": rose}


def load_lr_counters(shards: list[ShardState], groups: list[int],
                     counters: dict[str, Any]) -> None:
    """Restore what :func:`lr_counters` saved (string keys; int keys, as files written before
    were, load too); a group a checkpoint lacks starts as at construction."""
    peak, rose = counters.get("lr_peak", {}), counters.get("lr_rose", {})
    for s, g in zip(shards, groups):
        s.lr_peak = float(peak.get(str(g), peak.get(g, 0.0)))
        s.lr_rose = bool(rose.get(str(g), rose.get(g, 1)))

