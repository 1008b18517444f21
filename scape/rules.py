"""Rules for a sparse step: what the owner does with the synchronized compact gradient, and
which statistic picks the next mask.

A rule is a :class:`Rule`. ``update=`` of :class:`scape.SCAPE` names one in :data:`RULES`:

==========  ===========================================================================
``auto``    the default: masks by each coordinate's gain (:func:`gain_score`, with the wait
            up to sparsity 0.974: :func:`reads_wait`), the agreement catch-up bounded at
            half its block's RMS (16 B/coordinate)
``robust``  the same masks, the catch-up bounded at a quarter of the block's RMS: holds up
            better when the lr is above the one tuned for dense AdamS
``early``   masks by the fresh gain at every sparsity, the owner's EMAs at 0.95 while the
            lr rises and 0.98 after (:attr:`ShardState.lr_rose`), the catch-up bounded at
            1/8 of the block's RMS up to sparsity 0.974 and 1/2 above: short runs, with
            one dense step and a sparsity ramp (16 B/coordinate)
``sqrt``    masks by accumulated mass ``|m| (age + 1)``, a sent coordinate moves
            ``sqrt(age + 1)`` steps (:func:`catchup_sqrt`): no extra state, less compute
``lazy``    the baseline (DESIGN §1): a sent coordinate takes one AdamS step, the rest wait
==========  ===========================================================================

Other rules plug in with :func:`register` (``bench/research/rules.py`` registers its own).
The catch-ups (``update`` functions) live in :mod:`scape.catchups` and are importable here,
with the pieces they are built of (:func:`~scape.catchups.arrived_mean`, ...).

``update(shard, g, idx, block_size, hp, model_out)``:

- ``shard``: the owner's :class:`ShardState` (fp32 ``master``, fp32 ``m``, int32 ``age`` over
  the whole shard, plus ``extra`` tensors a rule may keep);
- ``g``: the averaged gradient at the mask coordinates (fp32, compact, ``n_blocks * k``). With
  error feedback it is everything accumulated there since the coordinate was last sent;
- ``idx``: the owner's mask, int16 ``[n_blocks, k]`` block-local offsets;
- ``hp``: ``lr``, ``beta1``, ``beta2``, ``eps``, ``weight_decay`` of the param group and the
  ``world`` size;
- ``model_out``: compact buffer (model dtype) that must receive the new parameter values at
  the mask coordinates; it is all-gathered and scattered into every rank's model.

It must set ``age = 0`` at the mask and ``age += 1`` elsewhere. Only the mask coordinates are
sent, so a rule may change other coordinates of ``master`` only if every rank can reproduce
that change (otherwise the ranks' models drift apart).

``score(shard) -> Tensor`` (length S): the next mask takes, per block, the largest ``|score|``
(default: the first moment ``m``, DESIGN §1 step 4), and a fraction ``explore`` of each
block's budget by age. A rule with ``score_reads_hp`` gets the hyperparameters and the mask's
budget too: ``score(shard, hp)``, ``hp["k"]`` of ``hp["block_size"]``. A rule with ``select``
makes that mask itself, score and selection fused (:func:`scape.kernels.gain_topk`).

Optional seams, each free of communication: ``observe(shard, buf, error_feedback)`` sees the
owner's slice of its own gradient buffer at the start of every step (local statistics, kept
in the shard tensors named by ``extra``, which checkpoints save and reshard); ``reset(shard)``
runs after a skipped step, whose residuals were cleared.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import torch

from scape.catchups import (  # noqa: F401  (the catch-ups stay importable from here)
    arrived_mean,
    catchup_agree,
    catchup_mean,
    catchup_snr,
    catchup_sqrt,
    lazy,
    mask_positions,
    move_selected,
    sign_agreement,
    trust_reach,
)
from scape.kernels import gain_score as kernel_gain_score
from scape.kernels import gain_topk as kernel_gain_topk
from scape.kernels import noise_ema_, noise_gain_topk_, restore_ages_


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
    two fused (:func:`gain_select_auto`). None: ``blockwise_topk`` of ``score``."""
    observe_select: Callable[..., torch.Tensor] | None = None
    """``observe``, the step's ages and ``select`` in one pass over the shard, before the
    take (:func:`observe_select_gain`): ``observe_select(shard, buf, error_feedback, hp,
    cur, k, k_explore, block_size)`` -> the next mask, where ``cur`` is the rank's rows of
    this step's mask; it leaves the old ages at ``cur`` in ``shard.age_at_mask``, and
    ``update`` must take them from there and set it back to None (:func:`catchup_agree`
    does). The optimizer calls it when this step and the next are sparse."""

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


