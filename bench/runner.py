"""The training-run engine of the benchmarks: one optimizer, W ranks, one JSON-able result.

``run(RunConfig(...))`` spawns W processes (torch.distributed, gloo over a file store on the
loopback -- it works inside a network namespace where only ``lo`` exists), and each rank trains
the same :mod:`bench.gpt` model from the same seed on its disjoint share of the global batch
(:func:`bench.data.batch_at`). Every optimizer sees the same data order, token budget and LR
schedule (linear warm-up, then cosine decay to 10%). Rank 0 evaluates the validation loss on
the fixed held-out windows every ``eval_every`` steps and at the end (outside the timed region;
the other ranks wait at a barrier).

Optimizers (``RunConfig.optimizer``):

======================  ===================================================================
``adamw_ddp``           ``torch.optim.AdamW`` on a ``DistributedDataParallel`` model (the
                        standard); every rank holds the full optimizer state
``dist_adamw``          ``scape.DistributedAdamW`` (dense ZeRO-1 AdamW)
``adams``               ``scape.SCAPE`` with ``sparsity=0`` (dense sharded AdamS)
``scape``               ``scape.SCAPE`` at ``sparsity``
``topk``                raw-gradient top-k with error feedback (:mod:`bench.topk_baseline`)
``compute_only``        ``scape.SCAPE`` at ``sparsity`` on a communicator that moves nothing:
                        the same per-rank work with no collectives (the step-time floor; its
                        model is not trained across ranks, so it reports no validation loss;
                        a barrier outside the timed region starts each step on every rank
                        together, as a real run's collectives do)
======================  ===================================================================

What is measured, per rank and step (a step = ``grad_accum`` forward/backward passes and the
optimizer step; data sampling and evaluation are outside it):

- ``step_s``: wall time of the step;
- ``wait_s``: time spent blocked on communication: inside ``Work.wait()`` of every collective
  (scape optimizers and top-k, through a timing wrapper around the communicator), or for DDP
  the union of the gradient buckets' launch-to-completion intervals (an upper bound of the
  exposed time, since an early bucket overlaps with the rest of backward);
- ``compute_s = step_s - wait_s``: the local work;
- bytes: the step's payload bytes by collective, from ``comm.stats`` (the library's counters,
  the convention of :mod:`scape.comm`: all_gather counts its output, reduce_scatter its input).
  DDP is counted from its buckets through a comm hook: a ring all-reduce of a bucket of ``n``
  bytes is a reduce-scatter plus an all-gather of ``n`` bytes each, so it counts ``2n``, the
  same ``N*(b_g + b_p)`` convention as the sharded optimizers' ``N_pad*(b_g + b_p)``.

Medians are over the steady-state window, steps ``timing_skip+1 .. steps`` (default: past the
SCAPE dense warm-up plus two), the same window for every optimizer of a comparison.

    python -m bench.runner --config '{"optimizer": "scape", "sparsity": 0.99}' --out r.json
    python -m bench.runner --config cfg.json --out r.json       # a JSON file works too
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import multiprocessing as mp
import os
import queue
import statistics
import sys
import tempfile
import time
import traceback
from typing import Any

import torch

from bench.comm_timing import DDPCounter, timed_communicator

OPTIMIZERS = ("adamw_ddp", "dist_adamw", "adams", "scape", "topk", "compute_only",
              "sparseloco", "diloco")  # the last two: bench.local_sgd_opts
"""Values of ``RunConfig.optimizer``."""

SCHEMA = "scape.run/1"
"""``schema`` field of the dict :func:`run` returns."""


@dataclasses.dataclass
class RunConfig:
    """One training run. Validated on construction; ``dataclasses.asdict`` is its JSON form."""

    optimizer: str = "scape"
    """One of :data:`OPTIMIZERS`."""
    sparsity: float = 0.99
    """Fraction of coordinates not sent per step (``scape``, ``topk``, ``compute_only``)."""
    optimizer_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Passed through to ``scape.SCAPE`` (e.g. ``explore``, ``warmup_steps``, ``dense_every``,
    ``error_feedback``, ``update``, ``block_size``) or to the top-k baseline
    (``warmup_steps``, ``block_size``)."""
    group_sparsity: dict[str, float] | None = None
    """Per-group sparsity by :func:`bench.gpt.param_groups` group name (``"embed"`` splits the
    embedding matrices, the tied head, into a group of their own); None: ``sparsity``
    everywhere. SCAPE rows only."""
    model: str = "small"
    """:mod:`bench.gpt` preset (``tiny``, ``small``, ``base``)."""
    world: int = 4
    """Number of ranks (processes)."""
    steps: int = 100
    """Optimizer steps."""
    batch: int = 4
    """Sequences per rank and micro-batch; the global batch is ``batch * world * grad_accum``."""
    grad_accum: int = 1
    """Micro-batches per optimizer step (larger global batches at the same memory)."""
    seq: int | None = None
    """Tokens per sequence (None: the preset's ``seq_len``)."""
    lr: float = 3e-3
    """Peak learning rate."""
    warmup_frac: float = 0.05
    """Linear LR warm-up over this fraction of the steps, then cosine decay to 10% of ``lr``."""
    betas: tuple[float, float] = (0.9, 0.95)
    """Moment coefficients of every optimizer (AdamW's and AdamS's)."""
    weight_decay: float = 0.1
    """On the attention and MLP matrices; norms and embeddings get none
    (:func:`bench.gpt.param_groups`)."""
    seed: int = 0
    """Model initialisation and data order."""
    eval_every: int = 50
    """Validation loss every n steps, and always after the last one."""
    eval_seqs: int = 64
    """Fixed held-out windows of the validation split."""
    data: str | None = None
    """Text file or directory (None: the interpreter's standard library)."""
    threads: int | None = None
    """torch threads per rank (None: ``max(1, cpu_count // world)``)."""
    timing_skip: int | None = None
    """Steps left out of the medians (None: the optimizer's dense warm-up + 2)."""
    log_every: int = 10
    """Rank 0 prints a progress line every n steps (0: never)."""
    timeout_s: float = 900.0
    """Deadline of the whole run; past it every rank is killed and :func:`run` raises."""
    profile_dir: str | None = None
    """Write a torch.profiler trace per rank here (steps 3..5 after the warm-up)."""
    name: str | None = None
    """Label in reports (None: derived from the optimizer and sparsity)."""

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"RunConfig.optimizer must be one of {OPTIMIZERS}, "
                             f"got {self.optimizer!r}")
        if not isinstance(self.sparsity, (int, float)) or not 0.0 <= self.sparsity < 1.0:
            raise ValueError(f"RunConfig.sparsity must be in [0, 1), got {self.sparsity!r}")
        if self.group_sparsity is not None:
            if self.optimizer not in ("scape", "compute_only"):
                raise ValueError("RunConfig.group_sparsity applies to the scape and "
                                 f"compute_only rows, not {self.optimizer!r}")
            from bench.gpt import check_group_sparsity

            check_group_sparsity(self.group_sparsity)  # param_groups' checks, before launch
        if self.optimizer in ("scape", "topk") and self.sparsity == 0.0:
            raise ValueError(f"RunConfig.sparsity must be > 0 for optimizer "
                             f"{self.optimizer!r} (use 'adams' for dense), got 0.0")
        if not isinstance(self.optimizer_kwargs, dict):
            raise TypeError("RunConfig.optimizer_kwargs must be a dict, got "
                            f"{type(self.optimizer_kwargs).__name__}")
        for field in ("world", "steps", "batch", "grad_accum", "eval_every", "eval_seqs"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"RunConfig.{field} must be a positive int, got {value!r}")
        for field in ("seq", "threads"):
            value = getattr(self, field)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise ValueError(f"RunConfig.{field} must be a positive int or None, "
                                 f"got {value!r}")
        if not isinstance(self.lr, (int, float)) or not self.lr > 0:
            raise ValueError(f"RunConfig.lr must be > 0, got {self.lr!r}")
        if not 0.0 <= self.warmup_frac < 1.0:
            raise ValueError(f"RunConfig.warmup_frac must be in [0, 1), got {self.warmup_frac!r}")
        self.betas = (float(self.betas[0]), float(self.betas[1]))
        if self.weight_decay < 0:
            raise ValueError(f"RunConfig.weight_decay must be >= 0, got {self.weight_decay!r}")
        if self.timing_skip is not None and not 0 <= self.timing_skip < self.steps:
            raise ValueError(f"RunConfig.timing_skip must be in [0, steps={self.steps}), "
                             f"got {self.timing_skip!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"RunConfig.timeout_s must be > 0, got {self.timeout_s!r}")
        from bench.gpt import PRESETS

        if self.model not in PRESETS:
            raise ValueError(f"RunConfig.model must be one of {sorted(PRESETS)}, "
                             f"got {self.model!r}")
        seq = self.seq_len
        if seq > PRESETS[self.model].seq_len:
            raise ValueError(f"RunConfig.seq must be <= the {self.model} preset's seq_len "
                             f"{PRESETS[self.model].seq_len}, got {seq}")
        if self.group_sparsity and "head" in self.group_sparsity and PRESETS[self.model].tie_head:
            raise ValueError(f"RunConfig.group_sparsity: group 'head' needs an untied model "
                             f"(e.g. small-untied); the {self.model} preset ties its head to "
                             f"the token embedding")

    @property
    def seq_len(self) -> int:
        from bench.gpt import PRESETS

        return self.seq if self.seq is not None else PRESETS[self.model].seq_len

    @property
    def label(self) -> str:
        if self.name:
            return self.name
        if self.optimizer in ("scape", "topk", "compute_only"):
            return f"{self.optimizer}-{self.sparsity:g}"
        return self.optimizer

    @property
    def warmup_steps(self) -> int:
        """Dense optimizer steps at the start (SCAPE's and top-k's warm-up; 0 otherwise)."""
        if self.optimizer in ("scape", "topk", "compute_only"):
            return int(self.optimizer_kwargs.get("warmup_steps", 20))
        return 0

    @property
    def skip(self) -> int:
        if self.timing_skip is not None:
            return self.timing_skip
        return min(self.steps - 1, self.warmup_steps + 2)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RunConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"RunConfig: unknown fields {unknown} (known: {sorted(known)})")
        d = dict(d)
        if "betas" in d:
            d["betas"] = tuple(d["betas"])
        return cls(**d)


