"""Convergence ablation and the quality research (issue: quality at 99% sparsity).

Trains the bundled byte-level GPT on the stdlib corpus once per variant -- dense sharded
AdamS (a learning-rate sweep picks its lr), SCAPE rules and schedules at sparsity 0.9 and
0.99 -- with the same seed, data order, token budget and LR schedule, and writes the final
validation loss of each and its ratio to dense AdamS.

**Why one process.** SCAPE with W ranks is, up to fp32 summation order, the same algorithm
as SCAPE with one rank fed the global batch: the take is linear, so the ranks' residuals sum
to the single-rank residual; the reduce-scatter (avg) delivers the global-batch gradient;
masks are per block and do not depend on W (padding aside). The ablation therefore runs
W = 1 with the global batch and spends the machine's cores on the model instead of on
process overhead; ``--check-world 4`` re-runs the first sparse variant on 4 gloo ranks
through :mod:`bench.runner` (same data, schedule and seed) to confirm the equivalence on
this workload. (The raw-gradient top-k peer
baseline is *not* W-invariant; it is measured by ``bench.compare`` on W ranks.)

**Local-step rows** (``--local``): SparseLoCo and DiLoCo are *not* W-invariant either (each
rank trains alone between syncs), so they run on ``--world`` gloo ranks (default 4) through
:mod:`bench.runner`, each rank on its ``1/W`` of the same global batch: the same tokens, lr
schedule, seed, data order and validation windows as the single-process rows. The inner
optimizer is AdamW (:func:`bench.local_sgd_opts.build_local_sgd`) at the ablation's lr (the
dense sweep's choice, or ``--local-lr``, which labels the rows). Row names are
``sparseloco-h<H>-d<density>[-b<bits>]`` and ``diloco-h<H>`` (``all``: :data:`LOCAL_ROWS`).
They are evaluated at sync points (every multiple of ``H`` near ``eval_every``) and at the
end; when ``steps`` is not a multiple of ``H`` a warning is printed and the row also records
its loss at the last sync. Every row records its bytes per step per rank (mean over the run;
the single-process rows count at W=1, which differs from W ranks only by padding), and the
report has dense sharded AdamS's ``N_pad * (4 + 4) + 8`` at ``--world`` for reference.
``--adamw-reference`` adds dense AdamW at the local-step rows' inner lr (one process: dense
data-parallel AdamW is W-invariant like SCAPE), which separates the inner optimizer from the
local steps.

    python -m bench.convergence --steps 400 --out bench/results/convergence_400.json
    python -m bench.convergence --steps 400 --lr 0.0003 --dense-loss 2.2193 --variants none \
        --local sparseloco-h8-d0.01 diloco-h8 --threads 1 --out bench/results/local.json
    python -m bench.convergence --smoke            # seconds; CI checks the schema
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import platform
import sys
import time
from typing import Any

import torch

from bench.convergence_rows import Allotment, ramp_sparsity, variants
from bench.data import batch_at, eval_loss, load_corpus
from bench.gpt import GPT, get_config, num_params, param_groups
from bench.local_sgd_opts import LOCAL_SGD, parse_local_name, sync_warning
from bench.runner import RunConfig, lr_at, run

SCHEMA = "scape.convergence/1"


@dataclasses.dataclass
class Workload:
    """The training setup every variant shares."""

    model: str = "small"
    """bench.gpt preset."""
    steps: int = 400
    """Optimizer steps."""
    batch: int = 16
    """Sequences per micro-batch (the global batch of W ranks)."""
    accum: int = 1
    """Micro-batches per step (a larger global batch at the same memory)."""
    seq: int = 128
    """Tokens per sequence."""
    warmup_frac: float = 0.05
    """Linear LR warm-up, as a fraction of steps; then cosine decay to 10%."""
    weight_decay: float = 0.1
    """On the weight matrices (norms and embeddings: 0)."""
    seed: int = 0
    """Model init and data order."""
    eval_every: int = 100
    """Validation loss every n steps (and at the end)."""
    eval_seqs: int = 128
    """Fixed held-out windows of the validation split."""
    threads: int = 2
    """torch threads."""


def run_config(variant: dict[str, Any], w: Workload, world: int) -> RunConfig:
    """The same run as :func:`train` for :mod:`bench.runner` on ``world`` ranks (a local-step
    variant, ``optimizer`` in ``LOCAL_SGD``, is evaluated at multiples of its ``H``)."""
    if w.batch % world:
        raise ValueError(f"the global batch of {w.batch} sequences does not split over "
                         f"{world} ranks; pick a world size that divides it")
    if variant.get("ramp") and world > 1:
        raise ValueError(f"{variant['name']}: sparsity-ramp rows run in one process only "
                         "(bench.runner has no sparsity schedule)")
    if variant.get("trust_lr") and world > 1:
        raise ValueError(f"{variant['name']}: scheduled-bound rows run in one process only "
                         "(bench.runner has no rule schedule)")
    if variant.get("allot") and world > 1:
        raise ValueError(f"{variant['name']}: automatic-split rows run in one process only "
                         "(bench.runner has no sparsity schedule)")
    if variant.get("transform") and world > 1:
        raise ValueError(f"{variant['name']}: transform-domain rows run in one process only "
                         "(bench.rotate is not wired into bench.runner)")
    kw = {k: v for k, v in variant.items()
          if k not in ("name", "optimizer", "lr", "sparsity", "group_sparsity", "allot",
                       "allot_floor", "trust_lr")}
    kind, sparsity, eval_every = variant.get("optimizer"), variant.get("sparsity", 0.0), \
        w.eval_every
    if kind in LOCAL_SGD:
        h = kw["sync_every"]
        eval_every = max(h, w.eval_every // h * h)
    else:
        kind = "scape" if sparsity > 0 else "adams"
    return RunConfig(optimizer=kind, sparsity=sparsity, optimizer_kwargs=kw,
                     group_sparsity=variant.get("group_sparsity"),
                     model=w.model, world=world, steps=w.steps, batch=w.batch // world,
                     grad_accum=w.accum, seq=w.seq, lr=variant["lr"],
                     warmup_frac=w.warmup_frac, weight_decay=w.weight_decay, seed=w.seed,
                     eval_every=eval_every, eval_seqs=w.eval_seqs, threads=1,
                     log_every=max(1, w.steps // 4), timeout_s=7200.0,
                     name=variant["name"] + f"@W{world}")


def build_optimizer(model: torch.nn.Module, variant: dict[str, Any], w: Workload,
                    comm: Any = None) -> tuple[torch.optim.Optimizer, Any]:
    """The variant's optimizer, and its :class:`bench.rotate.Rotated` (None unless the variant
    has a ``transform``: then the ``decay`` group trains in that transform domain)."""
    import scape

    kind = variant.get("optimizer", "scape")
    kw = {k: v for k, v in variant.items()
          if k not in ("name", "optimizer", "lr", "group_sparsity", "transform", "ramp",
                       "allot", "allot_floor", "trust_lr")}
    groups = param_groups(model, w.weight_decay, variant.get("group_sparsity"))
    if variant.get("allot"):  # the row's Allotment makes the split, not the optimizer
        if variant.get("split") not in (None, "auto"):
            raise ValueError(f"{variant['name']}: an -auto row cannot also set split")
        kw["split"] = None
    rotated = None
    if variant.get("transform"):
        from bench.rotate import Rotated

        tkind, chunk = variant["transform"]
        rotated = Rotated(groups[0]["params"], tkind, chunk)
        groups[0]["params"] = rotated.shadows
    for g in groups:
        g.pop("name", None)
    if kind == "adamw":
        return scape.DistributedAdamW(groups, lr=variant["lr"], betas=(0.9, 0.95),
                                      comm=comm), rotated
    return scape.SCAPE(groups, lr=variant["lr"], comm=comm, **kw), rotated


def train(variant: dict[str, Any], w: Workload, corpus: Any, rank: int = 0, world: int = 1,
          comm: Any = None, log: bool = True) -> dict[str, Any]:
    """Train one variant; return its curves and final validation loss."""
    torch.manual_seed(w.seed)
    model = GPT(get_config(w.model), seed=w.seed)
    opt, rotated = build_optimizer(model, variant, w, comm)
    schedule = run_config(variant, w, 1)  # the runner's LR schedule, shared
    curve, train_curve = [], []
    t0 = time.perf_counter()
    diag: dict[str, float] = {}
    sent = sent_sparse = 0
    base = [g.get("sparsity", 0.0) for g in opt.param_groups]
    warm = variant.get("warmup_steps", 0)
    split = Allotment(opt, variant, w.steps) if variant.get("allot") else None
    history: list = [] if split is None else split.history
    gain: Any = getattr(opt, "split_gain", None)  # the optimizer's last reading (-split)
    for step in range(w.steps):
        for g, sp in zip(opt.param_groups, base):
            g["lr"] = lr_at(step, schedule)
            if variant.get("ramp") and sp > 0:
                g["sparsity"] = ramp_sparsity(variant, sp, step - warm, w.steps)
        if split is not None and step >= warm:
            split(step - warm)
        if variant.get("trust_lr"):  # the bound moves with the lr: c_hi at the peak, c_lo at 0
            from scape.rules import agree_trust_rule

            c_hi, c_lo = variant["trust_lr"]
            opt.rule = agree_trust_rule(c_lo + (c_hi - c_lo) * lr_at(step, schedule)
                                        / variant["lr"])
        loss_acc = 0.0
        for micro in range(w.accum):
            x, y = batch_at(corpus.train, step * w.accum + micro, w.batch, w.seq, w.seed,
                            rank, world)
            loss = model.loss(x, y) / w.accum
            loss.backward()
            loss_acc += float(loss.detach())
        if rotated is not None:
            rotated.push_grads()
        if split is not None:
            split.observe()
        opt.step()
        opt.zero_grad()
        if getattr(opt, "split", None) and opt.split_gain is not gain:  # read for this mask
            gain = opt.split_gain
            history.append((step + 1 - warm, dict(gain), dict(opt.split_sparsity)))
        if rotated is not None:
            rotated.pull()
        sent += sum(opt.last_step.bytes.values())
        if step >= warm:
            sent_sparse += sum(opt.last_step.bytes.values())
        train_curve.append(loss_acc)
        if (step + 1) % w.eval_every == 0 or step + 1 == w.steps:
            val = eval_loss(model, corpus.val, w.seq, n_seqs=w.eval_seqs)
            curve.append((step + 1, val))
            if log and rank == 0:
                print(f"  [{variant['name']}] step {step + 1}/{w.steps} train {loss_acc:.3f} "
                      f"val {val:.4f} ({time.perf_counter() - t0:.0f} s)", flush=True)
    for d in getattr(opt, "diagnostics", [])[:1]:
        diag = {k: float(v) for k, v in d.items()}
    return {"variant": variant, "final_val_loss": curve[-1][1], "val_curve": curve,
            "train_loss_last50": sum(train_curve[-50:]) / len(train_curve[-50:]),
            "diagnostics": diag, "bytes_last_step": dict(opt.last_step.bytes),
            "bytes_per_step": sent / w.steps,
            "bytes_per_sparse_step": sent_sparse / max(1, w.steps - warm), "world": 1,
            "wall_s": time.perf_counter() - t0, "params": num_params(model),
            **({"allot_history": history} if history else {})}


LOCAL_ROWS = ("sparseloco-h8-d0.01", "sparseloco-h8-d0.03", "sparseloco-h32-d0.01",
              "sparseloco-h32-d0.03", "diloco-h8", "diloco-h32")
"""``--local all``: SparseLoCo at H = 8, 32 and density 1%, 3% (2-bit values), DiLoCo at
H = 8, 32; the other outer hyperparameters are the library's defaults."""