def lr_counters(shards: list[ShardState], groups: list[int]) -> dict[str, dict[int, Any]]:
    """:attr:`ShardState.lr_peak` and :attr:`~ShardState.lr_rose` per param group (the
    shards of a group see the same lrs; ``groups[i]`` is shard ``i``'s), for checkpoints."""
    peak: dict[int, Any] = {}
    rose: dict[int, Any] = {}
    for s, g in zip(shards, groups):
        peak.setdefault(g, s.lr_peak)
        rose.setdefault(g, int(s.lr_rose))
    return {"lr_peak": peak, "lr_rose": rose}


def load_lr_counters(shards: list[ShardState], groups: list[int],
                     counters: dict[str, Any]) -> None:
    """Restore what :func:`lr_counters` saved; a group a checkpoint lacks starts as at
    construction."""
    peak, rose = counters.get("lr_peak", {}), counters.get("lr_rose", {})
    for s, g in zip(shards, groups):
        s.lr_peak, s.lr_rose = float(peak.get(g, 0.0)), bool(rose.get(g, 1))


def accumulated_score(shard: ShardState) -> torch.Tensor:
    """``m * (age + 1)``, ranked by its magnitude: the gradient mass waiting in the residuals.

    A coordinate unsent for ``a`` steps has accumulated about ``(a + 1) * E[g]`` across the
    ranks' residuals, and ``m`` estimates ``E[g]``. Selecting by this product sends each
    coordinate at a rate proportional to ``|m|`` instead of re-sending the same large-``|m|``
    coordinates while the rest wait for ``explore``. The mask takes ``|score|``, so the sign
    is left in (one pass, no ``abs``; rounding is sign-symmetric, so the magnitudes are
    bitwise those of ``|m| + |m| * age``).
    """
    return torch.addcmul(shard.m, shard.m, shard.age)  # age promotes to fp32


NOISE_BETA = 0.95
"""EMA factor of the owner's local second moment (:func:`observe_local_noise`)."""
NOISE_STATE = ("prev", "s2", "s2w")
"""The shard tensors :func:`observe_local_noise` keeps."""


def observe_local_noise(shard: ShardState, buf: torch.Tensor, error_feedback: bool) -> None:
    """EMA of the square of this rank's own per-step gradient at its shard (``extra["s2"]``,
    with its weight ``extra["s2w"]`` so that ``s2 / s2w`` is unbiased from the first step).

    The buffer holds the residual left by the previous step plus this step's gradient. The
    previous residual is the previous buffer (``extra["prev"]``) with the coordinates synced
    last step (``age == 0``: the mask, or everything after a dense step) zeroed, so this
    step's own gradient is ``buf - where(age == 0, 0, prev)``. One fused pass on a GPU
    (:func:`scape.kernels.noise_ema_`). A non-finite entry (a step about to be skipped) leaves
    that coordinate's ``s2`` and ``s2w`` as they were; after the skip,
    :func:`reset_local_noise` clears ``prev`` (the skip cleared the residual).
    """
    ex = shard.extra
    noise_ema_(buf, ex["prev"], shard.age, ex["s2"], ex["s2w"], beta=NOISE_BETA,
               error_feedback=error_feedback)


def reset_local_noise(shard: ShardState) -> None:
    """After a skipped step the residual is zero: the next buffer is that step's gradient
    alone, so the previous buffer to subtract is zero too."""
    shard.extra["prev"].zero_()


