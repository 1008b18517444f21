"""Local-step optimizers in the benchmarks: ``scape.SparseLoCo`` and ``scape.DiLoCo``.

:mod:`bench.engine.optimizers` builds them for ``RunConfig.optimizer`` in ``("sparseloco",
"diloco")``. The inner optimizer is ``torch.optim.AdamW`` over the runner's param groups (the
same lr, betas and per-group weight decay as the ``adamw_ddp`` row); the runner's LR schedule
edits ``opt.param_groups``, which are the inner optimizer's. The outer hyperparameters come
from ``RunConfig.optimizer_kwargs`` (``sync_every``, ``density``,
``value_bits``, ``ef_decay``, ``outer_lr``, ``block_size`` for SparseLoCo; ``sync_every``,
``outer_lr``, ``outer_momentum``, ``nesterov`` for DiLoCo).

Bytes per step: these optimizers communicate only every ``H = sync_every`` steps, so the
per-step median the runner reports for other optimizers is 0 here; the comparison below uses
the mean over all steps (``bytes_per_step_mean_all_steps``), which is the average over a sync
period when ``steps`` is a multiple of every ``H`` (the final validation loss is then also
taken right after a sync, on the synchronized model).

Rows (``bench.compare --optimizers``, ``bench.research.convergence --local``): the local-step
rows of :data:`bench.engine.rows.ROWS` (``sparseloco-h8-d0.01``, ..., ``diloco-h32``), or a JSON
row with ``"optimizer": "sparseloco"`` and its ``optimizer_kwargs``; the other outer
hyperparameters are the library's defaults.

Running this module compares them with dense sharded AdamS and SCAPE on one workload and
token budget (:data:`WORKLOAD`: ``bench.compare``'s workload as it was measured for the
README, with ``steps`` a multiple of 32; ``--smoke``: :data:`SMOKE`):

    python -m bench.engine.local_sgd_opts --out out/local_sgd         # 249 s measured on 2 cores
    python -m bench.engine.local_sgd_opts --smoke --out /tmp/ls        # seconds
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time
from typing import Any

from bench.engine.optimizers import LOCAL_STEPS
from bench.engine.report import fmt, markdown_table
from bench.engine.rows import resolve as resolve_row
from bench.engine.runner import RunConfig, run

LOCAL_SGD = LOCAL_STEPS
"""Values of ``RunConfig.optimizer`` that take local steps (:mod:`bench.engine.optimizers`)."""

WORKLOAD = dict(model="small", world=4, steps=64, batch=4, seq=128, lr=3e-3, warmup_steps=20,
                eval_every=64, eval_seqs=64)
"""The workload of the README's table (SCAPE's dense warm-up: ``warmup_steps``)."""

SMOKE = dict(model="tiny", world=2, steps=8, batch=2, seq=64, lr=3e-3, warmup_steps=2,
             eval_every=8, eval_seqs=4)
"""``--smoke``: ``bench.compare``'s smoke workload over 8 steps (one sync of H = 8)."""


def sync_warning(name: str, sync_every: int, steps: int) -> str | None:
    """The warning printed when ``steps`` is not a multiple of ``H``, else None."""
    if steps % sync_every == 0:
        return None
    return (f"warning: {name}: {steps} steps is not a multiple of H={sync_every}; its final "
            f"validation loss is rank 0's local model {steps % sync_every} steps after the "
            f"last sync (step {steps - steps % sync_every}), not a synchronized model, and its "
            "bytes per step average over an incomplete sync period")


def steady_bytes(run: dict[str, Any]) -> tuple[float, str]:
    """``(bytes per step per rank, basis)`` of a ``bench.engine.runner`` result for comparisons.

    ``basis`` is ``"median"`` (the runner's per-step median over the timing window, for
    optimizers that communicate every step) or ``"mean_all_steps"`` for the local-step ones,
    whose median is 0: the mean over all steps, i.e. bytes per sync / H averaged over the
    sync periods of the run.
    """
    if run["config"]["optimizer"] in LOCAL_SGD:
        return float(run["bytes_per_step_mean_all_steps"]), "mean_all_steps"
    return float(run["bytes_per_step_total"]), "median"


# --------------------------------------------------------------------------- the comparison
ROWS = ("adams", "scape-0.99", "diloco-h8", "diloco-h32", "sparseloco-h8-d0.01",
        "sparseloco-h8-d0.03", "sparseloco-h32-d0.01", "sparseloco-h32-d0.03")
