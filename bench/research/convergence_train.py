"""Training of the convergence ablation (:mod:`bench.research.convergence`): the :class:`Workload`
every row shares, one row in one process fed the global batch (:func:`train`), a row on W gloo
ranks through :mod:`bench.engine.runner` (:func:`train_ranks`, :func:`train_local` for the
local-step rows) and the dense reference bytes. The rows themselves are
:mod:`bench.research.rows`."""

from __future__ import annotations

import dataclasses
import inspect
import time
from typing import Any

import torch

import scape
from bench.engine.local_sgd_opts import LOCAL_SGD, parse_local_name
from bench.engine.nullcomm import NullCommunicator
from bench.engine.optimizers import Spec, build
from bench.engine.runner import RunConfig, lr_at, run
from bench.research.rotate import Rotated
from bench.research.rows import TRAINING_KEYS, Allotment, ramp_sparsity, trust_rule
from bench.workloads.data import batch_at, eval_loss
from bench.workloads.gpt import GPT, get_config, num_params, param_groups


@dataclasses.dataclass
class Workload:
    """The training setup every variant shares."""

    model: str = "small"
    """bench.workloads.gpt preset."""
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


ONE_PROCESS_ROWS = (
    ("trust_lr", "scheduled-bound", "bench.engine.runner has no rule schedule"),
    ("allot", "automatic-split", "bench.engine.runner has no sparsity schedule"),
    ("transform", "transform-domain",
     "bench.research.rotate is not wired into bench.engine.runner"),
)
"""``(variant key, rows, why)``: the rows a run on more than one rank refuses."""


def run_config(variant: dict[str, Any], w: Workload, world: int) -> RunConfig:
    """The same run as :func:`train` for :mod:`bench.engine.runner` on ``world`` ranks (a local-step
    variant, ``optimizer`` in ``LOCAL_SGD``, is evaluated at multiples of its ``H``). A
    ``-ramp`` row takes the runner's ramp (``RunConfig.sparsity_ramp``: sparse step ``j``
    sends the mask made at ``ramp(j)``, as :class:`scape.SparsityRamp`), one step ahead of
    :func:`train`'s loop, whose sparse step ``j`` sends ``ramp(j - 1)``."""
    if w.batch % world:
        raise ValueError(f"the global batch of {w.batch} sequences does not split over "
                         f"{world} ranks; pick a world size that divides it")
    for key, rows, why in ONE_PROCESS_ROWS:
        if variant.get(key) and world > 1:
            raise ValueError(f"{variant['name']}: {rows} rows run in one process only ({why})")
    kw = {k: v for k, v in variant.items() if k not in TRAINING_KEYS and k != "sparsity"}
    kind, sparsity, eval_every = variant.get("optimizer"), variant.get("sparsity", 0.0), \
        w.eval_every
    if kind in LOCAL_SGD:
        h = kw["sync_every"]
        eval_every = max(h, w.eval_every // h * h)
    else:
        kind = "scape" if sparsity > 0 else "adams"
    ramp = variant.get("ramp")
    return RunConfig(optimizer=kind, sparsity=sparsity, optimizer_kwargs=kw,
                     group_sparsity=variant.get("group_sparsity"),
                     sparsity_ramp=(ramp[0], round(ramp[1] * w.steps)) if ramp else None,
                     model=w.model, world=world, steps=w.steps, batch=w.batch // world,
                     grad_accum=w.accum, seq=w.seq, lr=variant["lr"],
                     warmup_frac=w.warmup_frac, weight_decay=w.weight_decay, seed=w.seed,
                     eval_every=eval_every, eval_seqs=w.eval_seqs, threads=1,
                     log_every=max(1, w.steps // 4), timeout_s=7200.0,
                     name=variant["name"] + f"@W{world}")


def build_optimizer(model: torch.nn.Module, variant: dict[str, Any], w: Workload,
                    comm: Any = None) -> tuple[torch.optim.Optimizer, Any]:
    """The variant's optimizer (:mod:`bench.engine.optimizers`: ``dist_adamw`` for an ``"adamw"``
    row, else ``scape`` or, at sparsity 0, ``adams``), and its
    :class:`bench.research.rotate.Rotated` (None unless the variant has a ``transform``: then
    the ``decay`` group trains in that transform domain)."""
    kw = {k: v for k, v in variant.items() if k not in TRAINING_KEYS}
    groups = param_groups(model, w.weight_decay, variant.get("group_sparsity"))
    rotated = None
    if variant.get("transform"):
        tkind, chunk = variant["transform"]
        rotated = Rotated(groups[0]["params"], tkind, chunk)
        groups[0]["params"] = rotated.shadows
    for g in groups:
        g.pop("name", None)
    if variant.get("optimizer", "scape") == "adamw":
        return build("dist_adamw", groups, Spec(lr=variant["lr"], betas=(0.9, 0.95)),
                     comm), rotated
    sparsity = kw.pop("sparsity", 0.0)
    return build("scape" if sparsity > 0 else "adams", groups,
                 Spec(lr=variant["lr"], sparsity=sparsity, kwargs=kw), comm), rotated


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
    for step in range(w.steps):
        for g, sp in zip(opt.param_groups, base):
            g["lr"] = lr_at(step, schedule)
            if variant.get("ramp") and sp > 0:
                g["sparsity"] = ramp_sparsity(variant, sp, step - warm, w.steps)
        if split is not None and step >= warm:
            split(step - warm)
        if variant.get("trust_lr"):  # the bound moves with the lr
            opt.rule = trust_rule(variant, lr_at(step, schedule))
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
    """A local-step row on ``world`` gloo ranks through :mod:`bench.engine.runner`."""
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
    """A row on ``world`` gloo ranks through :mod:`bench.engine.runner` (``--ranks``): each rank
    sees its own ``batch / world`` sequences, so the rules' local statistics (the noise EMA,
    the gain masks' mean) are those of a real run, not of the global batch."""
    res = run(run_config(variant, w, world))
    curve = res["train_curve"]
    return {"variant": variant, "world": world, "final_val_loss": res["final_val_loss"],
            "val_curve": res["val_curve"], "train_loss_last50": sum(curve[-50:]) / len(curve[-50:]),
            "diagnostics": {}, "bytes_last_step": res["bytes_per_step"],
            "bytes_per_step": res["bytes_per_step_mean_all_steps"],
            "bytes_per_sparse_step": res["bytes_per_step_total"],  # median of the steady steps
            "wall_s": res["wall_s"], "params": res["params"],
            "param_sha256": res["param_sha256"]}


def dense_bytes_per_step(w: Workload, world: int) -> int:
    """Dense sharded AdamS's bytes per step per rank at ``world`` ranks on this model:
    ``N_pad * (4 + 4) + 8`` (fp32 reduce-scatter and all-gather of the padded flat buffers,
    DESIGN §1, plus the 8-byte scalar all-reduce), ``N_pad`` from the library's buckets."""
    groups = param_groups(GPT(get_config(w.model), seed=w.seed), w.weight_decay)
    for g in groups:
        g.pop("name", None)
    opt = build("adams", groups, Spec(lr=1e-3), NullCommunicator(world, 0))
    return sum(b.n_pad for b in opt.buckets) * (4 + 4) + 8