GAIN_STATE = NOISE_STATE + ("mu",)
"""The noise state plus ``mu``, the EMA of the owner's own per-step gradient
(:func:`gain_score`)."""


def observe_local_moments(shard: ShardState, buf: torch.Tensor, error_feedback: bool,
                          beta: float = NOISE_BETA) -> None:
    """:func:`observe_local_noise` at factor ``beta``, and the EMA of the local gradient itself
    in ``extra["mu"]`` (same weight ``s2w``; the same fused pass on a GPU)."""
    ex = shard.extra
    noise_ema_(buf, ex["prev"], shard.age, ex["s2"], ex["s2w"], beta=beta,
               error_feedback=error_feedback, mu=ex["mu"])


def gain_score(shard: ShardState, hp: dict, beta: float = NOISE_BETA) -> torch.Tensor:
    """What sending a coordinate now is worth: its fresh gradient signal times the steps the
    agreement rule would move it.

    ``|m| * (age + 1)`` (:func:`accumulated_score`) ranks by the first moment of the
    coordinate's last sync: stale for a coordinate not sent lately, and blind to noise, so a
    large, noisy coordinate wins the mask again and again only to move about one step. Here
    the signal comes from the owner's own fresh EMA ``mu`` of its per-step gradient
    (:func:`observe_local_moments`): ``sig^2 = mean^2 - var (1 - beta) / (1 + beta)`` (the
    EMA's own noise removed; ``mean = mu / s2w``, ``var = s2 / s2w - mean^2``, the per-rank
    variance), and the score is ``sig * max(1, (age + 1) * erf(sig / (sigma_m sqrt 2)))``
    with ``sigma_m^2 = var / W * (1 - beta1) / (1 + beta1)`` as :func:`catchup_agree`: the
    loss decrease per unit lr of the catch-up the rule would make (its trust bound aside).
    A coordinate whose per-step sign is a coin toss scores about its small ``sig``; it waits
    for ``explore``. The owner's mean is that of its own share of the batch, so the reading
    is noisier the more ranks share it (measured on 4 ranks; one process fed the global
    batch reads it better than any rank could). One fused pass on a GPU
    (:func:`scape.kernels.gain_score`, 20 bytes per coordinate). The score is written into
    the shard's buffer ``work["score"]`` and returned: the next call overwrites it.
    """
    ex = shard.extra
    return kernel_gain_score(ex["mu"], ex["s2"], ex["s2w"], shard.age, beta=beta,
                             beta1=hp["beta1"], world=hp.get("world", 1),
                             out=shard.buffer("score"))


def gain_score_residual(shard: ShardState, hp: dict, beta: float = NOISE_BETA) -> torch.Tensor:
    """:func:`gain_score` whose mean also reads the owner's own gradient summed since the
    coordinate was last sent (with error feedback: ``extra["prev"]``, this step's buffer,
    holds ``age`` of the owner's per-step gradients at an unsent coordinate): the EMA's mean
    covers about ``(1 + beta) / (1 - beta)`` (39) steps, the sum all ``age`` of the wait, so a
    weak but steady gradient shows in it the longer it waits, where the EMA's reading stays
    at noise. The two means are weighted by the steps they cover,
    ``mean = (39 * ema + age * sum / age) / (39 + age)``, its noise taken as
    ``var / (39 + age)``; the rest as :func:`gain_score`. One fused pass on a GPU
    (:func:`scape.kernels.gain_score` with ``prev``, 24 bytes per coordinate)."""
    ex = shard.extra
    return kernel_gain_score(ex["mu"], ex["s2"], ex["s2w"], shard.age, beta=beta,
                             beta1=hp["beta1"], world=hp.get("world", 1), prev=ex["prev"],
                             out=shard.buffer("score"))


