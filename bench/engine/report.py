"""Tables and plots shared by the end-to-end benchmarks (``bench.compare``, ``bench.step_time``).

Plots use matplotlib's Agg backend (no display needed); a missing matplotlib skips the plot
with a printed note rather than failing the run that produced the numbers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any


def fmt(value: Any, spec: str = ".4g") -> str:
    """A table cell: ``-`` for None/NaN, thousands separators for ints."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return format(value, spec)
    return str(value)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub markdown table (cells already formatted, or formatted with :func:`fmt`)."""
    if any(len(r) != len(headers) for r in rows):
        raise ValueError(f"every row must have {len(headers)} cells, got "
                         f"{sorted({len(r) for r in rows})}")
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(c if isinstance(c, str) else fmt(c) for c in r) + " |"
              for r in rows]
    return "\n".join(lines)


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: matplotlib is not installed; plots skipped (pip install matplotlib)")
        return None
    return plt


def plot_loss(runs: Sequence[dict[str, Any]], path: str, title: str = "") -> bool:
    """Validation loss against step, one line per run with a validation curve."""
    plt = _pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in runs:
        curve = r.get("val_curve") or []
        if curve:
            ax.plot([c[0] for c in curve], [c[1] for c in curve], marker="o", ms=3,
                    label=r["name"])
    ax.set_xlabel("step")
    ax.set_ylabel("validation loss (nats/byte)")
    ax.set_title(title or "validation loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def plot_bytes(runs: Sequence[dict[str, Any]], path: str, title: str = "") -> bool:
    """Bytes per step per rank (log scale), one bar per run, stacked by collective."""
    plt = _pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    names = [r["name"] for r in runs]
    ops = sorted({op for r in runs for op in r.get("bytes_per_step", {})})
    bottom = [0.0] * len(runs)
    for op in ops:
        vals = [float(r.get("bytes_per_step", {}).get(op, 0.0)) for r in runs]
        ax.bar(names, vals, bottom=bottom, label=op)
        bottom = [b + v for b, v in zip(bottom, vals)]
    for x, total in enumerate(bottom):
        if total > 0:
            ax.text(x, total, f"{total / 1e3:,.0f} kB", ha="center", va="bottom", fontsize=8)
    ax.set_yscale("log")
    # on a log scale the lowest segment must sit above the axis floor to be seen; segments
    # under 1% of their bar (the 8-byte scalar all-reduce) stay invisible anyway
    visible = [v for r in runs for v in r.get("bytes_per_step", {}).values()
               if v >= 0.01 * sum(r.get("bytes_per_step", {}).values())]
    if visible:
        ax.set_ylim(bottom=0.3 * min(visible))
    ax.set_ylabel("payload bytes per step per rank")
    ax.set_title(title or "communication per step")
    ax.tick_params(axis="x", rotation=30)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def plot_steps(table: Sequence[dict[str, Any]], path: str, title: str = "") -> bool:
    """Median step time per row, its local compute and its waiting on the link side by side
    (log scale: neither hides the other, as a stack would), the whole step written above;
    the compute-only floor as a dashed line."""
    plt = _pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    names = [r["name"] for r in table]
    step = [1e3 * (r["median_step_s"] or 0.0) for r in table]
    wait = [1e3 * min(r["median_wait_s"] or 0.0, r["median_step_s"] or 0.0) for r in table]
    xs = range(len(names))
    ax.bar([x - 0.2 for x in xs], [s - w for s, w in zip(step, wait)], width=0.4,
           label="local compute")
    ax.bar([x + 0.2 for x in xs], wait, width=0.4, label="waiting on the link")
    for x, s in enumerate(step):
        ax.text(x, s, f"step {s:,.0f} ms", ha="center", va="bottom", fontsize=8)
    floor = [1e3 * r["median_step_s"] for r in table if r["name"] == "compute_only"]
    if floor:
        ax.axhline(floor[0], color="black", lw=0.8, ls="--", label="compute-only step")
    ax.set_xticks(list(xs), names)
    ax.set_yscale("log")
    ax.set_ylabel("ms (median over the timed steps)")
    ax.set_title(title or "step time: compute and waiting")
    ax.tick_params(axis="x", rotation=30)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def plot_points(series: dict[str, list[tuple[float, float]]], path: str, *, xlabel: str,
                ylabel: str, title: str = "", logx: bool = False, hline: float | None = None
                ) -> bool:
    """One line of markers per series (points sorted by x); an optional horizontal line."""
    plt = _pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, pts in series.items():
        pts = sorted(pts)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=4, label=name)
    if hline is not None:
        ax.axhline(hline, color="black", lw=0.8, ls="--")
    if logx:
        ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
