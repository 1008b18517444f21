"""The rows of the convergence ablation (:mod:`bench.research.convergence`): one dict per variant.

A row is a dict; its name, ``<rule>[-<change>]@<sparsity>``, is a label made from the data
(never parsed; ``--variants`` selects by the part before ``@``, the row's key here): a rule
(the built-ins and the research rules of :mod:`bench.research.rules`) at the default schedule,
a schedule change (explore, dense warm-up, dense refresh, no error feedback), a per-group
sparsity (:data:`GROUP_RULES`), a sparsity warm-up (:data:`RAMP_RULES`), a measured per-group
split (:data:`AUTO_RULES`, :class:`Allotment`) or a transform domain
(:mod:`bench.research.rotate`). The keys are those
:func:`bench.research.convergence_train.run_config` maps to a ``RunConfig``: ``sparsity``,
``warmup_steps``, ``update`` and optionally ``group_sparsity``, ``ramp``, ``allot``,
``allot_floor``, ``transform``, ``trust_lr``, ``dense_every``. A row that changes ``explore``
or drops error feedback names a rule made by :func:`bench.research.rules.with_options` in
``update`` (``lazy-explore0.2``, ``lazy-noef``), registered on import
(:data:`bench.research.rules.OPTION_RULES`) in every process.

The research schedules run as ``RunConfig.hooks`` of the engine's loop: :class:`TrustLr`,
:class:`Allotment`, :class:`Diagnostics` here and :class:`bench.research.rotate.Rotation`.
"""
from __future__ import annotations

from typing import Any

from bench.research import allot
from bench.research.rules import RESEARCH_RULES, agree_trust_rule, with_options
from scape import rules, sparsity_ramp

TRAINING_KEYS = ("name", "optimizer", "lr", "group_sparsity", "transform", "ramp", "allot",
                 "allot_floor", "trust_lr")
"""Keys of a row that the training loop reads; the others go to the optimizer."""

ALIASES = {name: builtin for name, rule in RESEARCH_RULES.items()
           for builtin in rules.BUILTIN if rules.RULES[builtin] is rule}
"""The research names of the built-in rules (``catchup_agree_trust2_gainr``: ``auto``)."""

RULE_NAMES = tuple(dict.fromkeys([*rules.BUILTIN, *RESEARCH_RULES]))
"""The rules of the plain ``<rule>@<sparsity>`` rows: the built-ins, then the research rules
(their aliases of the built-ins run only when named with ``--variants``)."""

GROUP_RULES = ("catchup_sqrt_accum", "catchup_agree_accum", "catchup_agree_sqrt_accum",
               "catchup_agree_cap_accum", "catchup_agree_trust_accum",
               "catchup_agree_trust2_accum", "catchup_agree_trust4_accum", "catchup_snr_accum",
               "lazy")
"""Rules measured with per-group sparsity and in a transform domain:

- ``-embed0.9`` puts the embedding matrices (token, position; the tied head) in their own group
  at sparsity 0.9 (``-embed0.95``, ``-embed0.97`` likewise); ``-embed0`` keeps them dense;
- ``-vec0`` keeps the vectors (norms, biases) dense, the embeddings at the row's sparsity;
- ``-tok0.9`` / ``-pos0.9``: only the token embedding (the tied head) / only the position
  embedding at 0.9;
- ``-head0.9``: only an untied output head at 0.9 (``--model small-untied``, where ``-tok0.9``
  is the input token embedding alone); ``-tokhead0.9``: both;
- ``-dct64`` / ``-hadamard128`` train the weight matrices in a transform domain
  (:mod:`bench.research.rotate`: DeMo-style selection of transform coefficients)."""


RAMP_RULES = ("catchup_agree_trust4_accum", "catchup_agree_trust2_accum", "catchup_agree_accum",
              "catchup_sqrt_accum")
RAMPS = ((0.9, 0.1), (0.9, 0.2), (0.95, 0.2), (0.9, 0.4))
"""``-ramp<s0>x<f>``: a sparsity warm-up of every sparse group from ``s0`` to its own sparsity
(a group already at or below ``s0`` stays there) over the first ``f * steps`` sparse steps,
density falling geometrically: the engine's ``RunConfig.sparsity_ramp``
(:class:`scape.SparsityRamp`; sparse step ``j`` sends the mask made at
``scape.sparsity_ramp(j)``, one step ahead of the hand-written ramp of the ablation's own loop
before it trained through the engine)."""
EARLY_RAMP = (0.5, 0.01)
"""``early-ramp0.5x0.01``: ``update="early"`` behind one dense step (``--warmup 1``) and a
ramp from 0.5 over 1% of the run (20 steps of 2,000), as the newcomer workloads ran it."""
SHORT_RAMPS = ((0.5, 0.02), (0.7, 0.02))
"""Hypothesis 13: a short ramp from a low sparsity in place of most dense warm-up steps (run
with ``--warmup 2``), on the embedding split (``<rule>-embed<e>-ramp<s0>x<f>``)."""