def gain_select(shard: ShardState, hp: dict, k: int, k_explore: int, block_size: int,
                residual: bool = False, beta: float = NOISE_BETA) -> torch.Tensor:
    """The mask of largest :func:`gain_score` (``residual``: :func:`gain_score_residual`) of
    EMAs kept at factor ``beta``: one kernel on a GPU (:func:`scape.kernels.gain_topk`), the
    score never stored; on the CPU the score (into the shard's buffer) and ``blockwise_topk``."""
    ex = shard.extra
    return kernel_gain_topk(ex["mu"], ex["s2"], ex["s2w"], shard.age, k, block_size,
                            k_explore=k_explore, beta=beta, beta1=hp["beta1"],
                            world=hp.get("world", 1), prev=ex["prev"] if residual else None,
                            out=shard.buffer("score"))


def reads_wait(k: int, block_size: int) -> bool:
    """Whether the masks of ``auto`` and ``robust`` read the wait (:func:`gain_score_residual`,
    else :func:`gain_score`): when a mask takes at least ``(1 - beta) / (1 + beta)`` = 1/39 of
    each block (sparsity up to 0.974), so the mean wait, ``block_size / k`` steps, is within the
    EMA's 39; a longer wait outweighs the fresh mean (measured: docs/research.md)."""
    return k * (1.0 + NOISE_BETA) >= (1.0 - NOISE_BETA) * block_size


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


def unadvance_ages(shard: ShardState, cur: torch.Tensor, block_size: int) -> None:
    """A step skipped after :func:`observe_select_gain` advanced its ages: put them back."""
    if shard.age_at_mask is not None:
        restore_ages_(shard.age, cur, block_size, shard.age_at_mask)
        shard.age_at_mask = None


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
other rules' 0.95, while it rises): about 99 steps, a steadier mean after the warm-up."""
EARLY_TRUST = (0.125, 0.5)
"""``early``'s catch-up bound, in its block's RMS: where a mask would read the wait
(:func:`reads_wait`, sparsity up to 0.974), and above."""


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


RULES: dict[str, Rule] = {
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
}
"""The rules ``update=`` accepts by name: the four built in (module docstring), and more by
:func:`register`."""

BUILTIN = tuple(RULES)
"""The names of the built-in rules (they cannot be replaced)."""


def register(name: str, rule: Rule, *, replace: bool = False) -> None:
    """Make ``rule`` available as ``scape.SCAPE(..., update=name)``.

    Register the same rule on every rank before building the optimizer (the optimizer checks
    that every rank uses the same name). A name already registered raises unless ``replace``;
    the built-in names (:data:`BUILTIN`) cannot be replaced.
    """
    if not isinstance(name, str) or not name or any(c.isspace() for c in name):
        raise ValueError(f"register: name must be a non-empty string without spaces, got "
                         f"{name!r}")
    if not isinstance(rule, Rule):
        raise TypeError(f"register: rule must be a scape.rules.Rule, got "
                        f"{type(rule).__name__}")
    if name in BUILTIN:
        raise ValueError(f"register: {name!r} is a built-in rule and cannot be replaced")
    if name in RULES and not replace and RULES[name] is not rule:
        raise ValueError(f"register: a rule named {name!r} is already registered (pass "
                         "replace=True to replace it)")
    RULES[name] = rule


def get(name: Any) -> Rule:
    """The rule registered as ``name``; ``ValueError`` naming the known ones otherwise."""
    if not isinstance(name, str) or name not in RULES:
        raise ValueError(f"Invalid update rule: {name!r} (expected one of {sorted(RULES)}, "
                         "or a name added with scape.rules.register)")
    return RULES[name]


def round_half_up(x: float) -> int:
    """``round`` with halves going up (Python's ``round`` goes to even)."""
    return int(math.floor(x + 0.5))


def block_budget(sparsity: float, block_size: int, explore: float) -> tuple[int, int]:
    """``(k_b, k_x)``: coordinates per block a mask takes at ``sparsity``, and how many of them
    are chosen by age (``explore`` of them)."""
    k = max(1, round_half_up((1.0 - sparsity) * block_size))
    return k, round_half_up(explore * k)
