"""A sparse-step rule (:class:`Rule`) and the types of the functions it is made of; the
contract they follow is in :mod:`scape.rules`."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from scape.rules.state import ShardState

UpdateFn = Callable[[ShardState, torch.Tensor, torch.Tensor, int, dict, torch.Tensor], None]
ScoreFn = Callable[..., torch.Tensor]
"""``score(shard)``, or ``score(shard, hp)`` for a rule with ``score_reads_hp``."""
ObserveFn = Callable[[ShardState, torch.Tensor, bool], None]


@dataclasses.dataclass(frozen=True)
class Rule:
    """A sparse-step rule: the owner's update and the statistic the next mask is taken from."""

    update: UpdateFn
    score: ScoreFn | None = None
    """None: the first moment ``m`` (|m| picks the mask)."""
    observe: ObserveFn | None = None
    """Called at the start of every step with the owner's slice of its own gradient buffer
    (this step's local gradient + residual, before the take) and whether error feedback is
    on: local statistics a rule may keep in ``shard.extra`` at no communication cost."""
    extra: tuple[str, ...] = ()
    """Names of the fp32 shard-sized tensors the rule keeps in ``shard.extra`` (zeros at
    construction; saved, loaded and resharded with the shard)."""
    reset: Callable[[ShardState], None] | None = None
    """Called after a skipped step (non-finite gradient somewhere), whose residuals were
    cleared: what ``observe`` kept of the buffer no longer describes it."""
    score_reads_hp: bool = False
    """True: ``score(shard, hp)`` with the hyperparameters ``update`` gets (world size, betas)
    and the mask's budget, ``hp["k"]`` coordinates of each ``hp["block_size"]``."""
    explore: float = 0.1
    """Fraction of each block's budget taken by age (the longest-waiting coordinates) instead
    of by ``score``: every coordinate is sent now and then, whatever its score."""
    embeddings_apart: bool = False
    """With :meth:`scape.SCAPE.attach`, the embedding matrices get a bucket of their own in
    their group and a larger share of its bytes (:mod:`scape.embeddings`)."""
    error_feedback: bool = True
    """Keep what a sparse step did not send in the gradient buffer for later steps (False:
    drop it, so ``g`` is this step's gradient alone)."""
    select: Callable[..., torch.Tensor] | None = None
    """Makes the next mask itself, ``select(shard, hp, k, k_explore, block_size)`` -> int16
    ``[n_blocks, k]`` offsets: the mask ``blockwise_topk`` would take from ``score``, with the
    two fused (:func:`scape.rules.gain_select`). None: ``blockwise_topk`` of ``score``. A row
    may come in any order: the optimizer sorts a rule's own rows ascending, as the mask's wire
    codes them (the built-in rules' kernels make them so)."""
    observe_select: Callable[..., torch.Tensor] | None = None
    """``observe``, the step's ages and ``select`` in one pass over the shard, before the
    take (:func:`scape.rules.observe_select_gain`): ``observe_select(shard, buf,
    error_feedback, hp, cur, k, k_explore, block_size)`` -> the next mask, where ``cur`` is
    the rank's rows of this step's mask; it leaves the old ages at ``cur`` in
    ``shard.age_at_mask``, and ``update`` must take them from there and set it back to None
    (:func:`scape.rules.catchup_agree` does). The optimizer calls it when this step and the
    next are sparse."""

    def __post_init__(self) -> None:
        if not callable(self.update):
            raise TypeError(f"Rule.update must be callable, got {type(self.update).__name__}")
        for name in ("score", "observe", "reset", "select", "observe_select"):
            fn = getattr(self, name)
            if fn is not None and not callable(fn):
                raise TypeError(f"Rule.{name} must be callable or None, got "
                                f"{type(fn).__name__}")
        if not isinstance(self.extra, tuple) or \
                not all(isinstance(k, str) and k for k in self.extra):
            raise TypeError(f"Rule.extra must be a tuple of names, got {self.extra!r}")
        if isinstance(self.explore, bool) or not isinstance(self.explore, (int, float)) or \
                not 0.0 <= self.explore <= 1.0:
            raise ValueError(f"Invalid Rule.explore: {self.explore!r} (expected a float in "
                             "[0, 1])")
        if not isinstance(self.error_feedback, bool):
            raise TypeError("Invalid Rule.error_feedback: expected a bool, got "
                            f"{type(self.error_feedback).__name__}")