AUTO_RULES = ("catchup_agree_trust2_accum", "catchup_agree_trust4_accum")
AUTO_POWERS = (1.0, 2.0)
FRESH_POWERS = (1.0, 2.0, 3.0)
GAIN_POWERS = (1.0, 1.5, 2.0)
METER_BETAS = (0.99,)
FLOORS = (0.5,)
"""``-auto<p>``: every group (the embeddings and the position embedding in groups of their
own) at the row's sparsity overall, split by :func:`bench.research.allot.allot` with
``power=p`` from the groups' mean sign agreement read from ``m``
(:func:`bench.research.allot.group_agreement`), measured at the first sparse step and every
100 after (``allot=(power, every, "m")``); ``-autof<p>`` reads it from a fresh gradient mean
instead (:class:`bench.research.allot.AgreementMeter`, ``"fresh"``); ``-autog<p>`` splits by
the groups' expected loss decrease per step from the same meter
(:meth:`bench.research.allot.AgreementMeter.gain`, ``"gain"``: hypothesis 17, at
:data:`GAIN_POWERS`; ``-autog<p>-beta<b>`` with the meter's EMA at ``b`` of
:data:`METER_BETAS`, not the noise estimate's 0.95: ``allot=(p, 100, "gain", b)``);
``-auto<p>-ramp<s0>x<f>`` ramps the overall sparsity as :data:`SHORT_RAMPS` and splits it the
same way; ``-autog<p>-floor<fl>-ramp<s0>x<f>`` keeps every group's density at least ``fl`` of
the overall one (``allot(floor=fl)``, ``allot_floor``; :data:`FLOORS`).

The ``-split`` rows of hypotheses 18 and 19 made the ``-autog1`` split inside the optimizer,
which no longer has one: ``<rule>-split`` of :data:`AUTO_RULES` is ``<rule>-autog1`` here (the
split made from outside, applied from the mask after the reading), and the other ``-split``
rows became ``-autog1`` rows of the same rules (:data:`GAIN_RULES`, the ``-trustlr`` rows)."""


GAIN_RULES = ("catchup_agree_trust2_gain", "catchup_agree_trust4_gain")
"""Hypothesis 19: the masks by each coordinate's fresh gain (:func:`scape.rules.gain_score`);
``<rule>@<sp>`` every group at one sparsity (the embedding matrices in the decay group),
``<rule>-autog1@<sp>`` the groups as the ``-auto`` rows, split by gain at power 1. The control
``<rule>-explore1@<sp>`` takes every mask by age alone: each coordinate in turn."""


class TrustLr:
    """The ``RunConfig.hooks`` factory of a ``-trustlr`` row (``trust_lr=(c_hi, c_lo)``):
    before every step, the agreement catch-up bounded at ``c_hi`` at the row's peak lr,
    falling with the step's lr towards ``c_lo`` at 0."""

    def __init__(self, cfg: Any, module: Any, opt: Any, c_hi: float, c_lo: float) -> None:
        self.opt, self.peak, self.c_hi, self.c_lo = opt, cfg.lr, c_hi, c_lo

    def before_step(self, step: int) -> None:
        lr = self.opt.param_groups[0]["lr"]  # the engine's lr_at(step)
        self.opt.rule = agree_trust_rule(self.c_lo + (self.c_hi - self.c_lo) * lr / self.peak)


