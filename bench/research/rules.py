"""The research rules, registered with :func:`scape.rules.register` on import.

Each is a :class:`scape.rules.Rule` built from the library's public building blocks; the
findings behind them are in docs/research.md. The built-in ``sqrt`` is also registered here
under its research name, ``catchup_sqrt_accum``, so the research commands keep working.
``auto`` and ``robust`` train as ``catchup_agree_trust2_gain`` and
``catchup_agree_trust4_gain`` at sparsities above 0.974 and as ``catchup_agree_trust2_gainr``
and ``catchup_agree_trust4_gainr`` up to it (:func:`scape.rules.reads_wait`); the ``gainr``
rules were the two built-ins at every sparsity before.

Names: ``catchup_<size>_<mask>``. The catch-up size: ``mean`` (all ``a + 1`` steps), ``sqrt``
(``sqrt(a + 1)``), ``snr`` (by the arrived mean's signal-to-noise ratio), ``agree`` (by the
expected sign agreement of dense AdamS), ``agree_sqrt`` (never below ``sqrt``), ``agree_cap``
(never above ``sqrt``), ``agree_trust{,2,4}`` (displacement bounded by 1, 1/2, 1/4 of the
block RMS; ``agree`` alone: unbounded), ``agree_trustlr`` (the bound follows the lr from 1/2
at the peak to 1/4). The mask: none (``|m|``), ``accum`` (``|m| (age + 1)``), ``gain`` (the
fresh gain from the EMA), ``gainr`` (the gain with the summed wait); a suffix ``_b<f>`` sets
the factor of the owner's local EMAs to ``0.<f>`` (``_b98``: 0.98) instead of 0.95, and
``_b<f>w`` to it once the lr stops rising (0.95 through the lr's warm-up); ``trust24``: the
bound 1/2 above sparsity 0.974 and 1/4 up to it (``trust26``: 1/6, ``trust28``: 1/8, built
in as ``early``, bit for bit; ``trust2cap``: none above ``sqrt(a + 1)`` steps up to it).
``auto_b98w``: ``auto``'s masks (the summed wait up to sparsity 0.974) with ``_b98w``'s EMAs.
``early_decay``: ``early`` with its bound widened as the lr falls from its peak (up to one block
RMS; :func:`early_decay_update`). ``early_lead``: ``early`` whose sent coordinates are put ahead of
their catch-up by half the steps of their last wait (:func:`lead_update`). ``early_probe``:
``early`` bit for bit, recording per block what its catch-ups did (:mod:`bench.research.probe`).
``early_steady``: ``early`` whose bound widens with each sent coordinate's agreement
(:func:`steady_update`); ``early_steady_w``: at most twice, once the lr stops rising.
The ``early_*`` rules keep one bucket per param group (``embeddings_apart=False``, as when they
were measured): ``early`` with ``attach(model)`` sets the embedding matrices apart, and is ``early``
bit for bit only without (:mod:`scape.embeddings`), as ``_trust28_gain_b98w`` is.
``agree_trust48`` and ``agree_trust18``: ``agree`` (embeddings apart, its EMAs) with the bound
1/4 and 1 above sparsity 0.974 (1/8 up to it); ``agree_unbounded``: with none;
``agree_together``: ``agree`` whose ``attach`` leaves the embedding matrices in their group's
bucket (:func:`agree_above_rule`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import weakref
from typing import Any

import torch

from bench.research.probe import PROBE
from scape import rules
from scape.rules import (
    GAIN_STATE,
    RULES,
    Rule,
    ShardState,
    accumulated_score,
    arrived_mean,
    catchup_agree,
    catchup_mean,
    catchup_snr,
    catchup_sqrt,
    gain_score,
    gain_score_residual,
    gain_select,
    gain_selected,
    lazy,
    mask_positions,
    move_selected,
    noise_sized,
    observe_local_moments,
    observe_select_gain,
    reads_wait,
    sign_agreement,
    trust_reach,
)


def gain_score_auto(shard: ShardState, hp: dict) -> torch.Tensor:
    """The score of ``auto`` and ``robust``: :func:`scape.rules.gain_score_residual` if
    :func:`scape.rules.reads_wait` for the mask's budget (``hp["k"]`` of
    ``hp["block_size"]``), else :func:`scape.rules.gain_score`."""
    wait = reads_wait(hp["k"], hp["block_size"])
    return (gain_score_residual if wait else gain_score)(shard, hp)


def gain_select_auto(shard: ShardState, hp: dict, k: int, k_explore: int,
                     block_size: int) -> torch.Tensor:  # the top-k of gain_score_auto, fused
    return gain_select(shard, hp, k, k_explore, block_size, residual=reads_wait(k, block_size))


def auto_rule(trust: float) -> Rule:
    """``auto`` (``trust=0.5``, the library's default until the third workload) and ``robust``
    (0.25): masks by gain, with the summed wait up to sparsity 0.974, the agreement catch-up
    bounded at ``trust`` of the block's RMS, the owner's EMAs at 0.95 throughout."""
    return gain_selected(functools.partial(catchup_agree, trust=trust), gain_score_auto,
                         select=gain_select_auto, observe_select=observe_select_gain)


AUTO = auto_rule(0.5)
"""``auto``: the default rule before ``agree`` (20 dense steps, no ramp, as measured)."""

TRUST_LR = (0.5, 0.25)
"""``catchup_agree_trustlr``: the bound ``c`` at the peak lr and as the lr goes to 0."""


def agree_trust_rule(c: float) -> Rule:
    """The trust-bounded agreement rule at any bound ``c`` (``trust2``: 1/2, ``trust4``: 1/4)
    with masks by accumulated mass. All share their state, so an optimizer's ``rule`` may be
    swapped between them between steps (a bound scheduled with the lr)."""
    if isinstance(c, bool) or not (isinstance(c, (int, float)) and math.isfinite(c) and c > 0):
        raise ValueError(f"agree_trust_rule: c must be a finite float > 0, got {c!r}")
    return noise_sized(functools.partial(catchup_agree, trust=float(c)))


class TrustFollowsLr:
    """The agreement catch-up whose bound follows the learning rate: ``c = 1/4 + 1/4 * lr /
    lr_peak``, ``lr_peak`` the largest lr this shard has been stepped with (kept here per
    shard, not in checkpoints: a resumed run starts its peak again)."""

    def __init__(self) -> None:
        self.peak: dict[int, float] = {}

    def __call__(self, shard: ShardState, g: torch.Tensor, idx: torch.Tensor,
                 block_size: int, hp: dict, model_out: torch.Tensor) -> None:
        lr = hp["lr"]
        peak = max(self.peak.get(id(shard.master), 0.0), lr)
        self.peak[id(shard.master)] = peak
        hi, lo = TRUST_LR
        frac = lr / peak if lr > 0.0 else 1.0
        catchup_snr(shard, g, idx, block_size, hp, model_out, agree=True,
                    trust=lo + (hi - lo) * frac)


def gain_rule_beta(trust: float, beta: float) -> Rule:
    """``catchup_agree_trust<c>_gain`` whose gain and noise EMAs use the factor ``beta``
    (the default 0.95 spans about 39 steps, 0.9 about 19, 0.98 about 99): a shorter span
    reads a fresher, noisier mean; a longer one a staler, steadier mean."""
    base = gain_selected(functools.partial(catchup_agree, trust=trust),
                         functools.partial(gain_score, beta=beta),
                         select=functools.partial(gain_select, beta=beta))
    return dataclasses.replace(base,
                               observe=functools.partial(observe_local_moments, beta=beta))


class BetaAfterLrWarmup:
    """The fresh-gain rule whose owner's EMAs take ``rising`` (the default's 0.95) while the lr
    still rises (its warm-up, where the EMAs at 0.98 fell behind at the end of a 100-step one:
    docs/research.md) and ``beta`` once it stops. Whether the last update's lr rose above
    every earlier one is kept here per shard, as :class:`TrustFollowsLr` keeps its peak (not
    in checkpoints); the EMAs read it one step late (``observe`` runs before the update).
    ``wait``: the masks read the summed wait where ``auto``'s do (:func:`scape.rules.reads_wait`),
    else the fresh gain at every sparsity. ``trust_dense``: the catch-up's bound where that
    reading would be the wait (a mask of at least 1/39 of each block: sparsity up to 0.974),
    ``trust`` above it."""

    def __init__(self, trust: float, beta: float, rising: float = rules.NOISE_BETA,
                 wait: bool = False, trust_dense: float | None = None) -> None:
        self.trust, self.beta, self.rising, self.wait = trust, beta, rising, wait
        self.trust_dense = trust if trust_dense is None else trust_dense
        self.state: dict[int, tuple[float, bool]] = {}  # id(master) -> (peak lr, rose)

    def factor(self, shard: ShardState) -> float:
        return self.rising if self.state.get(id(shard.master), (0.0, True))[1] else self.beta

    def update(self, shard: ShardState, g: torch.Tensor, idx: torch.Tensor, block_size: int,
               hp: dict, model_out: torch.Tensor) -> None:
        key = id(shard.master)
        if key not in self.state:  # forget the shard with its tensor: ids are reused
            weakref.finalize(shard.master, self.state.pop, key, None)
        peak = self.state.get(key, (0.0, True))[0]
        self.state[key] = (max(peak, hp["lr"]), hp["lr"] > peak)
        wide = rules.reads_wait(idx.shape[-1], block_size)  # a mask of >= 1/39 of each block
        catchup_agree(shard, g, idx, block_size, hp, model_out,
                      trust=self.trust_dense if wide else self.trust)

    def observe(self, shard: ShardState, buf: torch.Tensor, error_feedback: bool) -> None:
        observe_local_moments(shard, buf, error_feedback, beta=self.factor(shard))

    def score(self, shard: ShardState, hp: dict) -> torch.Tensor:
        wait = self.wait and rules.reads_wait(hp["k"], hp["block_size"])
        return (rules.gain_score_residual if wait else gain_score)(shard, hp,
                                                                   beta=self.factor(shard))

    def select(self, shard: ShardState, hp: dict, k: int, k_explore: int,
               block_size: int) -> torch.Tensor:
        residual = self.wait and rules.reads_wait(k, block_size)
        return gain_select(shard, hp, k, k_explore, block_size, residual=residual,
                           beta=self.factor(shard))

    def rule(self) -> Rule:
        return dataclasses.replace(gain_selected(self.update, self.score, select=self.select),
                                   observe=self.observe)


def agree_above_rule(c: float | None) -> Rule:
    """``agree`` with the catch-up's bound ``c`` of the block's RMS above sparsity 0.974 in
    place of :data:`scape.rules.TRUST`'s 1/2 (1/8 up to it, as ``agree``); ``None``: no bound
    at either (docs/research.md, "The default judged on the third workload")."""

    def update(shard: ShardState, g: torch.Tensor, idx: torch.Tensor, block_size: int,
               hp: dict, model_out: torch.Tensor) -> None:
        wide = rules.reads_wait(idx.shape[-1], block_size)
        trust = None if c is None else (rules.TRUST[0] if wide else c)
        catchup_agree(shard, g, idx, block_size, hp, model_out, trust=trust)

    return dataclasses.replace(RULES["agree"], update=update)


TRUST_DECAY_CAP = 1.0
"""``early_decay``: the largest bound, in its block's RMS, the lr's decay widens it to."""


def early_decay_update(shard: ShardState, g: torch.Tensor, idx: torch.Tensor, block_size: int,
                       hp: dict, model_out: torch.Tensor) -> None:
    """``early``'s catch-up with its bound widened as the lr falls from its peak: ``c =
    min(TRUST_DECAY_CAP, c_early * lr_peak / lr)`` (``c_early`` of :data:`scape.rules.
    TRUST`; the shard's :attr:`~scape.rules.ShardState.lr_peak`, set before the update
    and checkpointed). At the peak, and at any flat lr, it is ``early``; as the cosine falls
    the bound in steps, ``c * rms_b / lr``, grows as ``1 / lr^2`` instead of ``1 / lr``."""
    base = rules.trust_bound(idx.shape[-1], block_size)
    lr, peak = hp["lr"], shard.lr_peak
    trust = min(max(base, TRUST_DECAY_CAP), base * peak / lr) if 0.0 < lr < peak else base
    catchup_agree(shard, g, idx, block_size, hp, model_out, trust=trust)


LEAD = 0.5
"""``early_lead``: the lead, in the steps of the coordinate's last wait."""


