"""Training of the convergence ablation (:mod:`bench.research.convergence`): the :class:`Workload`
every row shares, a row as a :class:`bench.engine.runner.RunConfig` (:func:`run_config`),
trained by the engine's one loop on W >= 1 ranks (:func:`train`; :func:`train_local` for the
local-step rows) and the dense reference bytes. The rows themselves are
:mod:`bench.research.rows`."""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import scape
from bench.engine.local_sgd_opts import LOCAL_SGD
from bench.engine.nullcomm import NullCommunicator
from bench.engine.optimizers import Spec, build
from bench.engine.rows import resolve as resolve_row
from bench.engine.runner import RunConfig, run
from bench.research.rows import TRAINING_KEYS
from bench.workloads.gpt import GPT, get_config, param_groups


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
    """torch threads of a row on one rank (a row on W ranks: one per rank)."""
    data: str | None = None
    """The corpus (``RunConfig.data``; None: the interpreter's standard library)."""


HOOKS = {"transform": "bench.research.rotate:Rotation",
         "allot": "bench.research.rows:Allotment",
         "trust_lr": "bench.research.rows:TrustLr",
         "diagnostics": "bench.research.rows:Diagnostics"}
"""The ``RunConfig.hooks`` entries a row's research keys become (:func:`run_config`)."""


