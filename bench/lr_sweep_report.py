"""What :mod:`bench.lr_sweep` reports from its runs: each optimizer's own best learning rate
per workload and training length, the ratio of bests to dense AdamS, a markdown table and a
plot of the ratio against steps. Pure functions of the run records, so a sweep split over
several files is reported the same as one (``python -m bench.lr_sweep --table FILES``).

A run record is a dict with ``workload``, ``optimizer`` (``adams``, ``scape-0.99``, ...),
``steps``, ``lr``, ``seed`` and ``final_val_loss`` (None or NaN: the run diverged or failed;
it never wins).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

from bench.engine.report import _pyplot, fmt, markdown_table

REFERENCE = "adams"
"""The optimizer every ratio divides by (dense sharded AdamS)."""


def _loss(value: Any) -> float:
    """A final loss as a number; None, NaN and inf (a diverged run) become inf."""
    if value is None:
        return math.inf
    value = float(value)
    return value if math.isfinite(value) else math.inf


def select_best(runs: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (workload, steps, optimizer), in first-seen order: the mean final
    validation loss over the seeds at every lr tried, the lr whose mean is lowest (``best_lr``;
    a tie goes to the smaller lr), that mean (``best_loss``, inf when every lr diverged), the
    seeds' spread there (max - min), and ``at_edge``: the best lr is the smallest or largest
    of three or more tried (the optimum may lie outside the grid)."""
    groups: dict[tuple[str, int, str], dict[float, list[float]]] = {}
    for r in runs:
        key = (r["workload"], int(r["steps"]), r["optimizer"])
        groups.setdefault(key, {}).setdefault(float(r["lr"]), []).append(
            _loss(r["final_val_loss"]))
    rows = []
    for (workload, steps, optimizer), by_lr in groups.items():
        means = {lr: sum(v) / len(v) for lr, v in sorted(by_lr.items())}
        best_lr = min(means, key=lambda lr: (means[lr], lr))
        lrs = sorted(means)
        at_best = by_lr[best_lr]
        rows.append({
            "workload": workload, "steps": steps, "optimizer": optimizer,
            "loss_by_lr": {f"{lr:g}": _json(m) for lr, m in means.items()},
            "seeds": max(len(v) for v in by_lr.values()),
            "best_lr": best_lr, "best_loss": _json(means[best_lr]),
            "spread": _json(max(at_best) - min(at_best)) if math.isfinite(means[best_lr])
            else None,
            "at_edge": len(lrs) >= 3 and best_lr in (lrs[0], lrs[-1]),
        })
    return add_ratios(rows)


def _json(x: float) -> float | None:
    return x if math.isfinite(x) else None


def add_ratios(rows: list[dict[str, Any]], reference: str = REFERENCE) -> list[dict[str, Any]]:
    """Each row gains ``ratio_of_bests`` (its best loss over the reference's best loss at the
    same workload and steps) and ``ratio_at_ref_lr`` (its mean loss at the reference's best lr
    over that best); None where a side is missing or diverged."""
    ref = {(r["workload"], r["steps"]): r for r in rows if r["optimizer"] == reference}
    for r in rows:
        base = ref.get((r["workload"], r["steps"]))
        r["ratio_of_bests"] = r["ratio_at_ref_lr"] = None
        if base is None or base["best_loss"] is None:
            continue
        if r["best_loss"] is not None:
            r["ratio_of_bests"] = r["best_loss"] / base["best_loss"]
        same = r["loss_by_lr"].get(f"{base['best_lr']:g}")
        if same is not None:
            r["ratio_at_ref_lr"] = same / base["best_loss"]
    return rows


