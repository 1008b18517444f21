"""The main job: every optimizer side by side on the same workload, behind a shaped link.

Trains the bundled byte-level GPT (:mod:`bench.gpt`) on the interpreter's standard library
(:mod:`bench.data`) once per optimizer, on W ranks (gloo), with the same seed, data order,
token budget and LR schedule (:mod:`bench.runner`):

=======================  ====================================================================
``adamw_ddp``            torch.optim.AdamW + DistributedDataParallel (the standard)
``dist_adamw``           scape.DistributedAdamW (dense ZeRO-1 AdamW)
``adams``                dense sharded AdamS (scape.SCAPE, sparsity 0) -- the reference row
``scape-0.9``            SCAPE at 90% sparsity
``scape-0.99``           SCAPE at 99% sparsity
``scape-0.99-embed0.9``  the same, the embedding matrices (the tied head) at 90%
``topk-0.99``            raw-gradient top-k with error feedback (:mod:`bench.topk_baseline`)
``compute_only``         SCAPE-0.99's per-rank work with no collectives (the step-time floor)
=======================  ====================================================================

A ``scape`` or ``compute_only`` name may end in ``-embed<sparsity>`` (e.g.
``scape-0.99-embed0.9``): the embedding matrices, the tied head among them, then form their own
param group at that sparsity (the quality research's finding; docs/research.md), with the rule
of the research's split rows (``catchup_agree_trust2_accum``, registered by
:mod:`bench.research.rules`). Without it a ``scape`` row runs the library's defaults
(``update="auto"``: the masks by fresh gain), its two sparse groups (``decay``, ``no_decay``)
each at the row's sparsity.

Opt-in local-step rows (:mod:`bench.local_sgd_opts`, AdamW inner optimizer at the same lr):
``sparseloco-h<H>-d<density>[-b<bits>]`` (``scape.SparseLoCo``, 2-bit values unless ``-b``
says otherwise) and ``diloco-h<H>`` (``scape.DiLoCo``). They communicate only every ``H``
steps, so their bytes per step are the mean over all steps (a sync's bytes / H), not the
per-step median; the table marks them. When ``steps`` is not a multiple of ``H`` a warning is
printed and stored in the report: the final loss is then not taken right after a sync.

Each run is ``python -m bench.runner`` in a subprocess; with ``--bandwidth RATE`` that
subprocess and its ranks run inside a fresh network namespace whose loopback is shaped to RATE
(:mod:`bench.netns`; default 100mbit where root and tc are available, else the plain loopback
with a printed note). Outputs in ``--out`` (default ``out/``): ``report.json`` (schema in
bench/README.md), ``report.md``, ``loss.png``, ``bytes.png`` and ``runs/NAME.json``.

    python -m bench.compare                      # the defaults (about 10 minutes on 2 cores)
    python -m bench.compare --smoke              # tiny model, W=2, a few steps, no shaping
    python -m bench.compare --optimizers adams scape-0.99 compute_only --steps 40
    python -m bench.compare --optimizers adams scape-0.99 sparseloco-h8-d0.01 diloco-h8
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import platform
import queue
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from bench.gpt import check_group_sparsity
from bench.local_sgd_opts import (
    NAME_FORMS,
    is_local_name,
    parse_local_name,
    steady_bytes,
    sync_warning,
)
from bench.optimizers import OPTIMIZERS
from bench.report import fmt, markdown_table, plot_bytes, plot_loss
from bench.runner import RunConfig

SCHEMA = "scape.compare/1"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OPTIMIZERS = ("adamw_ddp", "dist_adamw", "adams", "scape-0.9", "scape-0.99",
                      "scape-0.99-embed0.9", "topk-0.99", "compute_only")
DEFAULT_BANDWIDTH = "100mbit"
COMPUTE_ONLY_SPARSITY = 0.99
"""compute_only runs the per-rank work of SCAPE at this sparsity (the 1.15x target's floor)."""

DEFAULTS = dict(model="small", world=4, steps=40, batch=4, seq=128, lr=3e-3, warmup_steps=10,
                eval_every=10, eval_seqs=64)
"""The default workload, sized so the eight runs fit about 10 minutes on 2 shared cores at
100 Mbit/s: a dense step there takes ~2.4 s (6.7 MB per rank through one shaped loopback), so
the three dense runs and the dense warm-ups dominate; SCAPE's warm-up is 10 steps here instead
of the library's 20 for the same reason (bench/README.md has the measured times)."""
SMOKE = dict(model="tiny", world=2, steps=6, batch=2, seq=64, lr=3e-3, warmup_steps=2,
             eval_every=3, eval_seqs=4)

TARGETS = (
    ("scape-0.99 step time / compute_only", "<=", 1.15),
    ("adams step time / scape-0.99 step time", ">=", 3.0),
    ("scape-0.99 bytes / adams bytes", "<=", 1 / 50),
    ("scape-0.9 val loss / adams val loss", "<=", 1.01),
    ("scape-0.99 val loss / adams val loss", "<=", 1.03),
    ("scape-0.99 val loss / topk-0.99 val loss", "<", 1.0),
)
"""The project's targets, evaluated on the measured results (reported, never tuned for)."""


def parse_name(name: str) -> tuple[str, float]:
    """``"scape-0.99"`` -> ``("scape", 0.99)``; ``"adams"`` -> ``("adams", 0.0)``;
    ``"sparseloco-h8-d0.01"`` -> ``("sparseloco", 0.0)`` (its settings:
    :func:`bench.local_sgd_opts.parse_local_name`)."""
    if is_local_name(name):
        try:
            return parse_local_name(name)[0], 0.0
        except ValueError as e:
            raise ValueError(f"--optimizers: {e}") from None
    opt, _, sp = name.partition("-")
    entry = OPTIMIZERS.get(opt)
    if entry is None or entry.local_steps:
        raise ValueError(f"--optimizers: unknown optimizer {name!r} (expected one of "
                         f"{DEFAULT_OPTIMIZERS}, sparsity after '-', or {NAME_FORMS})")
    if entry.group_sparsity and embed_sparsity(name) is not None:
        sp = sp.partition("embed")[0].rstrip("-")
    if entry.needs_sparsity and not sp:
        raise ValueError(f"--optimizers: {name!r} needs a sparsity, e.g. {opt}-0.99")
    if opt == "compute_only":
        return opt, float(sp) if sp else COMPUTE_ONLY_SPARSITY
    try:
        return opt, float(sp) if sp else 0.0
    except ValueError:
        raise ValueError(f"--optimizers: bad sparsity in {name!r}") from None


def embed_sparsity(name: str) -> float | None:
    """``"scape-0.99-embed0.9"`` -> 0.9: the embedding matrices (the tied head) in their own
    param group at that sparsity (:func:`bench.gpt.param_groups`); None without the suffix."""
    head, sep, tail = name.partition("-embed")
    if not sep:
        return None
    takes = [n for n, e in OPTIMIZERS.items() if e.group_sparsity]
    if head.partition("-")[0] not in takes:
        raise ValueError(f"--optimizers: {name!r}: -embed<sparsity> applies to "
                         f"{' and '.join(takes)} rows")
    try:
        value = float(tail)
        check_group_sparsity({"embed": value})
    except ValueError as e:
        raise ValueError(f"--optimizers: bad embedding sparsity in {name!r}: {e}") from None
    return value


def make_configs(names: list[str], w: dict[str, Any], data: str | None, profile_dir: str | None,
                 timeout_s: float) -> list[RunConfig]:
    """One RunConfig per optimizer name, sharing the workload ``w`` and the timing window."""
    skip = min(w["steps"] - 1, w["warmup_steps"] + 2)
    cfgs = []
    for name in names:
        opt, sp = parse_name(name)
        kwargs = {"warmup_steps": w["warmup_steps"]} if OPTIMIZERS[opt].sparse else {}
        if is_local_name(name):
            kwargs = parse_local_name(name)[1]
        emb = embed_sparsity(name)
        if emb is not None:  # the split set by hand, as named, with the research's rule
            kwargs["update"] = "catchup_agree_trust2_accum"
        cfgs.append(RunConfig(
            optimizer=opt, sparsity=sp if opt != "adams" else 0.0, optimizer_kwargs=kwargs,
            group_sparsity=None if emb is None else {"embed": emb},
            model=w["model"], world=w["world"], steps=w["steps"], batch=w["batch"],
            seq=w["seq"], lr=w["lr"], eval_every=w["eval_every"], eval_seqs=w["eval_seqs"],
            data=data, timing_skip=skip, log_every=1, timeout_s=timeout_s, name=name,
            profile_dir=None if profile_dir is None else os.path.join(profile_dir, name)))
    return cfgs


@contextlib.contextmanager
def _launcher(cmd: list[str], bandwidth: str | None) -> Iterator[list[str]]:
    if bandwidth is None:
        yield cmd
    else:
        from bench.netns import shaped_command

        with shaped_command(cmd, bandwidth) as wrapped:
            yield wrapped


_PROGRESS = re.compile(r"step (\d+)/(\d+)")


def run_one(cfg: RunConfig, out_path: str, bandwidth: str | None, progress: Any = None,
            task: Any = None) -> dict[str, Any]:
    """Run ``cfg`` through ``python -m bench.runner`` (in a shaped namespace if asked)."""
    cmd = [sys.executable, "-m", "bench.runner", "--config",
           json.dumps(dataclasses.asdict(cfg)), "--out", out_path]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    tail: list[str] = []
    with _launcher(cmd, bandwidth) as argv:
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        lines: queue.Queue[str | None] = queue.Queue()

        def pump() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                lines.put(line)
            lines.put(None)

        threading.Thread(target=pump, daemon=True).start()
        deadline = time.monotonic() + cfg.timeout_s + 60
        while True:
            try:
                line = lines.get(timeout=0.5)
            except queue.Empty:
                if time.monotonic() > deadline:
                    proc.kill()
                    raise TimeoutError(f"{cfg.label}: no result within {cfg.timeout_s + 60:.0f}"
                                       " s; killed") from None
                continue
            if line is None:
                break
            tail = (tail + [line.rstrip()])[-40:]
            m = _PROGRESS.search(line)
            if m and progress is not None:
                progress.update(task, completed=int(m.group(1)),
                                description=f"{cfg.label:14s} {line.split('|')[0][-28:]}")
            elif progress is None and m is None and "USDT" not in line:
                print(line.rstrip(), flush=True)
            elif progress is None and m and int(m.group(1)) % 10 == 0:
                print(line.rstrip(), flush=True)
        rc = proc.wait()
    if rc != 0 or not os.path.exists(out_path):
        raise RuntimeError(f"{cfg.label} failed (exit {rc}); last output:\n" + "\n".join(tail))
    with open(out_path) as f:
        return json.load(f)  # type: ignore[no-any-return]


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def sync_warnings(cfgs: list[RunConfig]) -> list[str]:
    """A warning per local-step row whose ``steps`` is not a multiple of its ``H``."""
    out = []
    for c in cfgs:
        if OPTIMIZERS[c.optimizer].local_steps:
            text = sync_warning(c.label, c.optimizer_kwargs["sync_every"], c.steps)
            if text:
                out.append(text)
    return out


def _mean_step(r: dict[str, Any]) -> float | None:
    first, last = r.get("timing_window") or (1, 0)
    steps = (r.get("step_s") or [])[first - 1:last]
    return sum(steps) / len(steps) if steps else None


def build_table(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per run with its ratios to dense AdamS (loss, bytes) and to compute-only.

    ``bytes_per_step`` is :func:`bench.local_sgd_opts.steady_bytes`: the per-step median for
    optimizers that communicate every step, the mean over all steps for the local-step ones
    (``bytes_basis`` says which)."""
    by = {r["name"]: r for r in runs}
    dense, floor = by.get("adams", {}), by.get("compute_only", {})
    dense_bytes = steady_bytes(dense)[0] if dense else None
    rows = []
    for r in runs:
        nbytes, basis = steady_bytes(r)
        rows.append({
            "name": r["name"], "optimizer": r["config"]["optimizer"],
            "sparsity": r["config"]["sparsity"],
            "final_val_loss": r["final_val_loss"],
            "val_ratio_to_adams": _ratio(r["final_val_loss"],
                                         dense.get("final_val_loss")),
            "bytes_per_step": nbytes, "bytes_basis": basis,
            "bytes_ratio_to_adams": _ratio(nbytes, dense_bytes),
            "median_step_s": r["median_step_s"],
            "mean_step_s": _mean_step(r),
            "step_ratio_to_compute_only": _ratio(r["median_step_s"],
                                                 floor.get("median_step_s")),
            "median_compute_s": r["median_compute_s"],
        })
    return rows


def evaluate_targets(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    by = {r["name"]: r for r in runs}

    def get(name: str, key: str) -> float | None:
        return by[name][key] if name in by else None

    values = [
        _ratio(get("scape-0.99", "median_step_s"), get("compute_only", "median_step_s")),
        _ratio(get("adams", "median_step_s"), get("scape-0.99", "median_step_s")),
        _ratio(get("scape-0.99", "bytes_per_step_total"), get("adams", "bytes_per_step_total")),
        _ratio(get("scape-0.9", "final_val_loss"), get("adams", "final_val_loss")),
        _ratio(get("scape-0.99", "final_val_loss"), get("adams", "final_val_loss")),
        _ratio(get("scape-0.99", "final_val_loss"), get("topk-0.99", "final_val_loss")),
    ]
    out = []
    for (what, op, threshold), v in zip(TARGETS, values):
        met = None if v is None else {"<=": v <= threshold, ">=": v >= threshold,
                                      "<": v < threshold}[op]
        out.append({"target": f"{what} {op} {threshold:.4g}", "value": v, "met": met})
    return out


def render_markdown(report: dict[str, Any]) -> str:
    rows = []
    for t in report["table"]:
        b_ratio = t["bytes_ratio_to_adams"]
        mean = t.get("bytes_basis") == "mean_all_steps"
        rows.append([t["name"], fmt(t["final_val_loss"]), fmt(t["val_ratio_to_adams"], ".3f"),
                     fmt(int(t["bytes_per_step"])) + (" *" if mean else ""),
                     "-" if not b_ratio else f"{b_ratio:.4f} (1/{1 / b_ratio:.0f})",
                     fmt(None if t["median_step_s"] is None else t["median_step_s"] * 1e3, ".1f"),
                     fmt(t["step_ratio_to_compute_only"], ".2f")])
    table = markdown_table(["optimizer", "final val loss", "vs dense AdamS",
                            "bytes/step/rank", "vs dense", "median step (ms)",
                            "vs compute-only"], rows)
    targets = markdown_table(["target", "measured", "met"],
                             [[t["target"], fmt(t["value"], ".4g"),
                               {True: "yes", False: "**no**", None: "-"}[t["met"]]]
                              for t in report["targets"]])
    notes = ""
    if any(t.get("bytes_basis") == "mean_all_steps" for t in report["table"]):
        notes += ("\n\n\\* local-step method: communicates only every H steps, so its bytes "
                  "are the mean over all steps (`bytes_per_step_mean_all_steps`: a sync's bytes "
                  "/ H, averaged over the sync periods), not the per-step median (0); its "
                  "median step is a step without a sync (`mean_step_s` in report.json "
                  "includes the syncs).")
    for text in report.get("warnings", []):
        notes += f"\n\n{text}"
    w = report["workload"]
    return (f"# bench.compare\n\n`{report['command']}` on {report['machine']['cpus']} CPU "
            f"cores, {report['date']}; link: {report['bandwidth'] or 'unshaped loopback'}; "
            f"W={w['world']}, model {w['model']} ({report['params']:,} parameters), "
            f"{w['steps']} steps of {w['batch']}x{w['seq']} tokens per rank, lr {w['lr']:g}, "
            f"SCAPE/top-k dense warm-up {w['warmup_steps']} steps; medians over steps "
            f"{report['timing_window'][0]}-{report['timing_window'][1]}. "
            f"Wall time {report['wall_s']:.0f} s.\n\n{table}{notes}\n\n## Targets\n\n{targets}\n")


def resolve_bandwidth(arg: str) -> tuple[str | None, str]:
    """``(rate or None, note)`` from ``--bandwidth`` (``auto``, ``none`` or a tc rate)."""
    from bench.netns import available, parse_rate

    if arg == "none":
        return None, "unshaped loopback (--bandwidth none)"
    if arg == "auto":
        ok, reason = available()
        if ok:
            return DEFAULT_BANDWIDTH, f"shaped loopback at {DEFAULT_BANDWIDTH} (default)"
        return None, (f"note: bandwidth emulation is not available ({reason}); running on the "
                      "plain loopback, so the step times are not communication-bound")
    parse_rate(arg)  # raises ValueError on a bad rate
    from bench.netns import require

    require()
    return arg, f"shaped loopback at {arg}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bandwidth", default="auto",
                    help="tc rate (e.g. 100mbit), 'auto' (100mbit if possible) or 'none'")
    ap.add_argument("--world", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--model", default=None)
    ap.add_argument("--batch", type=int, default=None, help="sequences per rank per step")
    ap.add_argument("--optimizers", nargs="+", default=list(DEFAULT_OPTIMIZERS))
    ap.add_argument("--data", default=None, help="text file or directory (default: stdlib)")
    ap.add_argument("--out", default="out")
    ap.add_argument("--profile", action="store_true",
                    help="torch.profiler trace per rank under OUT/profile/NAME/")
    ap.add_argument("--smoke", action="store_true", help="tiny model, W=2, a few steps")
    ap.add_argument("--timeout", type=float, default=900.0, help="deadline per run (s)")
    args = ap.parse_args(argv)

    w: dict[str, Any] = dict(SMOKE if args.smoke else DEFAULTS)
    for key in ("world", "steps", "model", "batch"):
        if getattr(args, key) is not None:
            w[key] = getattr(args, key)
    if args.steps is not None:
        w["eval_every"] = max(1, w["steps"] // 3)
    if args.smoke and args.bandwidth == "auto":
        args.bandwidth = "none"
    bandwidth, note = resolve_bandwidth(args.bandwidth)
    print(note, flush=True)
    os.makedirs(os.path.join(args.out, "runs"), exist_ok=True)
    profile_dir = os.path.join(args.out, "profile") if args.profile else None
    try:
        cfgs = make_configs(args.optimizers, w, args.data, profile_dir, args.timeout)
    except ValueError as e:
        ap.error(str(e))
    warnings = sync_warnings(cfgs)
    for text in warnings:
        print(text, flush=True)

    started = time.perf_counter()
    runs: list[dict[str, Any]] = []
    try:
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
        progress: Any = Progress(TextColumn("{task.description}"), BarColumn(),
                                 TextColumn("{task.completed}/{task.total}"),
                                 TimeElapsedColumn())
    except ImportError:
        progress = None
    with progress if progress is not None else contextlib.nullcontext():
        tasks = [progress.add_task(c.label, total=c.steps) if progress else None for c in cfgs]
        for cfg, task in zip(cfgs, tasks):
            path = os.path.join(args.out, "runs", f"{cfg.label}.json")
            runs.append(run_one(cfg, path, bandwidth, progress, task))
    report = {
        "schema": SCHEMA,
        "command": " ".join(["python -m bench.compare"] + (argv if argv is not None
                                                           else sys.argv[1:])),
        "date": datetime.date.today().isoformat(),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "python": platform.python_version()},
        "bandwidth": bandwidth, "bandwidth_note": note,
        "workload": w, "params": runs[0]["params"], "timing_window": runs[0]["timing_window"],
        "table": build_table(runs), "targets": evaluate_targets(runs), "warnings": warnings,
        "profile_phases": {r["name"]: r["phases"] for r in runs} if args.profile else None,
        "wall_s": time.perf_counter() - started,
        "runs": runs,
    }
    with open(os.path.join(args.out, "report.json"), "w") as f:
        json.dump(report, f, indent=1)
    md = render_markdown(report)
    with open(os.path.join(args.out, "report.md"), "w") as f:
        f.write(md)
    title = f"W={w['world']}, {bandwidth or 'unshaped'}"
    plot_loss(runs, os.path.join(args.out, "loss.png"), f"validation loss ({title})")
    plot_bytes([dict(r, bytes_per_step={"mean over all steps": r["bytes_per_step_mean_all_steps"]})
                if steady_bytes(r)[1] == "mean_all_steps" else r for r in runs],
               os.path.join(args.out, "bytes.png"), f"bytes per step per rank ({title})")
    print(md)
    if args.profile:
        for r in runs:
            print(f"profile {r['name']}: ranges {', '.join(r['phases']) or '(none)'}")
    print(f"wrote {args.out}/report.json, report.md, loss.png, bytes.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