"""The rows compared, by name (:data:`bench.engine.rows.ROWS`): SparseLoCo at H = 8, 32 and
density 1%, 3% with 2-bit values, DiLoCo at H = 8, 32."""


def configs(workload: dict[str, Any], rows: tuple[str, ...] = ROWS,
            timeout_s: float = 1800.0) -> list[RunConfig]:
    """A RunConfig per row on ``workload`` (SCAPE's dense warm-up: ``warmup_steps``)."""
    w = workload
    skip = min(w["steps"] - 1, w["warmup_steps"] + 2)
    out = []
    for name in rows:
        name, fields = resolve_row(name)
        kwargs = dict(fields.get("optimizer_kwargs") or {})
        if fields["optimizer"] == "scape":
            kwargs = {"warmup_steps": w["warmup_steps"], **kwargs}
        out.append(RunConfig(**{**fields, "optimizer_kwargs": kwargs},
                             model=w["model"], world=w["world"], steps=w["steps"],
                             batch=w["batch"], seq=w["seq"], lr=w["lr"],
                             eval_every=w["eval_every"], eval_seqs=w["eval_seqs"],
                             timing_skip=skip, log_every=0, timeout_s=timeout_s, name=name))
    return out


def table(runs: list[dict[str, Any]]) -> str:
    """Markdown table: loss and bytes per step per rank, with ratios to dense AdamS.

    "per step" is the steady state: the runner's median for optimizers that communicate every
    step (SCAPE past its dense warm-up), the mean over the run (= over whole sync periods) for
    the local-step ones. The mean over all steps, warm-up included, is the last column.
    """
    def steady(r: dict[str, Any]) -> float:
        return steady_bytes(r)[0]

    dense = next((r for r in runs if r["name"] == "adams"), None)
    rows = []
    for r in runs:
        b = steady(r)
        ratio = b / steady(dense) if dense and b else None
        loss_ratio = (r["final_val_loss"] / dense["final_val_loss"]
                      if dense and r["final_val_loss"] else None)
        rows.append([r["name"], fmt(r["final_val_loss"]), fmt(loss_ratio, ".3f"),
                     fmt(int(b)), "-" if not ratio else f"1/{1 / ratio:.0f}",
                     fmt(int(r["bytes_per_step_mean_all_steps"]))])
    return markdown_table(["optimizer", "final val loss", "vs dense AdamS",
                           "bytes/step/rank", "vs dense", "bytes/step/rank, all steps"], rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="SparseLoCo and DiLoCo beside AdamS and SCAPE")
    ap.add_argument("--out", default="out/local_sgd")
    ap.add_argument("--steps", type=int, default=None, help="default: WORKLOAD's (64)")
    ap.add_argument("--only", nargs="+", default=None, help="names of ROWS to run")
    ap.add_argument("--smoke", action="store_true", help="tiny model, W=2, 8 steps")
    args = ap.parse_args(argv)
    w = dict(SMOKE if args.smoke else WORKLOAD)
    if args.smoke:
        rows = ROWS[:3] + ROWS[4:5]  # one sync of H = 8 in the 8 steps
    else:
        w["steps"] = args.steps or w["steps"]
        rows = ROWS
    if args.only:
        rows = tuple(r for r in rows if r in args.only)
    w["eval_every"] = w["steps"]
    os.makedirs(args.out, exist_ok=True)
    started = time.perf_counter()
    runs = []
    for cfg in configs(w, rows):
        print(f"running {cfg.label} ({cfg.steps} steps, W={cfg.world})", flush=True)
        runs.append(run(cfg))
        with open(os.path.join(args.out, f"{cfg.label}.json"), "w") as f:
            json.dump(runs[-1], f, indent=1)
    md = (f"W={w['world']}, model {w['model']} ({runs[0]['params']:,} parameters), "
          f"{w['steps']} steps of {w['batch']}x{w['seq']} tokens per rank, lr {w['lr']:g}, "
          f"unshaped loopback, {datetime.date.today().isoformat()}, {os.cpu_count()} CPUs; "
          f"wall {time.perf_counter() - started:.0f} s\n\n{table(runs)}\n")
    with open(os.path.join(args.out, "report.md"), "w") as f:
        f.write(md)
    with open(os.path.join(args.out, "report.json"), "w") as f:
        json.dump({"workload": w, "runs": runs}, f, indent=1)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
