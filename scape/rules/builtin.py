"""The built-in rules (``agree``, ``sqrt``, ``lazy``; :mod:`scape.rules` says what each does),
the default's constants (:data:`CONSTANTS`), and the pieces they are built of: the fused
observation and mask, and the constructors of noise-sized and gain-selected rules
(:func:`noise_sized`, :func:`gain_selected`), which other rules use too."""

from __future__ import annotations

import dataclasses
import functools
import types
from collections.abc import Mapping
from typing import Any

import torch

from scape.kernels import noise_gain_topk_
from scape.rules.budget import reads_wait
from scape.rules.catchups import catchup_agree, catchup_sqrt, lazy
from scape.rules.estimators import (
    GAIN_STATE,
    NOISE_BETA,
    NOISE_STATE,
    accumulated_score,
    gain_score,
    gain_score_residual,
    gain_select,
    observe_local_moments,
    observe_local_noise,
    reset_local_noise,
)
from scape.rules.rule import Rule, ScoreFn, UpdateFn
from scape.rules.state import ShardState


def observe_select_gain(shard: ShardState, buf: torch.Tensor, error_feedback: bool,
                        hp: dict, cur: torch.Tensor, k: int, k_explore: int,
                        block_size: int, beta: float = NOISE_BETA,
                        residual: bool | None = None) -> torch.Tensor:
    """:func:`observe_local_moments`, the step's ages (advanced at its mask ``cur``, as the
    catch-up would) and :func:`gain_select` on them in one pass before the take
    (:func:`scape.kernels.noise_gain_topk_`), bit for bit the three in turn. ``beta``: the
    EMAs' factor; ``residual``: whether the mask reads the summed wait
    (:func:`gain_score_residual`; None: where :func:`reads_wait`)."""
    ex = shard.extra
    idx, shard.age_at_mask = noise_gain_topk_(
        buf, ex["prev"], shard.age, ex["s2"], ex["s2w"], ex["mu"], cur, k, block_size,
        k_explore=k_explore, beta=beta, beta1=hp["beta1"], world=hp.get("world", 1),
        error_feedback=error_feedback,
        residual=reads_wait(k, block_size) if residual is None else residual,
        out=shard.buffer("score"))
    return idx


GAIN_SCORES: tuple[ScoreFn, ...] = (gain_score, gain_score_residual)
"""The scores that take a coordinate's fresh gain."""


def noise_sized(update: UpdateFn, score: ScoreFn | None = accumulated_score, **kw: Any) -> Rule:
    """A rule that sizes its catch-up by the owner's local noise estimate: it keeps
    :data:`NOISE_STATE` (12 B per coordinate) through :func:`observe_local_noise`; masks by
    ``score`` (accumulated mass by default). ``kw``: other :class:`Rule` fields."""
    return Rule(update, score, observe=observe_local_noise, extra=NOISE_STATE,
                reset=reset_local_noise, **kw)


def gain_selected(update: UpdateFn, score: ScoreFn = gain_score_residual, **kw: Any) -> Rule:
    """A noise-sized rule whose masks take the coordinates of largest gain (``score``, one of
    :data:`GAIN_SCORES`): it keeps :data:`GAIN_STATE` (16 B per coordinate) through
    :func:`observe_local_moments`, and makes its masks with the score and the selection
    fused (:func:`gain_select`; another score passes its own ``select``). ``kw``: other
    :class:`Rule` fields."""
    fused = {gain_score: gain_select,
             gain_score_residual: functools.partial(gain_select, residual=True)}
    kw.setdefault("select", fused.get(score))
    return Rule(update, score, observe=observe_local_moments, extra=GAIN_STATE,
                reset=reset_local_noise, score_reads_hp=True, **kw)


STEADY_BETA = 0.98
"""``agree``'s factor of the owner's EMAs once the lr stops rising (:data:`NOISE_BETA`, 0.95,
while it rises): a mean over about 50 steps, steadier after the warm-up (docs/research.md,
"The 1/8 bound built in")."""
TRUST = (0.125, 0.5)
"""``agree``'s bound on how far a sent coordinate moves, in its block's RMS: at sparsities up
to 0.974 (:func:`reads_wait`, where 1/2 let the denser masks overshoot) and above
(docs/research.md, "The 1/8 bound built in")."""


def _early_beta(shard: ShardState) -> float:
    return NOISE_BETA if shard.lr_rose else STEADY_BETA


