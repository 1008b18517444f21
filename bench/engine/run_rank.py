"""The engine's training loop, W >= 1, and the body of one rank of
:func:`bench.engine.runner.run`: build the model and the optimizer
(:mod:`bench.engine.optimizers`), train with the measurements the runner's docstring lists, and
report one dict per rank through a queue.

:func:`train_loop` is the loop itself; what differs between the ranks that run it is a
:class:`RankContext` (which rank, the device, the barrier of its group, the autocast context,
an optional stop check). :func:`rank_body` runs it in a process of a ``torch.distributed``
group; ``python -m bench.gpu`` runs it in W threads of one process
(:mod:`bench.engine.inprocess`), with a communicator of its own (``build_rank(..., comm=)``)."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import resource
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from bench.engine import netns_nodes
from bench.engine.comm_timing import DDPCounter, delayed_communicator, timed_communicator
from bench.engine.nullcomm import NullCommunicator
from bench.engine.optimizers import OPTIMIZERS, Spec, build
from bench.engine.run_config import RunConfig, hook_factory, lr_at
from bench.workloads.data import Corpus, batch_at, eval_loss
from bench.workloads.gpt import num_params, param_groups
from bench.workloads.llama import make_model
from bench.workloads.prose import load
from scape import SparsityRamp
from scape.comm import HierarchicalCommunicator, TorchCommunicator


class LanguageModel:
    """The run's workload unless :attr:`RunConfig.workload` names another: the preset
    :attr:`RunConfig.model` on the corpus :attr:`RunConfig.data`, each rank fed its share of
    the global batch (:func:`bench.workloads.data.batch_at`), validated on the corpus's fixed
    held-out windows (:func:`bench.workloads.data.eval_loss`)."""

    def __init__(self, cfg: RunConfig, device: torch.device, corpus: Corpus | None = None
                 ) -> None:
        """``corpus``: another corpus than :attr:`RunConfig.data`'s (the caller's, loaded)."""
        self.cfg, self.device = cfg, device
        self.corpus = corpus if corpus is not None else load(cfg.data)

    def model(self) -> torch.nn.Module:
        return make_model(self.cfg.model, seed=self.cfg.seed)

    def batch(self, index: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
        return batch_at(self.corpus.train, index, self.cfg.batch * world, self.cfg.seq_len,
                        self.cfg.seed, rank, world)

    def val_loss(self, module: torch.nn.Module) -> float:
        return eval_loss(module, self.corpus.val, self.cfg.seq_len, n_seqs=self.cfg.eval_seqs,
                         device=self.device)


def make_workload(cfg: RunConfig, device: torch.device) -> Any:
    """:attr:`RunConfig.workload`'s object, or the :class:`LanguageModel`."""
    if cfg.workload is None:
        return LanguageModel(cfg, device)
    return hook_factory(cfg.workload, "workload")(cfg)


def make_groups(module: torch.nn.Module, cfg: RunConfig) -> list[dict[str, Any]]:
    """The optimizer's param groups (without names): :func:`bench.workloads.gpt.param_groups`, or
    with ``one_group`` every parameter in one group decayed by ``weight_decay``; ``one_group`` with
    ``group_sparsity`` keeps :func:`~bench.workloads.gpt.param_groups`' split (the named groups at
    their own sparsity) but decays every group, as one group would be."""
    if cfg.one_group and not cfg.group_sparsity:
        return [{"params": list(module.parameters()), "weight_decay": cfg.weight_decay}]
    groups = param_groups(module, cfg.weight_decay, cfg.group_sparsity)
    for g in groups:
        g.pop("name")
        if cfg.one_group:
            g["weight_decay"] = float(cfg.weight_decay)
    return groups


