"""One training run of the benchmarks as data: :class:`RunConfig` (validated on construction,
``dataclasses.asdict`` is its JSON form), its learning-rate schedule :func:`lr_at`, and
:func:`load_config` for the ``--config`` of ``python -m bench.engine.runner``."""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
import os
from collections.abc import Callable
from typing import Any

from bench.engine.optimizers import OPTIMIZERS as REGISTRY
from bench.engine.optimizers import check_kwargs
from bench.workloads.gpt import PRESETS as GPT_PRESETS
from bench.workloads.gpt import check_group_sparsity
from bench.workloads.llama import PRESETS as LLAMA_PRESETS
from scape import sparsity_ramp

PRESETS = {**GPT_PRESETS, **LLAMA_PRESETS}
"""Values of ``RunConfig.model``: :mod:`bench.workloads.gpt`'s and :mod:`bench.workloads.llama`'s
presets."""
OPTIMIZERS = tuple(REGISTRY)
"""Values of ``RunConfig.optimizer``: the names of :data:`bench.engine.optimizers.OPTIMIZERS`."""
PLUGINS: list[str] = []
"""Modules a :class:`RunConfig` made in this process names in ``imports`` by default: a package
that registers rules or hooks on import appends its name here, so the ranks of the runs built
while it is loaded (by any job) import it too."""


FSDP2_OPTIMIZERS = ("scape", "adams", "dist_adamw", "hsdp_adamw")
"""The optimizers a run with :attr:`RunConfig.fsdp2` takes."""


