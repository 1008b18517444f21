"""W data-parallel ranks on one GPU: dense sharded AdamS, SCAPE-0.99 and SCAPE-0.9 on a 114M
GPT over the Python sources of the installed packages, quality and step time.

    python -m bench.gpu --out DIR                  # the GPU run (W=8, budget 480 s)
    python -m bench.gpu --smoke --out DIR          # the same code on the CPU, tiny (CI)

**Ranks.** W threads of one process, each with its own model replica (same seed), its own
``scape.SCAPE(..., comm=...)`` and its own share of every global batch; the communicator is
:class:`bench.engine.inprocess.InProcessCommunicator` (NCCL cannot put two ranks on one GPU).
So every rank's gradient, residual and masks are its own, as on W GPUs: SCAPE's default rule
reads each rank's own gradient. ``tests/test_bench_gpu.py`` checks that the threads give the
parameters W gloo processes give (:func:`train_rank` is the body of both).

**The engine's loop.** Each rank trains through :func:`bench.engine.run_rank.train_loop`, the
loop of every run: :func:`train_rank` builds the replica and the optimizer on the rank's
communicator (``build_rank(..., comm=)``) and hands the loop a ``RankContext`` with the
communicator's own ``barrier()``, bf16 autocast on CUDA and the deadline's stop check; the
timed steps after the run (:func:`_timed`) are this job's own measurement, on the model and
optimizer the loop trained.

**Recipe** (the README's for a newcomer): ``lr=3e-4``, weight decay 0.1 on one param group,
``max_grad_norm=1.0``, ``opt.attach(model)``, the library's defaults otherwise (rule ``agree``,
one dense warm-up step, the start ramp sized by ``total_steps``, block 4096); the benchmarks'
schedule (linear warm-up over 5% of the steps, cosine to 10%); bf16 autocast on a GPU. Every
optimizer sees the same data, steps and schedule.

**Plan.** The target is 1,000 steps and 30M tokens per optimizer. Before training, a
calibration (4 steps of all W ranks with SCAPE-0.99, one dense and three sparse, and one
evaluation) measures the step; the steps
are scaled down to what ``--budget-s`` (all of this command's device time) allows, never up,
and the plan is printed: parameters, tokens, steps, estimated device seconds. An optimizer
that overruns its share by half, or the whole budget, is stopped at its next evaluation (its
row says ``truncated``).

**Step time.** After each optimizer's last evaluation, ``--timed-steps`` more steps (at the
last lr) are timed phase by phase on all W ranks together: each phase ends with a device
synchronization and a barrier of every rank, read on rank 0's clock. ``fwd_bwd_s``: every
rank's forward and backward; ``opt_s``: every rank's ``opt.step()``, of which ``comm_s`` is
inside the in-process collectives (from the last rank's arrival to the end: reading and
reducing the ranks' buffers in device memory, no network) and ``local_s`` the rest. These are
one device's times for the work of W ranks; a rank of a W-GPU machine does 1/W of the
compute, and its collectives cross links instead.

**Outputs** (``--out``), rewritten after each optimizer: ``report.json``
(``scape.gpu/1``: command, environment, corpus record, plan, rows), ``report.md``,
``loss.png``. Run again with the same ``--out`` and plan, completed rows are kept and skipped.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench.engine.inprocess import InProcessGroup, run_threads
from bench.engine.report import fmt, markdown_table, plot_loss
from bench.engine.run_config import RunConfig
from bench.engine.run_rank import LanguageModel, RankContext, build_rank, param_digest, train_loop
from bench.workloads.data import Corpus, load_packages, package_root
from bench.workloads.gpt import num_params
from bench.workloads.llama import make_model

SCHEMA = "scape.gpu/1"
CORPUS_PACKAGES = ("torch", "triton", "transformers", "jax", "cupy", "numpy")
"""The installed packages whose ``.py`` sources make the corpus (those present)."""
ROWS = (("adams", 0.0), ("scape-0.99", 0.99), ("scape-0.9", 0.9))
"""``(name, sparsity)`` in the order they run; sparsity 0 is dense sharded AdamS."""


@dataclasses.dataclass(frozen=True)
class Preset:
    model: str
    world: int
    batch: int
    """Sequences per rank and step."""
    seq: int
    steps: int
    """Target steps per optimizer (``tokens`` may raise it)."""
    tokens: int
    """Target tokens per optimizer."""
    eval_every: int
    eval_seqs: int
    timed_steps: int
    corpus: tuple[str, ...]
    budget_s: float


PRESETS = {
    "gpu": Preset(model="gpu", world=8, batch=4, seq=1024, steps=1000, tokens=30_000_000,
                  eval_every=100, eval_seqs=128, timed_steps=10, corpus=CORPUS_PACKAGES,
                  budget_s=480.0),
    "smoke": Preset(model="tiny", world=8, batch=1, seq=64, steps=40, tokens=0, eval_every=10,
                    eval_seqs=16, timed_steps=4, corpus=("torch.optim",), budget_s=120.0),
}

RECIPE = {"lr": 3e-4, "weight_decay": 0.1, "max_grad_norm": 1.0}
"""The README's newcomer recipe."""