def local_variant(name: str, lr: float, label_lr: bool = False) -> dict[str, Any]:
    """The variant dict of a local-step row (``label_lr``: the name says the inner lr)."""
    opt, kw = parse_local_name(name)
    return dict(name=name + (f"-inner_lr{lr:g}" if label_lr else ""), optimizer=opt, lr=lr,
                **kw)


def train_local(variant: dict[str, Any], w: Workload, world: int) -> dict[str, Any]:
    """A local-step row on ``world`` gloo ranks through :mod:`bench.runner`."""
    import inspect

    import scape

    res = run(run_config(variant, w, world))
    h = variant["sync_every"]
    at_sync = [(s, v) for s, v in res["val_curve"] if s % h == 0]
    n_syncs = w.steps // h
    mean = res["bytes_per_step_mean_all_steps"]
    cls = scape.SparseLoCo if variant["optimizer"] == "sparseloco" else scape.DiLoCo
    outer = {k: p.default for k, p in inspect.signature(cls).parameters.items()
             if p.default is not inspect.Parameter.empty and k != "comm"}
    outer.update({k: variant[k] for k in outer if k in variant})
    curve = res["train_curve"]
    return {"variant": variant, "world": world, "final_val_loss": res["final_val_loss"],
            "val_curve": res["val_curve"],
            "last_sync_step": at_sync[-1][0] if at_sync else None,
            "last_sync_val_loss": at_sync[-1][1] if at_sync else None,
            "train_loss_last50_rank0": sum(curve[-50:]) / len(curve[-50:]),
            "bytes_per_step": mean,
            "bytes_per_sync": mean * w.steps / n_syncs if n_syncs else None,
            "outer_settings": outer, "wall_s": res["wall_s"], "params": res["params"]}


