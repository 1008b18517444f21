"""``scape.SCAPE``: sharded AdamS with masks synchronized one step late.

One sparse step t (docs/design.md, DESIGN §1; the mask ``M_t`` is already on every rank)::

    take        c = buf[M_t]; buf[M_t] = 0           (buf: gradient + residual, fp32)
    reduce-scatter (avg) every bucket's c and this rank's non-finite count, in ONE
                                                     -> owner gets g (k_s values), count > 0:
                                                        every rank skips
    update      rule(shard, g, M_t[own rows])        -> new values at M_t (model dtype)
    mask        M_{t+1} = per-block top-|score| (+ oldest by age) of the own shard
                (score: the rule's; the first moment ``m`` in DESIGN §1)
    all-gather  every bucket's new values, M_{t+1} (Elias-Fano rows) and |g|^2, in ONE
                (async)                              -> scatter into every model; the mask is
                                                        unpacked at step t+1's take

With clipping (its coefficient needs ``|g|`` before the update), two levels, a DTensor mesh or
a dense bucket, each bucket has its own collectives and one scalar all-reduce of
``[|g|^2, non-finite count]`` decides clipping and the skip.

Bytes per rank and sparse step: ``K * (b_g + b_p + o) + W * (b_g + 4)`` (``o`` the mask's
bytes an offset, :func:`scape.wire.mask_bytes`: 1.07 at sparsity 0.99 and ``B = 4096``; ``+ 8``,
the all-reduce, instead of ``W * (b_g + 4)``
where the scalars do not ride), with ``K = W * (S / B) * k_b``,
``k_b = max(1, round(density * B))``; :mod:`scape.wire` for the 8-bit wires.

A sparse group's ``sparsity`` may change between steps, like its ``lr`` (a sparsity warm-up,
:func:`scape.sparsity_ramp`): the mask of step t+1 is made at the end of step t from the
group's value then, so a value set before ``opt.step()`` number t shapes the masks from step
t+1 on. A mask carries its own ``k_b``; checkpoints restore the saved value as they restore
``lr``. A group built dense (``sparsity=0``) stays dense and a sparse one stays sparse: their
buckets are laid out differently.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from scape import config, embeddings, rules
from scape.agreement import agree, digest
from scape.buffers import DENSE_ALIGN, Bucket
from scape.checkpoint import load_sharded_state, sharded_state
from scape.comm import Communicator, HierarchicalCommunicator
from scape.comm.base import FinishedWork
from scape.dcp import is_torch_state_dict, load_torch_state_dict, torch_state_dict
from scape.kernels import (
    adams_dense_,
    blockwise_topk,
    gather,
    pack_mask,
    scatter_,
    take_,
    take_pack8_,
    unpack_mask,
)
from scape.masks import MaskState, fit_mask, on_device
from scape.optim_hooks import load_state_dict_hooks, state_dict_hooks
from scape.profiling import phase
from scape.rules import ShardState, block_budget
from scape.rules.builtin import BUILTIN_RULES
from scape.schedules import ramp_start, sparsity_ramp, start_ramp_steps
from scape.sharded import ShardedOptimizer, _Pending, positional_error
from scape.two_level import NodeLevel
from scape.wire import PARAM_BITS, ParamWire, Wire8, as_dtype, gather_parts

PARAM_WIRES = (None, *PARAM_BITS)
"""The ``param_comm_dtype`` values :class:`SCAPE` takes (:mod:`scape.wire`)."""

DIAG_FULL_EVERY = 10
"""Diagnostics that read the whole shard (``updated_last_100``) refresh this often; the
O(K) ones (``mask_overlap``, ``residual_norm``) every step."""


class SCAPE(ShardedOptimizer):
    """Sharded AdamS whose gradient and parameter traffic is sparsified by masks.

    Args:
        params: parameters or param groups (groups may set ``lr``, ``betas``, ``eps``,
            ``weight_decay`` and ``sparsity``; a group with ``sparsity=0`` is always dense).
        lr: learning rate (any torch LR scheduler may change it per group).
        betas: ``(beta1, beta2)`` of AdamS.
        eps: added to the AdamS denominator.
        weight_decay: decoupled weight decay (applied lazily to a coordinate when it is sent,
            so its total matches dense AdamW).
        sparsity: fraction of coordinates *not* sent per step, in [0, 1); 0.99 sends 1 in 100,
            about 1/80 of a dense step's bytes (README, "Cost").
        update: how a sent coordinate is updated and how masks are chosen (:mod:`scape.rules`):
            ``"agree"`` (the default; 16 B of state per shard coordinate), ``"sqrt"`` (no
            extra state), ``"lazy"`` (the paper's baseline), or a name added with
            :func:`scape.rules.register`.
        block_size: coordinates per mask block (power of two in [256, 32768]).
        total_steps: the run's length, to size the start: after ``warmup_steps`` dense steps
            the sparsity ramps from 10x the group's density (at most 0.5) to its own for as
            long as keeps a 0.99 run in 1/50 of dense's bytes (:mod:`scape.schedules`).
        warmup_steps: dense steps at the start (they build the statistics the masks read).
        dense_every: every n-th step is dense, sending all the residuals hold (0: never).
        max_grad_norm: clip the synchronized gradient to this norm (None: no clipping).
        grad_comm_dtype: dtype of gradients on the wire (float32, bfloat16, float16: half the
            bytes, and a step with an entry past 32752/W is skipped; ``torch.int8``: 8-bit
            codes, a scale per mask row); a sparse step keeps what they round off in the residual.
        param_comm_dtype: None (new values in the model's dtype), ``torch.float16``,
            ``torch.int8``, ``int6``, ``int4``: 16-, 8-, 6-, 4-bit updates (:mod:`scape.wire`).
        comm: the data-parallel group: a ProcessGroup, a 1-D DeviceMesh or a
            :class:`scape.comm.Communicator` (default: the default process group).
    """

    name = "SCAPE"
    _wire_dtypes = (torch.float32, torch.bfloat16, torch.float16, torch.int8)
    _step_supports_amp_scaling = True  # GradScaler hands its scale to step(), which refuses it

    def __init__(self, params: Any, *args: Any, lr: float | None = None,
                 betas: tuple[float, float] = (0.9, 0.95),
                 eps: float = 1e-8, weight_decay: float = 0.0, sparsity: float = 0.99,
                 update: str = "agree", block_size: int = 4096,
                 total_steps: int | None = None, warmup_steps: int = 1,
                 dense_every: int = 0, max_grad_norm: float | None = None,
                 grad_comm_dtype: torch.dtype = torch.float32,
                 param_comm_dtype: torch.dtype | None = None,
                 comm: Communicator | None = None) -> None:
        self._call_error = positional_error(self.name, args, lr)
        self.param_comm_dtype = param_comm_dtype
        self._two_level = isinstance(comm, HierarchicalCommunicator) or (  # or a 2-D mesh
            type(comm).__name__ == "DeviceMesh" and getattr(comm, "ndim", 1) == 2)
        self.warmup_steps = warmup_steps
        self.dense_every = dense_every
        self.total_steps = total_steps
        self._ramp_steps = 0  # the ramp_steps setter's, for every group
        self._ramp_sized: dict[int, int] = {}  # per group, sized at the first mask (after attach)
        self._ramp_fixed = False  # set by the ramp_steps setter: kept through a new layout
        self.update = update
        self.rule = rules.RULES.get(update) if isinstance(update, str) else None
        """The rule in force (:mod:`scape.rules`); it may be swapped for another with the same
        ``extra`` state between steps."""
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                        sparsity=sparsity)
        rule = self.rule  # every rank sends the same fields, also a rank whose name is unknown
        fields = dict(warmup_steps=warmup_steps, dense_every=dense_every, update=update,
                      total_steps=total_steps, param_comm_dtype=str(param_comm_dtype),
                      rule=None if rule is None else (rule.extra, rule.explore,
                                                      rule.error_feedback, rule.score_reads_hp))
        super().__init__(params, defaults, comm=comm, block_size=block_size,
                         max_grad_norm=max_grad_norm, grad_comm_dtype=grad_comm_dtype,
                         global_fields=fields)

    def _build_layout(self, apart: frozenset[int]) -> None:
        super()._build_layout(apart)
        self._ramp_sized = {}  # the budgets changed: sized again at the first mask
        self._share = [embeddings.share_of_blocks(self.buckets, gi)
                       for gi in range(len(self.param_groups))]
        """Per group, its embedding matrices' share of its blocks (0.0: none set apart)."""
        self.masks: list[MaskState | None] = []
        for b in self.buckets:
            n_local = b.shard_size // self.block_size
            sparse = self.param_groups[b.group]["sparsity"] > 0
            self.masks.append(MaskState(*self.mask_budget(b), n_local * b.world, n_local)
                              if sparse else None)
        self.diagnostics: list[dict[str, torch.Tensor]] = [{} for _ in self.buckets]
        self._take_bufs: list[torch.Tensor | None] = [None] * len(self.buckets)
        if isinstance(self.comm, HierarchicalCommunicator):  # two levels: scape.two_level
            self.level = NodeLevel(self.comm, self.buckets, [m is not None for m in self.masks])

    def attach(self, model: torch.nn.Module) -> Any:
        """:meth:`ShardedOptimizer.attach`; with a rule that sets the embeddings apart (the
        default, ``update="agree"``), before the first step, it first gives ``model``'s
        embedding matrices a bucket of their own in each sparse group and a larger share of
        the group's bytes (:mod:`scape.embeddings`). Collective then: every rank attaches the
        same model."""
        rule = self.rule
        if rule is not None and rule.embeddings_apart and self._step == 0 \
                and not any(b.apart for b in self.buckets):
            sparse = [g["sparsity"] > 0 for g in self.param_groups]
            apart = embeddings.to_set_apart(model, self._trainable, sparse)
            at = [i for i, p in enumerate(p for ps in self._trainable for p in ps)
                  if id(p) in apart]
            agree(self.comm, {"embedding_params": digest(at)}, None, what=f"{self.name}.attach")
            if apart:
                self._build_layout(apart)
        return super().attach(model)

    @property
    def explore(self) -> float:
        """Fraction of each block's budget the masks take by age (the rule's)."""
        assert self.rule is not None
        return self.rule.explore

    @property
    def error_feedback(self) -> bool:
        """Whether unsent gradient stays in the buffers for later steps (the rule's)."""
        assert self.rule is not None
        return self.rule.error_feedback

    def _validate_args(self, defaults: dict, block_size: int, max_grad_norm: Any,
                       grad_comm_dtype: Any, global_fields: dict) -> None:
        super()._validate_args(defaults, block_size, max_grad_norm, grad_comm_dtype,
                               global_fields)
        config.check_sparsity(defaults["sparsity"])
        config.check_int("dense_every", global_fields["dense_every"], 0)
        rules.get(global_fields["update"])  # ValueError naming the known rules
        config.check_int("warmup_steps", global_fields["warmup_steps"], 0)
        if global_fields["total_steps"] is not None:
            config.check_int("total_steps", global_fields["total_steps"], 1)
        if grad_comm_dtype == torch.int8 and self._two_level:
            raise ValueError("grad_comm_dtype=torch.int8 is one level only: with a "
                             "HierarchicalCommunicator use float32, bfloat16 or float16")
        if self.param_comm_dtype not in PARAM_WIRES:
            raise ValueError(f"Invalid param_comm_dtype: {self.param_comm_dtype!r} (expected "
                             "None, the model's values, or torch.float16, torch.int8, "
                             "torch.int6 or torch.int4: 16-, 8-, 6- or 4-bit updates)")
        if self.param_comm_dtype is not None and self._two_level:
            raise ValueError(f"param_comm_dtype={self.param_comm_dtype} is one level only: with a "
                             "HierarchicalCommunicator leave it None")

    def _validate_group(self, group: dict, index: int) -> None:
        super()._validate_group(group, index)
        config.check_sparsity(group["sparsity"])
        if group["sparsity"] > 0 and self.warmup_steps < 1:
            raise ValueError(f"Invalid warmup_steps: {self.warmup_steps} (expected >= 1 when "
                             "sparsity > 0: dense warm-up steps build the first moment that "
                             "the first mask is taken from)")

    def step(self, closure: Any = None) -> float | None:  # type: ignore[override]
        """One optimizer step (module docstring). A sparse group's ``sparsity`` may have
        changed since the last step; it is checked first, before anything changes."""
        if getattr(self, "found_inf", None) is not None:  # set by torch.amp.GradScaler.step
            raise ValueError(
                "SCAPE does not support torch.amp.GradScaler: its gradient buffers also hold "
                "the error-feedback residual, which the scaler's unscale_ would divide again "
                "at every step. Train in bfloat16 (torch.autocast(device_type, "
                "dtype=torch.bfloat16) needs no scaler), or use fp32")
        for b, m in zip(self.buckets, self.masks):
            if m is None:
                continue
            sp = self.param_groups[b.group]["sparsity"]
            config.check_sparsity(sp)
            if sp == 0:
                raise ValueError(f"Invalid sparsity for param group {b.group}: 0 (a group "
                                 "built sparse stays sparse: build it with sparsity=0 to "
                                 "keep it dense)")
        return super().step(closure)

    # ------------------------------------------------------------------ shard state
    def _bucket_align(self, group: dict) -> int:
        return self.block_size if group["sparsity"] > 0 else DENSE_ALIGN

    def _init_shard(self, bucket: Bucket) -> ShardState:
        master = bucket.param_flat[bucket.shard].to(torch.float32).clone()
        rule = rules.get(self.update)
        return ShardState(master=master, m=torch.zeros_like(master),
                          age=torch.zeros(bucket.shard_size, dtype=torch.int32,
                                          device=bucket.device),
                          extra={k: torch.zeros_like(master) for k in rule.extra})

    def state_tensors(self, shard: ShardState) -> dict[str, torch.Tensor]:
        """``exp_avg`` (AdamS's only moment), the fp32 ``master`` weights, ``age`` (steps since
        each coordinate was last sent) and the rule's statistics by their names."""
        return {"exp_avg": shard.m, "master": shard.master, "age": shard.age, **shard.extra}

    @property
    def optional_state_names(self) -> tuple[str, ...]:
        """The rule's per-coordinate statistics: a state dict that lacks them (saved with
        another rule) loads, and they start at zero."""
        return tuple(rules.get(self.update).extra)

    def _observe(self, i: int) -> None:
        """Give the rule the owner's slice of its own buffer (before the take); where this
        step and the next are sparse and the rule can, it makes the next mask here too."""
        rule, mask = self.rule, self.masks[i]
        assert rule is not None
        if rule.observe is None or mask is None:
            return
        b = self.buckets[i]
        own = self.level.own(i, b)
        if rule.observe_select is None or mask.local is None or self._is_dense(i) or \
                self.is_dense_step(self._step + 1):
            rule.observe(self.shards[i], own, self.error_feedback)
            return
        self._set_budget(b, mask)
        with phase("scape/mask", b.device):
            mask.made = rule.observe_select(self.shards[i], own, self.error_feedback,
                                            self._hp(b), mask.local, mask.k, mask.k_explore,
                                            self.block_size)

    def _after_skip(self) -> None:
        """The residuals were cleared: let the rule forget what it kept of the buffer."""
        self.level.clear()
        self._undo_ahead()
        for b, diag in zip(self.buckets, self.diagnostics):
            diag["residual_norm"] = torch.zeros((), device=b.device)
        if self.rule is not None and self.rule.reset is not None:
            for s in self.shards:
                self.rule.reset(s)

    def mask_budget(self, b: Bucket, sparsity: float | None = None) -> tuple[int, int]:
        """A mask's ``k`` and ``k_explore`` from its group's sparsity (now, or ``sparsity``):
        the embeddings' or the rest's share of it where they have buckets of their own."""
        sp = self.param_groups[b.group]["sparsity"] if sparsity is None else sparsity
        k, kx = block_budget(sp, self.block_size, self.explore)
        if self._share[b.group]:
            k = embeddings.split_budget(k, self.block_size, self._share[b.group])[not b.apart]
            kx = rules.round_half_up(self.explore * k)
        return k, kx

    @property
    def ramp_steps(self) -> int:
        """The start's sparsity ramp in steps after the dense warm-up, the longest of the
        groups' (:meth:`ramp_steps_of`), so read it after :meth:`attach`; setting it gives
        every group that length (0: none; a :class:`scape.SparsityRamp` sets 0)."""
        return max((self.ramp_steps_of(g) for g in range(len(self.param_groups))), default=0)

    @ramp_steps.setter
    def ramp_steps(self, steps: int) -> None:
        config.check_int("ramp_steps", steps, 0)
        self._ramp_steps, self._ramp_fixed = int(steps), True

    def ramp_steps_of(self, group: int) -> int:
        """Param group ``group``'s start ramp in steps after the dense warm-up: from
        :func:`scape.schedules.ramp_start` of its sparsity, sized from ``total_steps`` as a
        0.99 run from that start within 1/50 of dense's bytes
        (:func:`scape.schedules.start_ramp_steps`: 0.99 from 0.9 over 363 of 2,000 steps on
        the bundled model, 0.9 from 0.5 over 89); 0 for a dense group or one at or below 0.5;
        the setter's length where :attr:`ramp_steps` was set. Sized once, at the first read
        (the first mask), from the group's sparsity then, as a schedule's later values do not
        resize it."""
        if self._ramp_fixed:
            return self._ramp_steps
        if group not in self._ramp_sized:
            end = float(self.param_groups[group]["sparsity"])
            s0 = ramp_start(end)
            self._ramp_sized[group] = 0 if s0 >= end else \
                start_ramp_steps(self, self.total_steps, s0)
        return self._ramp_sized[group]

    def sparsity_at(self, group: int, t: int) -> float:
        """The sparsity of the mask made at step ``t`` for param group ``group``: the group's
        own, or on the start's ramp (:func:`scape.sparsity_ramp` at ``t - warmup_steps``)."""
        end = float(self.param_groups[group]["sparsity"])
        steps = self.ramp_steps_of(group)
        if end == 0.0 or steps == 0:
            return end
        return sparsity_ramp(t - self.warmup_steps, start=ramp_start(end), end=end,
                             ramp_steps=steps)

    def _set_budget(self, b: Bucket, mask: MaskState) -> None:
        mask.k, mask.k_explore = self.mask_budget(b, self.sparsity_at(b.group, self._step))

    def _undo_ahead(self) -> None:
        for s, m in zip(self.shards, self.masks):
            if m is not None and m.made is not None:  # ages advanced before the take: back
                assert m.local is not None  # (unless the update already took them)
                rules.unadvance_ages(s, m.local, self.block_size)
                m.made = None

    def is_dense_step(self, t: int) -> bool:
        """Whether step ``t`` (from 1) is dense by the schedule: the warm-up, and every
        ``dense_every``-th step."""
        return t <= self.warmup_steps or (self.dense_every > 0 and t % self.dense_every == 0)

    def _is_dense(self, i: int) -> bool:
        mask = self.masks[i]
        return mask is None or self.is_dense_step(self._step) or mask.next is None

    def _step_mask(self, i: int, dense: bool) -> torch.Tensor | None:
        mask = self.masks[i]
        return None if dense or mask is None else mask.next

    def _sync_size(self, i: int, dense: bool) -> int:
        mask = self.masks[i]
        if dense or mask is None:
            return self.buckets[i].n_pad
        assert mask.current is not None  # the mask this step used (set by _sparse_update)
        return mask.current.numel()

    # ------------------------------------------------------------------ dense path
    def _dense_update(self, i: int, g: torch.Tensor, hp: dict, model_out: torch.Tensor) -> None:
        s = self.shards[i]
        adams_dense_(s.master, s.m, g, lr=hp["lr"], beta1=hp["beta1"], beta2=hp["beta2"],
                     eps=hp["eps"], weight_decay=hp["weight_decay"], model_out=model_out)
        s.age.zero_()
        self.diagnostics[i]["residual_norm"] = torch.zeros((), device=g.device)  # all sent

    # ------------------------------------------------------------------ sparse path
    def _take(self, i: int) -> tuple[Communicator, torch.Tensor, int]:
        """Bucket ``i``'s take on the fp32/bf16/fp16 wire: ``(comm, c, n_g)``, the compact
        values ``c`` (owner-major, the wire's dtype) and the entries each owner receives."""
        b, mask_state = self.buckets[i], self.masks[i]
        assert mask_state is not None  # _is_dense routes mask-less buckets to the dense path
        with phase("scape/mask_sync", b.device):
            mask = mask_state.wait()
        assert mask is not None
        comm, src, mask, take_dtype = self.level.sparse_source(i, b, mask, mask_state.n_local,
                                                              self.grad_comm_dtype)
        # a narrower wire (bfloat16, float16) leaves each value's rounding error in the
        # residual, as the 8-bit wire does its coding error (DESIGN §1 step 2)
        keep = self.error_feedback and take_dtype != src.dtype
        with phase("scape/take", b.device):
            c = take_(src, mask, self.block_size, out_dtype=take_dtype, keep_error=keep)
            diag = self.diagnostics[i]
            taken = c.float().square().sum() \
                if self.error_feedback or self.max_grad_norm is not None else None
            if keep:  # (error feedback on: taken is set)
                diag["residual_norm"] = self._kept_residual_norm(i, src, mask, c.float())
            elif taken is not None and self.error_feedback:
                diag["residual_norm"] = (self._pre_sumsq[i] - taken).clamp(min=0).sqrt()
            else:
                src.zero_()
                diag["residual_norm"] = torch.zeros((), device=b.device)
            c, taken = self.level.to_wire(c, taken, self.grad_comm_dtype)
            self._sent_sumsq[i] = taken  # for the clipping norm (scape.grad_watch.clip_norm)
        return comm, c, mask_state.n_local * mask.shape[1]

    def _take8(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int, int]:
        """Bucket ``i``'s take on the 8-bit wire: ``(codes, scales, n_local, k)``."""
        b, mask_state = self.buckets[i], self.masks[i]
        assert mask_state is not None
        with phase("scape/mask_sync", b.device):
            mask = mask_state.wait()
        assert mask is not None
        src = b.grad_flat
        with phase("scape/take", b.device):
            codes, scales = take_pack8_(src, mask, self.block_size)
            diag = self.diagnostics[i]
            taken = None
            if self.error_feedback or self.max_grad_norm is not None:
                sent = Wire8.decoded(codes, scales, mask.shape[1])
                taken = sent.square().sum()
            if taken is not None and self.error_feedback:
                diag["residual_norm"] = self._kept_residual_norm(i, src, mask, sent)
            else:
                src.zero_()
                diag["residual_norm"] = torch.zeros((), device=b.device)
            self._sent_sumsq[i] = taken
        return codes, scales, mask_state.n_local, mask.shape[1]

    def _kept_residual_norm(self, i: int, src: torch.Tensor, mask: torch.Tensor,
                            sent: torch.Tensor) -> torch.Tensor:
        """Bucket ``i``'s residual norm after a take that left each entry's rounding or coding
        error in ``src``: the buffer's sum of squares before it, less the taken entries'
        (``sent`` + what is left), plus what is left."""
        left = gather(src, mask, self.block_size)
        return (self._pre_sumsq[i] - (sent + left).square().sum()
                + left.square().sum()).clamp(min=0).sqrt()

    def _sparse_launch(self, i: int) -> tuple[torch.Tensor, Any]:
        b = self.buckets[i]
        if self.grad_comm_dtype == torch.int8:  # codes and row scales in one all-to-all,
            codes, scales, n_local, k = self._take8(i)  # decoded by the owner when waited
            wire = Wire8(b.world, [(n_local, k)], b.device)
            send = wire.pack([(codes, scales)])
            self._take_bufs[i] = send
            with phase("scape/reduce_scatter", b.device):
                (g,), _, work8 = wire.exchange(self.comm, send)
            return g, work8
        comm, c, n_g = self._take(i)
        self._take_bufs[i] = c
        g = torch.empty(n_g, dtype=self.grad_comm_dtype, device=b.device)
        with phase("scape/reduce_scatter", b.device):
            work = comm.reduce_scatter(g, c, op="avg")
        return g, work

    def _launch(self, dense_flags: list[bool]) -> list[tuple[torch.Tensor, Any]]:
        """Where the scalars ride, every bucket's gradient in ONE collective: each owner's
        segment holds every bucket's entries for it and the sender's non-finite count."""
        count = self._ride_count
        if count is None:
            return super()._launch(dense_flags)
        n, device, world = len(self.buckets), self.buckets[0].device, self.comm.world_size
        if self.grad_comm_dtype == torch.int8:
            taken = [self._take8(i) for i in range(n)]
            wire = Wire8(world, [(t[2], t[3]) for t in taken], device, count=True)
            send = wire.pack([(t[0], t[1]) for t in taken], count)
            self._take_bufs = [send] * n
            with phase("scape/reduce_scatter", device):
                gs, flag, work8 = wire.exchange(self.comm, send)
            self._ride_flag = flag
            return [(g, work8) for g in gs]
        cs = [self._take(i) for i in range(n)]
        sizes = [n_g for _, _, n_g in cs]
        send = torch.empty(world, sum(sizes) + 1, dtype=self.grad_comm_dtype, device=device)
        at = 0
        for (_, c, n_g) in cs:
            send[:, at:at + n_g].copy_(c.view(world, n_g))
            at += n_g
        send[:, at:].copy_(count.expand(world, 1))  # (its mean: > 0 where any rank's is)
        self._take_bufs = [send] * n
        got = torch.empty(at + 1, dtype=self.grad_comm_dtype, device=device)
        with phase("scape/reduce_scatter", device):
            work = self.comm.reduce_scatter(got, send.view(-1), op="avg")
        self._ride_flag = got[at:]
        out, at = [], 0
        for n_g in sizes:
            out.append((got[at:at + n_g], work))
            at += n_g
        return out

    def _sparse_values(self, i: int, g: torch.Tensor, hp: dict
                       ) -> tuple[torch.Tensor, Callable[[torch.Tensor], None],
                                  torch.Tensor | None]:
        """Bucket ``i``'s update: ``(part, apply, idx)``, what its owner puts on the
        all-gather (the new values in the model's dtype, or 8-bit updates), what writes every
        owner's part (``[W, bytes]``) into the model, and the next mask's own rows (None when
        the next step is dense)."""
        b, mask_state = self.buckets[i], self.masks[i]
        assert mask_state is not None and mask_state.next is not None
        mask = mask_state.next
        rows = mask[b.rank * mask_state.n_local:(b.rank + 1) * mask_state.n_local]
        values = torch.empty(rows.numel(), dtype=b.dtype, device=b.device)
        assert self.rule is not None
        with phase("scape/update", b.device):
            self.shards[i].saw_lr(hp["lr"])
            self.rule.update(self.shards[i], g, rows, self.block_size, hp, values)
        if self.shards[i].age_at_mask is not None:
            raise RuntimeError(f"rule {self.update!r}: its observe_select advanced the ages but "
                               "its update did not take shard.age_at_mask (see Rule)")
        self._take_bufs[i] = None
        mask_state.current = mask
        if self.param_comm_dtype is not None:  # 16-, 8-, 6- or 4-bit updates of the model
            wire = ParamWire(b.world, mask_state.n_local, mask.shape[1], self.block_size,
                             PARAM_BITS[self.param_comm_dtype])
            part = wire.code(self.shards[i].master, b.param_flat[b.shard], rows)

            def apply(segs: torch.Tensor) -> None:
                wire.apply(b.param_flat, mask, segs)
        else:
            part = values

            def apply(segs: torch.Tensor) -> None:
                scatter_(b.param_flat, mask, self.block_size, as_dtype(segs, b.dtype))
        idx = None if self.is_dense_step(self._step + 1) else self._next_mask(i)
        return part, apply, idx

    def _share_next(self, i: int, idx: torch.Tensor, work: Any, packed: torch.Tensor) -> None:
        """Bucket ``i``'s next mask: every owner's packed rows ``packed`` (``[W, bytes]``)
        arrive with ``work``, unpacked when the mask is waited."""
        b, mask_state = self.buckets[i], self.masks[i]
        assert mask_state is not None
        full = torch.empty(mask_state.n_blocks, mask_state.k, dtype=torch.int16, device=b.device)
        mask_state.work = FinishedWork(work, lambda: unpack_mask(
            packed.contiguous().view(-1), idx.shape[0], self.block_size, out=full))
        mask_state.next, mask_state.local = full, idx

    def _sparse_update(self, i: int, g: torch.Tensor, hp: dict) -> _Pending:
        """One bucket's update and its one all-gather: the values and the next mask."""
        b = self.buckets[i]
        mask = self.masks[i].next  # type: ignore[union-attr]
        part, apply, idx = self._sparse_values(i, g, hp)
        parts = [part] if idx is None else [part, pack_mask(idx, self.block_size)]
        with phase("scape/all_gather", b.device):
            work, views, send = gather_parts(self.comm, parts)
        if idx is not None:
            self._share_next(i, idx, work, views[1])
        return _Pending(b, work, lambda: apply(views[0]), (send, mask))  # type: ignore[arg-type]

    def _apply(self, gs: list[torch.Tensor], dense_flags: list[bool]) -> None:
        """Where the scalars ride, every bucket's values and next mask and this rank's sum of
        squares in ONE all-gather."""
        ride = self._ride_norm
        if ride is None:
            return super()._apply(gs, dense_flags)
        parts, done = [], []
        for i, (b, g) in enumerate(zip(self.buckets, gs)):
            mask = self.masks[i].next  # type: ignore[union-attr]
            part, apply, idx = self._sparse_values(i, g, self._hp(b))
            parts.append(part)
            if idx is not None:
                parts.append(pack_mask(idx, self.block_size))
            done.append((i, mask, apply, idx))
        sumsq = [s for s in self._ride_sumsq if s is not None]
        parts.append(torch.cat(sumsq).sum().reshape(1))
        device = self.buckets[0].device
        with phase("scape/all_gather", device):
            work, views, send = gather_parts(self.comm, parts)
        at = 0
        for i, mask, apply, idx in done:
            view = views[at]
            if idx is not None:
                self._share_next(i, idx, work, views[at + 1])
            at += 1 if idx is None else 2

            def finish(apply: Callable[[torch.Tensor], None] = apply,
                       view: torch.Tensor = view) -> None:
                apply(view)

            assert mask is not None  # (the mask the step used)
            self._pending.append(_Pending(self.buckets[i], work, finish, (send, mask)))
        norms = views[-1]
        self._pending[-1].always = lambda: ride[1].append(as_dtype(norms, torch.float32))

    def _after_update(self, dense_flags: list[bool]) -> None:
        """Make and launch the next masks of the buckets that were dense this step (a sparse
        one's rides with its parameter values, :meth:`_sparse_update`), when the next step is
        sparse."""
        if self.is_dense_step(self._step + 1):
            for m in self.masks:
                if m is not None:
                    m.next, m.local, m.work = None, None, None
            return
        for i, (b, mask_state) in enumerate(zip(self.buckets, self.masks)):
            if mask_state is None or not dense_flags[i]:
                continue
            idx = self._next_mask(i)
            with phase("scape/mask_sync", b.device):  # Elias-Fano rows on the wire
                work, views, _ = gather_parts(self.comm,
                                              [pack_mask(idx, self.block_size)])
            self._share_next(i, idx, work, views[0])

    def _rule_sorts(self) -> bool:
        """Whether the rule's own selection makes each mask row ascending, as the wire's code
        needs (:func:`scape.kernels.pack_mask`): the built-in rules' kernels do; another
        rule's ``select`` or ``observe_select`` is sorted after it."""
        return any(self.rule is r for r in BUILTIN_RULES.values())

    def _next_mask(self, i: int) -> torch.Tensor:
        """Bucket ``i``'s next mask rows of this rank's shard (``[n_local, k]``, int16), at
        the budget of the group's sparsity now (DESIGN §1, step 4)."""
        b, mask_state = self.buckets[i], self.masks[i]
        assert self.rule is not None and mask_state is not None
        s = self.shards[i]
        self._set_budget(b, mask_state)
        with phase("scape/mask", b.device):
            rules_own = mask_state.made is not None or self.rule.select is not None
            if mask_state.made is not None:  # made before the take (observe_select)
                idx, mask_state.made = mask_state.made, None
            elif self.rule.select is not None:  # score and selection fused
                idx = self.rule.select(s, self._hp(b), mask_state.k, mask_state.k_explore,
                                       self.block_size)
            else:
                if self.rule.score is None:
                    score = s.m
                elif self.rule.score_reads_hp:
                    score = self.rule.score(s, {**self._hp(b), "k": mask_state.k,
                                                "block_size": self.block_size})
                else:
                    score = self.rule.score(s)
                idx = blockwise_topk(score, mask_state.k, self.block_size,
                                     age=s.age if mask_state.k_explore else None,
                                     k_explore=mask_state.k_explore)
            if rules_own and not self._rule_sorts():  # the wire codes ascending rows
                idx = idx.sort(dim=1).values
            age_blocks = s.age.view(mask_state.n_local, self.block_size)
            diag = self.diagnostics[i]
            diag["mask_overlap"] = (age_blocks.gather(1, idx.long()) == 0).float().mean()
            if self._step % DIAG_FULL_EVERY == 0 or "updated_last_100" not in diag:
                # a pass over the whole shard: refreshed every DIAG_FULL_EVERY steps
                diag["updated_last_100"] = (s.age < 100).float().mean()
        return idx

    def _scalars_ride(self, dense_flags: list[bool]) -> bool:
        """A sparse step without clipping, one level, plain parameters: the non-finite count
        rides in the gradient collective and the norm with the parameter values
        (:mod:`scape.sharded`)."""
        return not any(dense_flags) and self.max_grad_norm is None and \
            self._shard_mesh is None and not isinstance(self.level, NodeLevel)

    # ------------------------------------------------------------------ state
    def counters(self) -> dict[str, Any]:
        return rules.lr_counters(self.shards, [b.group for b in self.buckets])

    def load_counters(self, counters: dict[str, Any], step: int) -> None:
        super().load_counters(counters, step)
        rules.load_lr_counters(self.shards, [b.group for b in self.buckets], counters)

    def _mask_tensors(self) -> list[dict[str, torch.Tensor | None]]:
        self.finish_param_sync()
        for m in self.masks:
            if m is not None:
                m.wait()
        return [{"mask_next": None if m is None or m.next is None else m.next.clone(),
                 "mask_current": None if m is None or m.current is None else m.current.clone()}
                for m in self.masks]

    @state_dict_hooks
    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """torch.optim's shape (``state`` by parameter, ``param_groups``), each tensor holding
        this rank's part (:mod:`scape.dcp`): what DCP's ``get_state_dict`` reads."""
        return torch_state_dict(self, self._mask_tensors())

    def rank_state_dict(self) -> dict[str, Any]:
        """This rank's shard as one record (what :func:`scape.save_checkpoint` writes):
        master weights, ``m``, ages, rule statistics, residual, masks, step, groups."""
        return sharded_state(self, self._mask_tensors())

    @load_state_dict_hooks
    def load_state_dict(self, state_dict: Any) -> None:  # type: ignore[override]
        """Load a :meth:`state_dict` (also as DCP filled it, on any world size), this rank's
        :meth:`rank_state_dict`, or a list of every old rank's (any world size).

        A :meth:`rank_state_dict` saved with another rule loads too: the per-coordinate
        statistics this rule keeps and the state lacks start at zero (as at construction),
        those it does not keep are dropped."""
        self.finish_param_sync()
        if is_torch_state_dict(state_dict):
            extras = load_torch_state_dict(self, state_dict)
        else:
            extras = load_sharded_state(self, state_dict)
        self.level.adopt(self.buckets)  # the loaded residual is in the buffers
        self._watch.reset()  # the residuals were written: taken as seen
        for b, m, extra in zip(self.buckets, self.masks, extras):
            if m is None:
                continue
            self._set_budget(b, m)
            m.work = None
            m.next = fit_mask(on_device(extra.get("mask_next"), b.device), m, self.block_size)
            m.current = fit_mask(on_device(extra.get("mask_current"), b.device), m, self.block_size)
            m.local = None if m.next is None else \
                m.next[self.comm.rank * m.n_local:(self.comm.rank + 1) * m.n_local]
