"""The machinery shared by the sharded optimizers: buckets, agreement, the step skeleton.

A subclass decides, per bucket and step, whether the step is dense or sparse and supplies the
per-shard update. Every step runs the same phases on every rank, in the same order, so the
collectives match across ranks::

    fold stray grads -> local stats -> take / reduce-scatter (all buckets, async)
      -> wait -> ONE scalar all-reduce [sum of squares of the synchronized gradient,
                                        count of non-finite entries in the local buffers]
      -> skip (every rank) | clip, update shard, all-gather params (async), next mask (async)

Where the scalars can ride (:meth:`ShardedOptimizer._scalars_ride`: a sparse step of
:class:`scape.SCAPE` without clipping), the all-reduce is not launched: the non-finite count
travels in every owner's segment of the gradient collective, and each owner's sum of squares
with its parameter values, so the norm is known when they land.

The parameter all-gather is waited inside ``step()`` unless :meth:`attach` was called, in
which case a forward pre-hook waits for it (and scatters) right before the next forward.
The skip decision reads the all-reduced count on the host: one 8-byte read per step, the
same synchronisation Megatron's ``found_inf`` check makes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from scape import config, faults, local_shards
from scape.agreement import agree, digest, tensor_digest
from scape.buffers import Bucket
from scape.comm import CommError, Communicator, as_communicator
from scape.grad_watch import GradWatch, clip_norm
from scape.kernels import grad_stats
from scape.local_shards import ShardMesh
from scape.optim_hooks import refuse_copy
from scape.param_state import param_state
from scape.profiling import phase
from scape.step_info import StepInfo
from scape.two_level import FlatLevel
from scape.wrappers import check_not_wrapped

_GRAD_COMM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class _Pending:
    """A parameter all-gather in flight and what to do when it completes: ``finish`` writes
    the values (skipped where the parameters were written from outside meanwhile),
    ``always`` reads what else rode with them (run in any case)."""

    def __init__(self, bucket: Bucket, work: Any, finish: Callable[[], None] | None,
                 keep: tuple[torch.Tensor, ...] = (),
                 always: Callable[[], None] | None = None) -> None:
        self.bucket, self.work, self.finish, self.always = bucket, work, finish, always
        self.keep = keep  # buffers the collective reads or writes: alive until it completes


class _Handles:
    """The hooks :meth:`ShardedOptimizer.attach` adds, removed together."""

    def __init__(self, *handles: Any) -> None:
        self.handles = handles

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def positional_error(name: str, args: tuple, lr: Any) -> TypeError | None:
    """The error for hyperparameters given by position after ``params`` (they are taken by
    name only, as in ``scape.SCAPE(params, lr=3e-4)``), or for no ``lr`` at all; raised on
    every rank with the rest."""
    if not args:
        return None if lr is not None else TypeError(
            f"{name} needs a learning rate: {name}(params, lr=3e-4, ...)")
    shown = ", ".join(repr(a) for a in args[:3]) + (", ..." if len(args) > 3 else "")
    return TypeError(f"{name} takes its hyperparameters by name: got {shown} by position after "
                     f"params; write {name}(params, lr={args[0]!r}, ...) with every "
                     "hyperparameter as a keyword")


def wire_limit(dtype: torch.dtype, world: int) -> float:
    """The largest ``|entry|`` of a rank's gradient buffer that a gradient wire of ``dtype``
    (fp32, bf16, fp16) sums over ``world`` ranks: half the dtype's range over ``world``, so
    no partial sum of ``world`` entries, each rounded to the wire, reaches its end (fp16:
    ``32752 / world``; fp32 and bf16: about ``1.7e38 / world``). A buffer with a larger
    entry counts it as non-finite: the step is skipped on every rank (DESIGN §8), where a
    sum past the range would have written inf into every replica."""
    return float(torch.finfo(dtype).max) / (2 * world)


class ShardedOptimizer(torch.optim.Optimizer):
    """Base of :class:`scape.SCAPE` and :class:`scape.DistributedAdamW` (not used directly)."""

    name = "sharded optimizer"
    __getstate__ = refuse_copy
    _wire_dtypes: tuple[torch.dtype, ...] = _GRAD_COMM_DTYPES
    """The ``grad_comm_dtype`` values this optimizer takes."""

    def __init__(self, params: Any, defaults: dict[str, Any], *, comm: Communicator | None,
                 block_size: int, max_grad_norm: float | None,
                 grad_comm_dtype: torch.dtype, global_fields: dict[str, Any]) -> None:
        error: Exception | None = None
        groups_trainable: list[list[torch.Tensor]] = []
        try:
            self._validate_args(defaults, block_size, max_grad_norm, grad_comm_dtype,
                                global_fields)
            super().__init__(params, defaults)
            for i, g in enumerate(self.param_groups):
                self._validate_group(g, i)
                groups_trainable.append(config.check_params(g["params"]))
            if not any(groups_trainable):
                raise ValueError("optimizer got no trainable parameter (all have "
                                 "requires_grad=False)")
        except (ValueError, TypeError) as e:
            error = e
        self.comm: Communicator = as_communicator(comm)
        self._shard_mesh: ShardMesh | None = None
        """The mesh DTensor parameters are sharded over (:mod:`scape.local_shards`)."""
        if error is None:
            try:
                self._shard_mesh = local_shards.inspect(
                    [p for g in groups_trainable for p in g], self.comm)
            except (ValueError, TypeError) as e:
                error = e
        self.block_size = block_size
        self.max_grad_norm = max_grad_norm
        self.grad_comm_dtype = grad_comm_dtype
        self._dense_wire = torch.float32 if grad_comm_dtype == torch.int8 else grad_comm_dtype
        """The dtype of a dense step's gradient on the wire (the 8-bit wire is sparse only)."""
        self._wire_limit = wire_limit(self._dense_wire, self.comm.world_size) \
            if error is None else None
        """The largest ``|entry|`` of a local buffer the step sends (:func:`wire_limit`;
        None where the arguments were refused)."""
        self._faults: faults.FaultPlan | None = None  # armed by scape.faults.install
        self._failed: CommError | None = None
        fields = self._fingerprint(groups_trainable, global_fields, error is None)
        agree(self.comm, fields, error, what=self.name,
              shown=self._shown(groups_trainable, global_fields, error is None))

        self._trainable = groups_trainable
        self._norm_out: torch.Tensor | None = None
        self._wrap_checked = False
        self._step = 0
        self._pending: list[_Pending] = []
        self._attached = False
        self.last_step = StepInfo()
        self._build_layout(frozenset())

    def _build_layout(self, apart: frozenset[int]) -> None:
        """The buckets and what is kept per bucket, from the parameters alone (before the
        first step). One bucket per (param group, dtype); the parameters whose ids are in
        ``apart`` get one of their own within their group (:mod:`scape.embeddings`)."""
        world, rank = self.comm.world_size, self.comm.rank
        old_watch: GradWatch | None = getattr(self, "_watch", None)
        if old_watch is not None:  # a layout rebuilt: the old one's hooks go
            old_watch.remove()
        self.buckets: list[Bucket] = []
        for gi, trainable in enumerate(self._trainable):
            by_key: dict[tuple[torch.dtype, bool, float], list[torch.Tensor]] = {}
            for p in trainable:  # (a DTensor replicated over a mesh dimension apart too)
                by_key.setdefault((p.dtype, id(p) in apart, local_shards.norm_weight(p)),
                                  []).append(p)
            align = self._bucket_align(self.param_groups[gi])
            for (_, own, _), ps in by_key.items():
                self.buckets.append(Bucket(ps, gi, world, rank, align, own))  # type: ignore[arg-type]
        self.shards = [self._init_shard(b) for b in self.buckets]
        self.level: FlatLevel = FlatLevel(self.comm)
        """How gradients leave the rank (:mod:`scape.two_level`): one level here; a subclass
        may hold two."""
        self._watch = GradWatch(self.buckets, count_norms=self.max_grad_norm is not None)
        self._sent_sumsq: list[torch.Tensor | None] = [None] * len(self.buckets)
        self._ride_count: torch.Tensor | None = None
        """This step's non-finite count of the local buffers where the scalars ride (the
        gradient collective carries it), else None."""
        self._ride_flag: torch.Tensor | None = None
        """The counts every rank sent, as this owner received them (> 0: skip)."""
        self._ride_sumsq: list[torch.Tensor | None] = [None] * len(self.buckets)
        """Per bucket, this rank's sum of squares of its synchronized gradient (it rides with
        the parameter values)."""
        self._ride_norm: tuple[torch.Tensor, list[torch.Tensor]] | None = None
        """The step's norm tensor and every bucket's gathered sums of squares, once the
        parameter all-gathers land (:meth:`finish_param_sync`)."""
        self._owned = {id(p) for b in self.buckets for p in b.params}
        self.state = param_state(self.buckets, self.shards, self.state_tensors)
        """Per-parameter views of what this rank holds (:mod:`scape.param_state`)."""
        self.last_sync: list[dict[str, torch.Tensor | None]] = [{} for _ in self.buckets]
        """Per bucket, what the last applied step synchronized for this rank's shard: ``g``
        (the averaged fp32 gradient it received, before clipping) and ``mask`` (the mask of
        a sparse step, ``None`` for a dense one). For diagnostics and tests."""

    # ----------------------------------------------------------------- subclass interface
    def _validate_args(self, defaults: dict, block_size: int, max_grad_norm: Any,
                       grad_comm_dtype: Any, global_fields: dict) -> None:
        call_error = getattr(self, "_call_error", None)  # positional hyperparameters
        if call_error is not None:
            raise call_error
        config.check_block_size(block_size)
        config.check_max_grad_norm(max_grad_norm)
        if grad_comm_dtype not in self._wire_dtypes:
            raise ValueError(f"Invalid grad_comm_dtype: {grad_comm_dtype!r} (expected one of "
                             f"{', '.join(map(str, self._wire_dtypes))})")

    def _validate_group(self, group: dict, index: int) -> None:
        config.check_lr(group["lr"])
        config.check_betas(group["betas"])
        config.check_eps(group["eps"])
        config.check_weight_decay(group["weight_decay"])

    def _bucket_align(self, group: dict) -> int:
        raise NotImplementedError

    def _init_shard(self, bucket: Bucket) -> Any:
        raise NotImplementedError

    def _is_dense(self, bucket_index: int) -> bool:
        raise NotImplementedError

    def _dense_update(self, i: int, g: torch.Tensor, hp: dict, model_out: torch.Tensor) -> None:
        raise NotImplementedError

    def _observe(self, i: int) -> None:
        """Called for every bucket at the start of every step, before anything is sent."""

    def _dense_finish(self, i: int, hp: dict) -> Callable[[], None] | None:
        """What to run once a dense step's parameter all-gather has landed (None: nothing)."""
        return None

    def _sparse_launch(self, i: int) -> tuple[torch.Tensor, Any]:
        raise NotImplementedError

    def _sparse_update(self, i: int, g: torch.Tensor, hp: dict) -> _Pending:
        raise NotImplementedError

    def _after_update(self, dense_flags: list[bool]) -> None:
        """Called after every applied (not skipped) step, e.g. to launch the next mask."""

    def _after_skip(self) -> None:
        """Called after a skipped step, once the gradient buffers (residuals) are cleared."""

    def _undo_ahead(self) -> None:
        """After a failed or skipped step: undo what it did ahead of its update."""

    def _step_mask(self, i: int, dense: bool) -> torch.Tensor | None:
        """The mask bucket ``i`` synchronized this step (None when dense)."""
        return None

    def _launch(self, dense_flags: list[bool]) -> list[tuple[torch.Tensor, Any]]:
        """Take and start every bucket's gradient collective: per bucket ``(g, work)``, ``g``
        this rank's synchronized part once ``work.wait()`` returned (works may be shared)."""
        received = []
        for i, b in enumerate(self.buckets):
            if dense_flags[i]:
                with phase("scape/reduce_scatter", b.device):
                    received.append(self.level.dense_launch(i, b, self._dense_wire))
            else:
                received.append(self._sparse_launch(i))
        return received

    def _scalars_ride(self, dense_flags: list[bool]) -> bool:
        """Whether this step's scalars ride in the gradient and parameter collectives instead
        of an all-reduce of their own (module docstring)."""
        return False

    # ------------------------------------------------------ the checkpoint interface
    # What scape.checkpoint, scape.dcp, scape.io and scape.schedules read and write, typed
    # as scape.checkpoint.ShardedState: ``name``, ``comm``, ``block_size``, ``buckets``,
    # ``shards``, ``param_groups``, ``step_count`` and the methods below.
    def state_tensors(self, shard: Any) -> dict[str, torch.Tensor]:
        """A shard's tensors by the name ``opt.state[p]`` and state dicts give them."""
        raise NotImplementedError

    @property
    def optional_state_names(self) -> tuple[str, ...]:
        """Names among :meth:`state_tensors` that a state dict may lack (they load as
        zeros)."""
        return ()

    def residual(self, i: int) -> torch.Tensor:
        """Bucket ``i``'s gradient and residual as a whole buffer (what checkpoints keep)."""
        return self.level.residual(i, self.buckets[i])

    def counters(self) -> dict[str, Any]:
        """Scalar state beyond :attr:`step_count`, saved in checkpoints (plain values)."""
        return {}

    def load_counters(self, counters: dict[str, Any], step: int) -> None:
        """Restore :attr:`step_count` and what :meth:`counters` saved (a checkpoint loader
        calls it after the state tensors are written; a subclass extends it)."""
        self._step = int(step)

    # ------------------------------------------------------------------- fingerprint
    def _fingerprint(self, groups: list[list[torch.Tensor]], global_fields: dict,
                     valid: bool) -> dict[str, int]:
        names = ["lr", "betas", "eps", "weight_decay", "sparsity"]
        fields: dict[str, int] = {}
        for n in names:
            fields[n] = digest([g.get(n) for g in self.param_groups]) if valid else 0
        for k, v in global_fields.items():
            fields[k] = digest(v)
        fields["block_size"] = digest(self.block_size)
        fields["max_grad_norm"] = digest(self.max_grad_norm)
        fields["grad_comm_dtype"] = digest(str(self.grad_comm_dtype))
        flat = [p for g in groups for p in g]
        fields["param_count"] = digest([len(g) for g in groups]) if valid else 0
        shards = [local_shards.local(p) for p in flat]  # (a DTensor: its local shard)
        fields["param_shapes"] = digest([tuple(p.shape) for p in shards]) if valid else 0
        fields["param_dtypes"] = digest([str(p.dtype) for p in shards]) if valid else 0
        fields["param_values"] = tensor_digest(shards) if valid else 0
        # the same shard on every rank of comm (a field on every rank: the records align)
        mesh = self._shard_mesh
        fields["shard_coordinate"] = digest(None if mesh is None else mesh.coordinate)
        return fields

    def _shown(self, groups: list[list[torch.Tensor]], global_fields: dict,
               valid: bool) -> dict[str, Any]:
        """The plain values behind the fingerprint's fields, which a disagreement lists rank
        by rank (a param group's value, or the list of every group's)."""
        shown: dict[str, Any] = {}
        if valid:
            for n in ("lr", "betas", "eps", "weight_decay", "sparsity"):
                per_group = [g.get(n) for g in self.param_groups]
                shown[n] = per_group[0] if len(per_group) == 1 else per_group
            shown["param_count"] = [len(g) for g in groups]
        if self._shard_mesh is not None:
            shown["shard_coordinate"] = list(self._shard_mesh.coordinate)
        shown.update({k: v for k, v in global_fields.items() if k != "rule"})
        shown.update(block_size=self.block_size, max_grad_norm=self.max_grad_norm,
                     grad_comm_dtype=str(self.grad_comm_dtype))
        return shown

    # ------------------------------------------------------------------- public API
    @property
    def step_count(self) -> int:
        return self._step

    @property
    def shard_mesh(self) -> ShardMesh | None:
        """The mesh DTensor parameters are sharded over (FSDP2's ``dp_shard``), None for
        plain parameters (:mod:`scape.local_shards`)."""
        return self._shard_mesh

    def attach(self, model: torch.nn.Module) -> _Handles:
        """Wait for the parameter all-gather just before ``model``'s next forward.

        Without it, ``step()`` waits before returning. With it, the all-gather overlaps
        with whatever runs between ``step()`` and the next forward (data loading, logging).
        ``model.state_dict()`` and ``model.load_state_dict`` wait for it first too; for
        another read or in-place write of the parameters between ``step()`` and the next
        forward, call :meth:`finish_param_sync` first. Returns a handle whose ``remove()``
        removes the hooks.
        """
        self._attached = True

        def pre_hook(module: torch.nn.Module, args: Any) -> None:
            self.finish_param_sync()

        def sync_first(module: torch.nn.Module, *args: Any) -> None:
            self.finish_param_sync()  # the model holds the last step's parameters first

        # first among the pre-hooks: FSDP2's all-gathers the parameters in its own
        forward = model.register_forward_pre_hook(pre_hook, prepend=True)
        save = model.register_state_dict_pre_hook(sync_first)
        load = model.register_load_state_dict_pre_hook(sync_first)
        return _Handles(forward, save, load)

    def finish_param_sync(self) -> None:
        """Wait for in-flight parameter all-gathers and write them into the model; then adopt
        what was written into the parameters from outside (:meth:`_adopt_param_writes`)."""
        self.check_usable()
        if self._pending:
            device = self._pending[0].bucket.device
            written = {id(b) for b in self.buckets if b.written()}
            try:
                with phase("scape/all_gather", device):
                    for pend in self._pending:
                        pend.work.wait()
                        if pend.always is not None:
                            pend.always()
                        if id(pend.bucket) not in written:  # (values written meanwhile are
                            if pend.finish is not None:  # kept instead)
                                pend.finish()
                            pend.bucket.publish()
            except CommError as e:
                self._failed = e
                raise
            self._pending.clear()
            if self._ride_norm is not None:  # every owner's sum of squares has landed
                norm, parts = self._ride_norm
                norm.copy_(torch.cat(parts).sum().sqrt())
                self._ride_norm = None
        self._adopt_param_writes()

    def _adopt_param_writes(self) -> None:
        """Parameters written outside the optimizer since its last write of them
        (``model.load_state_dict(...)`` after construction, an in-place edit) become the
        master weights of this rank's shard, as torch.optim optimizers step from whatever the
        parameters hold. Each rank adopts what its own model holds: write the same values on
        every rank (as loading a checkpoint does), or the replicas differ."""
        for b, s in zip(self.buckets, self.shards):
            b.reattach()
            if b.written():
                s.master.copy_(b.param_flat[b.shard])
                b.mark_written()

    def check_usable(self) -> None:
        """Raise ``RuntimeError`` if a collective of an earlier step failed.

        After a ``CommError`` the ranks cannot know which collectives the others completed:
        the shard may hold an update whose parameter all-gather never arrived. Such an
        optimizer refuses ``step()``, ``state_dict()`` and checkpoint saves; restart the job
        and load the last complete checkpoint.
        """
        if self._failed is not None:
            raise RuntimeError(f"{self.name}: unusable after a failed collective ({self._failed})"
                               "; restart and load the last complete checkpoint")

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Keeps the gradient buffers: ``step()`` already consumed what it sent.

        The buffers hold the error-feedback residual (what was not sent yet); clearing them
        would lose it. ``set_to_none`` is accepted for compatibility and ignored.
        """

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip from the next ``step()`` on by the dense-comparable gradient norm (as
        ``max_grad_norm=``; call it on every rank, with the same value) and return a 0-dim
        tensor that ``step()`` fills with this step's norm before clipping (read it after
        ``step()``; ``opt.last_step.grad_norm`` holds it too). What the norm is on a sparse
        step: :func:`scape.grad_watch.clip_norm`. ``torch.nn.utils.clip_grad_norm_`` on the model's
        parameters would scale the error-feedback residual, and ``step()`` refuses it."""
        if norm_type != 2.0:
            raise ValueError(f"Invalid norm_type: {norm_type!r} (only the 2-norm is supported)")
        config.check_max_grad_norm(max_norm)
        if not self._watch.count_norms:  # counted from the next backward on; this step
            self._watch.count_norms, self._watch.counted = True, False  # uses the buffer
        self.max_grad_norm = float(max_norm)
        self._norm_out = torch.full((), float("nan"), device=self.buckets[0].device)
        return self._norm_out

    def add_param_group(self, param_group: dict) -> None:
        """Raises ``RuntimeError`` once the optimizer is built: its param groups are fixed at
        construction (the flat buffers and shards are laid out once). Build a new optimizer
        with every group instead."""
        if hasattr(self, "buckets"):
            raise RuntimeError(f"{self.name}: param groups are fixed at construction (the "
                               "flat buffers and shards are built once); build a new optimizer")
        super().add_param_group(param_group)

    def _hp(self, bucket: Bucket) -> dict:
        g = self.param_groups[bucket.group]
        return {"lr": float(g["lr"]), "beta1": g["betas"][0], "beta2": g["betas"][1],
                "eps": g["eps"], "weight_decay": g["weight_decay"],
                "world": self.level.senders}

    # ------------------------------------------------------------------- the step
    @torch.compiler.disable
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        self.check_usable()
        try:
            return self._run_step(closure)
        except BaseException as e:
            self._undo_ahead()
            if isinstance(e, CommError):  # the group is broken: refuse to go on from a
                self._failed = e  # partial step
            raise

    @torch.no_grad()
    def _run_step(self, closure: Callable[[], float] | None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.finish_param_sync()
        if not self._wrap_checked:  # once: a DDP wrap would reduce the gradients again
            if check_not_wrapped([p for b in self.buckets for p in b.params], self.name):
                self._watch.enabled = False  # its reducer copies the (same) grads back
            self._wrap_checked = True
        self._watch.check()
        self._step += 1
        set_step = getattr(self.comm, "set_step", None)
        if set_step is not None:
            set_step(self._step)
        before = {k: int(v["bytes"]) for k, v in self.comm.stats.items()}
        calls_before = sum(int(v["calls"]) for v in self.comm.stats.values())
        self._check_unfrozen()
        for b in self.buckets:
            b.fold_stray_grads()
        fault = self._faults
        if fault is not None:
            fault.fire(self._step, "grad", self)
        dense_flags = [self._is_dense(i) for i in range(len(self.buckets))]
        ride = self._scalars_ride(dense_flags)
        device = self.buckets[0].device
        self.level.gather_inside(self.buckets, self._dense_wire, self.max_grad_norm is not None)
        for i in range(len(self.buckets)):
            self._observe(i)

        # 1. local statistics of the whole buffers (this step's gradient + residual); with
        # clipping also [sent sum of squares (sparse), its local one, the fresh gradient's]
        clip = self.max_grad_norm is not None
        local = torch.zeros(5 if clip else 2, dtype=torch.float32, device=device)
        self._pre_sumsq = []
        for i in range(len(self.buckets)):
            s = grad_stats(self.level.buffer(i, self.buckets[i]), self._wire_limit)
            self._pre_sumsq.append(s[0])
            local[1] += s[1]
        self._ride_count = local[1:2] if ride else None
        weight = [b.norm_weight for b in self.buckets]  # 1 but for replicated DTensors
        # 2. take + reduce-scatter, every bucket in flight together
        if fault is not None:
            fault.fire(self._step, "reduce_scatter", self)
        received = self._launch(dense_flags)
        gs = []
        with phase("scape/reduce_scatter", device):
            for i, (g, work) in enumerate(received):
                work.wait()
                g = g.float() if g.dtype != torch.float32 else g
                gs.append(g)
                sumsq = grad_stats(g)[0]
                w = weight[i]
                local[0] += sumsq if w == 1.0 else w * sumsq
                if ride:
                    self._ride_sumsq[i] = (sumsq if w == 1.0 else w * sumsq).reshape(1)
                if clip and not dense_flags[i]:
                    local[2] += sumsq if w == 1.0 else w * sumsq
                    sent = self._sent_sumsq[i]
                    local[3] += 0.0 if sent is None else (sent if w == 1.0 else w * sent)
                    fresh = self.level.fresh_sumsq(i, self._watch)
                    fresh = self._pre_sumsq[i] if fresh is None else fresh
                    local[4] += fresh if w == 1.0 else w * fresh
                self.last_sync[i] = {"g": g.clone() if self.max_grad_norm else g,
                                     "mask": self._step_mask(i, dense_flags[i])}
        # 3. one scalar all-reduce: norm of the synchronized gradient + non-finite count
        # (the update below starts only after every gradient collective of the step completed)
        if fault is not None:
            fault.fire(self._step, "all_reduce", self)
        if ride:  # every owner received every rank's count; the norm lands with the values
            assert self._ride_flag is not None
            skipped = bool(self._ride_flag.gt(0).any())
            grad_norm = torch.full((), float("nan"), device=device)
            if not skipped:
                self._ride_norm = (grad_norm, [])
        else:
            self.comm.all_reduce(local, op="sum").wait()
            if self._shard_mesh is not None:  # and over the other shards of the model
                self._shard_mesh.all_reduce_(local)
            grad_norm = local[0].sqrt() if not clip else clip_norm(local, self.level.senders)
            skipped = bool(local[1] > 0)
        self._ride_count = None
        self._ride_flag = None
        for b, dense in zip(self.buckets, dense_flags):
            if dense or skipped:
                b.grad_flat.zero_()
        if not skipped:
            if self.max_grad_norm is not None:
                coef = (self.max_grad_norm / (grad_norm + 1e-6)).clamp(max=1.0)
                for g in gs:
                    g.mul_(coef)
            if fault is not None:
                fault.fire(self._step, "all_gather", self)
            self._apply(gs, dense_flags)
            if fault is not None:
                fault.fire(self._step, "mask_sync", self)
            self._after_update(dense_flags)
        else:
            self._after_skip()
        self._watch.reset()
        if self._norm_out is not None:
            self._norm_out.copy_(grad_norm)
            self._norm_out = None
        if not self._attached:
            self.finish_param_sync()
        after = self.comm.stats
        self.last_step = StepInfo(
            step=self._step, dense=all(dense_flags), skipped=skipped, grad_norm=grad_norm,
            bytes={k: int(v["bytes"]) - before.get(k, 0) for k, v in after.items()
                   if int(v["bytes"]) - before.get(k, 0)},
            collectives=sum(int(v["calls"]) for v in after.values()) - calls_before,
            mask_size=sum(self._sync_size(i, d) for i, d in enumerate(dense_flags)))
        return loss

    def _check_unfrozen(self) -> None:
        """A parameter frozen (``requires_grad=False``) when the optimizer was built has no
        place in its buffers: if it has a gradient now, raise instead of ignoring it."""
        owned = self._owned
        for gi, g in enumerate(self.param_groups):
            for p in g["params"]:
                if p.grad is not None and p.requires_grad and id(p) not in owned:
                    raise ValueError(
                        f"{self.name}: a parameter of shape {tuple(p.shape)} in param group "
                        f"{gi} has a gradient but had requires_grad=False when the optimizer "
                        "was built, so it has no place in the optimizer's buffers; build the "
                        "optimizer after setting requires_grad (or keep the parameter "
                        "trainable and set its group's lr to 0 while it should stay frozen)")

    def _sync_size(self, i: int, dense: bool) -> int:
        return self.buckets[i].n_pad

    def _apply(self, gs: list[torch.Tensor], dense_flags: list[bool]) -> None:
        for i, (b, g, dense) in enumerate(zip(self.buckets, gs, dense_flags)):
            hp = self._hp(b)
            if dense:
                model_out = torch.empty(b.shard_size, dtype=b.dtype, device=b.device)
                with phase("scape/update", b.device):
                    self._dense_update(i, g, hp, model_out)
                with phase("scape/all_gather", b.device):
                    work = self.comm.all_gather(b.param_flat, model_out)
                self._pending.append(_Pending(b, work, self._dense_finish(i, hp), (model_out,)))
            else:
                self._pending.append(self._sparse_update(i, g, hp))