def train_ranks(variant: dict[str, Any], w: Workload, world: int) -> dict[str, Any]:
    """A row on ``world`` gloo ranks through :mod:`bench.runner` (``--ranks``): each rank
    sees its own ``batch / world`` sequences, so the rules' local statistics (the noise EMA,
    the gain masks' mean) are those of a real run, not of the global batch."""
    res = run(run_config(variant, w, world))
    curve = res["train_curve"]
    return {"variant": variant, "world": world, "final_val_loss": res["final_val_loss"],
            "val_curve": res["val_curve"], "train_loss_last50": sum(curve[-50:]) / len(curve[-50:]),
            "diagnostics": {}, "bytes_last_step": res["bytes_per_step"],
            "bytes_per_step": res["bytes_per_step_mean_all_steps"],
            "bytes_per_sparse_step": res["bytes_per_step_total"],  # median of the steady steps
            "wall_s": res["wall_s"], "params": res["params"]}


def dense_bytes_per_step(w: Workload, world: int) -> int:
    """Dense sharded AdamS's bytes per step per rank at ``world`` ranks on this model:
    ``N_pad * (4 + 4) + 8`` (fp32 reduce-scatter and all-gather of the padded flat buffers,
    DESIGN §1, plus the 8-byte scalar all-reduce), ``N_pad`` from the library's buckets."""
    import scape
    from bench.nullcomm import NullCommunicator

    groups = param_groups(GPT(get_config(w.model), seed=w.seed), w.weight_decay)
    for g in groups:
        g.pop("name", None)
    opt = scape.SCAPE(groups, lr=1e-3, sparsity=0.0, comm=NullCommunicator(world, 0))
    return sum(b.n_pad for b in opt.buckets) * (4 + 4) + 8


