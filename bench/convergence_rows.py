"""The rows of the convergence ablation (:mod:`bench.convergence`): one dict per variant.

A row is ``<rule>[-<change>]@<sparsity>``: a rule of :data:`scape.rules.RULES` at the default
schedule, a schedule change (explore, dense warm-up, dense refresh, no error feedback), a
per-group sparsity (:data:`GROUP_RULES`) or a sparsity warm-up (:data:`RAMP_RULES`). The keys
are those :func:`bench.convergence.train` reads: ``sparsity``, ``warmup_steps``, ``explore``,
``update`` and optionally ``group_sparsity``, ``ramp``, ``allot``, ``transform``, ``dense_every``,
``error_feedback``.
"""
from __future__ import annotations

from typing import Any

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
  (:mod:`bench.rotate`: DeMo-style selection of transform coefficients)."""


RAMP_RULES = ("catchup_agree_trust4_accum", "catchup_agree_trust2_accum", "catchup_agree_accum",
              "catchup_sqrt_accum")
RAMPS = ((0.9, 0.1), (0.9, 0.2), (0.95, 0.2), (0.9, 0.4))
"""``-ramp<s0>x<f>``: a sparsity warm-up (:func:`scape.sparsity_ramp`) of every sparse group
from ``s0`` to its own sparsity (a group already at or below ``s0`` stays there) over the
first ``f * steps`` sparse steps, density falling geometrically."""
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
own) at the row's sparsity overall, split by :func:`scape.allot.allot` with ``power=p`` from
the groups' mean sign agreement read from ``m`` (:func:`scape.allot.group_agreement`),
measured at the first sparse step and every 100 after (``allot=(power, every, "m")``);
``-autof<p>`` reads it from a fresh gradient mean instead (:class:`scape.allot.AgreementMeter`,
``"fresh"``); ``-autog<p>`` splits by the groups' expected loss decrease per step from the
same meter (:meth:`scape.allot.AgreementMeter.gain`, ``"gain"``: hypothesis 17, at
:data:`GAIN_POWERS`; ``-autog<p>-beta<b>`` with the meter's EMA at ``b`` of
:data:`METER_BETAS`, not the noise estimate's 0.95: ``allot=(p, 100, "gain", b)``);
``-auto<p>-ramp<s0>x<f>`` ramps the overall sparsity as :data:`SHORT_RAMPS` and splits it the
same way; ``-autog<p>-floor<fl>-ramp<s0>x<f>`` keeps every group's density at least ``fl`` of
the overall one (``allot(floor=fl)``, ``allot_floor``; :data:`FLOORS`). ``-split`` is the
``-autog1`` split made by the optimizer (``SCAPE(split="gain")``): read at the first sparse
mask and every 100 after, applied from the mask it is read at (``-autog1`` from the mask
after), its meter checkpointed, and it runs on more than one process too."""


GAIN_RULES = ("catchup_agree_trust2_gain", "catchup_agree_trust4_gain")
"""Hypothesis 19: the masks by each coordinate's fresh gain (:func:`scape.rules.gain_score`);
``<rule>@<sp>`` every group at one sparsity (the embedding matrices in the decay group),
``<rule>-split@<sp>`` the groups as the ``-split`` rows, split by the optimizer. The control
``<rule>-explore1@<sp>`` takes every mask by age alone: each coordinate in turn."""


def ramp_sparsity(variant: dict[str, Any], base: float, sparse_step: int, steps: int) -> float:
    """A group's sparsity at sparse step ``sparse_step`` (0 = the first after the dense
    warm-up) of a ``-ramp`` row whose group is built at ``base``."""
    from scape import sparsity_ramp

    s0, frac = variant["ramp"]
    return sparsity_ramp(sparse_step, start=min(s0, base), end=base,
                         ramp_steps=round(frac * steps))


