"""The research's rows of the benchmark jobs (``python -m bench.research bench.lr_sweep
--optimizers NAME``), by name: the rows docs/research.md's commands name that need a research
rule (:mod:`bench.research.rules`) or a research hook (:mod:`bench.research.follow`,
:mod:`bench.research.drift`). Registered into :data:`bench.engine.rows.ROWS` on ``import
bench.research``; a name is a key, never parsed. Any other row is passed as JSON
(:func:`bench.engine.rows.resolve`)."""

from __future__ import annotations

from typing import Any

from bench.engine import rows

ROWS: dict[str, dict[str, Any]] = {
    "scape-0.99@robust": {
        "optimizer": "scape", "sparsity": 0.99,
        "optimizer_kwargs": {"update": "robust", "warmup_steps": 20}},
    "scape-0.9-ramp0.5x100@catchup_agree_trust2_gain_b98w": {
        "optimizer": "scape", "sparsity": 0.9,
        "optimizer_kwargs": {"update": "catchup_agree_trust2_gain_b98w"},
        "sparsity_ramp": (0.5, 100)},
    "scape-0.9-ramp0.5x20-drift@early": {
        "optimizer": "scape", "sparsity": 0.9, "optimizer_kwargs": {"update": "early"},
        "sparsity_ramp": (0.5, 20), "hooks": {"bench.research.drift:hook": {}}},
    "scape-0.9-ramp0.5x20-follow1@early": {
        "optimizer": "scape", "sparsity": 0.9, "optimizer_kwargs": {"update": "early"},
        "sparsity_ramp": (0.5, 20), "hooks": {"bench.research.follow:Hook": {"q": 1.0}}},
    "scape-0.9-ramp0.5x20@auto_b98w": {
        "optimizer": "scape", "sparsity": 0.9, "optimizer_kwargs": {"update": "auto_b98w"},
        "sparsity_ramp": (0.5, 20)},
    "scape-0.9-ramp0.5x20@catchup_agree_trust26_gain_b98w": {
        "optimizer": "scape", "sparsity": 0.9,
        "optimizer_kwargs": {"update": "catchup_agree_trust26_gain_b98w"},
        "sparsity_ramp": (0.5, 20)},
    "scape-0.9-ramp0.5x20@catchup_agree_trust28_gain_b98w": {
        "optimizer": "scape", "sparsity": 0.9,
        "optimizer_kwargs": {"update": "catchup_agree_trust28_gain_b98w"},
        "sparsity_ramp": (0.5, 20)},
    "scape-0.9-ramp0.5x20@catchup_agree_trust2_gain_b98": {
        "optimizer": "scape", "sparsity": 0.9,
        "optimizer_kwargs": {"update": "catchup_agree_trust2_gain_b98"},
        "sparsity_ramp": (0.5, 20)},
    "scape-0.9-ramp0.5x20@catchup_agree_trust2_gain_b98w": {
        "optimizer": "scape", "sparsity": 0.9,
        "optimizer_kwargs": {"update": "catchup_agree_trust2_gain_b98w"},
        "sparsity_ramp": (0.5, 20)},
    "scape-0.9-ramp0.5x20@catchup_agree_trust4_gain_b98w": {
        "optimizer": "scape", "sparsity": 0.9,
        "optimizer_kwargs": {"update": "catchup_agree_trust4_gain_b98w"},
        "sparsity_ramp": (0.5, 20)},
    "scape-0.9-ramp0.5x20@early_decay": {
        "optimizer": "scape", "sparsity": 0.9, "optimizer_kwargs": {"update": "early_decay"},
        "sparsity_ramp": (0.5, 20)},
    "scape-0.9-ramp0.5x20@early_lead": {
        "optimizer": "scape", "sparsity": 0.9, "optimizer_kwargs": {"update": "early_lead"},
        "sparsity_ramp": (0.5, 20)},
    "scape-0.9-ramp0.5x20@early_probe": {
        "optimizer": "scape", "sparsity": 0.9, "optimizer_kwargs": {"update": "early_probe"},
        "sparsity_ramp": (0.5, 20)},
    "scape-0.9-ramp0.5x50@catchup_agree_trust2_gain_b98w": {
        "optimizer": "scape", "sparsity": 0.9,
        "optimizer_kwargs": {"update": "catchup_agree_trust2_gain_b98w"},
        "sparsity_ramp": (0.5, 50)},
    "scape-0.99-ramp0.5x10@catchup_agree_trust24_gain_b98w": {
        "optimizer": "scape", "sparsity": 0.99,
        "optimizer_kwargs": {"update": "catchup_agree_trust24_gain_b98w"},
        "sparsity_ramp": (0.5, 10)},
    "scape-0.99-ramp0.5x10@catchup_agree_trust28_gain_b98w": {
        "optimizer": "scape", "sparsity": 0.99,
        "optimizer_kwargs": {"update": "catchup_agree_trust28_gain_b98w"},
        "sparsity_ramp": (0.5, 10)},
    "scape-0.99-ramp0.5x10@catchup_agree_trust2_gain_b98w": {
        "optimizer": "scape", "sparsity": 0.99,
        "optimizer_kwargs": {"update": "catchup_agree_trust2_gain_b98w"},
        "sparsity_ramp": (0.5, 10)},
    "scape-0.99-ramp0.5x12@catchup_agree_trust2_gain_b98": {
        "optimizer": "scape", "sparsity": 0.99,
        "optimizer_kwargs": {"update": "catchup_agree_trust2_gain_b98"},
        "sparsity_ramp": (0.5, 12)},
    "scape-0.99-ramp0.5x12@catchup_agree_trust2_gain_b98w": {
        "optimizer": "scape", "sparsity": 0.99,
        "optimizer_kwargs": {"update": "catchup_agree_trust2_gain_b98w"},
        "sparsity_ramp": (0.5, 12)},
    "scape-0.99-ramp0.5x20-follow1@early": {
        "optimizer": "scape", "sparsity": 0.99, "optimizer_kwargs": {"update": "early"},
        "sparsity_ramp": (0.5, 20), "hooks": {"bench.research.follow:Hook": {"q": 1.0}}},
    "scape-0.99-ramp0.5x20@auto-explore0.2": {
        "optimizer": "scape", "sparsity": 0.99, "optimizer_kwargs": {"update": "auto-explore0.2"},
        "sparsity_ramp": (0.5, 20)},
    "scape-0.99-ramp0.5x20@catchup_agree_trust28_gain_b98w": {
        "optimizer": "scape", "sparsity": 0.99,
        "optimizer_kwargs": {"update": "catchup_agree_trust28_gain_b98w"},
        "sparsity_ramp": (0.5, 20)},
    "scape-0.99-ramp0.5x20@catchup_agree_trust2_gain": {
        "optimizer": "scape", "sparsity": 0.99,
        "optimizer_kwargs": {"update": "catchup_agree_trust2_gain"}, "sparsity_ramp": (0.5, 20)},
    "scape-0.99-ramp0.5x20@catchup_agree_trust2_gain_b90": {
        "optimizer": "scape", "sparsity": 0.99,
        "optimizer_kwargs": {"update": "catchup_agree_trust2_gain_b90"},
        "sparsity_ramp": (0.5, 20)},
    "scape-0.99-ramp0.5x20@catchup_agree_trust2_gain_b98": {
        "optimizer": "scape", "sparsity": 0.99,
        "optimizer_kwargs": {"update": "catchup_agree_trust2_gain_b98"},
        "sparsity_ramp": (0.5, 20)},
    "scape-0.99-ramp0.5x20@catchup_agree_trust2_gain_b98w": {
        "optimizer": "scape", "sparsity": 0.99,
        "optimizer_kwargs": {"update": "catchup_agree_trust2_gain_b98w"},
        "sparsity_ramp": (0.5, 20)},
    "scape-0.99-ramp0.5x20@catchup_agree_trust2_gain_b99": {
        "optimizer": "scape", "sparsity": 0.99,
        "optimizer_kwargs": {"update": "catchup_agree_trust2_gain_b99"},
        "sparsity_ramp": (0.5, 20)},
    "scape-0.99-ramp0.5x20@early_decay": {
        "optimizer": "scape", "sparsity": 0.99, "optimizer_kwargs": {"update": "early_decay"},
        "sparsity_ramp": (0.5, 20)},
    "scape-0.99-ramp0.5x20@early_steady": {
        "optimizer": "scape", "sparsity": 0.99, "optimizer_kwargs": {"update": "early_steady"},
        "sparsity_ramp": (0.5, 20)},
    "scape-0.99@catchup_agree_gain": {
        "optimizer": "scape", "sparsity": 0.99,
        "optimizer_kwargs": {"update": "catchup_agree_gain"}},
    "scape-0.99@catchup_agree_trust2_accum": {
        "optimizer": "scape", "sparsity": 0.99,
        "optimizer_kwargs": {"update": "catchup_agree_trust2_accum"}},
    "scape-0.99@catchup_agree_trust2_gain": {
        "optimizer": "scape", "sparsity": 0.99,
        "optimizer_kwargs": {"update": "catchup_agree_trust2_gain"}},
    "scape-0.99@catchup_agree_trust2_gain_b98": {
        "optimizer": "scape", "sparsity": 0.99,
        "optimizer_kwargs": {"update": "catchup_agree_trust2_gain_b98"}},
    "scape-0.99@catchup_agree_trust2_gainr": {
        "optimizer": "scape", "sparsity": 0.99,
        "optimizer_kwargs": {"update": "catchup_agree_trust2_gainr"}},
    "scape-0.99@catchup_agree_trust4_gain": {
        "optimizer": "scape", "sparsity": 0.99,
        "optimizer_kwargs": {"update": "catchup_agree_trust4_gain"}},
    "scape-0.99@catchup_agree_trust_gain": {
        "optimizer": "scape", "sparsity": 0.99,
        "optimizer_kwargs": {"update": "catchup_agree_trust_gain"}},
    "scape-0.99@early_lead": {
        "optimizer": "scape", "sparsity": 0.99, "optimizer_kwargs": {"update": "early_lead"}},
    "scape-0.9@catchup_agree_trust2_accum": {
        "optimizer": "scape", "sparsity": 0.9,
        "optimizer_kwargs": {"update": "catchup_agree_trust2_accum"}},
    "scape-0.9@catchup_agree_trust2_gain": {
        "optimizer": "scape", "sparsity": 0.9,
        "optimizer_kwargs": {"update": "catchup_agree_trust2_gain"}},
    "scape-0.9@catchup_agree_trust2_gain_b98": {
        "optimizer": "scape", "sparsity": 0.9,
        "optimizer_kwargs": {"update": "catchup_agree_trust2_gain_b98"}},
}
"""Every research row by name (:data:`bench.engine.rows.FIELDS`)."""

for _name, _fields in ROWS.items():
    rows.register(_name, _fields)