def lr_at(step: int, cfg: RunConfig) -> float:
    """Learning rate of 0-based step ``step``: linear warm-up, then cosine to 10% of ``lr``."""
    warm = max(1, int(cfg.warmup_frac * cfg.steps))
    if step < warm:
        return cfg.lr * (step + 1) / warm
    t = (step - warm) / max(1, cfg.steps - warm)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * t)))


# --------------------------------------------------------------------------- one rank
def _build(cfg: RunConfig, rank: int, world: int) -> tuple[Any, Any, Any, torch.nn.Module]:
    """``(model_to_call, optimizer, counter, module)``: counter has ``stats`` and ``wait_s``."""
    import scape
    from bench.gpt import GPT, get_config, param_groups

    module = GPT(get_config(cfg.model), seed=cfg.seed)
    groups = param_groups(module, cfg.weight_decay, cfg.group_sparsity)
    for g in groups:
        g.pop("name", None)
    if cfg.optimizer == "adamw_ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        counter = DDPCounter(world)
        ddp = DDP(module)
        ddp.register_comm_hook(None, counter.hook)
        adamw = torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=1e-8)
        return ddp, adamw, counter, module
    if cfg.optimizer == "compute_only":
        from bench.nullcomm import NullCommunicator

        comm = timed_communicator(NullCommunicator(world, rank))
    else:
        from scape.comm import TorchCommunicator

        comm = timed_communicator(TorchCommunicator(timeout=cfg.timeout_s))
    kw = dict(cfg.optimizer_kwargs)
    opt: Any
    if cfg.optimizer in ("sparseloco", "diloco"):
        from bench.local_sgd_opts import build_local_sgd

        opt = build_local_sgd(cfg.optimizer, groups, cfg, comm)
    elif cfg.optimizer == "dist_adamw":
        opt = scape.DistributedAdamW(groups, lr=cfg.lr, betas=cfg.betas, comm=comm)
    elif cfg.optimizer == "adams":
        opt = scape.SCAPE(groups, lr=cfg.lr, betas=cfg.betas, sparsity=0.0, comm=comm, **kw)
    elif cfg.optimizer in ("scape", "compute_only"):
        opt = scape.SCAPE(groups, lr=cfg.lr, betas=cfg.betas, sparsity=cfg.sparsity, comm=comm,
                          **kw)
    else:
        from bench.topk_baseline import TopKAdamS

        opt = TopKAdamS(groups, lr=cfg.lr, betas=cfg.betas, sparsity=cfg.sparsity, comm=comm,
                        **kw)
    if hasattr(opt, "attach"):
        opt.attach(module)
    return module, opt, comm, module


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _rank_main(rank: int, world: int, cfg_dict: dict[str, Any], init_file: str,
               q: Any) -> None:
    """Body of one rank: train, measure, report a dict through ``q``."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    try:
        import torch.distributed as dist

        cfg = RunConfig.from_dict(cfg_dict)
        torch.set_num_threads(cfg.threads or max(1, (os.cpu_count() or 1) // world))
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                world_size=world,
                                timeout=datetime.timedelta(seconds=cfg.timeout_s))
        q.put(("result", rank, _train(cfg, rank, world)))
        q.close()
        q.join_thread()  # the result is in the pipe before any teardown below
    except BaseException:  # noqa: BLE001 - report everything to the parent
        q.put(("error", rank, traceback.format_exc()))
        raise SystemExit(1) from None
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass


def _train(cfg: RunConfig, rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist

    from bench.data import batch_at, eval_loss, load_corpus
    from bench.gpt import num_params

    corpus = load_corpus(cfg.data)
    model, opt, counter, module = _build(cfg, rank, world)
    seq, global_batch = cfg.seq_len, cfg.batch * world
    prof, prof_steps = None, range(cfg.skip + 1, min(cfg.steps, cfg.skip + 4) + 1)
    records: list[dict[str, Any]] = []
    val_curve: list[tuple[int, float]] = []
    evaluate = cfg.optimizer != "compute_only"
    started = time.perf_counter()
    for step in range(cfg.steps):
        if cfg.profile_dir is not None and step + 1 == prof_steps.start:
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            prof.__enter__()
        if cfg.optimizer == "compute_only":
            # Real runs start every step together (their collectives line the ranks up), so
            # the ranks compete for the cores the same way; without this the floor's ranks
            # drift apart and a lone rank runs faster than any synchronized one could.
            dist.barrier()
        batches = [batch_at(corpus.train, step * cfg.grad_accum + micro, global_batch, seq,
                            cfg.seed, rank, world) for micro in range(cfg.grad_accum)]
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg)
        bytes_before = {op: int(v["bytes"]) for op, v in counter.stats.items()}
        wait_before = counter.wait_s
        t0 = time.perf_counter()
        loss_sum = torch.zeros(())
        for micro, (x, y) in enumerate(batches):
            last = micro == cfg.grad_accum - 1
            ctx = model.no_sync() if (cfg.optimizer == "adamw_ddp" and not last) else _null()
            with ctx:
                loss = module.loss(x, y) if model is module else _ddp_loss(model, x, y)
                (loss / cfg.grad_accum).backward()
            loss_sum += loss.detach()
        opt.step()
        opt.zero_grad()
        step_s = time.perf_counter() - t0
        wait_s = counter.wait_s - wait_before
        sent = {op: int(v["bytes"]) - bytes_before.get(op, 0)
                for op, v in counter.stats.items()}
        records.append({"step_s": step_s, "wait_s": wait_s,
                        "bytes": {op: b for op, b in sent.items() if b},
                        "train_loss": float(loss_sum) / cfg.grad_accum,
                        "dense": bool(getattr(getattr(opt, "last_step", None), "dense", True))})
        if prof is not None and cfg.profile_dir is not None and step + 1 == prof_steps.stop - 1:
            _drain(opt)  # no collective may still be recording when the profiler stops
            prof.__exit__(None, None, None)
            os.makedirs(cfg.profile_dir, exist_ok=True)
            prof.export_chrome_trace(os.path.join(cfg.profile_dir, f"trace_rank{rank}.json"))
            prof = None
        done = step + 1
        if evaluate and (done % cfg.eval_every == 0 or done == cfg.steps):
            if hasattr(opt, "finish_param_sync"):
                opt.finish_param_sync()
            if rank == 0:
                val_curve.append((done, eval_loss(module, corpus.val, seq,
                                                  n_seqs=cfg.eval_seqs)))
            dist.barrier()
        if rank == 0 and cfg.log_every and (done % cfg.log_every == 0 or done == cfg.steps):
            val = f" val {val_curve[-1][1]:.4f}" if val_curve and val_curve[-1][0] == done \
                else ""
            print(f"[{cfg.label}] step {done}/{cfg.steps} train {records[-1]['train_loss']:.4f}"
                  f"{val} | {step_s * 1e3:.0f} ms/step ({time.perf_counter() - started:.0f} s)",
                  flush=True)
    phases: list[str] = []
    if cfg.profile_dir is not None:
        path = os.path.join(cfg.profile_dir, f"trace_rank{rank}.json")
        if os.path.exists(path):
            with open(path) as f:
                names = {e.get("name", "") for e in json.load(f).get("traceEvents", [])}
            phases = sorted(n for n in names if n.startswith(("scape/", "topk/")))
    settings: dict[str, Any] = {
        k: getattr(opt, k) for k in ("update", "split", "explore", "warmup_steps",
                                     "dense_every", "error_feedback", "block_size")
        if isinstance(getattr(opt, k, None), (str, int, float, bool))}
    if getattr(opt, "split", None):  # the split of the last mask, by param group index
        settings["split_sparsity"] = {str(g): v for g, v in opt.split_sparsity.items()}
    return {"records": records, "val_curve": val_curve, "params": num_params(module),
            "wall_s": time.perf_counter() - started, "phases": phases,
            "optimizer_settings": settings}


def _drain(opt: Any) -> None:
    """Wait for every collective the optimizer still has in flight (parameter all-gathers,
    SCAPE's next-mask all-gather). Stopping torch.profiler while gloo's threads still run a
    collective crashed ranks (SIGSEGV) intermittently on CPU."""
    if hasattr(opt, "finish_param_sync"):
        opt.finish_param_sync()
    for mask in getattr(opt, "masks", None) or []:
        if mask is not None:
            mask.wait()


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def _ddp_loss(ddp: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    import torch.nn.functional as F

    logits = ddp(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))


# --------------------------------------------------------------------------- the driver
def run(cfg: RunConfig) -> dict[str, Any]:
    """Train ``cfg`` on ``cfg.world`` spawned ranks and return the summary dict.

    Raises ``RuntimeError`` with every failing rank's traceback, or ``TimeoutError`` after
    killing every rank when ``cfg.timeout_s`` passes.
    """
    if not isinstance(cfg, RunConfig):
        raise TypeError(f"run() takes a RunConfig, got {type(cfg).__name__}")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="scape-run-") as tmp:
        init_file = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_rank_main, args=(r, cfg.world, dataclasses.asdict(cfg),
                                                      init_file, q), daemon=True)
                 for r in range(cfg.world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + cfg.timeout_s
        results: dict[int, dict[str, Any]] = {}
        errors: dict[int, str] = {}
        try:
            while len(results) + len(errors) < cfg.world:
                try:
                    kind, rank, payload = q.get(timeout=0.2)
                    (results if kind == "result" else errors)[rank] = payload
                    if errors:
                        break  # one rank failed: the others would wait on it forever
                except queue.Empty:
                    pass
                if all(not p.is_alive() for p in procs) and q.empty():
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"run {cfg.label}: {cfg.world} ranks did not finish within "
                        f"{cfg.timeout_s:.0f} s (RunConfig.timeout_s); ranks that finished: "
                        f"{sorted(results)}; all ranks were killed")
        finally:
            for p in procs:
                p.join(timeout=0.0 if errors or len(results) < cfg.world else 10.0)
                if p.is_alive():
                    p.kill()
                    p.join()
    if errors or len(results) < cfg.world:
        missing = [r for r in range(cfg.world) if r not in results and r not in errors]
        text = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
        codes = ", ".join(f"rank {r}: {p.exitcode}" for r, p in enumerate(procs))
        raise RuntimeError(f"run {cfg.label} failed; ranks without a result: "
                           f"{sorted(errors) + missing} (exit codes {codes})\n{text}")
    return summarize(cfg, [results[r] for r in range(cfg.world)],
                     time.perf_counter() - started)


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
        "bytes_per_step_mean_all_steps": sum(bytes_mean.values()),
        "dense_steps": sum(1 for r in r0["records"] if r["dense"]),
        "phases": r0["phases"],
        "wall_s": wall_s,
        "train_wall_s": max(rk["wall_s"] for rk in ranks),
    }


def load_config(text: str) -> RunConfig:
    """A RunConfig from a JSON string or the path of a JSON file."""
    if os.path.exists(text):
        with open(text) as f:
            text = f.read()
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--config must be JSON or a JSON file, got {text[:80]!r}: {e}") from e
    if not isinstance(d, dict):
        raise ValueError(f"--config must be a JSON object, got {type(d).__name__}")
    return RunConfig.from_dict(d)


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