DENSE_LRS = (1e-3, 3e-3, 1e-2)


def _load_reports(paths: list[str]) -> list[tuple[str, dict[str, Any]]]:
    reports = []
    for path in paths:
        with open(path) as f:
            rep = json.load(f)
        if rep.get("schema") != SCHEMA:
            raise ValueError(f"{path}: not a {SCHEMA} report")
        reports.append((path, rep))
    return reports


def _dense_losses(reports: list[tuple[str, dict[str, Any]]]) -> dict[tuple, float]:
    """The best dense AdamS loss per workload (steps, accum, model, seed) among the reports' rows:
    the sweep's choice when its learning rates ran as separate files."""
    best: dict[tuple, float] = {}
    for _, rep in reports:
        w = rep["workload"]
        key = (w["steps"], w["accum"], w["model"], w.get("seed", 0))
        for r in rep["results"]:
            if r["variant"]["name"].startswith("dense-adams"):
                best[key] = min(best.get(key, math.inf), r["final_val_loss"])
    return best


def _ratio(path: str, rep: dict[str, Any], r: dict[str, Any], dense_ref: float | None,
           dense: dict[tuple, float]) -> float:
    if dense_ref:
        return r["final_val_loss"] / dense_ref
    if r["ratio_to_dense"] is not None:
        return r["ratio_to_dense"]
    w = rep["workload"]
    ref = dense.get((w["steps"], w["accum"], w["model"], w.get("seed", 0)))
    if ref is None:
        raise ValueError(f"{path}: ran with --no-dense; give --dense-loss or a file with the "
                         f"dense run of the same workload for its ratios")
    return r["final_val_loss"] / ref


