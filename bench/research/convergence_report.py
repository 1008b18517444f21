"""Reading the convergence ablation's result files (:mod:`bench.research.convergence`): the markdown
table of ``--table`` and the gap plot of ``--plot``, with ratios to dense AdamS taken from the
files' own dense rows where a file ran without one."""

from __future__ import annotations

import json
import math
from typing import Any

from bench.engine.optimizers import LOCAL_STEPS as LOCAL_SGD
from bench.engine.report import plot_points

SCHEMA = "scape.convergence/1"
"""``schema`` field of a result file of :mod:`bench.research.convergence`."""


def _load_reports(paths: list[str]) -> list[tuple[str, dict[str, Any]]]:
    reports = []
    for path in paths:
        with open(path) as f:
            rep = json.load(f)
        if rep.get("schema") != SCHEMA:
            raise ValueError(f"{path}: not a {SCHEMA} report")
        reports.append((path, rep))
    return reports


def _dense_losses(reports: list[tuple[str, dict[str, Any]]]) -> dict[tuple, float]:
    """The best dense AdamS loss per workload (steps, accum, model, seed) among the reports' rows:
    the sweep's choice when its learning rates ran as separate files."""
    best: dict[tuple, float] = {}
    for _, rep in reports:
        w = rep["workload"]
        key = (w["steps"], w["accum"], w["model"], w.get("seed", 0))
        for r in rep["results"]:
            if r["variant"]["name"].startswith("dense-adams"):
                best[key] = min(best.get(key, math.inf), r["final_val_loss"])
    return best


def _ratio(path: str, rep: dict[str, Any], r: dict[str, Any], dense_ref: float | None,
           dense: dict[tuple, float]) -> float:
    if dense_ref:
        return r["final_val_loss"] / dense_ref
    if r["ratio_to_dense"] is not None:
        return r["ratio_to_dense"]
    w = rep["workload"]
    ref = dense.get((w["steps"], w["accum"], w["model"], w.get("seed", 0)))
    if ref is None:
        raise ValueError(f"{path}: ran with --no-dense; give --dense-loss or a file with the "
                         f"dense run of the same workload for its ratios")
    return r["final_val_loss"] / ref


def gap_series(paths: list[str], dense_ref: float | None = None
               ) -> dict[str, list[tuple[float, float]]]:
    """``{"<rule> @ <sparsity>": [(steps x density, ratio to dense), ...]}`` for every rule
    measured at two or more training lengths among the sparse rows of the given files."""
    reports = _load_reports(paths)
    dense = _dense_losses(reports)
    series: dict[str, set[tuple[float, float]]] = {}
    for path, rep in reports:
        for r in rep["results"]:
            sp = r["variant"].get("sparsity", 0.0)
            if sp <= 0 or r["variant"].get("optimizer") in LOCAL_SGD:
                continue
            name = f"{r['variant']['name'].split('@')[0]} @ {sp:g}"
            x = rep["workload"]["steps"] * (1.0 - sp)
            series.setdefault(name, set()).add((x, _ratio(path, rep, r, dense_ref, dense)))
    return {k: sorted(v) for k, v in sorted(series.items()) if len({x for x, _ in v}) > 1}


def plot_gap(paths: list[str], out: str, dense_ref: float | None = None) -> bool:
    """Plot :func:`gap_series`: ratio to dense AdamS against steps x density (the syncs a
    coordinate gets on average). False (and no file) when no rule has two lengths."""
    series = gap_series(paths, dense_ref)
    if not series:
        print("note: no rule was measured at two training lengths in these files; no plot")
        return False
    return plot_points(series, out, xlabel="steps x density (syncs per coordinate)",
                       ylabel="final val loss / dense AdamS", logx=True, hline=1.0,
                       title="gap to dense AdamS against training length")


def table(paths: list[str], dense_ref: float | None = None) -> str:
    """A markdown table of every row of the given result files, with the command of each.

    ``dense_ref``: recompute every ratio against this dense loss (e.g. the sweep's best when
    the sweep's learning rates ran as separate files). The bytes column is the row's mean
    bytes per step per rank (``–`` for files written before it was recorded); a local-step
    row names its world size, and when its last step is not a sync its loss at the last sync
    follows in brackets. Where a file recorded dense sharded AdamS's bytes per step (runs
    with local-step rows), its rows' bytes carry their fraction of it and a note after the
    table gives it."""
    lines = ["| steps | accum | variant | sparsity | final val loss | ratio to dense | "
             "bytes/step/rank | command |", "|---|---|---|---|---|---|---|---|"]
    notes: list[str] = []
    seen: set[tuple] = set()
    reports = _load_reports(paths)
    dense_losses = _dense_losses(reports)
    for path, rep in reports:
        w = rep["workload"]
        dense = rep.get("dense_adams_bytes_per_step")
        if dense:
            notes.append(f"Dense sharded AdamS on this model at W={dense['world']}: "
                         f"{dense['bytes']:,} bytes/step/rank ({dense['formula']}).")
        for r in rep["results"]:
            v = r["variant"]
            key = (w["steps"], w["accum"], v["name"], r["final_val_loss"])
            if key in seen:  # the same run repeated in another file (runs are deterministic)
                continue
            seen.add(key)
            ratio = _ratio(path, rep, r, dense_ref, dense_losses)
            local = v.get("optimizer") in LOCAL_SGD
            name = v["name"].split("@")[0] + (f" (W={r['world']})" if local else "")
            loss = f"{r['final_val_loss']:.4f}"
            if local and r.get("last_sync_step") not in (None, w["steps"]):
                loss += f" (last sync, step {r['last_sync_step']}: {r['last_sync_val_loss']:.4f})"
            nbytes = r.get("bytes_per_step")
            cell = "–" if nbytes is None else f"{nbytes:,.0f}"
            if nbytes and dense:
                cell += f" (1/{dense['bytes'] / nbytes:.0f})"
            lines.append(f"| {w['steps']} | {w['accum']} | {name} | "
                         f"{'–' if local else format(v.get('sparsity', 0.0), 'g')} | {loss} | "
                         f"{ratio:.3f} | {cell} | `{rep['command']}` |")
    return "\n".join(lines + [""] * bool(notes) + list(dict.fromkeys(notes)))