def lead_update(shard: ShardState, g: torch.Tensor, idx: torch.Tensor, block_size: int,
                hp: dict, model_out: torch.Tensor, lead: float = LEAD) -> None:
    """``early``'s catch-up, then the sent coordinates put ahead along their new step.

    Between two sends a coordinate stands where its last catch-up left it while dense AdamS
    moves on: it trails dense AdamS's trajectory by half its wait on the mean. Here the
    catch-up starts from the coordinate's tracked position (``extra["lead"]``, the offset it
    was given at its last send, taken off first), and the coordinate is then put
    ``lead * (a + 1) * frac`` normalized steps ahead (``a + 1`` its wait, the predictor of
    its next; ``frac`` the sign agreement of :func:`scape.rules.catchup_agree`, here from
    the updated moment), at most
    ``early``'s bound, so that it is on dense AdamS's trajectory in the middle of its next
    wait. The offset is kept for the next send; the weight decay applies to the tracked
    position. ``lead=0`` is ``early`` bit for bit. Torch ops (not fused)."""
    flat = mask_positions(idx, block_size)
    offset = shard.extra["lead"]
    a1 = shard.age.index_select(0, flat).float().add_(1.0)
    shard.master.index_add_(0, flat, offset.index_select(0, flat), alpha=-1.0)
    trust = rules.trust_bound(idx.shape[-1], block_size)
    catchup_agree(shard, g, idx, block_size, hp, model_out, trust=trust)
    if lead == 0.0 or hp["lr"] <= 0.0:
        offset.index_fill_(0, flat, 0.0)
        return
    m = shard.m.index_select(0, flat)
    denom, sigma2, mu2 = arrived_mean(shard, flat, m, g.float() / a1, a1, hp)
    steps = a1.mul_(sign_agreement(sigma2, mu2, hp["beta1"])).mul_(lead)
    steps = torch.minimum(steps, trust_reach(shard.master, block_size, idx.shape[1], trust,
                                             hp["lr"]))
    ahead = m.div_(denom).mul_(steps).mul_(-hp["lr"])
    p = shard.master.index_select(0, flat).add_(ahead)
    shard.master.index_copy_(0, flat, p)
    offset.index_copy_(0, flat, ahead)
    model_out.copy_(p)