def run_config(name: str, sparsity: float, p: Preset, steps: int, device: str,
               extra: dict[str, Any] | None = None) -> RunConfig:
    """One optimizer's :class:`RunConfig` (the recipe, one param group; no progress lines, the
    job prints one per row)."""
    return RunConfig(optimizer="adams" if sparsity == 0 else "scape", sparsity=sparsity,
                     model=p.model, world=p.world, steps=steps, batch=p.batch, seq=p.seq,
                     lr=RECIPE["lr"], weight_decay=RECIPE["weight_decay"], one_group=True,
                     optimizer_kwargs={"max_grad_norm": RECIPE["max_grad_norm"], **(extra or {})},
                     eval_every=p.eval_every, eval_seqs=p.eval_seqs, device=device, name=name,
                     log_every=0)


# -- one rank ------------------------------------------------------------------------------
def train_rank(rank: int, comm: Any, cfg_dict: dict[str, Any], corpus: Corpus,
               timed_steps: int = 0, deadline: float | None = None,
               return_params: bool = False) -> dict[str, Any]:
    """Rank ``rank`` of ``comm.world_size``: build the replica and the optimizer on ``comm``,
    train ``cfg.steps`` steps through the engine's loop
    (:func:`bench.engine.run_rank.train_loop`; evaluating on rank 0 every ``eval_every``, bf16
    autocast on CUDA, stopped at an evaluation past ``deadline``), then time ``timed_steps``
    more phase by phase (:func:`_timed`). The threads of :func:`run` and the gloo processes of
    the tests run this same body."""
    cfg = RunConfig.from_dict(cfg_dict)
    world = comm.world_size
    device = torch.device(comm.device)
    cuda = device.type == "cuda"
    work = LanguageModel(cfg, device, corpus)
    model, opt, counter, module = build_rank(cfg, rank, world, device, work.model(), comm=comm)
    amp: Any = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if cuda \
        else contextlib.nullcontext
    ctx = RankContext(rank, world, device, comm.barrier, autocast=amp,
                      stop=None if deadline is None else _past(deadline, rank, comm, device))
    run = train_loop(cfg, ctx, work, model, opt, counter, module)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    def fwd_bwd(step: int) -> None:
        x, y = (t.to(device, non_blocking=True) for t in work.batch(step, rank, world))
        with amp():
            loss = module.loss(x, y)
        loss.backward()

    phases = _timed(module, opt, comm, fwd_bwd, sync, run.steps, timed_steps)
    opt.finish_param_sync()
    out: dict[str, Any] = {"rank": rank, "steps": run.steps, "truncated": run.truncated,
                           "param_sha256": param_digest(module)}
    if return_params:
        out["params"] = torch.cat([p.detach().reshape(-1).float().cpu()
                                   for p in module.parameters()])
    if rank == 0:
        records = [{"step_s": r["step_s"], "train_loss": r["train_loss"],
                    "bytes": sum(r["bytes"].values()), "dense": r["dense"]}
                   for r in run.records]
        out.update(records=records, val_curve=[[s, v] for s, v in run.val_curve],
                   phases=phases, train_wall_s=run.wall_s,
                   params=out.get("params"), n_params=num_params(module),
                   peak_mem_gb=(torch.cuda.max_memory_allocated(device) / 2**30  # every rank's
                                if cuda else None),
                   optimizer_settings={k: getattr(opt, k) for k in (
                       "update", "warmup_steps", "block_size")
                       if isinstance(getattr(opt, k, None), (str, int, float))})
    return out