class Allotment:
    """The ``RunConfig.hooks`` factory of an ``-auto`` row (``allot=(power, every, source[,
    beta])``, ``allot_floor``): before every sparse step (0 = the first after the dense
    warm-up) it re-measures the groups' signal (agreement read from ``m``, or from a fresh
    gradient mean, or gain) every ``every`` sparse steps and writes the split of the overall
    sparsity into the groups; the overall sparsity follows ``RunConfig.sparsity_ramp`` as the
    engine's :class:`scape.SparsityRamp` does (sparse step ``j`` at ``scape.sparsity_ramp(j +
    1)``). ``result()``: ``history``, ``(sparse_step, signal, sparsity)`` at each
    measurement."""

    def __init__(self, cfg: Any, module: Any, opt: Any, power: float, every: int,
                 source: str, beta: float | None = None, floor: float = 0.0) -> None:
        self.cfg, self.opt = cfg, opt
        self.power, self.every, self.source, self.floor = power, every, source, floor
        self.meter = allot.AgreementMeter(opt, beta) if source in ("fresh", "gain") else None
        self.numels = allot.group_numels(opt)
        self.signal: dict[int, float] = {}
        self.history: list[tuple[int, dict[int, float], dict[int, float]]] = []

    @staticmethod
    def check(cfg: Any, power: float, every: int, source: str, beta: float | None = None,
              floor: float = 0.0) -> None:
        if cfg.optimizer != "scape" or not cfg.group_sparsity:
            raise ValueError("the -auto rows split a scape row's sparsity over its groups: "
                             "optimizer 'scape' with group_sparsity")
        if source not in ("m", "fresh", "gain"):
            raise ValueError(f"allot source must be 'm', 'fresh' or 'gain', got {source!r}")

    def after_backward(self, step: int) -> None:
        """Every step, warm-up included."""
        if self.meter is not None:
            self.meter.observe()

    def before_step(self, step: int) -> None:
        sparse_step = step - self.opt.warmup_steps
        if sparse_step < 0:
            return
        overall = self.cfg.sparsity
        if self.cfg.sparsity_ramp is not None:
            s0, ramp_steps = self.cfg.sparsity_ramp
            overall = sparsity_ramp(sparse_step + 1, start=min(s0, overall), end=overall,
                                    ramp_steps=ramp_steps)
        measure = sparse_step % self.every == 0
        if measure:
            self.signal = allot.group_agreement(self.opt) if self.meter is None \
                else self.meter.gain() if self.source == "gain" else self.meter.agreement()
        split = allot.allot(self.signal, self.numels, overall, self.opt.block_size,
                            power=self.power, floor=self.floor)
        allot.apply_allotment(self.opt, split)
        if measure:
            self.history.append((sparse_step, dict(self.signal), split))

    def result(self) -> dict[str, Any]:
        return {"history": self.history}


class Diagnostics:
    """The ``RunConfig.hooks`` factory that reports the optimizer's diagnostics of its first
    bucket at the end of the run (``result()``; the residual norm of SCAPE's take)."""

    def __init__(self, cfg: Any, module: Any, opt: Any) -> None:
        self.opt = opt

    def result(self) -> dict[str, float]:
        first = getattr(self.opt, "diagnostics", [])[:1]
        return {k: float(v) for d in first for k, v in d.items()}