def early_lead_rule(lead: float = LEAD) -> Rule:
    """``early`` with :func:`lead_update` (its three passes before the take unfused: the
    update reads the ages before they advance)."""
    return dataclasses.replace(RULES["agree"], update=functools.partial(lead_update, lead=lead),
                               observe_select=None, extra=GAIN_STATE + ("lead",),
                               embeddings_apart=False)


STEADY_FLOOR = 0.25
"""``early_steady``: the least ``1 - frac`` its bound divides by (the widest: 4x ``early``'s)."""


def steady_update(shard: ShardState, g: torch.Tensor, idx: torch.Tensor, block_size: int,
                  hp: dict, model_out: torch.Tensor, floor: float = STEADY_FLOOR,
                  after_rise: bool = False) -> None:
    """``early``'s catch-up whose bound widens with the sent coordinate's own agreement.

    The probe (:mod:`bench.research.probe`) found the token embedding the steadiest matrix at
    0.99 (it asks for 60-68 of its 100 steps, the others 15-25) and the half bound cutting
    12-39% of its sends. Here the bound is ``max(sqrt(a + 1), c * rms_b / lr)`` with ``c =
    c_early / max(1 - frac, floor)``, ``frac`` the sign agreement that sizes the catch-up
    (:func:`scape.rules.catchup_agree`): a coin-toss coordinate keeps about ``early``'s bound,
    a steady one gets up to ``1 / floor`` times it. ``floor = 1`` is ``early`` bit for bit
    (through the unfused path). ``after_rise``: ``early``'s bound while the lr still rises
    (``shard.lr_rose``), the wider one after. Torch ops, the order of
    :func:`scape.rules.catchup_snr`."""
    flat = mask_positions(idx, block_size)
    p_sel, m_sel = shard.master.index_select(0, flat), shard.m.index_select(0, flat)
    a1 = shard.age.index_select(0, flat).float().add_(1.0)
    gbar = g.float() / a1
    denom, sigma2, mu2 = arrived_mean(shard, flat, m_sel, gbar, a1, hp)
    frac = sign_agreement(sigma2, mu2, hp["beta1"])
    steps = torch.maximum(a1 * frac, a1.pow(0.0))
    if hp["lr"] > 0.0:
        trust = rules.trust_bound(idx.shape[-1], block_size)
        reach = trust_reach(shard.master, block_size, idx.shape[1], trust, hp["lr"])
        if floor < 1.0 and not (after_rise and shard.lr_rose):
            reach = reach / (1.0 - frac).clamp_(min=floor)
        steps = torch.minimum(steps, torch.maximum(a1.sqrt(), reach))
    move_selected(shard, flat, p_sel, m_sel, gbar, a1, denom, steps, hp, model_out)