def gap_series(paths: list[str], dense_ref: float | None = None
               ) -> dict[str, list[tuple[float, float]]]:
    """``{"<rule> @ <sparsity>": [(steps x density, ratio to dense), ...]}`` for every rule
    measured at two or more training lengths among the sparse rows of the given files."""
    reports = _load_reports(paths)
    dense = _dense_losses(reports)
    series: dict[str, set[tuple[float, float]]] = {}
    for path, rep in reports:
        for r in rep["results"]:
            sp = r["variant"].get("sparsity", 0.0)
            if sp <= 0 or r["variant"].get("optimizer") in LOCAL_SGD:
                continue
            name = f"{r['variant']['name'].split('@')[0]} @ {sp:g}"
            x = rep["workload"]["steps"] * (1.0 - sp)
            series.setdefault(name, set()).add((x, _ratio(path, rep, r, dense_ref, dense)))
    return {k: sorted(v) for k, v in sorted(series.items()) if len({x for x, _ in v}) > 1}


def plot_gap(paths: list[str], out: str, dense_ref: float | None = None) -> bool:
    """Plot :func:`gap_series`: ratio to dense AdamS against steps x density (the syncs a
    coordinate gets on average). False (and no file) when no rule has two lengths."""
    from bench.report import plot_points

    series = gap_series(paths, dense_ref)
    if not series:
        print("note: no rule was measured at two training lengths in these files; no plot")
        return False
    return plot_points(series, out, xlabel="steps x density (syncs per coordinate)",
                       ylabel="final val loss / dense AdamS", logx=True, hline=1.0,
                       title="gap to dense AdamS against training length")


