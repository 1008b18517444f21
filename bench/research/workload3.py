"""The third workload's protocol, reported from its result file (docs/research.md, "The
default judged on the third workload").

``bench/results/workload3_headers_bpe.json`` holds every run of the third workload
(:mod:`bench.workloads.headers`, the ``small-bpe`` GPT) in the newcomer set-up, each with its
config, final validation loss and validation curve. This reads the runs of one candidate and
dense AdamS at one length and reports, per optimizer:

- the **best lr**: the lowest final validation loss of seed 0 over the lrs run (the grid runs on
  seed 0; the other seeds run at the best lr only), and the mean over the seeds run there;
- the **ratio** of each sparsity's mean to dense AdamS's mean at their best lrs;
- **steps to reach** dense AdamS's loss: per seed, the first evaluation at which SCAPE's curve
  is at or below dense AdamS's (same seed) at step 600 and at the run's last step (None: not
  reached);

and draws the best-lr curves of every seed in one plot (``--plot``)::

    python -m bench.research.workload3 --plot docs/figures/workload3_default.png

(the default's candidate; ``--candidate "agree (the default after 969a225)"`` and
``docs/figures/workload3_protocol.png`` are the default before its start from 0.9).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parents[1] / "results" / "workload3_headers_bpe.json"
DENSE = "adams"
"""The candidate name of dense AdamS's runs."""
DEFAULT = "agree, 0.99 from 0.9 (the default after b49b01f)"
"""The candidate name of the library's default's runs."""


def load(path: str | Path = RESULTS) -> list[dict[str, Any]]:
    """The runs of the result file."""
    with open(path) as f:
        return list(json.load(f)["runs"])


def best(runs: list[dict[str, Any]], candidate: str, sparsity: float,
         steps: int) -> dict[str, Any] | None:
    """``{"lr", "grid", "seeds", "mean"}`` of ``candidate`` at ``sparsity`` over ``steps``: the
    lr of seed 0's lowest final loss among ``grid`` (the lrs seed 0 ran), the final loss of each
    seed run at it, and their mean; None when seed 0 ran no lr."""
    mine = [r for r in runs if r["candidate"] == candidate and r["sparsity"] == sparsity
            and r["steps"] == steps]
    seed0 = {r["lr"]: r["final_val_loss"] for r in mine if r["seed"] == 0}
    if not seed0:
        return None
    lr = min(seed0, key=lambda k: seed0[k])
    seeds = {r["seed"]: r["final_val_loss"] for r in mine if r["lr"] == lr}
    return {"lr": lr, "grid": sorted(seed0), "seeds": dict(sorted(seeds.items())),
            "mean": statistics.fmean(seeds.values())}


def steps_to_reach(curve: list[list[float]], target: float) -> int | None:
    """The first step of ``curve`` (``[step, loss]`` pairs in step order) whose loss is at or
    below ``target``; None if none is."""
    for step, loss in curve:
        if loss <= target:
            return int(step)
    return None


def loss_at(curve: list[list[float]], step: int) -> float:
    """The loss of ``curve`` at ``step`` (an evaluation step of the curve)."""
    for s, loss in curve:
        if int(s) == step:
            return float(loss)
    raise ValueError(f"no evaluation at step {step}")


def curve_of(runs: list[dict[str, Any]], candidate: str, sparsity: float, steps: int,
             lr: float, seed: int) -> list[list[float]] | None:
    """The validation curve of that run, or None when it was not run."""
    for r in runs:
        if (r["candidate"], r["sparsity"], r["steps"], r["lr"], r["seed"]) == \
                (candidate, sparsity, steps, lr, seed):
            return r["val_curve"]
    return None


def report(runs: list[dict[str, Any]], candidate: str, steps: int = 2000,
           sparsities: tuple[float, ...] = (0.99, 0.9), early: int = 600) -> dict[str, Any]:
    """The protocol's numbers (module docstring) for ``candidate`` at ``steps``."""
    dense = best(runs, DENSE, 0.0, steps)
    if dense is None:
        raise ValueError(f"no dense AdamS run of {steps} steps")
    out: dict[str, Any] = {"steps": steps, "early": early, "dense": dense, "sparse": {}}
    for sp in sparsities:
        b = best(runs, candidate, sp, steps)
        if b is None:
            continue
        b["ratio"] = b["mean"] / dense["mean"]
        reach: dict[int, dict[str, int | None]] = {}
        for seed in b["seeds"]:
            mine = curve_of(runs, candidate, sp, steps, b["lr"], seed)
            ref = curve_of(runs, DENSE, 0.0, steps, dense["lr"], seed)
            if mine is None or ref is None:
                continue
            reach[seed] = {str(at): steps_to_reach(mine, loss_at(ref, at))
                           for at in (early, steps)}
        b["reach"] = reach
        out["sparse"][str(sp)] = b
    return out