class Allotment:
    """The automatic split of an ``-auto`` row, called once per sparse step (0 = the first):
    re-measures the groups' signal (agreement, or gain on an ``-autog`` row) every ``every``
    sparse steps and writes the split of the overall sparsity (ramped on a ``-ramp`` row) into
    the groups. ``history`` keeps ``(sparse_step, signal, sparsity)`` at each measurement."""

    def __init__(self, opt: Any, variant: dict[str, Any], steps: int) -> None:
        from scape import allot

        self.allot, self.opt, self.variant, self.steps = allot, opt, variant, steps
        self.power, self.every, source, *beta = variant["allot"]
        self.source = source
        self.meter = allot.AgreementMeter(opt, *beta) if source in ("fresh", "gain") else None
        self.numels = allot.group_numels(opt)
        self.signal: dict[int, float] = {}
        self.history: list[tuple[int, dict[int, float], dict[int, float]]] = []

    def observe(self) -> None:
        """After the backward pass, before ``opt.step()`` (every step, warm-up included)."""
        if self.meter is not None:
            self.meter.observe()

    def __call__(self, sparse_step: int) -> None:
        overall = self.variant["sparsity"]
        if self.variant.get("ramp"):
            overall = ramp_sparsity(self.variant, overall, sparse_step, self.steps)
        measure = sparse_step % self.every == 0
        if measure:
            self.signal = self.allot.group_agreement(self.opt) if self.meter is None \
                else self.meter.gain() if self.source == "gain" else self.meter.agreement()
        split = self.allot.allot(self.signal, self.numels, overall, self.opt.block_size,
                                 power=self.power, floor=self.variant.get("allot_floor", 0.0))
        self.allot.apply_allotment(self.opt, split)
        if measure:
            self.history.append((sparse_step, dict(self.signal), split))


