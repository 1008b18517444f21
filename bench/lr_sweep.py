"""Each optimizer at its own best learning rate, per workload and training length.

A comparison at one shared learning rate can flatter the optimizer whose steps are smaller (it
tolerates a larger lr), so this job gives every optimizer the same grid of peak learning rates
(``--lrs``, default 3e-4, 1e-3, 3e-3), picks per optimizer, workload and length the lr with
the lowest final validation loss (the mean over ``--seeds``), and reports the **ratio of
bests**: an optimizer's best loss over dense sharded AdamS's best
(:mod:`bench.lr_sweep_report`). Each length of ``--steps`` is a run of its own (the schedule,
5% linear warm-up then cosine to 10%, spans the run), so the ratio against length is a curve
of separate runs, not one run's checkpoints.

Workloads (``--workloads``), all in the **newcomer configuration**: one param group with
weight decay 0.1 on every parameter (norms, embeddings and head included), the optimizers'
defaults otherwise (20 dense warm-up steps for the sparse rows):

===========  ===========================================================================
``gpt``      the bundled ``small`` GPT (836,736 parameters, tied head) on the standard
             library's Python sources (:mod:`bench.workloads.gpt`, :mod:`bench.workloads.data`)
``llama``    ``llama-small`` (1,252,992 parameters: RMSNorm, SwiGLU, rotary, untied head) on
             the English prose CPython ships (:mod:`bench.workloads.llama`,
             :mod:`bench.workloads.prose`)
``headers``  ``small-bpe`` (1,328,256 parameters, untied head, 2,048-token vocabulary) on
             torch's C++ headers under a BPE (:mod:`bench.workloads.headers`): kept apart from
             the rules' tuning, to judge a default on; not in ``--smoke`` (its first load
             tokenizes ~39 MB, ~40 s)
===========  ===========================================================================

Every run is :func:`bench.engine.runner.run` on W=4 gloo ranks (global batch 16 x 128 bytes, betas
(0.9, 0.95), validation loss on 128 fixed held-out windows). The rows (``--optimizers``) are
those of :mod:`bench.engine.rows`: a name of its table (``adams``, dense sharded AdamS, the
reference; ``scape-0.9``, ``scape-0.99``, ``topk-0.99`` (raw-gradient top-k,
:mod:`bench.engine.topk_baseline`), ``scape-0.99@robust``, ...; the research's rows under
``python -m bench.research bench.lr_sweep``), or a row as JSON, inline or in a
``.json``/``.toml`` file: ``'{"name": "scape-0.95-ramp", "optimizer": "scape", "sparsity":
0.95, "optimizer_kwargs": {"update": "agree"}, "group_sparsity": {"embed": 0.5},
"sparsity_ramp": [0.5, 20]}'`` trains SCAPE at 0.95 with ``update="agree"``, the embedding
matrices in a param group of their own at 0.5 (every group still decayed) and the sparsity
ramped from 0.5 over the first 20 sparse steps (:class:`scape.SparsityRamp`). The
JSON (schema ``scape.lr_sweep/1``) is rewritten after every run; ``--resume`` keeps the runs of
an earlier file with the same settings. ``--jobs N`` trains N runs at once, each rank on
``cpu_count // (N * W)`` threads (at least one): on a 2-core machine it gains nothing; on 16
cores seven 2,000-step ``gpt`` runs at once, a thread per rank, took about 300 s.

    python -m bench.lr_sweep --steps 600 --out bench/results/lr_sweep_600.json
    python -m bench.lr_sweep --steps 200 400 --seeds 0 1 --optimizers adams scape-0.99
    python -m bench.lr_sweep --optimizers adams scape-0.99 scape-0.99@robust --lrs 3e-4
    python -m bench.lr_sweep --steps 2000 --lrs 3e-4 5e-4 1e-3 --jobs 4  # a 16-core machine
    python -m bench.lr_sweep --table bench/results/lr_sweep_*.json --plot ratio.png
    python -m bench.lr_sweep --smoke --out /tmp/sweep.json          # seconds (CI)
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import datetime
import itertools
import json
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from multiprocessing import active_children
from typing import Any

from bench.compare_report import environment
from bench.engine.launch import sigterm_unwinds
from bench.engine.rows import resolve as resolve_row
from bench.engine.runner import RunConfig, run
from bench.lr_sweep_report import markdown, plot_ratios, select_best

SCHEMA = "scape.lr_sweep/1"
WORKLOADS: dict[str, dict[str, Any]] = {
    "gpt": {"model": "small", "data": None, "label": "small GPT, stdlib sources"},
    "llama": {"model": "llama-small", "data": "pydoc-topics",
              "label": "llama-small, pydoc prose"},
    "headers": {"model": "small-bpe", "data": "torch-headers-bpe",
                "label": "small-bpe GPT, torch's C++ headers under a 2,048-token BPE"},
}
"""The workloads: the two bundled ones the rules were tuned on, and ``headers``
(:mod:`bench.workloads.headers`), kept apart from that tuning to judge the defaults on."""
DEFAULT_WORKLOADS = ("gpt", "llama")
"""The workloads a sweep runs unless ``--workloads`` names others (each ``--smoke`` has)."""
SMOKE_WORKLOADS: dict[str, dict[str, Any]] = {
    "gpt": {"model": "tiny", "data": None, "label": "tiny GPT, stdlib sources"},
    "llama": {"model": "llama-tiny", "data": "pydoc-topics", "label": "llama-tiny, pydoc prose"},
}
COMMON: dict[str, Any] = {"world": 4, "batch": 4, "seq": 128, "weight_decay": 0.1,
                          "one_group": True, "eval_seqs": 128, "warmup_steps": None}
"""Shared by every run (``warmup_steps`` None: the sparse rows' library default)."""
SMOKE_COMMON: dict[str, Any] = {"world": 2, "batch": 2, "seq": 32, "weight_decay": 0.1,
                                "one_group": True, "eval_seqs": 4, "warmup_steps": 2}
DEFAULTS = {"optimizers": ["adams", "scape-0.9", "scape-0.99", "topk-0.99"],
            "lrs": [3e-4, 1e-3, 3e-3], "steps": [600]}
SMOKE = {"optimizers": ["adams", "scape-0.99"], "lrs": [1e-3, 3e-3], "steps": [6]}
GUESS_STEP_S = {"small": 0.15, "llama-small": 0.2, "small-bpe": 0.25}
"""Seconds per step on 2 cores before one run of the workload has finished (the ETA)."""


def eval_every(steps: int) -> int:
    """Validation every 100 steps, or four times in a shorter run."""
    return min(100, max(1, steps // 4))


def make_config(workload: dict[str, Any], common: dict[str, Any],
                row: str | tuple[str, dict[str, Any]], steps: int, lr: float, seed: int,
                name: str, timeout_s: float) -> RunConfig:
    """The run of ``row`` (a name of :data:`bench.engine.rows.ROWS`, a JSON/TOML row, or
    ``(name, fields)`` as :func:`bench.engine.rows.resolve` returns them) on ``workload``:
    ``common["warmup_steps"]`` is the dense warm-up of every row but ``adams`` (None: the
    library's default; a row's own ``warmup_steps`` wins)."""
    _, fields = resolve_row(row) if isinstance(row, str) else row
    kwargs: dict[str, Any] = {} if common["warmup_steps"] is None or \
        fields["optimizer"] == "adams" else {"warmup_steps": common["warmup_steps"]}
    kwargs.update(fields.get("optimizer_kwargs") or {})
    return RunConfig(**{**fields, "optimizer_kwargs": kwargs},
                     model=workload["model"], data=workload["data"], world=common["world"],
                     steps=steps, batch=common["batch"], seq=common["seq"], lr=lr,
                     weight_decay=common["weight_decay"], one_group=common["one_group"],
                     seed=seed, eval_every=eval_every(steps), eval_seqs=common["eval_seqs"],
                     log_every=0 if steps < 100 else 100, timeout_s=timeout_s, name=name)


def record(key: dict[str, Any], result: dict[str, Any]) -> dict[str, Any]:
    """The JSON record of one run: its key, final and curve losses, cost."""
    loss = result["final_val_loss"]
    train = result["train_curve"]
    tail = train[-max(1, len(train) // 20):]
    return {**key, "final_val_loss": loss if loss is not None and math.isfinite(loss) else None,
            "val_curve": result["val_curve"],
            "train_loss_last5pct": sum(tail) / len(tail) if all(map(math.isfinite, tail))
            else None,
            "params": result["params"], "ranks_agree": result["param_sha256_ranks_agree"],
            "dense_steps": result["dense_steps"],
            "bytes_per_step": result["bytes_per_step_total"],
            "bytes_per_step_mean_all_steps": result["bytes_per_step_mean_all_steps"],
            "median_step_s": result["median_step_s"], "wall_s": result["wall_s"]}


def _key(r: dict[str, Any]) -> tuple[str, str, int, float, int]:
    return (r["workload"], r["optimizer"], int(r["steps"]), float(r["lr"]), int(r["seed"]))


def _clock(seconds: float) -> str:
    s = max(0, int(round(seconds)))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def build_report(argv: list[str] | None, settings: dict[str, Any], runs: list[dict[str, Any]],
                 env: dict[str, Any], wall_s: float, complete: bool) -> dict[str, Any]:
    labels = {k: w["label"] for k, w in settings["workloads"].items()}
    best = select_best(runs)
    return {"schema": SCHEMA,
            "command": " ".join(["python -m bench.lr_sweep"]
                                + (sys.argv[1:] if argv is None else list(argv))),
            "date": datetime.date.today().isoformat(), "environment": env,
            "settings": settings, "complete": complete, "best": best,
            "table_md": markdown(best, labels), "runs": runs, "wall_s": wall_s}


def _load(paths: list[str]) -> tuple[list[dict[str, Any]], dict[str, str]]:
    runs: dict[tuple[str, str, int, float, int], dict[str, Any]] = {}
    labels: dict[str, str] = {}
    for path in paths:
        with open(path) as f:
            d = json.load(f)
        if d.get("schema") != SCHEMA:
            raise ValueError(f"{path}: schema {d.get('schema')!r}, expected {SCHEMA!r}")
        labels.update({k: w["label"] for k, w in d["settings"]["workloads"].items()})
        for r in d["runs"]:
            if _key(r) in runs and runs[_key(r)]["final_val_loss"] != r["final_val_loss"]:
                raise ValueError(f"{path}: run {_key(r)} differs from an earlier file's")
            runs[_key(r)] = r
    return list(runs.values()), labels


def execute(todo: list[dict[str, Any]], jobs: int,
            launch: Callable[[int, dict[str, Any]], dict[str, Any]]
            ) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """``(plan entry, launch(i, entry))`` for each entry of ``todo`` as its run ends, ``jobs``
    at a time (one: in order, on this thread). If one fails, or this process is interrupted or
    terminated, every run still going is stopped (its ranks killed) and none is started before
    the exception leaves: no rank trains on unattended."""
    if jobs == 1:
        for i, p in enumerate(todo):
            yield p, launch(i, p)
        return
    stop = threading.Event()

    def guarded(i: int, p: dict[str, Any]) -> dict[str, Any]:
        if stop.is_set():
            raise concurrent.futures.CancelledError()
        return launch(i, p)

    ex = concurrent.futures.ThreadPoolExecutor(jobs, thread_name_prefix="lr_sweep")
    futures = {ex.submit(guarded, i, p): p for i, p in enumerate(todo)}
    pending = set(futures)
    try:
        with sigterm_unwinds():
            while pending:
                # a timed wait: the main thread wakes to run a signal's handler even when the
                # kernel delivered the signal to another thread (an untimed wait sleeps on)
                done, pending = concurrent.futures.wait(
                    pending, timeout=0.5, return_when=concurrent.futures.FIRST_COMPLETED)
                for f in done:
                    yield futures[f], f.result()
    except BaseException:
        stop.set()
        ex.shutdown(wait=False, cancel_futures=True)
        while any(f.running() for f in futures):  # a run may be starting its ranks: again
            for child in active_children():
                child.kill()
            time.sleep(0.1)
        raise
    finally:
        ex.shutdown(wait=True)


def table_main(paths: list[str], plot: str | None) -> int:
    runs, labels = _load(paths)
    best = select_best(runs)
    print(markdown(best, labels))
    if plot and plot_ratios(best, plot, labels=labels):
        print(f"wrote {plot}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", nargs="+", choices=sorted(WORKLOADS), default=None,
                    help=f"default {' '.join(DEFAULT_WORKLOADS)} (the two the rules were tuned on)")
    ap.add_argument("--optimizers", nargs="+", default=None,
                    help=f"default {' '.join(DEFAULTS['optimizers'])}")
    ap.add_argument("--lrs", nargs="+", type=float, default=None, help="default 3e-4 1e-3 3e-3")
    ap.add_argument("--steps", nargs="+", type=int, default=None,
                    help="training lengths, one run each (default 600)")
    ap.add_argument("--seeds", nargs="+", type=int, default=[0])
    ap.add_argument("--out", default=None,
                    help="JSON path (default bench/results/lr_sweep.json; --smoke: required)")
    ap.add_argument("--plot", default=None, help="PNG of the ratio of bests against steps "
                    "(default: the JSON's path with .png)")
    ap.add_argument("--resume", action="store_true", help="keep --out's runs of this plan")
    ap.add_argument("--timeout", type=float, default=1800.0, help="deadline per run (s)")
    ap.add_argument("--jobs", type=int, default=1, metavar="N",
                    help="runs at once, the cores shared between them (default 1)")
    ap.add_argument("--table", nargs="+", default=None, metavar="FILE",
                    help="only report (and --plot) the runs of these JSON files")
    ap.add_argument("--smoke", action="store_true", help="tiny models, W=2, seconds (CI)")
    ap.add_argument("--warmup-steps", type=int, default=None, metavar="N",
                    help="dense warm-up steps of the sparse rows (default: the library's)")
    args = ap.parse_args(argv)
    if args.table:
        return table_main(args.table, args.plot)
    base = SMOKE if args.smoke else DEFAULTS
    optimizers = args.optimizers or base["optimizers"]
    lrs, lengths = args.lrs or base["lrs"], args.steps or base["steps"]
    if args.smoke and args.out is None:
        ap.error("--smoke needs --out")
    out = args.out or os.path.join("bench", "results", "lr_sweep.json")
    pool = SMOKE_WORKLOADS if args.smoke else WORKLOADS
    if args.smoke and set(args.workloads or ()) - set(pool):
        ap.error(f"--smoke runs the workloads {sorted(pool)}, not "
                 f"{sorted(set(args.workloads) - set(pool))}")
    workloads = {k: pool[k] for k in (args.workloads or DEFAULT_WORKLOADS)}
    common = dict(SMOKE_COMMON if args.smoke else COMMON)
    if args.warmup_steps is not None:
        if args.warmup_steps < 1:  # the first mask is taken from a dense step's moment
            ap.error(f"--warmup-steps must be >= 1, got {args.warmup_steps}")
        common["warmup_steps"] = args.warmup_steps
    try:
        rows = dict(resolve_row(o) for o in optimizers)
        optimizers = list(rows)
        if len(rows) < len(args.optimizers or base["optimizers"]):
            raise ValueError("--optimizers names a row twice")
        if "adams" not in optimizers:
            raise ValueError("--optimizers must include adams (every ratio divides by it)")
        if min(lrs) <= 0 or min(lengths) < 1:
            raise ValueError("--lrs must be > 0 and --steps >= 1")
        if args.jobs < 1:
            raise ValueError(f"--jobs must be >= 1, got {args.jobs}")
    except ValueError as e:
        ap.error(str(e))
    settings = {"workloads": workloads, "common": common, "optimizers": optimizers,
                "rows": rows, "lrs": lrs, "steps": lengths, "seeds": args.seeds}
    plan = [{"workload": w, "optimizer": o, "steps": s, "lr": lr, "seed": seed}
            for s, w, seed, o, lr in itertools.product(lengths, workloads, args.seeds,
                                                       optimizers, lrs)]
    runs: list[dict[str, Any]] = []
    if args.resume and os.path.exists(out):
        with open(out) as f:
            old = json.load(f)
        if old.get("schema") != SCHEMA or {k: old["settings"].get(k) for k in
                                           ("workloads", "common")} != \
                {"workloads": workloads, "common": common}:
            ap.error(f"--resume: {out} was written with other workloads or settings")
        wanted = {_key(p) for p in plan}
        runs = [r for r in old["runs"] if _key(r) in wanted]
    done = {_key(r) for r in runs}
    todo = [p for p in plan if _key(p) not in done]
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    rate = {w["model"]: GUESS_STEP_S.get(w["model"], 0.05) for w in workloads.values()}
    for r in runs:  # measured by a kept run
        rate[workloads[r["workload"]]["model"]] = r["wall_s"] / r["steps"]
    print(f"plan: {len(plan)} runs ({len(plan) - len(todo)} kept from {out}), "
          f"{len(workloads)} workloads x {len(optimizers)} optimizers x {len(lrs)} lrs x "
          f"{len(lengths)} lengths x {len(args.seeds)} seeds", flush=True)
    env = environment("cpu", None)
    started = time.perf_counter()
    jobs = min(args.jobs, max(1, len(todo)))
    threads = max(1, (os.cpu_count() or 1) // (jobs * common["world"]))  # jobs 1: the default

    def launch(i: int, p: dict[str, Any]) -> dict[str, Any]:
        w = workloads[p["workload"]]
        eta = sum(q["steps"] * rate[workloads[q["workload"]]["model"]] + 8
                  for q in todo[i:]) / jobs
        print(f"[{i + 1}/{len(todo)}] {_clock(time.perf_counter() - started)} elapsed, "
              f"ETA {_clock(eta)} | {p['workload']} {p['optimizer']} lr {p['lr']:g} "
              f"{p['steps']} steps seed {p['seed']}", flush=True)
        name = f"{p['workload']}/{p['optimizer']}/lr{p['lr']:g}/s{p['seed']}"
        cfg = make_config(w, common, (p["optimizer"], rows[p["optimizer"]]), p["steps"], p["lr"],
                          p["seed"], name, args.timeout)
        return run(dataclasses.replace(cfg, threads=threads))

    if jobs > 1:
        print(f"{jobs} runs at once, {threads} threads per rank", flush=True)
    for p, result in execute(todo, jobs, launch):
        rate[workloads[p["workload"]]["model"]] = result["wall_s"] / p["steps"]
        runs.append(record(p, result))
        loss = runs[-1]["final_val_loss"]
        done_by = f" ({p['optimizer']} lr {p['lr']:g} seed {p['seed']})" if jobs > 1 else ""
        print(f"    val {fmt_loss(loss)} in {result['wall_s']:.0f} s{done_by}", flush=True)
        _write(out, build_report(argv, settings, runs, env, time.perf_counter() - started,
                                 complete=False))
    report = build_report(argv, settings, runs, env, time.perf_counter() - started, True)
    _write(out, report)
    print(report["table_md"])
    plot = args.plot or os.path.splitext(out)[0] + ".png"
    written = [out]
    if plot and plot_ratios(report["best"], plot,
                            labels={k: w["label"] for k, w in workloads.items()}):
        written.append(plot)
    print(f"wrote {', '.join(written)}")
    return 0


def fmt_loss(loss: float | None) -> str:
    return "diverged" if loss is None else f"{loss:.4f}"


def _write(path: str, report: dict[str, Any]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(report, f, indent=1)
    os.replace(tmp, path)


if __name__ == "__main__":
    raise SystemExit(main())