def early_steady_rule(floor: float = STEADY_FLOOR, after_rise: bool = False) -> Rule:
    """``early`` with :func:`steady_update` (its passes before the take unfused: the update
    reads the ages before they advance)."""
    update = functools.partial(steady_update, floor=floor, after_rise=after_rise)
    return dataclasses.replace(RULES["agree"], update=update, observe_select=None,
                               embeddings_apart=False)


RESEARCH_RULES: dict[str, Rule] = {
    "auto": AUTO,
    "robust": auto_rule(0.25),
    "early": RULES["agree"],  # the default's name while it was research
    "lazy_accum": Rule(lazy, accumulated_score),
    "catchup_mean": Rule(catchup_mean),
    "catchup_accum": Rule(catchup_mean, accumulated_score),
    "catchup_sqrt": Rule(catchup_sqrt),
    "catchup_sqrt_accum": RULES["sqrt"],
    "catchup_snr_accum": noise_sized(catchup_snr),
    "catchup_agree_accum": noise_sized(catchup_agree),
    "catchup_snr_sqrt_accum": noise_sized(functools.partial(catchup_snr, floor=0.5)),
    "catchup_agree_sqrt_accum": noise_sized(
        functools.partial(catchup_snr, floor=0.5, agree=True)),
    "catchup_agree_cap_accum": noise_sized(functools.partial(catchup_snr, agree=True, cap=0.5)),
    "catchup_agree_trust_accum": agree_trust_rule(1.0),
    "catchup_agree_trust2_accum": agree_trust_rule(0.5),
    "catchup_agree_trust4_accum": agree_trust_rule(0.25),
    "catchup_agree_trustlr_accum": noise_sized(TrustFollowsLr()),
    "catchup_agree_trust2_gain": gain_selected(functools.partial(catchup_agree, trust=0.5),
                                               gain_score),
    "catchup_agree_trust4_gain": gain_selected(functools.partial(catchup_agree, trust=0.25),
                                               gain_score),
    "catchup_agree_trust2_gainr": gain_selected(functools.partial(catchup_agree, trust=0.5)),
    "catchup_agree_trust_gain": gain_selected(functools.partial(catchup_agree, trust=1.0),
                                              gain_score),
    "catchup_agree_gain": gain_selected(catchup_agree, gain_score),
    "catchup_agree_trust2_gain_b90": gain_rule_beta(0.5, 0.9),
    "catchup_agree_trust2_gain_b98": gain_rule_beta(0.5, 0.98),
    "catchup_agree_trust2_gain_b99": gain_rule_beta(0.5, 0.99),
    "catchup_agree_trust4_gain_b98": gain_rule_beta(0.25, 0.98),
    "catchup_agree_trust2_gain_b98w": BetaAfterLrWarmup(0.5, 0.98).rule(),
    "auto_b98w": BetaAfterLrWarmup(0.5, 0.98, wait=True).rule(),
    "catchup_agree_trust4_gain_b98w": BetaAfterLrWarmup(0.25, 0.98).rule(),
    "catchup_agree_trust24_gain_b98w": BetaAfterLrWarmup(0.5, 0.98, trust_dense=0.25).rule(),
    "catchup_agree_trust26_gain_b98w": BetaAfterLrWarmup(0.5, 0.98, trust_dense=1 / 6).rule(),
    "catchup_agree_trust28_gain_b98w": BetaAfterLrWarmup(0.5, 0.98, trust_dense=0.125).rule(),
    "catchup_agree_trust2cap_gain_b98w": BetaAfterLrWarmup(0.5, 0.98, trust_dense=0.0).rule(),
    "early_decay": dataclasses.replace(RULES["agree"], update=early_decay_update,
                                       embeddings_apart=False),
    "early_lead": early_lead_rule(),
    "early_steady": early_steady_rule(),
    "early_steady_w": early_steady_rule(0.5, after_rise=True),  # at most 2x, after the rise
    "early_steady1": early_steady_rule(1.0),  # early through the same unfused path: the check
    "early_probe": PROBE,  # early, recording what its catch-ups did (bench.research.probe)
    "early_lead0": early_lead_rule(0.0),  # early through the same unfused path: the check
    # the default with its pass before the take split into the three ops (observe, then the
    # catch-up's own ages, then select): the same steps bit for bit, the check of the fusion
    "auto_three_passes": dataclasses.replace(AUTO, observe_select=None),
    "catchup_agree_trust4_gainr": gain_selected(functools.partial(catchup_agree,
                                                                  trust=0.25)),
    # agree with another bound above sparsity 0.974 (1/8 up to it, as agree), or none at all,
    # and agree without attach's embedding share: the third workload's ablation
    "agree_trust48": agree_above_rule(0.25),
    "agree_trust18": agree_above_rule(1.0),
    "agree_unbounded": agree_above_rule(None),
    "agree_together": dataclasses.replace(RULES["agree"], embeddings_apart=False),
}
"""Every research rule by name (registered on import)."""