def build_rank(cfg: RunConfig, rank: int, world: int, device: torch.device,
               module: torch.nn.Module, comm: Any = None
               ) -> tuple[Any, Any, Any, torch.nn.Module]:
    """``(model_to_call, optimizer, counter, module)``: counter has ``stats`` and ``wait_s``.
    ``comm``: the communicator the optimizer is built on, as it is (not timed: the counter
    counts its bytes, ``wait_s`` stays 0), in place of one over the process group; a
    communicator-built optimizer only (not DDP, FSDP2, two levels or the floor)."""
    module = module.to(device)
    entry = OPTIMIZERS[cfg.optimizer]
    kwargs = dict(cfg.optimizer_kwargs)
    if cfg.optimizer in ("scape", "compute_only"):  # sparse scape.SCAPE: its start, sized
        kwargs.setdefault("total_steps", cfg.steps)  # to the run
    spec = Spec(lr=cfg.lr, betas=cfg.betas, sparsity=cfg.sparsity, kwargs=kwargs)
    if comm is not None and (cfg.fsdp2 or cfg.two_level or entry.comm != "torch"):
        raise ValueError(f"build_rank: a given communicator takes an optimizer built on one "
                         f"(not {cfg.optimizer!r} with fsdp2={cfg.fsdp2}, "
                         f"two_level={cfg.two_level})")
    if cfg.fsdp2:
        return _build_fsdp2(cfg, world, device, module, spec)
    groups = _hooked_groups(cfg, module, make_groups(module, cfg))
    if comm is not None:
        opt_given: Any = build(cfg.optimizer, groups, spec, comm)
        if cfg.attach and hasattr(opt_given, "attach"):
            opt_given.attach(module)
        return module, opt_given, _Untimed(comm), module
    if entry.comm == "ddp":
        counter = DDPCounter(world)
        ddp = DDP(module, device_ids=None if device.type == "cpu" else [device.index])
        ddp.register_comm_hook(None, counter.hook)
        return ddp, build(cfg.optimizer, groups, spec), counter, module
    comm: Any
    if cfg.two_level and entry.comm != "null":
        comm = _two_level(cfg, world)
    else:
        inner = NullCommunicator(world, rank) if entry.comm == "null" \
            else TorchCommunicator(timeout=cfg.timeout_s)
        if cfg.link_delay_ms and entry.comm != "null":
            inner = delayed_communicator(inner, cfg.link_delay_ms / 1e3)
        comm = timed_communicator(inner)
    opt: Any = build(cfg.optimizer, groups, spec, comm)
    if cfg.attach and hasattr(opt, "attach"):
        opt.attach(module)
    return module, opt, _Levels(comm) if isinstance(comm, HierarchicalCommunicator) else comm, \
        module


def _build_fsdp2(cfg: RunConfig, world: int, device: torch.device, module: torch.nn.Module,
                 spec: Spec) -> tuple[Any, Any, Any, torch.nn.Module]:
    """:attr:`RunConfig.fsdp2`: ``fully_shard`` each block, then the root, over the node's ranks
    (or the whole mesh for ``hsdp_adamw``); the optimizer over the ranks holding the same
    shard."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (cfg.nodes, world // cfg.nodes),
                            mesh_dim_names=("dp_replicate", "dp_shard"))
    hsdp = OPTIMIZERS[cfg.optimizer].comm == "hsdp"
    over = mesh if hsdp else mesh["dp_shard"]
    for block in module.blocks:  # type: ignore[union-attr]
        fully_shard(block, mesh=over)
    fully_shard(module, mesh=over)
    groups = _hooked_groups(cfg, module, make_groups(module, cfg))  # (fully_shard's params)
    if hsdp:
        return module, build(cfg.optimizer, groups, spec), _Uncounted(), module
    comm = timed_communicator(TorchCommunicator(mesh["dp_replicate"].get_group(),
                                                timeout=cfg.timeout_s))
    opt: Any = build(cfg.optimizer, groups, spec, comm)
    if cfg.attach and hasattr(opt, "attach"):
        opt.attach(module)
    return module, opt, comm, module


def _hooked_groups(cfg: RunConfig, module: torch.nn.Module, groups: list[dict[str, Any]]
                   ) -> list[dict[str, Any]]:
    """``groups`` through each hook factory's ``param_groups`` (:attr:`RunConfig.hooks`)."""
    for path, kw in cfg.hooks.items():
        edit = getattr(hook_factory(path), "param_groups", None)
        if edit is not None:
            groups = edit(cfg, module, groups, **kw)
    return groups