def markdown(rows: Sequence[dict[str, Any]], labels: dict[str, str] | None = None) -> str:
    """Per workload and length: each optimizer's loss at every lr (its best in bold), its best
    lr (``*``: at the edge of the grid), the ratio of bests and the ratio at dense's best lr."""
    labels = labels or {}
    out = []
    for workload, steps in dict.fromkeys((r["workload"], r["steps"]) for r in rows):
        part = [r for r in rows if r["workload"] == workload and r["steps"] == steps]
        lrs = sorted({float(lr) for r in part for lr in r["loss_by_lr"]})
        seeds = max(r["seeds"] for r in part)
        headers = ["optimizer"] + [f"lr {lr:g}" for lr in lrs] + [
            "best lr", "best loss" + (" (spread)" if seeds > 1 else ""), "ratio of bests",
            f"ratio at {REFERENCE}'s lr"]
        table = []
        for r in part:
            cells = []
            for lr in lrs:
                v = r["loss_by_lr"].get(f"{lr:g}", "absent")
                text = "-" if v == "absent" else "diverged" if v is None else f"{v:.4f}"
                cells.append(f"**{text}**" if lr == r["best_lr"] and v is not None else text)
            best = fmt(r["best_loss"], ".4f") + (f" ({fmt(r['spread'], '.4f')})"
                                                  if seeds > 1 else "")
            table.append([r["optimizer"], *cells,
                          f"{r['best_lr']:g}" + ("*" if r["at_edge"] else ""), best,
                          fmt(r["ratio_of_bests"], ".3f"), fmt(r["ratio_at_ref_lr"], ".3f")])
        title = labels.get(workload, workload)
        out.append(f"**{title}, {steps} steps** ({seeds} seed{'s' if seeds > 1 else ''})\n\n"
                   + markdown_table(headers, table))
    return "\n\n".join(out)


def curves(rows: Sequence[dict[str, Any]], reference: str = REFERENCE
           ) -> dict[tuple[str, str], list[tuple[int, float]]]:
    """``{(workload, optimizer): [(steps, ratio_of_bests), ...]}`` sorted by steps, the
    reference left out."""
    out: dict[tuple[str, str], list[tuple[int, float]]] = {}
    for r in rows:
        if r["optimizer"] != reference and r["ratio_of_bests"] is not None:
            out.setdefault((r["workload"], r["optimizer"]), []).append(
                (r["steps"], r["ratio_of_bests"]))
    return {k: sorted(v) for k, v in out.items()}


def plot_ratios(rows: Sequence[dict[str, Any]], path: str, title: str = "",
                labels: dict[str, str] | None = None) -> bool:
    """The ratio of bests against training length, one line per optimizer and workload
    (colour: optimizer; line style and marker: workload), with 1 and the goals 1.01 and 1.03
    marked."""
    plt = _pyplot()
    lines = curves(rows)
    if plt is None or not lines:
        return False
    labels = labels or {}
    optimizers = list(dict.fromkeys(o for _, o in lines))
    workloads = list(dict.fromkeys(w for w, _ in lines))
    styles, markers = ["-", "--", ":", "-."], ["o", "s", "^", "D"]
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for (workload, optimizer), pts in lines.items():
        k = workloads.index(workload)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=markers[k % len(markers)],
                ms=5, color=f"C{optimizers.index(optimizer)}", linestyle=styles[k % len(styles)],
                label=f"{optimizer}, {labels.get(workload, workload)}")
    ax.axhline(1.0, color="black", lw=0.8)
    for goal in (1.01, 1.03):
        ax.axhline(goal, color="grey", lw=0.6, ls=":")
    steps = sorted({p[0] for pts in lines.values() for p in pts})
    ax.set_xscale("log")
    ax.set_xlim(steps[0] / 1.5, steps[-1] * 1.5)
    ax.set_xticks(steps)
    ax.set_xticklabels([str(s) for s in steps])
    ax.minorticks_off()
    ax.set_xlabel("training length (steps; a separate run per length)")
    ax.set_ylabel(f"best final val loss / {REFERENCE}'s best")
    ax.set_title(title or "ratio of bests (each optimizer at its own best lr)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