def run_config(variant: dict[str, Any], w: Workload, world: int) -> RunConfig:
    """The run of one row on ``world`` ranks (1: one process fed the global batch, on
    ``w.threads`` threads; more: each rank fed ``batch / world`` sequences, on one thread).

    An ``"adamw"`` row trains ``dist_adamw``; a local-step row (``optimizer`` in
    ``LOCAL_SGD``) is evaluated at multiples of its ``H``; any other row trains ``scape``, or
    at sparsity 0 ``adams``. The research keys become ``RunConfig.hooks`` entries
    (:data:`HOOKS`: ``transform``, ``allot`` with ``allot_floor``, ``trust_lr``; every
    ``scape``/``adams`` row reports its diagnostics), a ``ramp`` the engine's
    ``RunConfig.sparsity_ramp`` over that share of the run (:class:`scape.SparsityRamp`: sparse
    step ``j`` sends the mask made at ``scape.sparsity_ramp(j)``, one step ahead of the ramp
    the ablation wrote by hand before it trained through the engine, docs/research.md). The
    optimizer is not attached to the model (``RunConfig.attach=False``), as the ablation has
    always run it."""
    if w.batch % world:
        raise ValueError(f"the global batch of {w.batch} sequences does not split over "
                         f"{world} ranks; pick a world size that divides it")
    kw = {k: v for k, v in variant.items() if k not in TRAINING_KEYS and k != "sparsity"}
    kind, sparsity, eval_every = variant.get("optimizer"), variant.get("sparsity", 0.0), \
        w.eval_every
    if kind in LOCAL_SGD:
        h = kw["sync_every"]
        eval_every = max(h, w.eval_every // h * h)
    elif kind == "adamw":
        kind = "dist_adamw"
    else:
        kind = "scape" if sparsity > 0 else "adams"
    hooks: dict[str, dict[str, Any]] = {}
    if variant.get("transform"):
        tkind, chunk = variant["transform"]
        hooks[HOOKS["transform"]] = {"kind": tkind, "chunk": chunk}
    if variant.get("allot"):
        power, every, source, *beta = variant["allot"]
        hooks[HOOKS["allot"]] = {"power": power, "every": every, "source": source,
                                 "beta": beta[0] if beta else None,
                                 "floor": variant.get("allot_floor", 0.0)}
    if variant.get("trust_lr"):
        c_hi, c_lo = variant["trust_lr"]
        hooks[HOOKS["trust_lr"]] = {"c_hi": c_hi, "c_lo": c_lo}
    if kind in ("scape", "adams"):
        hooks[HOOKS["diagnostics"]] = {}
    ramp = variant.get("ramp")
    return RunConfig(optimizer=kind, sparsity=sparsity, optimizer_kwargs=kw,
                     group_sparsity=variant.get("group_sparsity"),
                     # without a ramp of its own, the start it was measured with: none
                     sparsity_ramp=(ramp[0], round(ramp[1] * w.steps)) if ramp else
                     (0.5, 0) if kind == "scape" else None,
                     hooks=hooks, attach=False,
                     model=w.model, world=world, steps=w.steps, batch=w.batch // world,
                     grad_accum=w.accum, seq=w.seq, data=w.data, lr=variant["lr"],
                     warmup_frac=w.warmup_frac, weight_decay=w.weight_decay, seed=w.seed,
                     eval_every=eval_every, eval_seqs=w.eval_seqs,
                     threads=w.threads if world == 1 else 1,
                     log_every=max(1, w.steps // 4), timeout_s=7200.0,
                     name=variant["name"] + f"@W{world}")


def train(variant: dict[str, Any], w: Workload, world: int = 1, log: bool = True
          ) -> dict[str, Any]:
    """Train one row through the engine (:func:`bench.engine.runner.run` of
    :func:`run_config`) on ``world`` ranks and return its curves, bytes and final validation
    loss. On more than one rank each rank sees its own ``batch / world`` sequences, so the
    rules' local statistics (the noise EMA, the gain masks' mean) are those of a real run."""
    cfg = run_config(variant, w, world)
    if not log:
        cfg.log_every = 0
    res = run(cfg)
    warm = cfg.warmup_steps
    sent, curve = res["bytes_by_step"], res["train_curve"]
    history = res["hooks"].get(HOOKS["allot"], {}).get("history", [])
    return {"variant": variant, "world": world, "final_val_loss": res["final_val_loss"],
            "val_curve": res["val_curve"],
            "train_loss_last50": sum(curve[-50:]) / len(curve[-50:]),
            "diagnostics": res["hooks"].get(HOOKS["diagnostics"], {}),
            "bytes_last_step": res["bytes_last_step"], "bytes_per_step": sum(sent) / w.steps,
            "bytes_per_sparse_step": sum(sent[warm:]) / max(1, w.steps - warm),
            "wall_s": res["wall_s"], "params": res["params"],
            "param_sha256": res["param_sha256"],
            **({"allot_history": history} if history else {})}


LOCAL_ROWS = ("sparseloco-h8-d0.01", "sparseloco-h8-d0.03", "sparseloco-h32-d0.01",
              "sparseloco-h32-d0.03", "diloco-h8", "diloco-h32")
"""``--local all``: SparseLoCo at H = 8, 32 and density 1%, 3% (2-bit values), DiLoCo at
H = 8, 32; the other outer hyperparameters are the library's defaults."""


def local_variant(spec: str, lr: float, label_lr: bool = False) -> dict[str, Any]:
    """The variant dict of a local-step row, a name of :data:`bench.engine.rows.ROWS` or a
    JSON/TOML row (:func:`bench.engine.rows.resolve`; ``label_lr``: the name says the inner
    lr). ValueError for a row that does not take local steps."""
    name, fields = resolve_row(spec)
    if fields["optimizer"] not in LOCAL_SGD:
        raise ValueError(f"--local: row {name!r} is {fields['optimizer']!r}, not a local-step "
                         f"optimizer {LOCAL_SGD}")
    return dict(name=name + (f"-inner_lr{lr:g}" if label_lr else ""),
                optimizer=fields["optimizer"], lr=lr, **fields.get("optimizer_kwargs", {}))


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


def dense_bytes_per_step(w: Workload, world: int) -> int:
    """Dense sharded AdamS's bytes per step per rank at ``world`` ranks on this model:
    ``N_pad * (4 + 4) + 8`` (fp32 reduce-scatter and all-gather of the padded flat buffers,
    DESIGN §1, plus the 8-byte scalar all-reduce), ``N_pad`` from the library's buckets."""
    groups = param_groups(GPT(get_config(w.model), seed=w.seed), w.weight_decay)
    for g in groups:
        g.pop("name", None)
    opt = build("adams", groups, Spec(lr=1e-3), NullCommunicator(world, 0))
    return sum(b.n_pad for b in opt.buckets) * (4 + 4) + 8