def _past(deadline: float, rank: int, comm: Any, device: torch.device) -> Any:
    """The loop's stop check: rank 0's clock past ``deadline`` (``time.monotonic()``), agreed
    by every rank through ``comm`` (every rank stops, or none)."""
    def stop(done: int) -> bool:
        flag = torch.tensor([float(rank == 0 and time.monotonic() > deadline)], device=device)
        comm.all_reduce(flag, op="max").wait()
        return bool(flag.item() > 0)

    return stop


def _timed(module: Any, opt: Any, comm: Any, fwd_bwd: Any, sync: Any, start: int,
           n: int) -> list[dict[str, float]]:
    """``n`` steps after the run, each phase closed by a device sync and a barrier of every
    rank (rank 0's clock; module docstring)."""
    group = getattr(comm, "group", None)
    if n <= 0 or not isinstance(group, InProcessGroup):
        return []
    group.sync_device = True
    out = []
    try:
        for i in range(n):
            comm.barrier()
            t0 = time.perf_counter()
            fwd_bwd(start + i)
            comm.barrier()
            t1 = time.perf_counter()
            c0 = comm.comm_s
            opt.step()
            opt.zero_grad()
            opt.finish_param_sync()
            comm.barrier()
            t2 = time.perf_counter()
            comm_s = comm.comm_s - c0
            out.append({"step_s": t2 - t0, "fwd_bwd_s": t1 - t0, "opt_s": t2 - t1,
                        "comm_s": comm_s, "local_s": t2 - t1 - comm_s})
    finally:
        group.sync_device = False
    return out


# -- the job -------------------------------------------------------------------------------
def _threads_run(cfg: RunConfig, corpus: Corpus, timed_steps: int,
                 deadline: float | None) -> dict[str, Any]:
    group = InProcessGroup(cfg.world, cfg.device, timeout=900.0)
    if cfg.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    try:
        results = run_threads(train_rank, cfg.world, dataclasses.asdict(cfg), corpus,
                              timed_steps, deadline, group=group)
    finally:  # the replicas are garbage now: the next optimizer starts from an empty device
        gc.collect()
        if cfg.device == "cuda":
            torch.cuda.empty_cache()
    digests = {r["param_sha256"] for r in results}
    res = dict(results[0])
    res["replicas_agree"] = len(digests) == 1
    return res


def calibrate(p: Preset, corpus: Corpus, device: str) -> dict[str, float]:
    """Seconds of one W-rank step, one evaluation and one optimizer's set-up, measured on
    SCAPE-0.99 after one dense step (its sparse step does the most local work of the rows)."""
    steps = 4
    cfg = run_config("calibration", 0.99, dataclasses.replace(p, eval_every=steps), steps,
                     device, {"warmup_steps": 1})
    t0 = time.perf_counter()
    res = _threads_run(cfg, corpus, 0, None)
    wall = time.perf_counter() - t0
    step_s = statistics.median(r["step_s"] for r in res["records"][2:])
    eval_s = max(0.0, res["train_wall_s"] - sum(r["step_s"] for r in res["records"]))
    return {"step_s": step_s, "eval_s": eval_s,
            "setup_s": max(0.0, wall - res["train_wall_s"]), "wall_s": wall}


def prewarm(corpus: Corpus, device: str = "cuda") -> None:
    """Compile the Triton kernels of a SCAPE step in one thread (the tiny model, W=1), before
    W threads run them."""
    p = dataclasses.replace(PRESETS["smoke"], world=1, eval_every=100)
    cfg = run_config("prewarm", 0.99, p, 3, device, {"warmup_steps": 1})
    run_threads(train_rank, 1, dataclasses.asdict(cfg), corpus, device=device)


def _out_of_memory(e: BaseException | None) -> bool:
    while e is not None:
        if isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e):
            return True
        e = e.__cause__
    return False


