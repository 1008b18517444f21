"""Step time under a shaped link: median step time of dense sharded AdamS, SCAPE-0.9,
SCAPE-0.99 and the compute-only floor at W=4, at 50, 100 and 1000 Mbit/s and unshaped.

Each cell is one :mod:`bench.engine.runner` run (the workload of ``bench.compare``: the ``small``
GPT, 4 sequences of 128 bytes per rank and step) inside a fresh shaped network namespace
(:mod:`bench.engine.netns`). Runs are short: ``--warmup`` dense steps (they only build SCAPE's first
moment; their length does not change a sparse step's cost), two more, then ``--timed`` steps
whose median is reported. The compute-only run never communicates, so it is measured once,
unshaped, and is the denominator of every rate's ratio.

``--delays 10ms 50ms`` adds a leg on a link of that one-way latency (a round trip twice
it: sites that far apart) instead of the rates: through ``tc netem`` on the namespace's
loopback at 1 Gbit/s where the kernel has ``netem`` (:mod:`bench.engine.netns`), else
modelled in the communicator on the unshaped loopback
(:func:`bench.engine.comm_timing.delayed_communicator`: each collective completes no sooner
than its ring's ``W - 1`` message rounds times the delay); each cell records which. The rows
then differ in how many collectives a step launches (``collectives``), which is what latency
charges.

    python -m bench.step_time                 # writes bench/results/step_time.json
    python -m bench.step_time --smoke         # tiny model, W=2, unshaped only
    python -m bench.step_time --delays 10ms 50ms --out bench/results/step_time_latency.json
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import time
from typing import Any

from bench.compare import make_configs
from bench.compare_exec import run_one
from bench.engine.report import fmt, markdown_table

SCHEMA = "scape.step_time/1"
RATES = ("50mbit", "100mbit", "1gbit", "none")
OPTIMIZERS = ("adams", "scape-0.9", "scape-0.99", "scape-0.99-wire8")
"""The rows it can time (``scape-0.99-wire8``: the 8-bit wire, gradients and parameters)."""
DEFAULT_OPTIMIZERS = ("adams", "scape-0.9", "scape-0.99")
DELAY_RATE = "1gbit"
"""The rate under a ``netem`` delay: fast enough that the delay is what a step pays for."""


def workload(smoke: bool, warmup: int, timed: int) -> dict[str, Any]:
    steps = warmup + 2 + timed
    if smoke:
        return dict(model="tiny", world=2, steps=steps, batch=2, seq=64, lr=3e-3,
                    warmup_steps=warmup, eval_every=steps, eval_seqs=4)
    return dict(model="small", world=4, steps=steps, batch=4, seq=128, lr=3e-3,
                warmup_steps=warmup, eval_every=steps, eval_seqs=16)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rates", nargs="+", default=list(RATES),
                    help="tc rates; 'none' is the unshaped loopback")
    ap.add_argument("--optimizers", nargs="+", default=list(DEFAULT_OPTIMIZERS),
                    help=f"subset of {OPTIMIZERS}")
    ap.add_argument("--delays", nargs="+", default=None,
                    help="one-way link latencies ('10ms', '50ms'): a leg per delay instead of "
                         "--rates (module docstring)")
    ap.add_argument("--warmup", type=int, default=5, help="SCAPE dense warm-up steps")
    ap.add_argument("--timed", type=int, default=12, help="steps in the median")
    ap.add_argument("--out", default="bench/results/step_time.json")
    ap.add_argument("--runs-dir", default=None,
                    help="per-run JSON (default: out/step_time_runs, or beside a given --out)")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--timeout", type=float, default=600.0, help="deadline per run (s)")
    args = ap.parse_args(argv)
    bad = [n for n in args.optimizers if n not in OPTIMIZERS]
    if bad:
        raise ValueError(f"--optimizers must be among {OPTIMIZERS}, got {bad}")
    if args.smoke:
        args.rates, args.warmup, args.timed = ["none"], 2, 3
    w = workload(args.smoke, args.warmup, args.timed)
    rates = [None if r == "none" else r for r in args.rates]
    links: list[tuple[str | None, float]] = [(r, 0.0) for r in rates]  # (tc link, modelled ms)
    latency = None
    if args.delays:
        from bench.engine.netns import netem_available, parse_delay

        delays = [parse_delay(d) for d in args.delays]
        has_netem, why = netem_available()
        latency = "netem" if has_netem else f"modelled in the communicator ({why})"
        print(f"latency: {latency}", flush=True)
        links = [(f"{DELAY_RATE}+{ms:g}ms", 0.0) if has_netem else (None, ms) for ms in delays]
    if any(link for link, _ in links):
        from bench.engine.netns import require

        require()
    runs_dir = args.runs_dir or os.path.join(os.path.dirname(os.path.abspath(args.out)),
                                             "step_time_runs")
    if args.runs_dir is None and args.out == ap.get_default("out"):
        runs_dir = os.path.join("out", "step_time_runs")  # per-run JSON stays out of git
    os.makedirs(runs_dir, exist_ok=True)
    started = time.perf_counter()

    def one(name: str, rate: str | None, delay_ms: float = 0.0) -> dict[str, Any]:
        (cfg,) = make_configs([name], w, None, None, args.timeout)
        cfg = dataclasses.replace(cfg, link_delay_ms=delay_ms)
        label = label_of(rate, delay_ms)
        path = os.path.join(runs_dir, f"{name}@{label}.json")
        r = run_one(cfg, path, rate)
        print(f"{name:16s} {label:14s} median step "
              f"{r['median_step_s'] * 1e3:8.1f} ms (wait {r['median_wait_s'] * 1e3:.1f} ms)",
              flush=True)
        return r

    floor = one("compute_only", None)
    cells = []
    for rate, delay_ms in links:
        for name in args.optimizers:
            r = one(name, rate, delay_ms)
            cells.append({"optimizer": name, "rate": label_of(rate, delay_ms),
                          "collectives_per_step": r.get("collectives_per_step"),
                          "median_step_s": r["median_step_s"],
                          "median_wait_s": r["median_wait_s"],
                          "median_compute_s": r["median_compute_s"],
                          "bytes_per_step": r["bytes_per_step_total"],
                          "ratio_to_compute_only": r["median_step_s"] / floor["median_step_s"]})
    report = {"schema": SCHEMA, "date": datetime.date.today().isoformat(),
              "command": " ".join(["python -m bench.step_time"] + (argv or [])),
              "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
              "workload": w, "timing_window": floor["timing_window"], "latency": latency,
              "compute_only_step_s": floor["median_step_s"], "cells": cells,
              "wall_s": time.perf_counter() - started}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(render(report))
    print(f"wrote {args.out}")
    return 0


def label_of(rate: str | None, delay_ms: float) -> str:
    """A cell's link: the tc link, ``+Dms (modelled)`` for a delay in the communicator, or
    ``unshaped``."""
    if delay_ms:
        return f"+{delay_ms:g}ms (modelled)"
    return rate or "unshaped"


def render(report: dict[str, Any]) -> str:
    """Markdown: one row per rate, median step (ms) and ratio to compute-only per optimizer."""
    rates = list(dict.fromkeys(c["rate"] for c in report["cells"]))
    names = [n for n in OPTIMIZERS if any(c["optimizer"] == n for c in report["cells"])]
    rows = []
    for rate in rates:
        by = {c["optimizer"]: c for c in report["cells"] if c["rate"] == rate}
        row = [rate]
        for name in names:
            c = by.get(name)
            row.append("-" if c is None else
                       f"{c['median_step_s'] * 1e3:.0f} ({c['ratio_to_compute_only']:.2f}x)")
        dense, s99 = by.get("adams"), by.get("scape-0.99")
        row.append(fmt(dense["median_step_s"] / s99["median_step_s"], ".2f")
                   if dense and s99 else "-")
        rows.append(row)
    head = [f"link (compute-only {report['compute_only_step_s'] * 1e3:.0f} ms)",
            *[f"{n} ms (vs compute-only)" for n in names], "dense / scape-0.99"]
    return markdown_table(head, rows)


if __name__ == "__main__":
    raise SystemExit(main())