class _Uncounted:
    """The counter of a run whose collectives are FSDP2's own: none counted (the link's own
    byte counter still reads them, :attr:`RunConfig.node_netns`)."""

    stats: dict[str, Any] = {}
    wait_s = 0.0


class _Untimed:
    """The counter of a communicator the caller gave (:func:`build_rank`): its bytes; no
    wait time measured."""

    wait_s = 0.0

    def __init__(self, comm: Any) -> None:
        self.comm = comm

    @property
    def stats(self) -> Any:
        return self.comm.stats


class _Levels:
    """The counter of a two-level communicator: its bytes by level and the seconds its
    levels' collectives were waited."""

    def __init__(self, comm: HierarchicalCommunicator) -> None:
        self.comm = comm

    @property
    def stats(self) -> Any:
        return self.comm.stats

    @property
    def wait_s(self) -> float:
        return float(self.comm.intra.wait_s + self.comm.inter.wait_s)  # type: ignore[attr-defined]


def _two_level(cfg: RunConfig, world: int) -> HierarchicalCommunicator:
    """The ``(nodes, per_node)`` mesh's two groups, each timed, as one communicator."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu" if cfg.device == "cpu" else "cuda",
                            (cfg.nodes, world // cfg.nodes),
                            mesh_dim_names=("replicate", "shard"))
    levels = [timed_communicator(TorchCommunicator(mesh.get_group(d), timeout=cfg.timeout_s))
              for d in (1, 0)]
    return HierarchicalCommunicator(intra=levels[0], inter=levels[1])


@dataclasses.dataclass
class RankContext:
    """What :func:`train_loop` takes of the rank it runs in, besides the config: the rank, the
    world and the device; ``barrier()`` of the rank's group (``torch.distributed``'s, or an
    in-process group's communicator's); ``autocast()``, a new context the forward passes and
    the evaluations run in (none by default; ``python -m bench.gpu``: bf16 on CUDA); ``stop``,
    called with the steps done after each evaluation but the last, on every rank alike: true
    ends the run there (``truncated``), as a deadline does."""

    rank: int
    world: int
    device: torch.device
    barrier: Callable[[], Any]
    autocast: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext
    stop: Callable[[int], bool] | None = None


@dataclasses.dataclass
class Trained:
    """What :func:`train_loop` returns: rank's per-step ``records``, rank 0's ``val_curve``
    (``(step, loss)``), the ``steps`` done (fewer than ``cfg.steps`` if ``truncated``), the
    clock at the loop's start (``started``, ``time.perf_counter()``) and its length
    (``wall_s``), and the objects of :attr:`RunConfig.hooks` by path."""

    records: list[dict[str, Any]]
    val_curve: list[tuple[int, float]]
    steps: int
    truncated: bool
    started: float
    wall_s: float
    hooks: dict[str, Any]


def rank_body(rank: int, world: int, cfg_dict: dict[str, Any]) -> dict[str, Any]:
    """Body of one rank, launched by :func:`bench.engine.runner.run` (its process group joined):
    train, measure, return the records."""
    return _train(RunConfig.from_dict(cfg_dict), rank, world)


def _train(cfg: RunConfig, rank: int, world: int) -> dict[str, Any]:
    """One rank of a ``torch.distributed`` group: :func:`train_loop`, then the run's result."""
    device = torch.device("cuda", torch.cuda.current_device()) if cfg.device == "cuda" \
        else torch.device("cpu")
    work = make_workload(cfg, device)
    model, opt, counter, module = build_rank(cfg, rank, world, device, work.model())
    run = train_loop(cfg, RankContext(rank, world, device, dist.barrier), work, model, opt,
                     counter, module)
    phases: list[str] = []
    if cfg.profile_dir is not None:
        path = os.path.join(cfg.profile_dir, f"trace_rank{rank}.json")
        if os.path.exists(path):
            with open(path) as f:
                names = {e.get("name", "") for e in json.load(f).get("traceEvents", [])}
            phases = sorted(n for n in names if n.startswith(("scape/", "topk/")))
    settings: dict[str, Any] = {
        k: getattr(opt, k) for k in ("update", "explore", "warmup_steps", "ramp_steps",
                                     "total_steps", "dense_every", "error_feedback",
                                     "block_size")
        if isinstance(getattr(opt, k, None), (str, int, float, bool))}
    if hasattr(opt, "finish_param_sync"):
        opt.finish_param_sync()
    return {"records": run.records, "val_curve": run.val_curve, "params": num_params(module),
            "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "wall_s": time.perf_counter() - run.started, "phases": phases,
            "optimizer_settings": settings, "param_sha256": param_digest(module),
            "n_pad": sum(b.n_pad for b in getattr(opt, "buckets", ())) or None,
            "mask_rows": [[m.n_local, m.k] for m in getattr(opt, "masks", ()) or ()
                          if m is not None] or None,  # per sparse bucket: rows per rank, k
            "hooks": {path: h.result() for path, h in run.hooks.items()
                      if hasattr(h, "result")},
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}