def variants(sparsities: list[float], names: list[str] | None,
             warmup: int = 20) -> list[dict[str, Any]]:
    """The ablation rows (their lr is the dense sweep's choice, filled in by ``main``).

    Per sparsity: every rule of :data:`scape.rules.RULES` at the default schedule, and the
    schedule variants (explore, warm-up, dense refresh, error feedback off) for both the
    plain ``lazy`` rule and ``catchup_accum`` (the library's default when those rows were
    measured; ``catchup_agree_trust4_accum`` is now with one sparse group), the per-group
    sparsity rows of :data:`GROUP_RULES` and the sparsity warm-up rows of :data:`RAMP_RULES`.
    A row is named
    ``<rule>[-<schedule change>]@<sparsity>``. Every row sends each group at its own sparsity
    (``split=None``, whatever the optimizer's default) except the ``-split`` rows.
    """
    from scape.rules import RULES

    rows: list[dict[str, Any]] = []
    for sp in sparsities:
        base = dict(sparsity=sp, warmup_steps=warmup, explore=0.1, split=None)
        rows += [dict(base, name=f"{rule}@{sp}", update=rule) for rule in RULES]
        for rule in ("lazy", "catchup_accum"):
            rows += [
                dict(base, name=f"{rule}-explore0@{sp}", update=rule, explore=0.0),
                dict(base, name=f"{rule}-explore0.05@{sp}", update=rule, explore=0.05),
                dict(base, name=f"{rule}-explore0.2@{sp}", update=rule, explore=0.2),
                dict(base, name=f"{rule}-warmup10@{sp}", update=rule, warmup_steps=10),
                dict(base, name=f"{rule}-warmup100@{sp}", update=rule, warmup_steps=100),
                dict(base, name=f"{rule}-dense_every50@{sp}", update=rule, dense_every=50),
                dict(base, name=f"{rule}-no_ef@{sp}", update=rule, error_feedback=False),
            ]
        for rule in GROUP_RULES:  # where the gap lives: the embedding matrices (tied head)
            rows += [dict(base, name=f"{rule}-embed{e}@{sp}", update=rule,
                          group_sparsity={"embed": e}) for e in (0.9, 0.95, 0.97)]
            rows += [
                dict(base, name=f"{rule}-embed0@{sp}", update=rule,
                     group_sparsity={"embed": 0.0}),
                dict(base, name=f"{rule}-vec0@{sp}", update=rule,
                     group_sparsity={"embed": sp, "no_decay": 0.0}),
                dict(base, name=f"{rule}-dct64@{sp}", update=rule, transform=("dct", 64)),
                dict(base, name=f"{rule}-hadamard128@{sp}", update=rule,
                     transform=("hadamard", 128)),
                dict(base, name=f"{rule}-tok0.9@{sp}", update=rule,
                     group_sparsity={"embed": 0.9, "pos": sp}),
                dict(base, name=f"{rule}-pos0.9@{sp}", update=rule,
                     group_sparsity={"embed": sp, "pos": 0.9}),
                dict(base, name=f"{rule}-head0.9@{sp}", update=rule,
                     group_sparsity={"head": 0.9}),
                dict(base, name=f"{rule}-tokhead0.9@{sp}", update=rule,
                     group_sparsity={"embed": 0.9, "pos": sp, "head": 0.9}),
            ]
        for rule in RAMP_RULES:  # hypothesis 11: spend the bytes early
            rows += [dict(base, name=f"{rule}-ramp{s0:g}x{frac:g}@{sp}", update=rule,
                          ramp=(s0, frac)) for s0, frac in RAMPS if s0 < sp]
            rows += [dict(base, name=f"{rule}-embed{e}-ramp{s0:g}x{frac:g}@{sp}", update=rule,
                          group_sparsity={"embed": e}, ramp=(s0, frac))
                     for e in (0.9, 0.95) for s0, frac in SHORT_RAMPS if s0 < min(e, sp)]
        for rule in AUTO_RULES:  # hypothesis 16: the split of hypothesis 14, measured
            for power, source in [(p, "m") for p in AUTO_POWERS] + \
                    [(p, "fresh") for p in FRESH_POWERS] + [(p, "gain") for p in GAIN_POWERS]:
                tag = {"m": "auto", "fresh": "autof", "gain": "autog"}[source]
                auto = dict(base, name=f"{rule}-{tag}{power:g}@{sp}", update=rule,
                            group_sparsity={"embed": sp, "pos": sp}, allot=(power, 100, source))
                rows += [auto] + [dict(auto, name=f"{rule}-{tag}{power:g}-ramp{s0:g}x{f:g}@{sp}",
                                       ramp=(s0, f)) for s0, f in SHORT_RAMPS if s0 < sp]
                if source == "gain":
                    rows += [dict(auto, name=f"{rule}-{tag}{power:g}-beta{b:g}@{sp}",
                                  allot=(power, 100, source, b)) for b in METER_BETAS]
                    rows += [dict(auto, name=f"{rule}-{tag}{power:g}-floor{fl:g}"
                                  f"-ramp{s0:g}x{f:g}@{sp}", allot_floor=fl, ramp=(s0, f))
                             for fl in FLOORS for s0, f in SHORT_RAMPS if s0 < sp]
            # the gain split made by the optimizer itself (SCAPE(split="gain")): no Allotment
            rows.append(dict(base, name=f"{rule}-split@{sp}", update=rule,
                             group_sparsity={"embed": sp, "pos": sp}, split="gain"))
        for rule in GAIN_RULES:  # hypothesis 19: masks by fresh gain, with the split too
            rows.append(dict(base, name=f"{rule}-split@{sp}", update=rule,
                             group_sparsity={"embed": sp, "pos": sp}, split="gain"))
        for rule in ("catchup_agree_trust2_accum", "catchup_agree_trust2_gain"):
            # its control: every coordinate in turn (the oldest first), no score at all
            rows.append(dict(base, name=f"{rule}-explore1@{sp}", update=rule, explore=1.0))
        # hypothesis 18: the bound at c = 1/2 at the peak lr, falling with it towards 1/4; set
        # by the row from the schedule's peak (-trustlr), or by the library's rule from the
        # largest lr so far (catchup_agree_trustlr_accum-split)
        rows.append(dict(base, name=f"catchup_agree_trust2_accum-split-trustlr@{sp}",
                         update="catchup_agree_trust2_accum",
                         group_sparsity={"embed": sp, "pos": sp}, split="gain",
                         trust_lr=(0.5, 0.25)))
        rows.append(dict(base, name=f"catchup_agree_trustlr_accum-split@{sp}",
                         update="catchup_agree_trustlr_accum",
                         group_sparsity={"embed": sp, "pos": sp}, split="gain"))
    if names:
        rows = [r for r in rows if r["name"].split("@")[0] in names]
    return rows