@dataclasses.dataclass
class RunConfig:
    """One training run. Validated on construction; ``dataclasses.asdict`` is its JSON form."""

    optimizer: str = "scape"
    """One of :data:`OPTIMIZERS`."""
    sparsity: float = 0.99
    """Fraction of coordinates not sent per step (``scape``, ``topk``, ``compute_only``)."""
    optimizer_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Passed through to the optimizer's factory (:mod:`bench.engine.optimizers`): to
    ``scape.SCAPE`` (e.g. ``update``, ``warmup_steps``, ``dense_every``, ``block_size``; also a
    rule registered by a module of ``imports``), to the top-k baseline (``warmup_steps``,
    ``block_size``) or to the
    outer optimizer of a local-step row (``sync_every``, ``density``, ...)."""
    group_sparsity: dict[str, float] | None = None
    """Per-group sparsity by :func:`bench.workloads.gpt.param_groups` group name (``"embed"`` splits
    the embedding matrices, the tied head, into a group of their own); None: ``sparsity``
    everywhere. SCAPE rows only. With ``one_group`` every group is decayed alike
    (:func:`bench.engine.run_rank.make_groups`)."""
    sparsity_ramp: tuple[float, int] | None = None
    """``(start, ramp_steps)``: after the dense warm-up every sparse group's sparsity ramps
    from ``start`` (or its own, if lower) to its own over ``ramp_steps`` steps, by the
    library's :class:`scape.SparsityRamp` (the ``j``-th sparse step, from 0, sends the mask made
    at ``scape.sparsity_ramp(j)``); None: no ramp. SCAPE rows only."""
    imports: list[str] = dataclasses.field(default_factory=lambda: list(PLUGINS))
    """Modules imported before the run is validated, in this process and in every rank, so
    rules they register (``scape.rules.register``) may be named in ``optimizer_kwargs`` and
    hooks they define in ``hooks`` (default: :data:`PLUGINS`)."""
    hooks: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    """``{"package.module:factory": kwargs}``: each rank calls ``factory(cfg, module, opt,
    **kwargs)`` once its optimizer is built and calls the object returned each step, in the
    order of this dict: ``before_step(step)`` once the step's lr is set,
    ``after_backward(step)`` after the step's last backward pass and before ``opt.step()``,
    ``after_step(step)`` after ``opt.step()`` (any may be absent); at the end of the run the
    object's ``result()``, where it has one, goes into the run's result under ``"hooks"``
    (JSON-able). A factory's ``check(cfg, **kwargs)``, where it has one, runs on construction,
    before launch; its ``param_groups(cfg, module, groups, **kwargs)``, where it has one,
    returns the param groups the optimizer is built over (in place of ``groups``). {}: none."""
    attach: bool = True
    """Give the optimizer the model (``opt.attach(model)``, where it has ``attach``): the
    parameter all-gather completes at the next forward, and ``update="agree"`` sets the
    embedding matrices apart. False: ``step()`` completes it before it returns, and no
    embeddings are set apart (the convergence ablation's rows)."""
    model: str = "small"
    """:mod:`bench.workloads.gpt` preset (``tiny``, ``small``, ``base``) or
    :mod:`bench.workloads.llama` preset."""
    workload: str | None = None
    """``"package.module:factory"``: ``factory(cfg)`` builds what each rank trains in place of
    :attr:`model` on :attr:`data`: an object with ``model()`` (a module with ``loss(x, y)``),
    ``batch(index, rank, world)`` (rank's share of micro-batch ``index``, ``(x, y)``) and
    ``val_loss(module)``; with it, ``model``, ``data``, ``seq`` and ``batch`` are the factory's
    to read or ignore. None: the language model :attr:`model` on :attr:`data`."""
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
    (:func:`bench.workloads.gpt.param_groups`)."""
    one_group: bool = False
    """One param group, ``weight_decay`` on every parameter (a newcomer's setup)."""
    seed: int = 0
    """Model initialisation and data order."""
    eval_every: int = 50
    """Validation loss every n steps, and always after the last one."""
    eval_seqs: int = 64
    """Fixed held-out windows of the validation split."""
    data: str | None = None
    """Text file or directory (None: the interpreter's standard library; ``"pydoc-topics"``:
    :mod:`bench.workloads.prose`)."""
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
    device: str = "cpu"
    """``"cpu"`` (gloo) or ``"cuda"`` (rank r on GPU r, NCCL; the Triton kernels run)."""
    nodes: int = 1
    """The ranks form ``nodes`` nodes of ``world // nodes`` (rank r on node ``r // per_node``,
    as ``init_device_mesh`` lays out a ``(nodes, per_node)`` mesh)."""
    two_level: bool = False
    """Give the optimizer the ``(nodes, per_node)`` mesh (SCAPE on two levels, dense inside
    a node); False: one flat group of every rank."""
    node_netns: list[str] | None = None
    """Per node, the network namespace its ranks enter (:mod:`bench.engine.netns_nodes`)."""
    link_delay_ms: float = 0.0
    """A link latency modelled in the optimizer's communicator (one way, per message round:
    :func:`bench.engine.comm_timing.delayed_communicator`), for machines whose kernel has no
    ``netem`` (:mod:`bench.engine.netns` adds it on the link where it has); 0: none."""
    fsdp2: bool = False
    """Shard the model with FSDP2 (``fully_shard`` per block, then the root) over each node's
    ranks, the ``dp_shard`` dimension of the ``(nodes, per_node)`` mesh, and give the
    optimizer ``comm=`` the ``dp_replicate`` dimension (the ranks holding the same shard);
    with ``hsdp_adamw`` the model is sharded over the whole mesh instead (FSDP2's HSDP)."""

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"RunConfig.optimizer must be one of {OPTIMIZERS}, "
                             f"got {self.optimizer!r}")
        if not isinstance(self.sparsity, (int, float)) or not 0.0 <= self.sparsity < 1.0:
            raise ValueError(f"RunConfig.sparsity must be in [0, 1), got {self.sparsity!r}")
        entry = REGISTRY[self.optimizer]
        if self.group_sparsity is not None:
            if not entry.group_sparsity:
                takes = [n for n, e in REGISTRY.items() if e.group_sparsity]
                raise ValueError(f"RunConfig.group_sparsity applies to the {' and '.join(takes)}"
                                 f" rows, not {self.optimizer!r}")
            check_group_sparsity(self.group_sparsity)  # param_groups' checks, before launch
        if self.sparsity_ramp is not None:
            if self.optimizer != "scape":
                raise ValueError(f"RunConfig.sparsity_ramp applies to scape rows, not "
                                 f"{self.optimizer!r}")
            start, ramp_steps = self.sparsity_ramp
            self.sparsity_ramp = (float(start), int(ramp_steps))
            sparsity_ramp(0, start=start, end=self.sparsity, ramp_steps=ramp_steps)  # its checks
        if not isinstance(self.imports, list) or not all(isinstance(m, str)
                                                          for m in self.imports):
            raise TypeError(f"RunConfig.imports must be a list of module names, "
                            f"got {self.imports!r}")
        for module in self.imports:
            importlib.import_module(module)
        if not isinstance(self.hooks, dict):
            raise TypeError(f"RunConfig.hooks must be a dict, got {type(self.hooks).__name__}")
        if entry.needs_sparsity and self.sparsity == 0.0:
            raise ValueError(f"RunConfig.sparsity must be > 0 for optimizer "
                             f"{self.optimizer!r} (use 'adams' for dense), got 0.0")
        if not isinstance(self.optimizer_kwargs, dict):
            raise TypeError("RunConfig.optimizer_kwargs must be a dict, got "
                            f"{type(self.optimizer_kwargs).__name__}")
        try:
            check_kwargs(self.optimizer, self.optimizer_kwargs)
        except ValueError as e:
            raise ValueError(f"RunConfig.{e}") from None
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
        if isinstance(self.nodes, bool) or not isinstance(self.nodes, int) or self.nodes < 1 \
                or self.world % self.nodes:
            raise ValueError(f"RunConfig.nodes must be a positive divisor of world={self.world},"
                             f" got {self.nodes!r}")
        if self.fsdp2 and (self.two_level or self.optimizer not in FSDP2_OPTIMIZERS):
            raise ValueError(f"RunConfig.fsdp2 takes the optimizers {FSDP2_OPTIMIZERS} on one "
                             f"level, got {self.optimizer!r} (two_level={self.two_level})")
        if self.optimizer == "hsdp_adamw" and not self.fsdp2:
            raise ValueError("RunConfig.optimizer 'hsdp_adamw' shards the model with FSDP2: "
                             "set fsdp2=True")
        if self.node_netns is not None and len(self.node_netns) != self.nodes:
            raise ValueError(f"RunConfig.node_netns must name one namespace per node "
                             f"({self.nodes}), got {self.node_netns!r}")
        if isinstance(self.link_delay_ms, bool) or not isinstance(
                self.link_delay_ms, (int, float)) or not 0.0 <= self.link_delay_ms <= 10_000.0:
            raise ValueError(f"RunConfig.link_delay_ms must be in [0, 10000], got "
                             f"{self.link_delay_ms!r}")
        if self.link_delay_ms and (self.two_level or self.fsdp2):
            raise ValueError("RunConfig.link_delay_ms models one flat group's link: not with "
                             "two_level or fsdp2")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"RunConfig.device must be 'cpu' or 'cuda', got {self.device!r}")
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

        if not isinstance(self.attach, bool):
            raise TypeError(f"RunConfig.attach must be a bool, got {self.attach!r}")
        if self.workload is not None:
            hook_factory(self.workload, "workload")  # importable, before launch
        for path, kwargs in self.hooks.items():
            if not isinstance(kwargs, dict):
                raise TypeError(f"RunConfig.hooks[{path!r}] must be a dict of keyword "
                                f"arguments, got {type(kwargs).__name__}")
            check = getattr(hook_factory(path), "check", None)  # importable, before launch
            if check is not None:
                check(self, **kwargs)

    @property
    def seq_len(self) -> int:
        return self.seq if self.seq is not None else PRESETS[self.model].seq_len

    @property
    def label(self) -> str:
        if self.name:
            return self.name
        if REGISTRY[self.optimizer].sparse:
            return f"{self.optimizer}-{self.sparsity:g}"
        return self.optimizer

    @property
    def ramp_end(self) -> int:
        """The first step whose sent mask is past the dense warm-up and the sparsity ramp."""
        return self.warmup_steps + (self.sparsity_ramp or (0.0, 0))[1]

    @property
    def warmup_steps(self) -> int:
        """Dense optimizer steps at the start (SCAPE's and top-k's warm-up; 0 otherwise)."""
        if REGISTRY[self.optimizer].sparse:
            default = 20 if self.optimizer == "topk" else 1  # top-k's and scape.SCAPE's
            return int(self.optimizer_kwargs.get("warmup_steps", default))
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
        d.setdefault("imports", [])  # a config as written imports what it names, nothing more
        return cls(**d)


def lr_at(step: int, cfg: RunConfig) -> float:
    """Learning rate of 0-based step ``step``: linear warm-up, then cosine to 10% of ``lr``."""
    warm = max(1, int(cfg.warmup_frac * cfg.steps))
    if step < warm:
        return cfg.lr * (step + 1) / warm
    t = (step - warm) / max(1, cfg.steps - warm)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * t)))


def hook_factory(path: str, field: str = "hooks") -> Callable[..., Any]:
    """The callable ``"package.module:name"`` names (:attr:`RunConfig.hooks`,
    :attr:`RunConfig.workload`); ValueError where it names none."""
    module, sep, name = path.partition(":") if isinstance(path, str) else ("", "", "")
    if not sep or not module or not name:
        raise ValueError(f"RunConfig.{field}: {path!r} must read 'package.module:factory'")
    try:
        factory = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"RunConfig.{field}: {path!r} names no importable callable: {e}") \
            from None
    if not callable(factory):
        raise ValueError(f"RunConfig.{field}: {path!r} is not callable")
    return factory


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
