"""The built-in rules (``auto``, ``robust``, ``early``, ``sqrt``, ``lazy``; :mod:`scape.rules`
says what each does), their constants, and the pieces they are built of: the scores and
selections that read the mask's budget, and the constructors of noise-sized and gain-selected
rules (:func:`noise_sized`, :func:`gain_selected`), which other rules use too."""

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


def gain_score_auto(shard: ShardState, hp: dict) -> torch.Tensor:
    """The score of ``auto`` and ``robust``: :func:`gain_score_residual` if :func:`reads_wait`
    for the mask's budget (``hp["k"]`` of ``hp["block_size"]``), else :func:`gain_score`."""
    wait = reads_wait(hp["k"], hp["block_size"])
    return (gain_score_residual if wait else gain_score)(shard, hp)


def gain_select_auto(shard: ShardState, hp: dict, k: int, k_explore: int,
                     block_size: int) -> torch.Tensor:  # the top-k of gain_score_auto, fused
    return gain_select(shard, hp, k, k_explore, block_size, residual=reads_wait(k, block_size))


def observe_select_gain(shard: ShardState, buf: torch.Tensor, error_feedback: bool,
                        hp: dict, cur: torch.Tensor, k: int, k_explore: int,
                        block_size: int, beta: float = NOISE_BETA,
                        residual: bool | None = None) -> torch.Tensor:
    """:func:`observe_local_moments`, the step's ages (advanced at its mask ``cur``, as the
    catch-up would) and :func:`gain_select_auto` on them in one pass before the take
    (:func:`scape.kernels.noise_gain_topk_`), bit for bit the three in turn. ``beta``: the
    EMAs' factor; ``residual``: whether the mask reads the summed wait (None:
    :func:`reads_wait`, as ``auto``'s)."""
    ex = shard.extra
    idx, shard.age_at_mask = noise_gain_topk_(
        buf, ex["prev"], shard.age, ex["s2"], ex["s2w"], ex["mu"], cur, k, block_size,
        k_explore=k_explore, beta=beta, beta1=hp["beta1"], world=hp.get("world", 1),
        error_feedback=error_feedback,
        residual=reads_wait(k, block_size) if residual is None else residual,
        out=shard.buffer("score"))
    return idx


GAIN_SCORES: tuple[ScoreFn, ...] = (gain_score, gain_score_residual, gain_score_auto)
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
    fused (:func:`gain_select`, :func:`gain_select_auto`). ``kw``: other :class:`Rule` fields."""
    fused = {gain_score: gain_select, gain_score_auto: gain_select_auto,
             gain_score_residual: functools.partial(gain_select, residual=True)}
    kw.setdefault("select", fused.get(score))
    return Rule(update, score, observe=observe_local_moments, extra=GAIN_STATE,
                reset=reset_local_noise, score_reads_hp=True, **kw)


EARLY_BETA = 0.98
"""``early``'s factor of the owner's EMAs once the lr stops rising (:data:`NOISE_BETA`, the
other rules' 0.95, while it rises): about 99 steps, a steadier mean after the warm-up
(docs/research.md, "The 1/8 bound built in")."""
EARLY_TRUST = (0.125, 0.5)
"""``early``'s catch-up bound, in its block's RMS: where a mask would read the wait
(:func:`reads_wait`, sparsity up to 0.974), and above (docs/research.md, "The 1/8 bound
built in")."""


def _early_beta(shard: ShardState) -> float:
    return NOISE_BETA if shard.lr_rose else EARLY_BETA


def _early_observe(shard: ShardState, buf: torch.Tensor, error_feedback: bool) -> None:
    observe_local_moments(shard, buf, error_feedback, beta=_early_beta(shard))


def early_trust(k: int, block_size: int) -> float:
    """``early``'s catch-up bound for a mask of ``k`` per block (:data:`EARLY_TRUST`)."""
    return EARLY_TRUST[0] if reads_wait(k, block_size) else EARLY_TRUST[1]


def _early_update(shard: ShardState, g: torch.Tensor, idx: torch.Tensor, block_size: int,
                  hp: dict, model_out: torch.Tensor) -> None:
    catchup_agree(shard, g, idx, block_size, hp, model_out,
                  trust=early_trust(idx.shape[-1], block_size))


def _early_score(shard: ShardState, hp: dict) -> torch.Tensor:
    return gain_score(shard, hp, beta=_early_beta(shard))


def _early_select(shard: ShardState, hp: dict, k: int, k_explore: int,
                  block_size: int) -> torch.Tensor:
    return gain_select(shard, hp, k, k_explore, block_size, beta=_early_beta(shard))


def _early_observe_select(shard: ShardState, buf: torch.Tensor, error_feedback: bool,
                          hp: dict, cur: torch.Tensor, k: int, k_explore: int,
                          block_size: int) -> torch.Tensor:
    """``early``'s observation, ages and mask in one pass (:func:`observe_select_gain`). The
    EMAs observe at the factor the last update saw; the mask is the one this step's update
    will see (its lr above the peak or not): where the two differ (the step after the lr
    stops rising) the mask is taken again at the second, bit for bit the three passes."""
    observed = _early_beta(shard)
    idx = observe_select_gain(shard, buf, error_feedback, hp, cur, k, k_explore, block_size,
                              beta=observed, residual=False)
    selected = NOISE_BETA if hp["lr"] > shard.lr_peak else EARLY_BETA
    if selected != observed:
        idx = gain_select(shard, hp, k, k_explore, block_size, beta=selected)
    return idx


BUILTIN_RULES: Mapping[str, Rule] = types.MappingProxyType({
    "auto": gain_selected(functools.partial(catchup_agree, trust=0.5), gain_score_auto,
                          observe_select=observe_select_gain),
    "robust": gain_selected(functools.partial(catchup_agree, trust=0.25), gain_score_auto,
                            observe_select=observe_select_gain),
    "early": dataclasses.replace(gain_selected(_early_update, _early_score,
                                               select=_early_select,
                                               observe_select=_early_observe_select),
                                 observe=_early_observe, embeddings_apart=True),
    "sqrt": Rule(catchup_sqrt, accumulated_score),
    "lazy": Rule(lazy),
})
"""The built-in rules by name, in the order :data:`scape.rules.RULES` lists them (read-only)."""