def train_loop(cfg: RunConfig, ctx: RankContext, work: Any, model: Any, opt: Any, counter: Any,
               module: torch.nn.Module) -> Trained:
    """The training loop of every run, W >= 1: ``cfg.steps`` steps of ``work``'s batches
    (:func:`make_workload`) through ``model``/``opt`` (:func:`build_rank`), the lr of
    :func:`~bench.engine.run_config.lr_at`, :attr:`RunConfig.hooks` and
    :attr:`RunConfig.sparsity_ramp`, one record per step (time, bytes of ``counter``, train
    loss), an evaluation on rank 0 every ``eval_every`` steps and at the end."""
    rank, world, device = ctx.rank, ctx.world, ctx.device
    hooks = {path: hook_factory(path)(cfg, module, opt, **kw) for path, kw in cfg.hooks.items()}
    before = [h.before_step for h in hooks.values() if hasattr(h, "before_step")]
    backward = [h.after_backward for h in hooks.values() if hasattr(h, "after_backward")]
    after = [h.after_step for h in hooks.values() if hasattr(h, "after_step")]
    ramp = None if cfg.sparsity_ramp is None else SparsityRamp(
        opt, start=cfg.sparsity_ramp[0], ramp_steps=cfg.sparsity_ramp[1])  # writes step 1's
    prof, prof_steps = None, range(cfg.skip + 1, min(cfg.steps, cfg.skip + 4) + 1)
    records: list[dict[str, Any]] = []
    val_curve: list[tuple[int, float]] = []
    ddp = OPTIMIZERS[cfg.optimizer].comm == "ddp"
    floor = OPTIMIZERS[cfg.optimizer].comm == "null"  # nothing trained across ranks
    evaluate = not floor
    done, truncated = 0, False
    started = time.perf_counter()
    for step in range(cfg.steps):
        if cfg.profile_dir is not None and step + 1 == prof_steps.start:
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            prof.__enter__()
        if floor:
            # Real runs start every step together (their collectives line the ranks up), so
            # the ranks compete for the cores the same way; without this the floor's ranks
            # drift apart and a lone rank runs faster than any synchronized one could.
            ctx.barrier()
        # (lists: tuple() of a generator can raise SystemError on CPython 3.11 when another
        # thread's garbage collection holds the half-built tuple, as with ranks as threads)
        batches = [[t.to(device) for t in work.batch(step * cfg.grad_accum + micro, rank, world)]
                   for micro in range(cfg.grad_accum)]
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg)
        for hook in before:  # RunConfig.hooks
            hook(step)
        bytes_before = {op: int(v["bytes"]) for op, v in counter.stats.items()}
        calls_before = sum(int(v["calls"]) for v in counter.stats.values())
        link_before = _link_tx() if cfg.node_netns is not None else 0
        wait_before = counter.wait_s
        t0 = time.perf_counter()
        loss_sum = torch.zeros((), device=device)
        for micro, (x, y) in enumerate(batches):
            last = micro == cfg.grad_accum - 1
            sync = model.no_sync() if (ddp and not last) else _null()
            with sync:
                with ctx.autocast():
                    loss = module.loss(x, y) if model is module else _ddp_loss(model, x, y)
                (loss / cfg.grad_accum).backward()
            loss_sum += loss.detach()
        for hook in backward:
            hook(step)
        opt.step()
        opt.zero_grad()
        if ramp is not None:  # the next step's sparsity, as an LR scheduler writes the lr
            ramp.step()
        for hook in after:
            hook(step)
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the step's kernels are in the time
        step_s = time.perf_counter() - t0
        wait_s = counter.wait_s - wait_before
        sent = {op: int(v["bytes"]) - bytes_before.get(op, 0)
                for op, v in counter.stats.items()}
        records.append({"step_s": step_s, "wait_s": wait_s,
                        "bytes": {op: b for op, b in sent.items() if b},
                        "calls": sum(int(v["calls"]) for v in counter.stats.values())
                        - calls_before,
                        "train_loss": float(loss_sum) / cfg.grad_accum,
                        "dense": bool(getattr(getattr(opt, "last_step", None), "dense", True)),
                        **({"link_tx": _link_tx() - link_before} if cfg.node_netns else {})})
        if prof is not None and cfg.profile_dir is not None and step + 1 == prof_steps.stop - 1:
            _drain(opt)  # no collective may still be recording when the profiler stops
            prof.__exit__(None, None, None)
            os.makedirs(cfg.profile_dir, exist_ok=True)
            prof.export_chrome_trace(os.path.join(cfg.profile_dir, f"trace_rank{rank}.json"))
            prof = None
        done = step + 1
        evaluated = evaluate and (done % cfg.eval_every == 0 or done == cfg.steps)
        if evaluated:
            if hasattr(opt, "finish_param_sync"):
                opt.finish_param_sync()
            if rank == 0 or cfg.fsdp2:  # (a sharded model's forward runs on every rank)
                with ctx.autocast():
                    val = work.val_loss(module)
                if rank == 0:
                    val_curve.append((done, val))
            ctx.barrier()
        if rank == 0 and cfg.log_every and (done % cfg.log_every == 0 or done == cfg.steps):
            val = f" val {val_curve[-1][1]:.4f}" if val_curve and val_curve[-1][0] == done \
                else ""
            print(f"[{cfg.label}] step {done}/{cfg.steps} train {records[-1]['train_loss']:.4f}"
                  f"{val} | {step_s * 1e3:.0f} ms/step ({time.perf_counter() - started:.0f} s)",
                  flush=True)
        if evaluated and ctx.stop is not None and done < cfg.steps and ctx.stop(done):
            truncated = True  # (every rank's stop says the same)
            break
    return Trained(records=records, val_curve=val_curve, steps=done, truncated=truncated,
                   started=started, wall_s=time.perf_counter() - started, hooks=hooks)


def _link_tx() -> int:
    """Bytes this node's end of the emulated link has sent (:mod:`bench.engine.netns_nodes`)."""
    with open("/proc/self/net/dev") as f:  # (this process's namespace; /sys is not)
        for line in f:
            name, _, fields = line.partition(":")
            if name.strip() == netns_nodes.NODE_IF:
                return int(fields.split()[8])  # receive: 8 fields, then transmit bytes
    raise RuntimeError(f"no interface {netns_nodes.NODE_IF} in this network namespace")


def param_digest(module: torch.nn.Module) -> str:
    """sha256 of the module's parameters (names, dtypes, shapes and bytes, in order): two runs
    whose digests agree trained bitwise the same model."""
    h = hashlib.sha256()
    for name, p in module.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p  # (a DTensor: gathered)
        t = full.detach().cpu().contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


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
    logits = ddp(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))
