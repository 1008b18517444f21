"""Convergence ablation and the quality research: how close SCAPE gets to dense AdamS at 99%
sparsity.

Trains the bundled byte-level GPT on the stdlib corpus once per variant -- dense sharded
AdamS (a learning-rate sweep picks its lr), SCAPE rules and schedules at sparsity 0.9 and
0.99 -- with the same seed, data order, token budget and LR schedule, and writes the final
validation loss of each and its ratio to dense AdamS.

**Why one process.** SCAPE with W ranks is, up to fp32 summation order, the same algorithm
as SCAPE with one rank fed the global batch: the take is linear, so the ranks' residuals sum
to the single-rank residual; the reduce-scatter (avg) delivers the global-batch gradient;
masks are per block and do not depend on W (padding aside). The ablation therefore runs
W = 1 with the global batch and spends the machine's cores on the model instead of on
process overhead. Every row trains through the engine's one loop
(:func:`bench.engine.runner.run`, one rank; the research schedules are ``RunConfig.hooks``,
:mod:`bench.research.convergence_train`); ``--check-world 4`` re-runs the first sparse variant
on 4 gloo ranks (same data, schedule and seed) to confirm the equivalence on this workload, and
``--ranks W`` trains every row on W ranks. (The raw-gradient top-k peer
baseline is *not* W-invariant; it is measured by ``bench.compare`` on W ranks.)

**Local-step rows** (``--local``): SparseLoCo and DiLoCo are *not* W-invariant either (each
rank trains alone between syncs), so they run on ``--world`` gloo ranks (default 4) through
:mod:`bench.engine.runner`, each rank on its ``1/W`` of the same global batch: the same tokens, lr
schedule, seed, data order and validation windows as the single-process rows. The inner
optimizer is AdamW (:mod:`bench.engine.optimizers`) at the ablation's lr (the
dense sweep's choice, or ``--local-lr``, which labels the rows). The rows are those of
:mod:`bench.engine.rows` (``sparseloco-h8-d0.01``, ``diloco-h8``, ...; ``all``:
:data:`LOCAL_ROWS`) or JSON rows (``'{"name": "sparseloco-h3-d0.03", "optimizer":
"sparseloco", "optimizer_kwargs": {"sync_every": 3, "density": 0.03}}'``).
They are evaluated at sync points (every multiple of ``H`` near ``eval_every``) and at the
end; when ``steps`` is not a multiple of ``H`` a warning is printed and the row also records
its loss at the last sync. Every row records its bytes per step per rank (mean over the run;
the single-process rows count at W=1, which differs from W ranks only by padding), and the
report has dense sharded AdamS's ``N_pad * (4 + 4) + 8`` at ``--world`` for reference.
``--adamw-reference`` adds dense AdamW at the local-step rows' inner lr (one process: dense
data-parallel AdamW is W-invariant like SCAPE), which separates the inner optimizer from the
local steps.

    python -m bench.research.convergence --steps 400 --out bench/results/convergence_400.json
    python -m bench.research.convergence --steps 400 --lr 0.0003 --dense-loss 2.2193 \
        --variants none --local sparseloco-h8-d0.01 diloco-h8 --threads 1 \
        --out bench/results/local.json
    python -m bench.research.convergence --smoke            # seconds; CI checks the schema

The rows are :mod:`bench.research.rows`; training is :mod:`bench.research.convergence_train`,
the ``--table`` and ``--plot`` readers :mod:`bench.research.convergence_report`; this module is
the CLI.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import sys
import time
from typing import Any

from bench.compare_report import environment
from bench.engine.local_sgd_opts import sync_warning
from bench.engine.runner import run
from bench.research.convergence_report import SCHEMA, gap_series, plot_gap, table
from bench.research.convergence_train import (
    LOCAL_ROWS,
    Workload,
    dense_bytes_per_step,
    local_variant,
    run_config,
    train,
    train_local,
)
from bench.research.rows import variants

__all__ = ["DENSE_LRS", "LOCAL_ROWS", "SCHEMA", "Workload", "dense_bytes_per_step",
           "gap_series", "local_variant", "main", "plot_gap", "run_config", "table", "train",
           "train_local", "variants"]

DENSE_LRS = (1e-3, 3e-3, 1e-2)
"""The learning rates of the dense AdamS sweep (``--dense-lrs``)."""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--accum", type=int, default=1, help="micro-batches per step")
    ap.add_argument("--sparsity", type=float, nargs="+", default=[0.9, 0.99])
    ap.add_argument("--variants", nargs="*", default=None,
                    help="row names without @sparsity (default: all)")
    ap.add_argument("--dense-lrs", type=float, nargs="+", default=list(DENSE_LRS))
    ap.add_argument("--lr", type=float, default=None,
                    help="skip the dense sweep and use this lr (the sweep's choice)")
    ap.add_argument("--warmup", type=int, default=20, help="dense warm-up steps")
    ap.add_argument("--dense-loss", type=float, default=None,
                    help="with --lr: the dense AdamS loss measured by an earlier run of the "
                         "same workload; skips the dense run (ratios use this value)")
    ap.add_argument("--no-dense", action="store_true",
                    help="with --lr: skip the dense run and record no ratio (for a dense run "
                         "going on in parallel; --table fills the ratios in from the dense "
                         "run's file or --dense-loss)")
    ap.add_argument("--model", default="small")
    ap.add_argument("--data", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None, help="JSON output (default bench/results/...)")
    ap.add_argument("--seed", type=int, default=0,
                    help="model init and data order (every row of a run shares it; compare "
                         "only with a dense run of the same seed)")
    ap.add_argument("--smoke", action="store_true", help="tiny model, a few steps")
    ap.add_argument("--check-world", type=int, default=0,
                    help="re-run the first sparse variant on this many gloo ranks "
                         "(bench.engine.runner) and report its final loss beside the "
                         "single-process one")
    ap.add_argument("--local", nargs="+", default=None, metavar="ROW",
                    help="local-step rows on --world gloo ranks: names of bench.engine.rows "
                         "(e.g. sparseloco-h8-d0.01, diloco-h8), JSON rows, or 'all' ("
                         + " ".join(LOCAL_ROWS) + ")")
    ap.add_argument("--world", type=int, default=None,
                    help="ranks of the local-step rows (default 4; 2 with --smoke)")
    ap.add_argument("--ranks", type=int, default=0,
                    help="train the ablation rows on this many gloo ranks "
                         "(bench.engine.runner), each fed batch/ranks sequences, instead of "
                         "one process fed the global batch: the rules' local statistics are "
                         "then a real run's")
    ap.add_argument("--local-lr", type=float, default=None,
                    help="inner AdamW lr of the local-step rows (default: the ablation's lr; "
                         "another value is added to the row names)")
    ap.add_argument("--adamw-reference", action="store_true",
                    help="also train dense AdamW (scape.DistributedAdamW, one process, at the "
                         "local-step rows' inner lr): their inner optimizer without local steps")
    ap.add_argument("--table", nargs="+", default=None, metavar="JSON",
                    help="print a markdown table of these result files and exit; ratios of "
                         "--no-dense files come from --dense-loss or the dense rows of the "
                         "same workload among the files")
    ap.add_argument("--plot", default=None, metavar="PNG",
                    help="with --table: also plot the ratio to dense against steps x density")
    args = ap.parse_args(argv)
    if args.table:
        print(table(args.table, args.dense_loss))
        if args.plot:
            print(f"wrote {args.plot}" if plot_gap(args.table, args.plot, args.dense_loss)
                  else "no plot written")
        return 0

    w = Workload(model=args.model, steps=args.steps, accum=args.accum, threads=args.threads,
                 eval_every=max(1, args.steps // 4), seed=args.seed, data=args.data)
    if args.smoke:
        w = dataclasses.replace(w, model="tiny", steps=6, batch=4, seq=64, eval_every=3,
                                eval_seqs=4)
        args.dense_lrs, args.sparsity, args.warmup = [3e-3], [0.9], 2
        args.variants = args.variants or ["lazy", "catchup_accum"]
    world = args.world or (2 if args.smoke else 4)
    local_names = list(LOCAL_ROWS) if args.local == ["all"] else (args.local or [])
    warnings: list[str] = []
    try:
        for name in local_names:
            v = local_variant(name, 1.0)
            run_config(v, w, world)  # validates the row and the world size
            warnings += [t for t in [sync_warning(v["name"], v["sync_every"], w.steps)] if t]
    except ValueError as e:
        ap.error(f"--local/--world: {e}")
    for text in warnings:
        print(text, flush=True)
    out = args.out or f"bench/results/convergence_{w.steps}_accum{w.accum}.json"
    results: list[dict[str, Any]] = []
    started = time.perf_counter()

    if (args.dense_loss is not None or args.no_dense) and args.lr is None:
        ap.error("--dense-loss and --no-dense need --lr (the dense run's learning rate)")
    if args.dense_loss is not None and args.no_dense:
        ap.error("--dense-loss and --no-dense exclude each other")
    lrs = [args.lr] if args.lr is not None else args.dense_lrs
    dense_rows = []
    for lr in lrs if args.dense_loss is None and not args.no_dense else []:
        print(f"dense AdamS lr={lr:g}", flush=True)
        r = train(dict(name=f"dense-adams-lr{lr:g}", sparsity=0.0, lr=lr), w)
        dense_rows.append(r)
    if dense_rows:
        best = min(dense_rows, key=lambda r: r["final_val_loss"])
        lr, dense_loss = best["variant"]["lr"], best["final_val_loss"]
    else:
        lr, dense_loss = args.lr, args.dense_loss
    results += dense_rows
    if args.adamw_reference:
        adamw_lr = lr if args.local_lr is None else args.local_lr
        print(f"dense AdamW lr={adamw_lr:g}", flush=True)
        results.append(train(dict(name=f"dense-adamw-lr{adamw_lr:g}", optimizer="adamw",
                                  lr=adamw_lr), w))
    for v in variants(args.sparsity, args.variants, args.warmup):
        v["lr"] = lr
        print(f"{v['name']} (lr {lr:g}{f', {args.ranks} ranks' if args.ranks else ''})",
              flush=True)
        results.append(train(v, w, args.ranks or 1))
    for name in local_names:
        inner_lr = lr if args.local_lr is None else args.local_lr
        v = local_variant(name, inner_lr, label_lr=inner_lr != lr)
        print(f"{v['name']} on {world} gloo ranks (AdamW inner, lr {inner_lr:g})", flush=True)
        results.append(train_local(v, w, world))
    world_check = None
    sparse_rows = [r for r in results if r["variant"].get("sparsity", 0) > 0]
    if args.check_world and sparse_rows:
        first = sparse_rows[0]
        print(f"{first['variant']['name']} on {args.check_world} ranks", flush=True)
        multi = run(run_config(first["variant"], w, args.check_world))
        world_check = {"variant": first["variant"]["name"], "world": args.check_world,
                       "single_process_val_loss": first["final_val_loss"],
                       "multi_rank_val_loss": multi["final_val_loss"],
                       "multi_rank_val_curve": multi["val_curve"],
                       "relative_difference": multi["final_val_loss"] / first["final_val_loss"]
                       - 1.0}
        print(f"  W=1 {first['final_val_loss']:.4f}  W={args.check_world} "
              f"{multi['final_val_loss']:.4f}", flush=True)
    for r in results:
        r["ratio_to_dense"] = None if dense_loss is None else r["final_val_loss"] / dense_loss
    report = {"schema": SCHEMA, "workload": dataclasses.asdict(w), "dense_lr": lr,
              "dense_val_loss": dense_loss,
              "command": " ".join(["python -m bench.research.convergence"]
                                  + (argv or sys.argv[1:])),
              "machine": platform.processor() or platform.machine(),
              "environment": environment("cpu", None),
              "date": datetime.date.today().isoformat(),
              "wall_s": time.perf_counter() - started, "world_check": world_check,
              "warnings": warnings, "results": results}
    if local_names:
        report["dense_adams_bytes_per_step"] = {
            "world": world, "bytes": dense_bytes_per_step(w, world),
            "formula": "N_pad * (4 + 4) + 8, N_pad from the library's buckets"}
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"\n{'variant':34s} {'val loss':>9s} {'ratio':>7s} {'bytes/step/rank':>16s}")
    for r in results:
        ratio = "–" if r["ratio_to_dense"] is None else f"{r['ratio_to_dense']:.3f}"
        print(f"{r['variant']['name']:34s} {r['final_val_loss']:9.4f} "
              f"{ratio:>7s} {r['bytes_per_step']:16,.0f}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
