"""Local compute of one optimizer step: SCAPE-0.9/0.99 against dense sharded AdamS.

Everything a rank runs in ``opt.step()`` except waiting on the network: the collectives go
through :class:`bench.engine.nullcomm.NullCommunicator`, which completes at once but touches the
same buffers, so the timing holds every kernel, copy and Python line of the step for rank 0 of W.
Gradients are refilled (untimed) before each step with the same random values.

Target: SCAPE-0.99's local compute <= 1.3x dense sharded AdamS's on the same model and W.

    python -m bench.step_compute                      # model "base", W=4, 30 timed steps
    python -m bench.step_compute --smoke
    python -m bench.step_compute --update sqrt        # another sparse rule
    python -m bench.research bench.step_compute --update catchup_agree_accum   # a research one
    python -m bench.step_compute --groups             # two param groups (decay, no_decay)
    python -m bench.step_compute --device cuda --model medium --world 8   # on a GPU

On ``--device cuda`` the step runs the compiled Triton kernels; each timed step is bracketed
by ``torch.cuda.synchronize()``, so it holds the kernels' device time as well as the Python
and launch time of the step.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import time
from typing import Any

import torch

import scape
from bench.compare_report import environment
from bench.engine import optimizers
from bench.engine.nullcomm import NullCommunicator
from bench.workloads.gpt import GPT, get_config, num_params, param_groups

SCHEMA = "scape.step_compute/1"
OPTIMIZERS = {
    "dense_adams": ("adams", 0.0, {}),
    "scape_0.9": ("scape", 0.9, {"warmup_steps": 1}),
    "scape_0.99": ("scape", 0.99, {"warmup_steps": 1}),
    "dist_adamw": ("dist_adamw", 0.0, {}),
}
"""Row name -> (:mod:`bench.engine.optimizers` entry, sparsity, keyword arguments)."""
WIRE8_ROWS = {
    "scape_0.9_int8": ("scape", 0.9, {"warmup_steps": 1, "grad_comm_dtype": "int8"}),
    "scape_0.99_int8": ("scape", 0.99, {"warmup_steps": 1, "grad_comm_dtype": "int8"}),
    "scape_0.99_wire8": ("scape", 0.99, {"warmup_steps": 1, "grad_comm_dtype": "int8",
                                         "param_comm_dtype": "int8"}),
    "scape_0.99_wire86": ("scape", 0.99, {"warmup_steps": 1, "grad_comm_dtype": "int8",
                                          "param_comm_dtype": "int6"}),
    "scape_0.99_wire16": ("scape", 0.99, {"warmup_steps": 1, "grad_comm_dtype": "float16",
                                          "param_comm_dtype": "float16"}),
}
"""The compact wires' rows (``--int8``: 8-bit gradients; ``wire8`` also 8-bit parameter
updates, ``wire86`` 6-bit ones; ``wire16`` fp16 gradients and 16-bit updates), timed beside
the others."""


def build(model_name: str, world: int, kind: str, update: str | None = None,
          device: str = "cpu", groups: bool = False) -> tuple[torch.optim.Optimizer, int]:
    """One optimizer of :data:`OPTIMIZERS` on a fresh model on ``device``; ``update`` picks
    the rule of the SCAPE rows (default: the library's). ``groups``: the model's ``decay`` and
    ``no_decay`` param groups (:func:`bench.workloads.gpt.param_groups`) instead of one group."""
    model = GPT(get_config(model_name), seed=0).to(device)
    comm = NullCommunicator(world, 0, device)
    params: Any = list(model.parameters())
    if groups:
        params = [{k: v for k, v in g.items() if k != "name"} for g in param_groups(model, 0.1)]
    name, sparsity, kw = {**OPTIMIZERS, **WIRE8_ROWS}[kind]
    if update and name in ("adams", "scape"):
        kw = dict(kw, update=update)
    spec = optimizers.Spec(lr=1e-3, sparsity=sparsity, kwargs=kw)
    opt = optimizers.build(name, params, spec, comm)
    if isinstance(opt, scape.SCAPE):
        opt.ramp_steps = 0  # the sparse steps at their sparsity, not on the start's ramp
    return opt, num_params(model)


def time_steps(model_name: str, world: int, kinds: list[str], steps: int,
               warm: int, update: str | None = None, device: str = "cpu",
               profile: str | None = None, groups: bool = False) -> list[dict]:
    """Median step time of each optimizer, their steps interleaved round-robin so that a
    change in machine load hits all of them alike (the ratios are what we report).

    ``profile``: a path; after the timed steps, three more steps of each optimizer run under
    ``torch.profiler`` and the per-op table (sorted by device time on a GPU, CPU time
    otherwise) is written there, one section per optimizer."""
    built = {k: build(model_name, world, k, update, device, groups) for k in kinds}
    gen = torch.Generator().manual_seed(0)
    grads = {k: [(torch.randn(b.n_pad, generator=gen) * 1e-2).to(device)
                 for b in opt.buckets]  # type: ignore[attr-defined]
             for k, (opt, _) in built.items()}
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for i in range(warm + steps):
        for k, (opt, _) in built.items():
            for b, g in zip(opt.buckets, grads[k]):  # type: ignore[attr-defined]
                b.write_grad_(g)
            sync()
            t0 = time.perf_counter()
            opt.step()
            sync()
            dt = time.perf_counter() - t0
            if i >= warm:
                times[k].append(dt)
    if profile:
        _profile(built, grads, device, profile)
    rows = []
    for k, (opt, n) in built.items():
        info = opt.last_step  # type: ignore[attr-defined]
        rows.append({"optimizer": k, "median_s": statistics.median(times[k]),
                     "min_s": min(times[k]), "dense_step": info.dense,
                     "bytes": sum(info.bytes.values()), "params": n,
                     "update": getattr(opt, "update", None)})
    return rows


def _profile(built: dict, grads: dict, device: str, path: str) -> None:
    cuda = torch.device(device).type == "cuda"
    acts = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    sort = "cuda_time_total" if cuda else "cpu_time_total"
    with open(path, "w") as f:
        for k, (opt, _) in built.items():
            with torch.profiler.profile(activities=acts) as prof:
                for _ in range(3):
                    for b, g in zip(opt.buckets, grads[k]):
                        b.write_grad_(g)
                    opt.step()
                if cuda:
                    torch.cuda.synchronize()
            f.write(f"== {k}: 3 steps\n")
            f.write(prof.key_averages().table(sort_by=sort, row_limit=25) + "\n\n")
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="local compute of one optimizer step")
    ap.add_argument("--model", default="base")
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="bench/results/step_compute.json")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda for the Triton kernels")
    ap.add_argument("--profile", default=None, metavar="PATH",
                    help="also profile three steps of each optimizer; per-op table to PATH")
    ap.add_argument("--update", default=None, help="sparse rule of the SCAPE rows "
                    "(default: the library's default)")
    ap.add_argument("--groups", action="store_true", help="decay and no_decay param groups "
                    "instead of one group")
    ap.add_argument("--int8", action="store_true", help="also the SCAPE rows with the compact "
                    "wires (grad_comm_dtype=torch.int8, and param_comm_dtype int8 or int6 too)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.model, args.world, args.steps = "tiny", 2, 3
    torch.set_num_threads(args.threads)
    update = args.update or inspect.signature(scape.SCAPE).parameters["update"].default
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch.cuda.is_available() is False")
    kinds = list(OPTIMIZERS) + (list(WIRE8_ROWS) if args.int8 else [])
    rows = time_steps(args.model, args.world, kinds, args.steps, warm=3,
                      update=update, device=args.device, profile=args.profile,
                      groups=args.groups)
    for r in rows:
        print(f"{r['optimizer']:12s} median {r['median_s'] * 1e3:8.2f} ms  "
              f"min {r['min_s'] * 1e3:8.2f} ms  bytes/step {r['bytes']:>10d}  "
              f"dense={r['dense_step']}", flush=True)
    dense = rows[0]["median_s"]
    for r in rows:
        r["ratio_to_dense_adams"] = r["median_s"] / dense
    ratio = rows[2]["ratio_to_dense_adams"]
    print(f"SCAPE-0.99 / dense sharded AdamS local compute: {ratio:.2f}x (goal <= 1.3x)")
    on_cuda = torch.device(args.device).type == "cuda"
    env = environment(args.device, torch.cuda.get_device_name() if on_cuda else None)
    report = {"schema": SCHEMA, "environment": env, "model": args.model, "world": args.world,
              "device": args.device, "threads": args.threads, "steps": args.steps,
              "groups": args.groups, "update": rows[2]["update"], "rows": rows}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