def variants(sparsities: list[float], names: list[str] | None,
             warmup: int = 20) -> list[dict[str, Any]]:
    """The ablation rows (their lr is the dense sweep's choice, filled in by ``main``).

    Per sparsity: every rule of :data:`RULE_NAMES` at the default schedule, and the schedule
    variants (explore, warm-up, dense refresh, error feedback off) for both the plain ``lazy``
    rule and ``catchup_accum``, the per-group sparsity rows of :data:`GROUP_RULES`, the
    sparsity warm-up rows of :data:`RAMP_RULES` and the measured splits of
    :data:`AUTO_RULES`. A row is named ``<rule>[-<schedule change>]@<sparsity>``; ``names``
    keeps the rows whose name before ``@`` it lists (None: every row but the research aliases
    of the built-in rules, which repeat them).
    """
    rows: list[dict[str, Any]] = []
    for sp in sparsities:
        base = dict(sparsity=sp, warmup_steps=warmup)
        rows += [dict(base, row=f"{rule}", update=rule) for rule in RULE_NAMES]
        for rule in ("lazy", "catchup_accum"):
            rows += [
                dict(base, row=f"{rule}-explore0", update=with_options(rule, explore=0.0)),
                dict(base, row=f"{rule}-explore0.05",
                     update=with_options(rule, explore=0.05)),
                dict(base, row=f"{rule}-explore0.2",
                     update=with_options(rule, explore=0.2)),
                dict(base, row=f"{rule}-warmup10", update=rule, warmup_steps=10),
                dict(base, row=f"{rule}-warmup100", update=rule, warmup_steps=100),
                dict(base, row=f"{rule}-dense_every50", update=rule, dense_every=50),
                dict(base, row=f"{rule}-no_ef",
                     update=with_options(rule, error_feedback=False)),
            ]
        for rule in GROUP_RULES:  # where the gap lives: the embedding matrices (tied head)
            rows += [dict(base, row=f"{rule}-embed{e}", update=rule,
                          group_sparsity={"embed": e}) for e in (0.9, 0.95, 0.97)]
            rows += [
                dict(base, row=f"{rule}-embed0", update=rule,
                     group_sparsity={"embed": 0.0}),
                dict(base, row=f"{rule}-vec0", update=rule,
                     group_sparsity={"embed": sp, "no_decay": 0.0}),
                dict(base, row=f"{rule}-dct64", update=rule, transform=("dct", 64)),
                dict(base, row=f"{rule}-hadamard128", update=rule,
                     transform=("hadamard", 128)),
                dict(base, row=f"{rule}-tok0.9", update=rule,
                     group_sparsity={"embed": 0.9, "pos": sp}),
                dict(base, row=f"{rule}-pos0.9", update=rule,
                     group_sparsity={"embed": sp, "pos": 0.9}),
                dict(base, row=f"{rule}-head0.9", update=rule,
                     group_sparsity={"head": 0.9}),
                dict(base, row=f"{rule}-tokhead0.9", update=rule,
                     group_sparsity={"embed": 0.9, "pos": sp, "head": 0.9}),
            ]
        for rule in RAMP_RULES:  # hypothesis 11: spend the bytes early
            rows += [dict(base, row=f"{rule}-ramp{s0:g}x{frac:g}", update=rule,
                          ramp=(s0, frac)) for s0, frac in RAMPS if s0 < sp]
            rows += [dict(base, row=f"{rule}-embed{e}-ramp{s0:g}x{frac:g}", update=rule,
                          group_sparsity={"embed": e}, ramp=(s0, frac))
                     for e in (0.9, 0.95) for s0, frac in SHORT_RAMPS if s0 < min(e, sp)]
        s0, frac = EARLY_RAMP
        rows.append(dict(base, row=f"early-ramp{s0:g}x{frac:g}", update="early",
                         ramp=EARLY_RAMP))
        split_groups = {"embed": sp, "pos": sp}
        for rule in AUTO_RULES:  # hypothesis 16: the split of hypothesis 14, measured
            for power, source in [(p, "m") for p in AUTO_POWERS] + \
                    [(p, "fresh") for p in FRESH_POWERS] + [(p, "gain") for p in GAIN_POWERS]:
                tag = {"m": "auto", "fresh": "autof", "gain": "autog"}[source]
                auto = dict(base, row=f"{rule}-{tag}{power:g}", update=rule,
                            group_sparsity=split_groups, allot=(power, 100, source))
                rows += [auto] + [dict(auto, row=f"{rule}-{tag}{power:g}-ramp{s0:g}x{f:g}",
                                       ramp=(s0, f)) for s0, f in SHORT_RAMPS if s0 < sp]
                if source == "gain":
                    rows += [dict(auto, row=f"{rule}-{tag}{power:g}-beta{b:g}",
                                  allot=(power, 100, source, b)) for b in METER_BETAS]
                    rows += [dict(auto, row=f"{rule}-{tag}{power:g}-floor{fl:g}"
                                  f"-ramp{s0:g}x{f:g}", allot_floor=fl, ramp=(s0, f))
                             for fl in FLOORS for s0, f in SHORT_RAMPS if s0 < sp]
        for rule in GAIN_RULES:  # hypothesis 19: masks by fresh gain, with the split too
            rows.append(dict(base, row=f"{rule}-autog1", update=rule,
                             group_sparsity=split_groups, allot=(1.0, 100, "gain")))
        for rule in ("catchup_agree_trust2_accum", "catchup_agree_trust2_gain"):
            # its control: every coordinate in turn (the oldest first), no score at all
            rows.append(dict(base, row=f"{rule}-explore1",
                             update=with_options(rule, explore=1.0)))
        # hypothesis 18: the bound at c = 1/2 at the peak lr, falling with it towards 1/4; set
        # by the row from the schedule's peak (-trustlr), or by the research rule from the
        # largest lr so far (catchup_agree_trustlr_accum); both with the gain split
        rows.append(dict(base, row="catchup_agree_trust2_accum-autog1-trustlr",
                         update="catchup_agree_trust2_accum", group_sparsity=split_groups,
                         allot=(1.0, 100, "gain"), trust_lr=(0.5, 0.25)))
        rows.append(dict(base, row="catchup_agree_trustlr_accum-autog1",
                         update="catchup_agree_trustlr_accum", group_sparsity=split_groups,
                         allot=(1.0, 100, "gain")))
    keep = [r for r in rows if (r["row"] in names if names else r["row"] not in ALIASES)]
    return [{"name": f"{r.pop('row')}@{r['sparsity']}", **r} for r in keep]
