"""The training-run engine of the benchmarks: one optimizer, W ranks, one JSON-able result.

``run(RunConfig(...))`` launches W processes (torch.distributed, gloo over a file store on the
loopback -- it works inside a network namespace where only ``lo`` exists), and each rank trains
the same :mod:`bench.workloads.gpt` model from the same seed on its disjoint share of the global
batch (:func:`bench.workloads.data.batch_at`). Every optimizer sees the same data order, token
budget and LR schedule (linear warm-up, then cosine decay to 10%). Rank 0 evaluates the validation
loss on the fixed held-out windows every ``eval_every`` steps and at the end (outside the timed
region; the other ranks wait at a barrier).

Optimizers (``RunConfig.optimizer``) are the entries of :data:`bench.engine.optimizers.OPTIMIZERS`
(``adamw_ddp``, ``dist_adamw``, ``adams``, ``scape``, ``topk``, ``compute_only``,
``sparseloco``, ``diloco``). ``compute_only`` is ``scape.SCAPE`` at ``sparsity`` on a
communicator that moves nothing: the same per-rank work with no collectives (the step-time
floor; its model is not trained across ranks, so it reports no validation loss; a barrier
outside the timed region starts each step on every rank together, as a real run's collectives
do).

The modules: :mod:`bench.engine.run_config` (the :class:`RunConfig` and its LR schedule),
:mod:`bench.engine.run_rank` (the body of one rank), this one (launch, collect, summarize, the CLI).

What is measured, per rank and step (a step = ``grad_accum`` forward/backward passes and the
optimizer step; data sampling and evaluation are outside it):

- ``step_s``: wall time of the step;
- ``wait_s``: time spent blocked on communication: inside ``Work.wait()`` of every collective
  (scape optimizers and top-k, through a timing wrapper around the communicator), or for DDP
  the union of the gradient buckets' launch-to-completion intervals (an upper bound of the
  exposed time, since an early bucket overlaps with the rest of backward);
- ``compute_s = step_s - wait_s``: the local work;
- bytes: the step's payload bytes by collective, from ``comm.stats`` (the library's counters,
  the convention of :mod:`scape.comm`: all_gather counts its output, reduce_scatter and
  all_to_all their input).
  DDP is counted from its buckets through a comm hook: a ring all-reduce of a bucket of ``n``
  bytes is a reduce-scatter plus an all-gather of ``n`` bytes each, so it counts ``2n``, the
  same ``N*(b_g + b_p)`` convention as the sharded optimizers' ``N_pad*(b_g + b_p)``.

Medians are over the steady-state window, steps ``timing_skip+1 .. steps`` (default: past the
SCAPE dense warm-up plus two), the same window for every optimizer of a comparison.

    python -m bench.engine.runner --config '{"optimizer": "scape", "sparsity": 0.99}' --out r.json
    python -m bench.engine.runner --config cfg.json --out r.json       # a JSON file works too
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from typing import Any

from bench.engine.launch import Ranks, launch
from bench.engine.run_config import OPTIMIZERS, RunConfig, load_config, lr_at
from bench.engine.run_rank import param_digest, rank_body

__all__ = ["OPTIMIZERS", "SCHEMA", "RunConfig", "load_config", "lr_at", "main", "param_digest",
           "run", "summarize"]

SCHEMA = "scape.run/1"
"""``schema`` field of the dict :func:`run` returns."""


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


# --------------------------------------------------------------------------- the driver
def run(cfg: RunConfig) -> dict[str, Any]:
    """Train ``cfg`` on ``cfg.world`` ranks (:mod:`bench.engine.launch`) and return
    the summary dict.

    Raises ``RuntimeError`` with every failing rank's traceback, or ``TimeoutError`` after
    killing every rank when ``cfg.timeout_s`` passes. Interrupted (Ctrl-C, or SIGTERM on the
    main thread), it kills every rank before the exception leaves it; killed outright
    (SIGKILL), its ranks get SIGKILL from the kernel on Linux (``PR_SET_PDEATHSIG``).
    """
    if not isinstance(cfg, RunConfig):
        raise TypeError(f"run() takes a RunConfig, got {type(cfg).__name__}")
    started = time.perf_counter()
    per_node = cfg.world // cfg.nodes
    spec = Ranks(world=cfg.world, timeout_s=cfg.timeout_s,
                 backend="nccl" if cfg.device == "cuda" else "gloo", threads=cfg.threads,
                 netns=None if cfg.node_netns is None else
                 [cfg.node_netns[r // per_node] for r in range(cfg.world)],
                 fail_fast=True, label=f"run {cfg.label} (RunConfig.timeout_s)")
    outcomes = launch(rank_body, spec, dataclasses.asdict(cfg))
    if not all(o.ok for o in outcomes):
        errors = {o.rank: o.error for o in outcomes if not o.ok and o.exc_type is not None}
        missing = [o.rank for o in outcomes if not o.ok and o.exc_type is None]
        text = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
        codes = ", ".join(f"rank {o.rank}: {o.exitcode}" for o in outcomes)
        raise RuntimeError(f"run {cfg.label} failed; ranks without a result: "
                           f"{sorted(errors) + missing} (exit codes {codes})\n{text}")
    return summarize(cfg, [o.result for o in outcomes], time.perf_counter() - started)


def summarize(cfg: RunConfig, ranks: list[dict[str, Any]], wall_s: float) -> dict[str, Any]:
    """The JSON-able result of a run from every rank's records."""
    r0 = ranks[0]
    window = slice(cfg.skip, cfg.steps)
    steady = r0["records"][window]
    step_s = [r["step_s"] for r in steady]
    compute = [[r["step_s"] - r["wait_s"] for r in rk["records"][window]] for rk in ranks]
    ops = sorted({op for r in r0["records"] for op in r["bytes"]})
    bytes_steady = {op: _median([float(r["bytes"].get(op, 0)) for r in steady]) or 0.0
                    for op in ops}
    bytes_steady = {op: b for op, b in bytes_steady.items() if b}
    bytes_mean = {op: sum(r["bytes"].get(op, 0) for r in r0["records"]) / cfg.steps
                  for op in ops}
    val_curve = [list(v) for v in r0["val_curve"]]
    return {
        "schema": SCHEMA,
        "name": cfg.label,
        "config": dataclasses.asdict(cfg),
        "optimizer_settings": r0.get("optimizer_settings", {}),
        "params": r0["params"],
        "param_sha256": r0.get("param_sha256"),
        "param_sha256_ranks_agree": len({rk.get("param_sha256") for rk in ranks}) == 1,
        "final_val_loss": val_curve[-1][1] if val_curve else None,
        "val_curve": val_curve,
        "train_curve": [r["train_loss"] for r in r0["records"]],
        "timing_window": [cfg.skip + 1, cfg.steps],
        "median_step_s": _median(step_s),
        "median_wait_s": _median([r["wait_s"] for r in steady]),
        "median_compute_s": _median(compute[0]),
        "median_compute_s_by_rank": [_median(c) for c in compute],
        "step_s": [r["step_s"] for r in r0["records"]],
        "bytes_per_step": bytes_steady,
        "bytes_per_step_total": sum(bytes_steady.values()),
        "collectives_per_step": _median([float(r.get("calls", 0)) for r in steady]),
        "bytes_per_step_mean_all_steps": sum(bytes_mean.values()),
        "bytes_by_step": [sum(r["bytes"].values()) for r in r0["records"]],
        "bytes_last_step": dict(r0["records"][-1]["bytes"]),
        "dense_steps": sum(1 for r in r0["records"] if r["dense"]),
        # two emulated nodes: per node (its first rank's reading), the bytes its end of the
        # link sent per step, median over the timed steps (the wire's own count)
        "link_tx_per_step_by_node": [
            _median([float(r["link_tx"]) for r in rk["records"][window]])
            for rk in ranks[::cfg.world // cfg.nodes]] if cfg.node_netns else None,
        "phases": r0["phases"],
        "hooks": r0.get("hooks", {}),
        "n_pad": r0.get("n_pad"),
        "mask_rows": r0.get("mask_rows"),
        "max_rss_mb_by_rank": [rk.get("max_rss_mb") for rk in ranks],
        "device": r0.get("device", "cpu"),
        "wall_s": wall_s,
        "train_wall_s": max(rk["wall_s"] for rk in ranks),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Run one benchmark training run on W ranks.")
    ap.add_argument("--config", required=True, help="RunConfig as JSON, or a JSON file")
    ap.add_argument("--out", default=None, help="write the result JSON here (else stdout)")
    args = ap.parse_args(argv)
    cfg = load_config(args.config)
    result = run(cfg)
    text = json.dumps(result, indent=1)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text)
        print(f"[{cfg.label}] final val loss {result['final_val_loss']} | median step "
              f"{result['median_step_s'] * 1e3:.1f} ms | {result['bytes_per_step_total']:,.0f} "
              f"B/step/rank -> {args.out}", flush=True)
    else:
        sys.stdout.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