def table(paths: list[str], dense_ref: float | None = None) -> str:
    """A markdown table of every row of the given result files, with the command of each.

    ``dense_ref``: recompute every ratio against this dense loss (e.g. the sweep's best when
    the sweep's learning rates ran as separate files). The bytes column is the row's mean
    bytes per step per rank (``–`` for files written before it was recorded); a local-step
    row names its world size, and when its last step is not a sync its loss at the last sync
    follows in brackets. Where a file recorded dense sharded AdamS's bytes per step (runs
    with local-step rows), its rows' bytes carry their fraction of it and a note after the
    table gives it."""
    lines = ["| steps | accum | variant | sparsity | final val loss | ratio to dense | "
             "bytes/step/rank | command |", "|---|---|---|---|---|---|---|---|"]
    notes: list[str] = []
    seen: set[tuple] = set()
    reports = _load_reports(paths)
    dense_losses = _dense_losses(reports)
    for path, rep in reports:
        w = rep["workload"]
        dense = rep.get("dense_adams_bytes_per_step")
        if dense:
            notes.append(f"Dense sharded AdamS on this model at W={dense['world']}: "
                         f"{dense['bytes']:,} bytes/step/rank ({dense['formula']}).")
        for r in rep["results"]:
            v = r["variant"]
            key = (w["steps"], w["accum"], v["name"], r["final_val_loss"])
            if key in seen:  # the same run repeated in another file (runs are deterministic)
                continue
            seen.add(key)
            ratio = _ratio(path, rep, r, dense_ref, dense_losses)
            local = v.get("optimizer") in LOCAL_SGD
            name = v["name"].split("@")[0] + (f" (W={r['world']})" if local else "")
            loss = f"{r['final_val_loss']:.4f}"
            if local and r.get("last_sync_step") not in (None, w["steps"]):
                loss += f" (last sync, step {r['last_sync_step']}: {r['last_sync_val_loss']:.4f})"
            nbytes = r.get("bytes_per_step")
            cell = "–" if nbytes is None else f"{nbytes:,.0f}"
            if nbytes and dense:
                cell += f" (1/{dense['bytes'] / nbytes:.0f})"
            lines.append(f"| {w['steps']} | {w['accum']} | {name} | "
                         f"{'–' if local else format(v.get('sparsity', 0.0), 'g')} | {loss} | "
                         f"{ratio:.3f} | {cell} | `{rep['command']}` |")
    return "\n".join(lines + [""] * bool(notes) + list(dict.fromkeys(notes)))


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
                    help="re-run the first sparse variant on this many gloo ranks (bench.runner)"
                         " and report its final loss beside the single-process one")
    ap.add_argument("--local", nargs="+", default=None, metavar="NAME",
                    help="local-step rows on --world gloo ranks: sparseloco-h<H>-d<density>"
                         "[-b<bits>], diloco-h<H>, or 'all' (" + " ".join(LOCAL_ROWS) + ")")
    ap.add_argument("--world", type=int, default=None,
                    help="ranks of the local-step rows (default 4; 2 with --smoke)")
    ap.add_argument("--ranks", type=int, default=0,
                    help="train the ablation rows on this many gloo ranks (bench.runner), each "
                         "fed batch/ranks sequences, instead of one process fed the global "
                         "batch: the rules' local statistics are then a real run's")
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
                 eval_every=max(1, args.steps // 4), seed=args.seed)
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
            h = parse_local_name(name)[1]["sync_every"]
            run_config(local_variant(name, 1.0), w, world)  # validates the world size
            warnings += [t for t in [sync_warning(name, h, w.steps)] if t]
    except ValueError as e:
        ap.error(f"--local/--world: {e}")
    for text in warnings:
        print(text, flush=True)
    torch.set_num_threads(w.threads)
    corpus = load_corpus(args.data)
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
        r = train(dict(name=f"dense-adams-lr{lr:g}", sparsity=0.0, lr=lr), w, corpus)
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
                                  lr=adamw_lr), w, corpus))
    for v in variants(args.sparsity, args.variants, args.warmup):
        v["lr"] = lr
        print(f"{v['name']} (lr {lr:g}{f', {args.ranks} ranks' if args.ranks else ''})",
              flush=True)
        results.append(train_ranks(v, w, args.ranks) if args.ranks else train(v, w, corpus))
    for name in local_names:
        inner_lr = lr if args.local_lr is None else args.local_lr
        v = local_variant(name, inner_lr, label_lr=inner_lr != lr)
        print(f"{v['name']} on {world} gloo ranks (AdamW inner, lr {inner_lr:g})", flush=True)
        results.append(train_local(v, w, world))
    world_check = None
    sparse_rows = [r for r in results  # the runner does not rotate: no transform rows
                   if r["variant"].get("sparsity", 0) > 0 and not r["variant"].get("transform")]
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
              "dense_val_loss": dense_loss, "command": " ".join(["python -m bench.convergence"]
                                                               + (argv or sys.argv[1:])),
              "machine": platform.processor() or platform.machine(),
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