def plan_steps(p: Preset, cal: dict[str, float], budget_s: float, rows: int,
               spent_s: float) -> dict[str, Any]:
    """The steps per optimizer: the target, scaled down to the budget (never up)."""
    tokens_per_step = p.world * p.batch * p.seq
    target = max(p.steps, math.ceil(p.tokens / tokens_per_step))
    margin = 1.15  # steps vary; a stalled device would stop the row (truncated), not the job
    per_row = (budget_s - spent_s) / rows - cal["setup_s"] - p.timed_steps * cal["step_s"]

    def cost(steps: int) -> float:
        evals = math.ceil(steps / p.eval_every)
        return margin * steps * cal["step_s"] + evals * cal["eval_s"]

    steps = target
    while steps > 1 and cost(steps) > per_row:
        steps = max(1, int(steps * 0.95))
    est = rows * (cost(steps) + cal["setup_s"] + p.timed_steps * cal["step_s"] * margin)
    return {"target_steps": target, "steps": steps, "tokens_per_step": tokens_per_step,
            "tokens_per_optimizer": steps * tokens_per_step, "scaled_down": steps < target,
            "estimated_s": est, "budget_s": budget_s, "calibration": cal}


def _environment(device: str) -> dict[str, Any]:
    def rev(*args: str) -> str | None:
        try:
            return subprocess.run(["git", *args], capture_output=True, text=True, timeout=10,
                                  cwd=Path(__file__).parent).stdout.strip() or None
        except (OSError, subprocess.SubprocessError):
            return None

    from importlib.metadata import packages_distributions, version

    versions = {}
    dists = packages_distributions()
    for name in CORPUS_PACKAGES:  # (distribution names: cupy is cupy-cuda12x, ...)
        for dist in dists.get(name, []):
            try:
                versions[dist] = version(dist)
            except Exception:  # noqa: BLE001 - unreadable metadata: not recorded
                continue
    return {"platform": platform.platform(), "python": platform.python_version(),
            "cpus": os.cpu_count(), "device": device,
            "device_name": torch.cuda.get_device_name() if device == "cuda" else "cpu",
            "packages": versions, "git_revision": rev("rev-parse", "HEAD"),
            "git_dirty": bool(rev("status", "--porcelain"))}