def _early_observe(shard: ShardState, buf: torch.Tensor, error_feedback: bool) -> None:
    observe_local_moments(shard, buf, error_feedback, beta=_early_beta(shard))


def trust_bound(k: int, block_size: int) -> float:
    """``agree``'s bound for a mask of ``k`` per block (:data:`TRUST`)."""
    return TRUST[0] if reads_wait(k, block_size) else TRUST[1]


def _early_update(shard: ShardState, g: torch.Tensor, idx: torch.Tensor, block_size: int,
                  hp: dict, model_out: torch.Tensor) -> None:
    catchup_agree(shard, g, idx, block_size, hp, model_out,
                  trust=trust_bound(idx.shape[-1], block_size))


def _early_score(shard: ShardState, hp: dict) -> torch.Tensor:
    return gain_score(shard, hp, beta=_early_beta(shard))


def _early_select(shard: ShardState, hp: dict, k: int, k_explore: int,
                  block_size: int) -> torch.Tensor:
    return gain_select(shard, hp, k, k_explore, block_size, beta=_early_beta(shard))


def _early_observe_select(shard: ShardState, buf: torch.Tensor, error_feedback: bool,
                          hp: dict, cur: torch.Tensor, k: int, k_explore: int,
                          block_size: int) -> torch.Tensor:
    """``agree``'s observation, ages and mask in one pass (:func:`observe_select_gain`). The
    EMAs observe at the factor the last update saw; the mask is the one this step's update
    will see (its lr above the peak or not): where the two differ (the step after the lr
    stops rising) the mask is taken again at the second, bit for bit the three passes."""
    observed = _early_beta(shard)
    idx = observe_select_gain(shard, buf, error_feedback, hp, cur, k, k_explore, block_size,
                              beta=observed, residual=False)
    selected = NOISE_BETA if hp["lr"] > shard.lr_peak else STEADY_BETA
    if selected != observed:
        idx = gain_select(shard, hp, k, k_explore, block_size, beta=selected)
    return idx


BUILTIN_RULES: Mapping[str, Rule] = types.MappingProxyType({
    "agree": dataclasses.replace(gain_selected(_early_update, _early_score,
                                               select=_early_select,
                                               observe_select=_early_observe_select),
                                 observe=_early_observe, embeddings_apart=True),
    "sqrt": Rule(catchup_sqrt, accumulated_score),
    "lazy": Rule(lazy),
})
"""The built-in rules by name, in the order :data:`scape.rules.RULES` lists them (read-only)."""

CONSTANTS: tuple[tuple[str, Any, str, str], ...] = (
    ("NOISE_BETA", NOISE_BETA, "the factor of the owner's EMAs of its own gradient while the "
     "lr rises", "docs/research.md, entry 4"),
    ("STEADY_BETA", STEADY_BETA, "the same factor once the lr stops rising",
     "docs/research.md, \"The EMA that lengthens once the lr stops rising\""),
    ("TRUST", TRUST, "how far a sent coordinate moves, in its block's RMS: up to sparsity "
     "0.974 (a mask of at least (1 - NOISE_BETA) / (1 + NOISE_BETA) = 1/39 of its block), "
     "and above", "docs/research.md, entry 10 and \"The 1/8 bound built in\""),
    ("Rule.explore", 0.1, "the share of each block's budget taken by age", "DESIGN §1"),
    ("SHORT_FACTOR, LONG_FACTOR, MAX_SHARE", (5, 2, 0.5), "the embedding matrices' budget "
     "over the rest's (up to 0.974, above) and their largest share of the bytes (attach; "
     "scape.embeddings)",
     "docs/research.md, \"The embedding matrices set apart inside one group\""),
    ("RAMP_START, RAMP_FACTOR", (0.5, 10), "where the start's sparsity ramp begins: at 10 "
     "times the group's density, at most half the coordinates (scape.schedules.ramp_start)",
     "docs/research.md, \"A sparsity ramp in place of the dense warm-up\" and \"The start's "
     "ramp at ten times the density\""),
    ("RAMP_BUDGET, RAMP_REFERENCE", (1 / 50, 0.99), "the ramp's length: what keeps a 0.99 "
     "run within 1/50 of dense AdamS's bytes", "README \"Cost\""),
)
"""The default rule's constants and its start's: name, value, what it controls, the docs
entry that chose it (docs/design.md has the same table)."""
