"""The optimizers the benchmarks train, by name: one table, one factory each.

Every entry point that builds an optimizer (:mod:`bench.engine.runner`, :mod:`bench.compare`,
:mod:`bench.step_compute`, and the research's jobs) goes through :func:`build`::

    opt = build("scape", groups, Spec(lr=3e-3, sparsity=0.99, kwargs={"update": "agree"}), comm)

A factory is ``(groups, spec, comm) -> optimizer``: ``groups`` are torch param groups (or a
list of parameters), ``spec`` the :class:`Spec` (lr, betas, sparsity and the optimizer's own
keyword arguments), ``comm`` a :class:`scape.comm.Communicator` (None: the optimizer's
default). The :class:`Entry` beside each factory says how a run drives it: which communicator
it gets, whether it is sparse, whether it communicates only every few steps.

=================  ==========================================================================
``adamw_ddp``      ``torch.optim.AdamW``; the runner wraps the model in
                   ``DistributedDataParallel`` (every rank holds the full optimizer state)
``hsdp_adamw``     ``torch.optim.AdamW`` on a model FSDP2 shards as HSDP (``fsdp2`` runs)
``dist_adamw``     ``scape.DistributedAdamW`` (dense ZeRO-1 AdamW)
``adams``          ``scape.SCAPE`` with ``sparsity=0`` (dense sharded AdamS)
``scape``          ``scape.SCAPE`` at ``spec.sparsity``
``topk``           raw-gradient top-k with error feedback (:mod:`bench.engine.topk_baseline`)
``compute_only``   ``scape.SCAPE`` at ``spec.sparsity`` on a communicator that moves nothing
``sparseloco``     ``scape.SparseLoCo`` around an AdamW inner optimizer
``diloco``         ``scape.DiLoCo`` around an AdamW inner optimizer
=================  ==========================================================================

``spec.kwargs["update"]`` names a rule of ``scape.rules`` (a built-in, or one a module
registered with ``scape.rules.register``); a module may also add a function to
:data:`RULE_NAMES` that makes rules on demand from names of its own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch

import scape
from bench.engine.topk_baseline import TopKAdamS


@dataclasses.dataclass(frozen=True)
class Spec:
    """What a factory builds besides the param groups and the communicator."""

    lr: float
    """Peak learning rate (the runner's schedule edits ``param_groups`` from there)."""
    betas: tuple[float, float] | None = None
    """Moment coefficients; None: the optimizer's own default."""
    sparsity: float = 0.0
    """Fraction of coordinates not sent per step (the sparse entries only)."""
    kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """The optimizer's other keyword arguments (``update``, ``warmup_steps``, ``sync_every``,
    ...); for the local-step entries, the outer optimizer's."""


Factory = Callable[[Any, Spec, Any], torch.optim.Optimizer]


@dataclasses.dataclass(frozen=True)
class Entry:
    """One optimizer of the benchmarks and how a run drives it."""

    factory: Factory
    """``(groups, spec, comm) -> optimizer``."""
    sparse: bool = False
    """Sends ``spec.sparsity`` of its coordinates and starts with ``warmup_steps`` dense steps
    (default 20); a comparison names it ``<name>-<sparsity>``."""
    needs_sparsity: bool = False
    """``spec.sparsity`` must be > 0 (the dense form has a name of its own)."""
    group_sparsity: bool = False
    """Takes a per-group ``sparsity`` in its param groups
    (:func:`bench.workloads.gpt.param_groups`)."""
    comm: str = "torch"
    """``"torch"``: a ``scape.comm.TorchCommunicator``; ``"null"``: a
    :class:`bench.engine.nullcomm.NullCommunicator` (no collectives: the step-time floor, nothing
    trained across ranks); ``"ddp"``: none, the model is wrapped in DDP instead; ``"hsdp"``:
    none, FSDP2 shards the model over the whole mesh and all-reduces across replicas."""
    local_steps: bool = False
    """Communicates every ``sync_every`` steps only (bytes per step are a mean, not a
    per-step median)."""


REMOVED_KWARGS = {
    "explore": "explore is a field of the rule: register a rule with another explore "
               "(dataclasses.replace(scape.rules.get(name), explore=...))",
    "error_feedback": "error_feedback is a field of the rule: register a rule with "
                      "error_feedback=False",
    "split": "the optimizer sends each param group at its own sparsity; split the budget "
             "from outside the optimizer (param groups at their own sparsity)",
    "split_every": "the optimizer sends each param group at its own sparsity; split the "
                   "budget from outside the optimizer",
}
"""Keyword arguments ``scape.SCAPE`` does not take that older rows passed, with what does
their work."""


RULE_NAMES: list[Callable[[Any], Any]] = []
"""Functions ``update -> update`` applied in order before a rule is looked up: a module that
makes rules on demand from names of its own (registering each) appends one on import."""


def rule_name(rule: Any) -> Any:
    """``rule`` through :data:`RULE_NAMES` (unchanged when none is registered)."""
    for resolve in RULE_NAMES:
        rule = resolve(rule)
    return rule


def _hp(spec: Spec) -> dict[str, Any]:
    return {"lr": spec.lr, **({} if spec.betas is None else {"betas": spec.betas})}


def _scape_kwargs(spec: Spec) -> dict[str, Any]:
    kw = dict(spec.kwargs)
    if "update" in kw:
        kw["update"] = rule_name(kw["update"])
    return kw


def _adamw(groups: Any, spec: Spec, comm: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(groups, **_hp(spec), eps=1e-8, **spec.kwargs)


def _dist_adamw(groups: Any, spec: Spec, comm: Any) -> torch.optim.Optimizer:
    return scape.DistributedAdamW(groups, **_hp(spec), comm=comm, **spec.kwargs)


def _adams(groups: Any, spec: Spec, comm: Any) -> torch.optim.Optimizer:
    return scape.SCAPE(groups, **_hp(spec), sparsity=0.0, comm=comm, **_scape_kwargs(spec))


def _scape(groups: Any, spec: Spec, comm: Any) -> torch.optim.Optimizer:
    return scape.SCAPE(groups, **_hp(spec), sparsity=spec.sparsity, comm=comm,
                       **_scape_kwargs(spec))


def _topk(groups: Any, spec: Spec, comm: Any) -> torch.optim.Optimizer:
    return TopKAdamS(groups, **_hp(spec), sparsity=spec.sparsity, comm=comm, **spec.kwargs)


def _inner_adamw(groups: Any, spec: Spec) -> tuple[list[torch.Tensor], torch.optim.Optimizer]:
    """The parameters and the inner AdamW of a local-step optimizer (the ``adamw_ddp``
    entry's lr, betas and per-group weight decay)."""
    inner = torch.optim.AdamW(groups, **_hp(spec), eps=1e-8)
    return [p for g in inner.param_groups for p in g["params"]], inner


def _sparseloco(groups: Any, spec: Spec, comm: Any) -> torch.optim.Optimizer:
    params, inner = _inner_adamw(groups, spec)
    return scape.SparseLoCo(params, inner, comm=comm, **spec.kwargs)


def _diloco(groups: Any, spec: Spec, comm: Any) -> torch.optim.Optimizer:
    params, inner = _inner_adamw(groups, spec)
    return scape.DiLoCo(params, inner, comm=comm, **spec.kwargs)


OPTIMIZERS: dict[str, Entry] = {
    "adamw_ddp": Entry(_adamw, comm="ddp"),
    "hsdp_adamw": Entry(_adamw, comm="hsdp"),
    "dist_adamw": Entry(_dist_adamw),
    "adams": Entry(_adams),
    "scape": Entry(_scape, sparse=True, needs_sparsity=True, group_sparsity=True),
    "topk": Entry(_topk, sparse=True, needs_sparsity=True),
    "compute_only": Entry(_scape, sparse=True, group_sparsity=True, comm="null"),
    "sparseloco": Entry(_sparseloco, local_steps=True),
    "diloco": Entry(_diloco, local_steps=True),
}
"""Every optimizer of the benchmarks by name (``RunConfig.optimizer``)."""

LOCAL_STEPS = tuple(name for name, e in OPTIMIZERS.items() if e.local_steps)
"""The entries that communicate every ``sync_every`` steps only."""


def entry(name: str) -> Entry:
    """The :class:`Entry` of ``name``; ``ValueError`` naming the known ones otherwise."""
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; expected one of {tuple(OPTIMIZERS)}")
    return OPTIMIZERS[name]


def check_kwargs(name: str, kwargs: Mapping[str, Any]) -> None:
    """Refuse a keyword argument the optimizer no longer takes, saying what replaces it
    (before any process starts)."""
    entry(name)
    for key in kwargs:
        if key in REMOVED_KWARGS and name in ("adams", "scape", "compute_only"):
            raise ValueError(f"optimizer_kwargs[{key!r}] of {name!r}: {REMOVED_KWARGS[key]}")


def check_rule(rule: Any) -> None:
    """Refuse an ``update=`` name that no rule is registered under (a built-in, one a module
    registered, or one a function of :data:`RULE_NAMES` makes), naming the known ones."""
    try:
        scape.rules.get(rule_name(rule))
    except ValueError as e:
        raise ValueError(f"unknown rule {rule!r}: {e}") from None


def build(name: str, groups: Any, spec: Spec, comm: Any = None) -> torch.optim.Optimizer:
    """The optimizer ``name`` over ``groups`` (module docstring)."""
    check_kwargs(name, spec.kwargs)
    for key in ("grad_comm_dtype", "param_comm_dtype"):
        wire = spec.kwargs.get(key)
        if isinstance(wire, str):  # a row's JSON names the dtype: "int8", "bfloat16"
            dtype = getattr(torch, wire, None)
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"optimizer_kwargs[{key!r}] of {name!r}: {wire!r} is not a "
                                 "torch dtype")
            spec = dataclasses.replace(spec, kwargs={**spec.kwargs, key: dtype})
    return entry(name).factory(groups, spec, comm)