def with_options(name: str, *, explore: float | None = None,
                 error_feedback: bool | None = None) -> str:
    """Register the rule ``name`` with another ``explore`` or ``error_feedback`` (the
    schedule rows of the ablation) and return the new name, e.g. ``lazy-explore0.2`` or
    ``lazy-noef``. The same options give the same name; registering it again is a no-op."""
    base = RULES[name] if name in RULES else rules.get(name)
    changes: dict[str, Any] = {}
    suffix = ""
    if explore is not None:
        changes["explore"] = float(explore)
        suffix += f"-explore{explore:g}"
    if error_feedback is not None:
        changes["error_feedback"] = bool(error_feedback)
        suffix += "" if error_feedback else "-noef"
    if not changes:
        return name
    new = f"{name}{suffix}"
    if new not in RULES:
        rules.register(new, dataclasses.replace(base, **changes))
    return new


OPTION_RULES: dict[str, tuple[dict[str, Any], ...]] = {
    "lazy": ({"explore": 0.0}, {"explore": 0.05}, {"explore": 0.2}, {"error_feedback": False}),
    "catchup_accum": ({"explore": 0.0}, {"explore": 0.05}, {"explore": 0.2},
                      {"error_feedback": False}),
    "catchup_agree_trust2_accum": ({"explore": 1.0}, {"explore": 0.2},
                                   {"explore": 0.2, "error_feedback": False}),
    "catchup_agree_trust2_gain": ({"explore": 1.0},),
    "auto": ({"explore": 0.2},),
}
"""The rules made by :func:`with_options` that the research's rows name (``lazy-explore0.2``,
``catchup_accum-noef``, ``auto-explore0.2``, ...), registered on import like the others, so a
rank of the runner builds them by name. A rule made by :func:`with_options` in one process
only exists there: add its options here to name it in a run."""


for _name, _rule in RESEARCH_RULES.items():
    if _name not in RULES:
        rules.register(_name, _rule)
for _name, _options in OPTION_RULES.items():
    for _opts in _options:
        with_options(_name, **_opts)
