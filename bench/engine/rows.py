"""The rows of the benchmark jobs as data: a row is a name and the :class:`RunConfig` fields
it sets (optimizer, sparsity, optimizer_kwargs, per-group sparsity, sparsity ramp, hooks). The
jobs lay their workload over it (``bench.compare``, ``bench.lr_sweep``, ``bench.step_time``,
``bench.research.convergence --local``, ``bench.engine.local_sgd_opts``).

A name is a key of :data:`ROWS`, never parsed: ``scape-0.99`` is SCAPE at 0.99 because the
table says so. A row not in the table is passed as JSON, inline or as a file::

    python -m bench.lr_sweep --optimizers adams \\
        '{"name": "scape-0.95-ramp", "optimizer": "scape", "sparsity": 0.95,
          "sparsity_ramp": [0.5, 20], "optimizer_kwargs": {"update": "agree"}}'
    python -m bench.compare --optimizers adams scape-0.99 rows/my_row.json   # or .toml

A JSON/TOML row needs ``name`` (its label and the name of its result files) and
``optimizer``; ``sparsity`` defaults to 0 for the optimizers that send everything. A module
registers rows of its own with :func:`register` (the research's rows, :mod:`bench.research`).
"""

from __future__ import annotations

import copy
import json
import os
from typing import Any

import tomllib

from bench.engine.optimizers import OPTIMIZERS, check_rule

FIELDS = ("optimizer", "sparsity", "optimizer_kwargs", "group_sparsity", "sparsity_ramp",
          "hooks")
"""The :class:`bench.engine.run_config.RunConfig` fields a row may set; the job sets the
rest (model, steps, lr, ...)."""

