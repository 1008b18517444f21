"""The main job: every optimizer side by side on one workload, in two legs.

**Quality leg** (the unshaped loopback): the bundled byte-level GPT (:mod:`bench.workloads.gpt`) on
the interpreter's standard library (:mod:`bench.workloads.data`), trained once per optimizer on W
gloo ranks with the same seed, data order, token budget and LR schedule (:mod:`bench.engine.runner`)
for 600 steps, long enough that dense AdamS is well below the unigram plateau (~3.2 nats/byte),
at dense AdamS's tuned learning rate (:data:`TUNED_LR`). Reports final validation loss and
its ratio to dense sharded AdamS, and the curves.

**Speed leg** (the loopback shaped to ``--bandwidth``, 100 Mbit/s by default, where root and
``tc`` are present; :mod:`bench.engine.netns`): a short run of each optimizer and of the
compute-only floor, the same model and batch. Reports the median step, its ratio to
compute-only, the speed-up over dense sharded AdamS, and bytes per step per rank against
the DESIGN formula (:func:`bench.compare_report.formula_bytes`). The shaped link's delivered
rate is measured before the leg and stored.

=======================  ====================================================================
``adams``                dense sharded AdamS (scape.SCAPE, sparsity 0) -- the reference row
``adamw_ddp``            torch.optim.AdamW + DistributedDataParallel (the standard)
``scape-0.9``            SCAPE at 90% sparsity, the library's defaults
``scape-0.99``           SCAPE at 99% sparsity, the library's defaults (the headline row)
``scape-0.99-wire8``     the same with the 8-bit wire (``grad_comm_dtype`` and
                         ``param_comm_dtype`` ``torch.int8``: codes with a scale per mask row)
``topk-0.99``            raw-gradient top-k with error feedback (:mod:`bench.engine.topk_baseline`)
``compute_only``         SCAPE-0.99's per-rank work with no collectives (speed leg only)
=======================  ====================================================================

``--optimizers`` takes rows (:mod:`bench.engine.rows`): a name of its table -- besides those
above ``dist_adamw`` (scape.DistributedAdamW), ``topk-0.9``, ``scape-0.99-embed0.9`` (the
embedding matrices, the tied head, in their own param group at 0.9), the local-step rows
``sparseloco-h8-d0.01``, ``sparseloco-h32-d0.03``, ``diloco-h8``, ... -- or a row as JSON,
inline or in a ``.json``/``.toml`` file, e.g. ``'{"name": "scape-0.95", "optimizer": "scape",
"sparsity": 0.95}'``. The local-step rows (:mod:`bench.engine.local_sgd_opts`) report the mean
bytes over all steps, and a ``steps`` that their ``H`` does not divide prints a warning.

Each run is ``python -m bench.engine.runner`` in a subprocess (:mod:`bench.compare_exec`), one
progress line with an ETA covers the plan. It prints the headline first: SCAPE-0.99's loss
ratio, bytes ratio and speed-up in one line. Outputs in ``--out`` (default ``out/``):
``report.json`` (schema ``scape.compare/2``, bench/README.md), ``report.md``, ``loss.png``,
``bytes.png``, ``steps.png`` and ``runs/LEG/NAME.json``. On a machine with a CUDA GPU per rank
(``--device auto``, the default, or ``cuda``) both legs run on the GPUs with NCCL and the
Triton kernels; without, they run on the CPU and say so.

    python -m bench.compare                      # both legs (about 12 minutes on 2 cores)
    python -m bench.compare --quick              # tiny model, W=2, both legs in under 2 min
    python -m bench.compare --leg speed --bandwidth 1gbit
    python -m bench.compare --optimizers adams scape-0.99 compute_only --steps 1000
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from typing import Any

from bench.compare_exec import Planned, Tracker, run_one
from bench.compare_report import (
    SCHEMA,
    environment,
    evaluate_targets,
    headline,
    quality_table,
    render_markdown,
    speed_table,
    verify_link,
)
from bench.engine.local_sgd_opts import steady_bytes, sync_warning
from bench.engine.optimizers import OPTIMIZERS
from bench.engine.report import plot_bytes, plot_loss, plot_steps
from bench.engine.rows import resolve as resolve_row
from bench.engine.runner import RunConfig

__all__ = ["SCHEMA", "make_configs", "main", "run_one"]

DEFAULT_OPTIMIZERS = ("adams", "adamw_ddp", "scape-0.9", "scape-0.99", "scape-0.99-wire8",
                      "topk-0.99", "compute_only")
DEFAULT_BANDWIDTH = "100mbit"
TUNED_LR = 3e-4
"""Dense sharded AdamS's best peak learning rate on the quality leg's workload, of 1e-4, 3e-4
and 1e-3 at 600 steps (bench/results/compare_lr_sweep.json; docs/benchmarks.md)."""

QUALITY = dict(model="small", world=4, steps=600, batch=4, seq=128, lr=TUNED_LR,
               warmup_steps=None, eval_every=100, eval_seqs=128)
"""The quality leg: ``warmup_steps=None`` keeps each optimizer's own start (SCAPE's: one dense
step, then its sparsity ramp sized to the run's 600 steps; top-k's: 20 dense steps)."""
SPEED = dict(model="small", world=4, steps=16, batch=4, seq=128, lr=TUNED_LR, warmup_steps=2,
             eval_every=16, eval_seqs=8)
"""The speed leg: 2 dense warm-up steps (they only build SCAPE's first moment; a sparse
step's cost does not depend on their number), 2 more, then the median of 12 steps."""
QUICK_QUALITY = dict(model="tiny", world=2, steps=30, batch=2, seq=64, lr=3e-3, warmup_steps=5,
                     eval_every=10, eval_seqs=4)
QUICK_SPEED = dict(model="tiny", world=2, steps=8, batch=2, seq=64, lr=3e-3, warmup_steps=2,
                   eval_every=8, eval_seqs=4)
GUESS_STEP_S = {"tiny": 0.03, "small": 0.2}
"""Seconds per step on 2 cores before any is measured (the ETA's first estimate)."""


def make_configs(names: list[str], w: dict[str, Any], data: str | None, profile_dir: str | None,
                 timeout_s: float, device: str = "cpu") -> list[RunConfig]:
    """One RunConfig per row (a name of :data:`bench.engine.rows.ROWS`, or a JSON/TOML row:
    :func:`bench.engine.rows.resolve`), sharing the workload ``w`` and the timing window.
    ``w["warmup_steps"]`` is the sparse rows' dense warm-up (None: the library's default; a
    row's own ``warmup_steps`` wins)."""
    warmup = w.get("warmup_steps")
    skip = min(w["steps"] - 1, (20 if warmup is None else warmup) + 2)
    cfgs = []
    for spec in names:
        name, fields = resolve_row(spec)
        opt = fields["optimizer"]
        kwargs: dict[str, Any] = {}
        if OPTIMIZERS[opt].sparse and warmup is not None:
            kwargs["warmup_steps"] = warmup
        kwargs.update(fields.get("optimizer_kwargs") or {})
        cfgs.append(RunConfig(
            **{**fields, "optimizer_kwargs": kwargs},
            model=w["model"], world=w["world"], steps=w["steps"], batch=w["batch"],
            seq=w["seq"], lr=w["lr"], eval_every=w["eval_every"], eval_seqs=w["eval_seqs"],
            data=data, timing_skip=skip, log_every=1, timeout_s=timeout_s, name=name,
            device=device,
            profile_dir=None if profile_dir is None else os.path.join(profile_dir, name)))
    return cfgs


def sync_warnings(cfgs: list[RunConfig]) -> list[str]:
    """A warning per local-step row whose ``steps`` is not a multiple of its ``H``."""
    out = []
    for c in cfgs:
        if OPTIMIZERS[c.optimizer].local_steps:
            text = sync_warning(c.label, c.optimizer_kwargs["sync_every"], c.steps)
            if text:
                out.append(text)
    return out



def resolve_bandwidth(arg: str) -> tuple[str | None, str]:
    """``(rate or None, note)`` from ``--bandwidth`` (``auto``, ``none`` or a tc rate)."""
    from bench.engine.netns import available, parse_rate

    if arg == "none":
        return None, "unshaped loopback (--bandwidth none)"
    if arg == "auto":
        ok, reason = available()
        if ok:
            return DEFAULT_BANDWIDTH, f"shaped loopback at {DEFAULT_BANDWIDTH} (default)"
        return None, (f"note: bandwidth emulation is not available ({reason}); running on the "
                      "plain loopback, so the step times are not communication-bound")
    parse_rate(arg)  # raises ValueError on a bad rate
    from bench.engine.netns import require

    require()
    return arg, f"shaped loopback at {arg}"


def resolve_device(arg: str, world: int) -> tuple[str, str]:
    """``(device, note)`` from ``--device`` (``auto``, ``cpu`` or ``cuda``): CUDA needs one GPU
    per rank."""
    import torch

    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if arg == "cpu":
        return "cpu", "device: CPU, gloo (--device cpu)"
    if found >= world:
        return "cuda", (f"device: {found} CUDA GPUs, one per rank: NCCL and the Triton "
                        "kernels")
    if arg == "cuda":
        raise ValueError(f"--device cuda needs one GPU per rank ({world}), found {found}")
    why = "no CUDA GPU" if found == 0 else f"{found} CUDA GPUs for {world} ranks"
    return "cpu", f"note: {why} here: both legs run on the CPU (gloo, the kernels' torch path)"


def plan_legs(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """The workload of each leg that runs, with the command line's changes applied."""
    legs = {"quality": dict(QUICK_QUALITY if args.quick else QUALITY),
            "speed": dict(QUICK_SPEED if args.quick else SPEED)}
    for w in legs.values():
        for key in ("world", "model", "batch", "lr"):
            if getattr(args, key) is not None:
                w[key] = getattr(args, key)
    if args.steps is not None:
        legs["quality"].update(steps=args.steps, eval_every=max(1, args.steps // 6))
    if args.speed_steps is not None:
        w = legs["speed"]
        w.update(steps=args.speed_steps, eval_every=args.speed_steps,
                 warmup_steps=min(w["warmup_steps"], max(0, args.speed_steps - 3)))
    return {k: v for k, v in legs.items() if args.leg in ("both", k)}


def _guess(w: dict[str, Any], rate: str | None, dense: bool) -> float:
    """Seconds per step before one is measured: compute, plus for a dense row behind a shaped
    link its ring traffic (``2 * 4 * N * (W - 1)`` bytes cross the one shared loopback)."""
    step = GUESS_STEP_S.get(w["model"], 1.0)
    if dense and rate is not None:
        from bench.engine.netns import parse_rate
        from bench.workloads.gpt import GPT, get_config, num_params

        n = num_params(GPT(get_config(w["model"])))
        step += 64 * n * (w["world"] - 1) / parse_rate(rate)
    return step


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--leg", choices=("both", "quality", "speed"), default="both")
    ap.add_argument("--optimizers", nargs="+", default=list(DEFAULT_OPTIMIZERS))
    ap.add_argument("--steps", type=int, default=None,
                    help="quality leg steps (default 600; --quick 30)")
    ap.add_argument("--speed-steps", type=int, default=None,
                    help="speed leg steps (default 16: 4 left out, the median of 12)")
    ap.add_argument("--bandwidth", default="auto",
                    help="speed leg link: a tc rate (e.g. 100mbit), 'auto' (100mbit where "
                         "possible) or 'none'")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument("--world", type=int, default=None)
    ap.add_argument("--model", default=None)
    ap.add_argument("--batch", type=int, default=None, help="sequences per rank per step")
    ap.add_argument("--lr", type=float, default=None, help=f"peak lr (default {TUNED_LR:g})")
    ap.add_argument("--data", default=None, help="text file or directory (default: stdlib)")
    ap.add_argument("--out", default="out")
    ap.add_argument("--profile", action="store_true",
                    help="torch.profiler trace per rank of the speed leg under OUT/profile/")
    ap.add_argument("--quick", action="store_true",
                    help="tiny model, W=2, both legs in under 2 minutes (the CI smoke)")
    ap.add_argument("--timeout", type=float, default=900.0, help="deadline per run (s)")
    args = ap.parse_args(argv)
    legs = plan_legs(args)
    try:
        world = next(iter(legs.values()))["world"]
        device, device_note = resolve_device(args.device, world)
        cfgs = {leg: [c for c in make_configs(
            args.optimizers, w, args.data,
            os.path.join(args.out, "profile") if args.profile and leg == "speed" else None,
            args.timeout, device) if leg == "speed" or c.optimizer != "compute_only"]
            for leg, w in legs.items()}
        bandwidth, link_note = resolve_bandwidth(args.bandwidth) if "speed" in legs \
            else (None, "")
    except ValueError as e:
        ap.error(str(e))
    print(device_note, flush=True)
    if link_note:
        print(f"speed leg: {link_note}", flush=True)
    warnings = [t for c in cfgs.values() for t in sync_warnings(c)]
    for text in warnings:
        print(text, flush=True)
    plan = [Planned(leg, c, "quality" if leg == "quality" else "sparse"
                    if OPTIMIZERS[c.optimizer].sparse or OPTIMIZERS[c.optimizer].local_steps
                    else "dense") for leg, cs in cfgs.items() for c in cs]
    guess = {"quality": _guess(legs.get("quality", legs.get("speed", {})), None, False),
             "sparse": _guess(legs.get("speed", QUICK_SPEED), None, False),
             "dense": _guess(legs.get("speed", QUICK_SPEED), bandwidth, True)}
    tracker = Tracker(plan, guess)
    print("plan: " + "; ".join(f"{leg} leg {len(cs)} runs x {legs[leg]['steps']} steps"
                               for leg, cs in cfgs.items())
          + f"; estimated {tracker.remaining_s() / 60:.0f} min", flush=True)

    started = time.perf_counter()
    env = environment(device, None)
    link = verify_link(bandwidth) if "speed" in legs else None
    if link and link["delivered_bps"]:
        print(f"speed leg: {link['label']}", flush=True)
    results: dict[str, list[dict[str, Any]]] = {leg: [] for leg in cfgs}
    try:
        for p in plan:
            os.makedirs(os.path.join(args.out, "runs", p.leg), exist_ok=True)
            tracker.start(p)
            results[p.leg].append(run_one(
                p.cfg, os.path.join(args.out, "runs", p.leg, f"{p.cfg.label}.json"),
                bandwidth if p.leg == "speed" else None, tracker.step))
            tracker.finish(p)
    except BaseException:
        tracker.close()
        done = sum(len(rs) for rs in results.values())
        print(f"stopped: {done} of {len(plan)} runs finished; their results are in "
              f"{os.path.join(args.out, 'runs')}/", flush=True)
        raise
    tracker.close()
    env["device_name"] = next((r.get("device", "cpu") for rs in results.values() for r in rs),
                              device)
    report = build_report(argv, legs, results, env, link, warnings,
                          time.perf_counter() - started, args.profile, args.quick,
                          args.lr is not None)
    write_outputs(report, args.out)
    return 0


def build_report(argv: list[str] | None, legs: dict[str, dict[str, Any]],
                 results: dict[str, list[dict[str, Any]]], env: dict[str, Any],
                 link: dict[str, Any] | None, warnings: list[str], wall_s: float,
                 profile: bool, quick: bool = False, lr_given: bool = False
                 ) -> dict[str, Any]:
    """``report.json``'s content (schema in bench/README.md)."""
    quality, speed = results.get("quality"), results.get("speed")
    first = (quality or speed or [{}])[0]
    scape_run = next((r for r in (quality or []) + (speed or []) if r["name"] == "scape-0.99"),
                     None)
    lr_source = "given" if lr_given else "the quick plan's" if quick else \
        "dense AdamS's tuned rate"
    report: dict[str, Any] = {
        "schema": SCHEMA,
        "command": " ".join(["python -m bench.compare"] + (sys.argv[1:] if argv is None
                                                           else list(argv))),
        "date": datetime.date.today().isoformat(),
        "environment": env,
        "params": first.get("params"),
        "update": (scape_run or {}).get("optimizer_settings", {}).get("update", "agree"),
        "quality": None if quality is None else {
            "workload": legs["quality"], "link": "unshaped loopback", "lr_source": lr_source,
            "table": quality_table(quality), "runs": quality},
        "speed": None if speed is None else {
            "workload": legs["speed"], "link": link, "timing_window": speed[0]["timing_window"],
            "table": speed_table(speed, legs["speed"]["world"]), "runs": speed},
        "warnings": warnings,
        "profile_phases": {r["name"]: r["phases"] for r in speed or []} if profile else None,
        "wall_s": wall_s,
    }
    report["quick"] = quick
    report["targets"] = [] if quick else evaluate_targets(
        report["quality"]["table"] if quality else [], report["speed"]["table"] if speed else [])
    report["headline"] = headline(report)
    if quick:  # a tiny model for a few steps: it shows every leg runs, nothing more
        report["headline"]["text"] = ("--quick is a smoke: every leg ran, on a tiny model for a "
                                      "few steps; it judges nothing (no targets). "
                                      + report["headline"]["text"])
    return report


def write_outputs(report: dict[str, Any], out: str) -> None:
    """report.json, report.md and the plots; the headline is printed first."""
    with open(os.path.join(out, "report.json"), "w") as f:
        json.dump(report, f, indent=1)
    md = render_markdown(report)
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write(md)
    written = ["report.json", "report.md"]
    if report["quality"]:
        w = report["quality"]["workload"]
        if plot_loss(report["quality"]["runs"], os.path.join(out, "loss.png"),
                     f"validation loss (W={w['world']}, {w['steps']} steps, unshaped)"):
            written.append("loss.png")
    if report["speed"]:
        runs = report["speed"]["runs"]
        title = f"W={report['speed']['workload']['world']}, {report['speed']['link']['label']}"
        if plot_bytes([dict(r, bytes_per_step={"mean over all steps":
                                               r["bytes_per_step_mean_all_steps"]})
                       if steady_bytes(r)[1] == "mean_all_steps" else r for r in runs],
                      os.path.join(out, "bytes.png"), f"bytes per step per rank ({title})"):
            written.append("bytes.png")
        if plot_steps(report["speed"]["table"], os.path.join(out, "steps.png"),
                      f"median step ({title})"):
            written.append("steps.png")
    print(report["headline"]["text"])
    print(md.split("\n", 4)[-1])
    if report.get("profile_phases"):
        for name, phases in report["profile_phases"].items():
            print(f"profile {name}: ranges {', '.join(phases) or '(none)'}")
    print(f"wrote {', '.join(os.path.join(out, f) for f in written)}")


if __name__ == "__main__":
    raise SystemExit(main())