def markdown(rep: dict[str, Any]) -> str:
    """``rep`` (:func:`report`) as a markdown table."""
    d = rep["dense"]
    lines = ["| optimizer | lrs (seed 0) | best lr | final loss per seed | mean | vs dense "
             "| steps to dense's loss at 600 / at the end, per seed |",
             "|---|---|---|---|---|---|---|",
             f"| dense AdamS | {', '.join(f'{x:g}' for x in d['grid'])} | {d['lr']:g} | "
             f"{', '.join(f'{v:.4f}' for v in d['seeds'].values())} | {d['mean']:.4f} | 1 | – |"]
    for sp, b in rep["sparse"].items():
        at = (str(rep["early"]), str(rep["steps"]))
        reach = "; ".join(f"seed {s}: {r[at[0]]} / {r[at[1]]}" for s, r in b["reach"].items())
        lines.append(f"| SCAPE-{sp} | {', '.join(f'{x:g}' for x in b['grid'])} | {b['lr']:g} | "
                     f"{', '.join(f'{v:.4f}' for v in b['seeds'].values())} | {b['mean']:.4f} | "
                     f"{b['ratio']:.3f} | {reach} |")
    return "\n".join(lines)


def plot(runs: list[dict[str, Any]], rep: dict[str, Any], candidate: str, path: str) -> None:
    """The best-lr validation curves of every seed, dense AdamS and each sparsity, in one
    plot, with dense AdamS's loss at 600 steps and at the end (seed 0) marked."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = rep["steps"]
    fig, ax = plt.subplots(figsize=(8, 5))
    rows = [("dense AdamS", DENSE, 0.0, rep["dense"], "black")]
    colours = {"0.99": "tab:blue", "0.9": "tab:orange"}
    rows += [(f"SCAPE-{sp}", candidate, float(sp), b, colours.get(sp, "tab:green"))
             for sp, b in rep["sparse"].items()]
    for label, cand, sp, b, colour in rows:
        for seed in b["seeds"]:
            curve = curve_of(runs, cand, sp, steps, b["lr"], seed)
            if curve is None:
                continue
            xs, ys = zip(*curve)
            ax.plot(xs, ys, color=colour, linestyle="-" if seed == 0 else "--", linewidth=1.2,
                    label=f"{label}, lr {b['lr']:g}, seed {seed}: {ys[-1]:.3f}")
    ref = curve_of(runs, DENSE, 0.0, steps, rep["dense"]["lr"], 0)
    if ref is not None:
        for at in (rep["early"], steps):
            ax.axhline(loss_at(ref, at), color="grey", linestyle=":", linewidth=0.8)
            ax.annotate(f"dense AdamS's loss at step {at} (seed 0)", (10, loss_at(ref, at)),
                        ha="left", va="bottom", fontsize=7, color="grey")
        for sp, b in rep["sparse"].items():  # where seed 0 reaches dense's loss at `early`
            reached = b["reach"].get(0, {}).get(str(rep["early"]))
            if reached is not None:
                y = loss_at(ref, rep["early"])
                ax.plot([reached], [y], marker="o", color=colours.get(sp, "tab:green"))
                ax.annotate(f"{reached}", (reached, y), textcoords="offset points",
                            xytext=(0, 6), ha="center", fontsize=7,
                            color=colours.get(sp, "tab:green"))
    ax.set_xlim(0, steps)
    ax.set_ylim(2.2, 5.0)
    ax.set_xlabel("step")
    ax.set_ylabel("validation loss (nats/token)")
    ax.set_title(f"third workload, {steps} steps, each at its best lr (seed 0's)\nsolid seed 0, "
                 f"dashed seed 1; dots: seed 0 reaches dense's loss at step {rep['early']}",
                 fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", default=str(RESULTS))
    ap.add_argument("--candidate", default=DEFAULT)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--plot", default=None, help="PNG path of the curves")
    args = ap.parse_args(argv)
    runs = load(args.results)
    rep = report(runs, args.candidate, args.steps)
    print(markdown(rep))
    if args.plot:
        plot(runs, rep, args.candidate, args.plot)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