ROWS: dict[str, dict[str, Any]] = {
    "adams": {"optimizer": "adams", "sparsity": 0.0},
    "adamw_ddp": {"optimizer": "adamw_ddp", "sparsity": 0.0},
    "dist_adamw": {"optimizer": "dist_adamw", "sparsity": 0.0},
    "scape-0.9": {"optimizer": "scape", "sparsity": 0.9},
    "scape-0.99": {"optimizer": "scape", "sparsity": 0.99},
    "scape-0.9-int8": {"optimizer": "scape", "sparsity": 0.9,
                       "optimizer_kwargs": {"grad_comm_dtype": "int8"}},
    "scape-0.99-int8": {"optimizer": "scape", "sparsity": 0.99,
                        "optimizer_kwargs": {"grad_comm_dtype": "int8"}},
    # the whole 8-bit wire: gradient codes and parameter updates (scape.wire)
    "scape-0.9-wire8": {"optimizer": "scape", "sparsity": 0.9, "optimizer_kwargs": {
        "grad_comm_dtype": "int8", "param_comm_dtype": "int8"}},
    "scape-0.99-wire8": {"optimizer": "scape", "sparsity": 0.99, "optimizer_kwargs": {
        "grad_comm_dtype": "int8", "param_comm_dtype": "int8"}},
    "topk-0.9": {"optimizer": "topk", "sparsity": 0.9},
    "topk-0.99": {"optimizer": "topk", "sparsity": 0.99},
    "compute_only": {"optimizer": "compute_only", "sparsity": 0.99},
    "scape-0.99-embed0.9": {
        "optimizer": "scape", "sparsity": 0.99, "group_sparsity": {"embed": 0.9}},
    "sparseloco-h8-d0.01": {
        "optimizer": "sparseloco", "sparsity": 0.0,
        "optimizer_kwargs": {"sync_every": 8, "density": 0.01, "value_bits": 2}},
    "sparseloco-h8-d0.03": {
        "optimizer": "sparseloco", "sparsity": 0.0,
        "optimizer_kwargs": {"sync_every": 8, "density": 0.03, "value_bits": 2}},
    "sparseloco-h32-d0.01": {
        "optimizer": "sparseloco", "sparsity": 0.0,
        "optimizer_kwargs": {"sync_every": 32, "density": 0.01, "value_bits": 2}},
    "sparseloco-h32-d0.03": {
        "optimizer": "sparseloco", "sparsity": 0.0,
        "optimizer_kwargs": {"sync_every": 32, "density": 0.03, "value_bits": 2}},
    "diloco-h8": {"optimizer": "diloco", "sparsity": 0.0, "optimizer_kwargs": {"sync_every": 8}},
    "diloco-h32": {"optimizer": "diloco", "sparsity": 0.0, "optimizer_kwargs": {"sync_every": 32}},
    # the rows of docs/research.md's commands that need no research module
    "scape-0.9-embed0.5-ramp0.5x20@early": {
        "optimizer": "scape", "sparsity": 0.9, "optimizer_kwargs": {"update": "agree"},
        "group_sparsity": {"embed": 0.5}, "sparsity_ramp": (0.5, 20)},
    "scape-0.9-ramp0.5x100@early": {
        "optimizer": "scape", "sparsity": 0.9, "optimizer_kwargs": {"update": "agree"},
        "sparsity_ramp": (0.5, 100)},
    "scape-0.9-ramp0.5x20": {"optimizer": "scape", "sparsity": 0.9, "sparsity_ramp": (0.5, 20)},
    "scape-0.9-ramp0.5x20@early": {
        "optimizer": "scape", "sparsity": 0.9, "optimizer_kwargs": {"update": "agree"},
        "sparsity_ramp": (0.5, 20)},
    "scape-0.9107-embed0.5-ramp0.5x20@early": {
        "optimizer": "scape", "sparsity": 0.9107, "optimizer_kwargs": {"update": "agree"},
        "group_sparsity": {"embed": 0.5}, "sparsity_ramp": (0.5, 20)},
    "scape-0.925-embed0.5-ramp0.5x20@early": {
        "optimizer": "scape", "sparsity": 0.925, "optimizer_kwargs": {"update": "agree"},
        "group_sparsity": {"embed": 0.5}, "sparsity_ramp": (0.5, 20)},
    "scape-0.99-embed0.9-head0.9": {
        "optimizer": "scape", "sparsity": 0.99, "group_sparsity": {"embed": 0.9, "head": 0.9}},
    "scape-0.99-embed0.97-head0.97": {
        "optimizer": "scape", "sparsity": 0.99, "group_sparsity": {"embed": 0.97, "head": 0.97}},
    "scape-0.99-embed0.98-ramp0.5x20@early": {
        "optimizer": "scape", "sparsity": 0.99, "optimizer_kwargs": {"update": "agree"},
        "group_sparsity": {"embed": 0.98}, "sparsity_ramp": (0.5, 20)},
    "scape-0.99-embed0.99-head0.99": {
        "optimizer": "scape", "sparsity": 0.99, "group_sparsity": {"embed": 0.99, "head": 0.99}},
    "scape-0.99-ramp0.5x10": {"optimizer": "scape", "sparsity": 0.99, "sparsity_ramp": (0.5, 10)},
    "scape-0.99-ramp0.5x10@early": {
        "optimizer": "scape", "sparsity": 0.99, "optimizer_kwargs": {"update": "agree"},
        "sparsity_ramp": (0.5, 10)},
    "scape-0.99-ramp0.5x12": {"optimizer": "scape", "sparsity": 0.99, "sparsity_ramp": (0.5, 12)},
    "scape-0.99-ramp0.5x20": {"optimizer": "scape", "sparsity": 0.99, "sparsity_ramp": (0.5, 20)},
    "scape-0.99-ramp0.5x20@early": {
        "optimizer": "scape", "sparsity": 0.99, "optimizer_kwargs": {"update": "agree"},
        "sparsity_ramp": (0.5, 20)},
    "scape-0.99-ramp0.5x89@early": {
        "optimizer": "scape", "sparsity": 0.99, "optimizer_kwargs": {"update": "agree"},
        "sparsity_ramp": (0.5, 89)},
    "scape-0.99-ramp0.9x80": {"optimizer": "scape", "sparsity": 0.99, "sparsity_ramp": (0.9, 80)},
    "scape-0.9906-embed0.98-ramp0.5x10@early": {
        "optimizer": "scape", "sparsity": 0.9906, "optimizer_kwargs": {"update": "agree"},
        "group_sparsity": {"embed": 0.98}, "sparsity_ramp": (0.5, 10)},
    "scape-0.9906-embed0.98-ramp0.5x20@early": {
        "optimizer": "scape", "sparsity": 0.9906, "optimizer_kwargs": {"update": "agree"},
        "group_sparsity": {"embed": 0.98}, "sparsity_ramp": (0.5, 20)},
    "topk-0.9958": {"optimizer": "topk", "sparsity": 0.9958},
}
"""Every row by name: the jobs' defaults, the local-step rows, and the rows the commands of
docs/ name (those that need a research rule or hook are :mod:`bench.research`'s,
registered on import)."""