def summarize(name: str, sparsity: float, res: dict[str, Any], cfg: RunConfig) -> dict[str, Any]:
    """One row of the report from rank 0's result."""
    recs = res["records"]
    steady = [r for r in recs if not r["dense"]] or recs[len(recs) // 2:]
    phases = res["phases"]
    med = {k: statistics.median(ph[k] for ph in phases) for k in phases[0]} if phases else {}
    return {"name": name, "optimizer": cfg.optimizer, "sparsity": sparsity,
            "steps": res["steps"], "planned_steps": cfg.steps, "truncated": res["truncated"],
            "tokens": res["steps"] * cfg.batch * cfg.world * cfg.seq_len,
            "final_val_loss": res["val_curve"][-1][1] if res["val_curve"] else None,
            "val_curve": res["val_curve"],
            "train_loss_rank0": [[i + 1, r["train_loss"]] for i, r in enumerate(recs)
                                 if (i + 1) % max(1, len(recs) // 50) == 0],
            "median_train_step_s": statistics.median(r["step_s"] for r in steady),
            "bytes_per_step_per_rank": statistics.median(r["bytes"] for r in steady),
            "phases_median": med, "phases": phases, "timed_steps": len(phases),
            "train_wall_s": res["train_wall_s"], "peak_mem_gb": res["peak_mem_gb"],
            "replicas_agree": res["replicas_agree"], "param_sha256": res["param_sha256"],
            "optimizer_settings": res["optimizer_settings"]}


def write_report(out: Path, report: dict[str, Any]) -> None:
    rows = report["rows"]
    dense = dict(next((map(tuple, r["val_curve"]) for r in rows if r["sparsity"] == 0), ()))
    for r in rows:  # against dense AdamS at the row's last evaluation (a truncated row's too)
        last = r["val_curve"][-1] if r["val_curve"] else None
        r["val_ratio_to_adams"] = (last[1] / dense[last[0]]
                                   if last is not None and last[0] in dense else None)
    tmp = out / "report.json.tmp"
    tmp.write_text(json.dumps(report, indent=1))
    tmp.replace(out / "report.json")
    p, c = report["plan"], report["corpus"]
    env = report["environment"]
    lines = [f"# W={report['preset']['world']} ranks on one device ({env['device_name']})",
             "", f"`{report['command']}` ({report['date']})", "",
             f"Plan: {p['text']}", "",
             f"Corpus: `.py` sources of {', '.join(c['packages'])}; train {c['train_files']:,} "
             f"files, {c['train_bytes']:,} bytes; validation {c['val_files']:,} files, "
             f"{c['val_bytes']:,} bytes, sha256 `{c['val_sha256'][:16]}…`", "",
             "## Quality (validation loss, nats/byte)", "",
             markdown_table(["row", "steps", "tokens", "final val loss", "ratio to adams",
                             "bytes/step/rank", "truncated"],
                            [[r["name"], r["steps"], r["tokens"], fmt(r["final_val_loss"]),
                              fmt(r["val_ratio_to_adams"]), int(r["bytes_per_step_per_rank"]),
                              str(r["truncated"])] for r in rows]),
             "", "## Step time (ms, all W ranks on this one device, median of the timed steps)",
             "", markdown_table(["row", "step", "fwd+bwd", "optimizer", "of which local",
                                 "of which in-process comm", "training step (median)"],
                                [[r["name"]] + [fmt(r["phases_median"].get(k, float("nan")) * 1e3,
                                                    ".1f")
                                                for k in ("step_s", "fwd_bwd_s", "opt_s",
                                                          "local_s", "comm_s")]
                                 + [fmt(r["median_train_step_s"] * 1e3, ".1f")] for r in rows]),
             "", "Every rank is a thread with its own replica, gradient, residual and optimizer "
             "shard; collectives read and reduce the ranks' buffers in device memory (no "
             "network). A step here is the work of all W ranks on one device."]
    (out / "report.md").write_text("\n".join(lines) + "\n")
    if any(r["val_curve"] for r in rows):
        if not plot_loss(rows, str(out / "loss.png"), title=f"{report['preset']['model']}, "
                         f"W={report['preset']['world']} on one device"):
            plain_plot(rows, out / "loss.png")


def plain_plot(rows: list[dict[str, Any]], path: Path, w: int = 640, h: int = 400) -> None:
    """loss.png without matplotlib (a machine without it): each row's validation curve as a
    line on white, x from 0 to the last step, y from the lowest to the highest loss; colours
    in row order (black, red, blue, green)."""
    import struct
    import zlib

    img = torch.full((h, w, 3), 255, dtype=torch.uint8)
    img[h - 21, 20:w - 10] = 0  # the axes
    img[10:h - 20, 20] = 0
    curves = [r["val_curve"] for r in rows if r["val_curve"]]
    xs = [c[0] for cv in curves for c in cv]
    ys = [c[1] for cv in curves for c in cv]
    x1, y0, y1 = max(xs), min(ys), max(ys) if max(ys) > min(ys) else min(ys) + 1

    def px(c: list[float]) -> tuple[float, float]:
        return 21 + (w - 32) * c[0] / x1, (h - 22) - (h - 32) * (c[1] - y0) / (y1 - y0)

    colours = [(0, 0, 0), (220, 30, 30), (30, 60, 220), (20, 150, 40)]
    for i, cv in enumerate(curves):
        pts = [px(c) for c in cv]
        for (xa, ya), (xb, yb) in zip(pts, pts[1:] or pts):
            for t in torch.linspace(0, 1, 200).tolist():
                x, y = int(xa + t * (xb - xa)), int(ya + t * (yb - ya))
                img[max(0, y - 1):y + 2, max(0, x - 1):x + 2] = torch.tensor(colours[i % 4],
                                                                             dtype=torch.uint8)
    raw = b"".join(b"\x00" + img[y].numpy().tobytes() for y in range(h))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(
            ">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)  # 8-bit RGB
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header)
                     + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))


def run(args: argparse.Namespace) -> dict[str, Any]:
    preset = PRESETS["smoke" if args.smoke else "gpu"]
    if args.steps is not None:
        preset = dataclasses.replace(preset, steps=args.steps, tokens=0)
    if args.world is not None:
        preset = dataclasses.replace(preset, world=args.world)
    device = "cpu" if args.smoke else ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu" and not args.smoke:
        raise SystemExit("bench.gpu: no CUDA device here; --smoke runs the same code on the "
                         "CPU with the tiny preset")
    if device == "cpu":
        torch.set_num_threads(1)
    budget = args.budget_s if args.budget_s is not None else preset.budget_s
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()
    corpus = load_packages(preset.corpus)
    record = {**corpus.record(),
              "packages": [n for n in preset.corpus if package_root(n) is not None]}
    n_params = num_params(make_model(preset.model))
    tokens_per_step = preset.world * preset.batch * preset.seq
    target = max(preset.steps, math.ceil(preset.tokens / tokens_per_step))
    print(f"plan: {preset.model} GPT, {n_params:,} parameters; W={preset.world} ranks as "
          f"threads on one {device}; {tokens_per_step:,} tokens/step ({preset.world} x "
          f"{preset.batch} x {preset.seq}); target {target:,} "
          f"steps per optimizer; rows {', '.join(n for n, _ in ROWS)}; budget {budget:.0f} s",
          flush=True)
    print(f"corpus: {record['train_files']:,} train files ({record['train_bytes']:,} bytes), "
          f"{record['val_files']:,} validation files ({record['val_bytes']:,} bytes, sha256 "
          f"{record['val_sha256'][:16]}) from {', '.join(record['packages'])}", flush=True)
    previous = _load(out / "report.json")
    key = json.loads(json.dumps({"preset": dataclasses.asdict(preset), "device": device,
                                 "budget_s": budget}))  # (as report.json holds it)
    if previous is not None and previous.get("key") == key \
            and previous["corpus"]["val_sha256"] == record["val_sha256"]:
        plan, rows = previous["plan"], previous["rows"]
        preset = dataclasses.replace(preset, batch=plan["batch"])
        print(f"plan: resumed from {out / 'report.json'} ({len(rows)} rows done)", flush=True)
    else:
        if device == "cuda":
            prewarm(corpus)
        while True:
            try:
                cal = calibrate(preset, corpus, device)
                break
            except RuntimeError as e:  # out of memory: half the batch per rank
                if preset.batch == 1 or not _out_of_memory(e):
                    raise
                preset = dataclasses.replace(preset, batch=preset.batch // 2)
                print(f"plan: out of device memory in the calibration; {preset.batch} "
                      f"sequences per rank", flush=True)
        plan = plan_steps(preset, cal, budget, len(ROWS), time.monotonic() - t_start)
        plan["batch"] = preset.batch
        plan["text"] = (f"{plan['steps']:,} steps x {len(ROWS)} optimizers, "
                        f"{plan['tokens_per_optimizer'] / 1e6:.2f}M tokens each"
                        + (f" (scaled down from {plan['target_steps']:,} by the budget)"
                           if plan["scaled_down"] else "")
                        + f"; estimated {plan['estimated_s']:.0f} device seconds (W-rank step "
                        f"{cal['step_s'] * 1e3:.0f} ms, evaluation {cal['eval_s']:.1f} s, "
                        f"set-up {cal['setup_s']:.1f} s, measured)")
        rows = []
    print(f"plan: {plan['text']}", flush=True)
    report: dict[str, Any] = {
        "schema": SCHEMA, "command": "python -m bench.gpu " + " ".join(sys.argv[1:]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "environment": _environment(device), "key": key, "preset": dataclasses.asdict(preset),
        "params": n_params, "recipe": RECIPE, "corpus": record, "plan": plan, "rows": rows}
    write_report(out, report)
    share = (budget - (time.monotonic() - t_start)) / max(1, len(ROWS) - len(rows))
    for name, sparsity in ROWS:
        if any(r["name"] == name for r in rows):
            print(f"[{name}] done before, kept", flush=True)
            continue
        every = min(preset.eval_every, max(1, plan["steps"] // 10))  # 10 points at least
        cfg = run_config(name, sparsity, dataclasses.replace(preset, eval_every=every),
                         plan["steps"], device)
        t0 = time.monotonic()
        # stop at the next evaluation past half again its share, or past the whole budget
        deadline = min(t0 + 1.5 * share, t_start + budget)
        res = _threads_run(cfg, corpus, preset.timed_steps, deadline)
        row = summarize(name, sparsity, res, cfg)
        row["wall_s"] = time.monotonic() - t0
        rows.append(row)
        write_report(out, report)
        ph = row["phases_median"]
        print(f"[{name}] {row['steps']} steps, val {fmt(row['final_val_loss'])}, step "
              f"{ph.get('step_s', float('nan')) * 1e3:.1f} ms (fwd+bwd "
              f"{ph.get('fwd_bwd_s', float('nan')) * 1e3:.1f}, local "
              f"{ph.get('local_s', float('nan')) * 1e3:.1f}, comm "
              f"{ph.get('comm_s', float('nan')) * 1e3:.1f}), {row['wall_s']:.0f} s", flush=True)
    report["wall_s"] = time.monotonic() - t_start
    write_report(out, report)
    print(f"wrote {out / 'report.json'}, report.md, loss.png ({report['wall_s']:.0f} s)")
    return report


# -- threads or processes (the choice, measured on the CPU) ----------------------------------
def _process_rank(rank: int, world: int, configs: list[dict[str, Any]],
                  corpus_names: tuple[str, ...]) -> list[list[dict[str, Any]]]:
    from scape.comm import TorchCommunicator

    comm = TorchCommunicator(timeout=300.0)
    corpus = load_packages(corpus_names)
    return [train_rank(rank, comm, c, corpus).get("records", []) for c in configs]


def _thread_rank(rank: int, comm: Any, configs: list[dict[str, Any]],
                 corpus: Corpus) -> list[list[dict[str, Any]]]:
    return [train_rank(rank, comm, c, corpus).get("records", []) for c in configs]


def threads_vs_processes(out: Path, world: int = 8, steps: int = 30, reps: int = 2
                         ) -> dict[str, Any]:
    """W ranks as threads (:class:`InProcessGroup`) against W gloo processes (the engine's
    launcher, one torch thread each) on the CPU, the same :func:`train_rank`: dense and
    SCAPE-0.99 (5 dense warm-up steps), ``tiny`` and ``small``, repetitions interleaved; the
    median step of the last two thirds on rank 0 and each launch's wall time."""
    from bench.engine.launch import Ranks, launch

    torch.set_num_threads(1)
    names = PRESETS["smoke"].corpus
    corpus = load_packages(names)
    results: dict[str, list[dict[str, float]]] = {}
    for model, seq in (("tiny", 64), ("small", 128)):
        p = dataclasses.replace(PRESETS["smoke"], model=model, world=world, seq=seq,
                                eval_every=10 * steps)
        configs = [dataclasses.asdict(run_config(f"s{s}", s, p, steps, "cpu",
                                                 {"warmup_steps": 5})) for s in (0.0, 0.99)]
        for _ in range(reps):
            for kind in ("threads", "processes"):
                t0 = time.perf_counter()
                if kind == "threads":
                    recs = run_threads(_thread_rank, world, configs, corpus)[0]
                else:
                    outcomes = launch(_process_rank, Ranks(world=world, timeout_s=900,
                                                           threads=1, label=kind),
                                      configs, names)
                    bad = [o.error for o in outcomes if not o.ok]
                    if bad:
                        raise RuntimeError(f"a process rank failed: {bad[0]}")
                    recs = outcomes[0].result
                wall = time.perf_counter() - t0
                med = [statistics.median(r["step_s"] for r in rs[steps // 3:]) for rs in recs]
                row = {"wall_s": wall, "dense_step_s": med[0], "scape_0.99_step_s": med[1]}
                results.setdefault(f"{model}/{kind}", []).append(row)
                print(f"{model:6} {kind:9} launch to results {wall:6.1f} s, step: dense "
                      f"{med[0] * 1e3:6.1f} ms, SCAPE-0.99 {med[1] * 1e3:6.1f} ms", flush=True)
    report = {"schema": "scape.gpu_ranks/1", "world": world, "steps": steps,
              "environment": _environment("cpu"), "results": results}
    out.mkdir(parents=True, exist_ok=True)
    (out / "threads_vs_processes.json").write_text(json.dumps(report, indent=1))
    return report


def _load(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("schema") == SCHEMA else None


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="report folder (kept rows resume there)")
    ap.add_argument("--smoke", action="store_true", help="tiny preset on the CPU (CI)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="device seconds for the whole command (default 480; smoke 120)")
    ap.add_argument("--steps", type=int, default=None, help="target steps (default 1000)")
    ap.add_argument("--world", type=int, default=None, help="ranks (default 8)")
    ap.add_argument("--threads-vs-processes", action="store_true",
                    help="measure W=8 ranks as threads against gloo processes on the CPU "
                         "(the choice of threads; writes OUT/threads_vs_processes.json)")
    args = ap.parse_args(argv)
    if args.threads_vs_processes:
        threads_vs_processes(Path(args.out))
    else:
        run(args)


if __name__ == "__main__":
    main()