def check(name: str, fields: dict[str, Any]) -> dict[str, Any]:
    """``fields`` as a row: only :data:`FIELDS`, a known ``optimizer`` and ``update`` rule,
    ``sparsity`` 0 by default for an optimizer that sends everything. ValueError otherwise."""
    if not isinstance(name, str) or not name or "/" in name or name.startswith("-"):
        raise ValueError(f"row name must be a non-empty string without '/' that does not "
                         f"start with '-', got {name!r}")
    if not isinstance(fields, dict):
        raise ValueError(f"row {name!r}: expected a dict of RunConfig fields, "
                         f"got {type(fields).__name__}")
    unknown = sorted(set(fields) - set(FIELDS))
    if unknown:
        raise ValueError(f"row {name!r}: unknown fields {unknown} (a row sets {FIELDS}; the "
                         f"job sets the others)")
    opt = fields.get("optimizer")
    if opt not in OPTIMIZERS:
        raise ValueError(f"row {name!r}: optimizer must be one of {tuple(OPTIMIZERS)}, "
                         f"got {opt!r}")
    update = (fields.get("optimizer_kwargs") or {}).get("update")
    if update is not None:
        try:
            check_rule(update)
        except ValueError as e:
            raise ValueError(f"row {name!r}: {e}") from None
    out = copy.deepcopy(fields)
    if not OPTIMIZERS[opt].sparse:
        out.setdefault("sparsity", 0.0)
    if out.get("sparsity_ramp") is not None:
        out["sparsity_ramp"] = tuple(out["sparsity_ramp"])
    return out


def register(name: str, fields: dict[str, Any]) -> None:
    """Add the row ``name``; registering the same fields again is a no-op, other fields under
    a taken name a ValueError."""
    fields = check(name, fields)
    if name in ROWS and check(name, ROWS[name]) != fields:
        raise ValueError(f"row {name!r} is registered with other fields: {ROWS[name]}")
    ROWS[name] = fields


def resolve(spec: str) -> tuple[str, dict[str, Any]]:
    """``(name, fields)`` of a row given on a command line: a name of :data:`ROWS`, a JSON
    object (``{"name": ..., "optimizer": ..., ...}``) or the path of a ``.json`` or ``.toml``
    file holding one. ValueError naming the forms otherwise."""
    if spec in ROWS:
        return spec, check(spec, ROWS[spec])
    text = spec.strip()
    if text.startswith("{"):
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"row {text[:60]!r}...: not valid JSON: {e}") from None
    elif text.endswith((".json", ".toml")) and os.path.isfile(text):
        with open(text, "rb") as f:
            try:
                d = tomllib.load(f) if text.endswith(".toml") else json.load(f)
            except (json.JSONDecodeError, tomllib.TOMLDecodeError) as e:
                raise ValueError(f"row file {text}: {e}") from None
    else:
        raise ValueError(f"unknown row {spec!r}: give a name of bench.engine.rows.ROWS "
                         f"({', '.join(list(ROWS)[:9])}, ...), a JSON object with 'name' and "
                         f"'optimizer', or a .json/.toml file holding one")
    if not isinstance(d, dict) or "name" not in d:
        raise ValueError(f"row {spec[:60]!r}: a JSON/TOML row is an object with a 'name'")
    fields = dict(d)
    name = fields.pop("name")
    return name, check(name, fields)
