"""``scape.SCAPE``: sharded AdamS with first-moment masks synchronized one step late.

One sparse step t for one bucket (DESIGN §1; the mask ``M_t`` is already on every rank)::

    take        c = buf[M_t]; buf[M_t] = 0           (buf: gradient + residual, fp32)
    reduce-scatter (avg) c                           -> owner gets g (k_s values)
    one scalar all-reduce [|g|^2, non-finite count]  -> clip or skip, on every rank
    update      rule(shard, g, M_t[own rows])        -> new values at M_t (model dtype)
    all-gather  the new values (async)               -> scatter into every model
    mask        M_{t+1} = per-block top-|score| (+ oldest by age) of the own shard
                (score: the rule's; |m| in DESIGN §1, the fresh gain by default)
    all-gather  M_{t+1} (int16, async)               -> waited at step t+1's take

Bytes per rank and sparse step: ``K * (b_g + b_p + 2)`` plus the 8-byte scalar all-reduce,
with ``K = W * (S / B) * k_b``, ``k_b = max(1, round(density * B))``.

A sparse group's ``sparsity`` may change between steps, like its ``lr`` (a sparsity warm-up,
:func:`scape.sparsity_ramp`): the mask of step t+1 is made at the end of step t from the
group's value then, so a value set before ``opt.step()`` number t shapes the masks from step
t+1 on. A mask carries its own ``k_b``; checkpoints restore the saved value as they restore
``lr``. A group built dense (``sparsity=0``) stays dense and a sparse one stays sparse: their
buckets are laid out differently. Under the gain split (``split="gain"``; by default only
with the ``*_accum`` agreement rules and two or more sparse groups) the groups' values set one
budget, and each mask is made
at the group's share of it (:attr:`SCAPE.split_sparsity`), re-read from the measured gain
every ``split_every`` masks; every rank reads the same all-reduced gain.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from scape import config
from scape.allot import AgreementMeter, allot
from scape.buffers import DENSE_ALIGN, Bucket
from scape.checkpoint import load_sharded_state, sharded_state
from scape.comm import Communicator
from scape.drift import Drift
from scape.kernels import adams_dense_, blockwise_topk, scatter_, take_
from scape.profiling import phase
from scape.rules import GAIN_SCORES, NOISE_STATE, RULES, ShardState, mask_positions
from scape.sharded import ShardedOptimizer, _Pending

AUTO_RULE = "catchup_agree_trust2_gainr"
"""``update="auto"``: the masks by each coordinate's gain, read from the owner's fresh EMA and
its gradient summed over the wait, and the agreement catch-up at half the block RMS. On the
bundled workload, on 4 ranks with every group at one sparsity, it meets the 0.99 and the 0.9
quality goals (bench/README.md, hypotheses 19 and 20)."""

SPLIT_STATE = "split_mu"
"""The ``shard.extra`` key of the gain meter's EMA under ``split="gain"``."""

DIAG_FULL_EVERY = 10
"""Diagnostics that read the whole shard (``updated_last_100``) refresh this often; the
O(K) ones (``mask_overlap``, ``residual_norm``) every step."""


def round_half_up(x: float) -> int:
    """``round`` with halves going up (Python's ``round`` goes to even)."""
    return int(math.floor(x + 0.5))


def block_budget(sparsity: float, block_size: int, explore: float) -> tuple[int, int]:
    """``(k_b, k_x)``: coordinates per block, and how many of them are chosen by age."""
    k = max(1, round_half_up((1.0 - sparsity) * block_size))
    return k, round_half_up(explore * k)


class _MaskState:
    """Masks of one sparse bucket: the one used last and the next one (maybe in flight)."""

    def __init__(self, k: int, k_explore: int, n_blocks: int, n_local: int) -> None:
        self.k, self.k_explore = k, k_explore  # the budget of the next mask made
        self.n_blocks, self.n_local = n_blocks, n_local
        self.current: torch.Tensor | None = None  # mask of the last sparse step [n_blocks, k]
        self.next: torch.Tensor | None = None  # mask for the next sparse step [n_blocks, k]
        self.work: Any = None  # the all-gather filling `next`, if still in flight
        self.local: torch.Tensor | None = None  # this rank's rows of `next`

    def wait(self) -> torch.Tensor | None:
        if self.work is not None:
            self.work.wait()
            self.work = None
        return self.next


class SCAPE(ShardedOptimizer):
    """Sharded AdamS whose gradient and parameter traffic is sparsified by first-moment masks.

    Args:
        params: parameters or param groups (groups may set ``lr``, ``betas``, ``eps``,
            ``weight_decay`` and ``sparsity``; a group with ``sparsity=0`` is always dense).
        lr: learning rate (any torch LR scheduler may change it per group).
        betas: ``(beta1, beta2)`` of AdamS.
        eps: added to the AdamS denominator.
        weight_decay: decoupled weight decay (lazy on sparse steps, see :func:`rules.lazy`).
        sparsity: fraction of coordinates *not* synchronized per step, in [0, 1).
        block_size: coordinates per selection block (power of two in [256, 32768]).
        warmup_steps: dense steps before going sparse (they build the first moment).
        dense_every: every n-th step is dense and flushes all residuals (0: never).
        explore: fraction of each block's budget chosen by age instead of ``|m|``.
        error_feedback: keep what was not sent in the gradient buffer for later steps.
        update: the sparse-step rule, a key of :data:`scape.rules.RULES`, or ``"auto"``
            (default): ``"catchup_agree_trust2_gainr"`` (:data:`AUTO_RULE`; :attr:`update`
            holds the rule in force). Its masks take, per block, the coordinates whose
            sending is worth most now: the gradient signal the owner reads from its fresh EMA
            of its own gradient and from that gradient summed over the coordinate's wait,
            times the steps the catch-up would move them
            (:func:`scape.rules.gain_score_residual`). A sent coordinate moves the number of
            AdamS steps dense AdamS would have moved in the ``age+1`` steps it missed
            (``(age+1)`` times its expected sign agreement, from the owner's local noise
            estimate), capped at the larger of ``sqrt(age+1)`` and ``rms_b / (2 lr)`` (half
            its block's weight RMS). With every group at one sparsity it meets the 0.99 and
            0.9 quality goals on the bundled workload on 4 ranks (bench/README.md,
            hypotheses 19 and 20). It keeps 16 bytes of state per shard coordinate.
            ``"catchup_agree_trust4_gainr"`` (a quarter of the RMS) holds up better well
            above the tuned lr and ends a little higher at it; ``"catchup_agree_trust2_gain"``
            (the EMA alone) ends lowest at 0.99 and the tuned lr but falls behind at 0.9;
            ``"catchup_agree_trust2_accum"`` and ``"catchup_agree_trust4_accum"`` (the
            defaults before) take their masks by accumulated mass ``|m|*(age+1)``;
            ``"catchup_sqrt_accum"`` (no extra state, less local compute) moves
            ``sqrt(age+1)`` steps. ``"lazy"`` is DESIGN §1's baseline. A group's
            ``sparsity`` may change between steps (module docstring).
        split: how the sparse groups share their coordinates. ``"gain"``: the groups'
            ``sparsity`` values only set the budget (the coordinates per step of every group
            at its value), and the masks split it in proportion to each group's measured gain,
            the loss decrease one step of its coordinates is worth
            (:meth:`scape.allot.AgreementMeter.gain`; README, "The split"). It needs a
            noise-sized rule (the ``catchup_agree*`` and ``catchup_snr`` rules), keeps 4 more
            bytes per shard coordinate and adds one blocking all-reduce of 2 floats per sparse
            group every ``split_every`` sparse steps; one sparse group has nothing to share and
            keeps no meter. ``None``: each group sends its own ``sparsity``. ``"auto"``
            (default): ``"gain"`` where there are 2 or more sparse groups and the rule sizes
            its catch-up by the noise estimate but takes its masks by accumulated mass (the
            ``*_accum`` agreement rules, with which the split meets the goal at 98.47%
            overall), else ``None``: so ``None`` with the default rule, whose masks already
            follow the gain. :attr:`split` holds the split in force and
            :attr:`split_sparsity` the sparsity each group's last mask was made at.
        split_every: sparse steps between two readings of the gain (``split="gain"``).
        max_grad_norm: clip the synchronized gradient to this norm (None: no clipping).
        grad_comm_dtype: dtype of gradients on the wire (float32, bfloat16, float16).
        comm: a :class:`scape.comm.Communicator`; default: a ``TorchCommunicator`` on the
            default process group (single-rank when torch.distributed is not initialized).
    """

    _name = "SCAPE"

    def __init__(self, params: Any, *, lr: float, betas: tuple[float, float] = (0.9, 0.95),
                 eps: float = 1e-8, weight_decay: float = 0.0, sparsity: float = 0.99,
                 block_size: int = 4096, warmup_steps: int = 20, dense_every: int = 0,
                 explore: float = 0.1, error_feedback: bool = True,
                 update: str = "auto", split: str | None = "auto", split_every: int = 100,
                 max_grad_norm: float | None = None,
                 grad_comm_dtype: torch.dtype = torch.float32,
                 comm: Communicator | None = None) -> None:
        self.warmup_steps = warmup_steps
        self.dense_every = dense_every
        self.explore = explore
        self.error_feedback = error_feedback
        self.update, self.split_every = update, split_every
        self.split: str | None = None
        """The split in force (``"auto"`` resolved), set with :attr:`update` when the first
        shard is made, once every bucket is laid out (the resolution counts sparse groups)."""
        self._asked: tuple[str, str | None] | None = (update, split)  # None once resolved
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                        sparsity=sparsity)
        fields = dict(warmup_steps=warmup_steps, dense_every=dense_every, explore=explore,
                      error_feedback=error_feedback, update=update, split=split,
                      split_every=split_every)
        super().__init__(params, defaults, comm=comm, block_size=block_size,
                         max_grad_norm=max_grad_norm, grad_comm_dtype=grad_comm_dtype,
                         global_fields=fields)
        self.rule = RULES[self.update]
        self.masks: list[_MaskState | None] = []
        self.diagnostics: list[dict[str, torch.Tensor]] = []
        for b in self.buckets:
            sp = self.param_groups[b.group]["sparsity"]
            if sp > 0:
                k, kx = block_budget(sp, block_size, explore)
                n_local = b.shard_size // block_size
                self.masks.append(_MaskState(k, kx, n_local * b.world, n_local))
            else:
                self.masks.append(None)
            self.diagnostics.append({})
        self._take_bufs: list[torch.Tensor | None] = [None] * len(self.buckets)
        self.drifts: list[Drift | None] = [
            Drift(self.rule.drift, b.param_flat) if m is not None and self.rule.drift else None
            for b, m in zip(self.buckets, self.masks)]
        """Replicated drift state per sparse bucket when the rule drifts (scape.drift)."""
        self.lr_peak: dict[int, float] = {}
        """The largest lr each param group has had in a step (see :meth:`_hp`)."""
        self.meter: AgreementMeter | None = None
        self.split_gain: dict[int, float] = {}
        """The gain last read per sparse group (``split="gain"``; a new dict per reading)."""
        self._split_made = 0  # sparse masks made under split="gain"
        self.split_sparsity: dict[int, float] = {}
        """Sparsity each sparse group's last mask was made at (param group index -> value):
        the group's own ``sparsity``, or its share of the budget under ``split="gain"``."""
        self._mask_numels: dict[int, int] = {}
        """Coordinates each sparse group's masks cover, padding blocks included (fixed)."""
        for b, m in zip(self.buckets, self.masks):
            if m is not None:
                self._mask_numels[b.group] = self._mask_numels.get(b.group, 0) + \
                    m.n_blocks * self.block_size
        if self.split is not None and len(self._mask_numels) > 1:  # one group: no split
            self.meter = AgreementMeter(self)  # its EMA lives in the shards: checkpointed
            for s, mu in zip(self.shards, self.meter.mu):
                if mu is not None:
                    s.extra[SPLIT_STATE] = mu

    def _validate_args(self, defaults: dict, block_size: int, max_grad_norm: Any,
                       grad_comm_dtype: Any, global_fields: dict) -> None:
        super()._validate_args(defaults, block_size, max_grad_norm, grad_comm_dtype,
                               global_fields)
        config.check_sparsity(defaults["sparsity"])
        config.check_int("dense_every", global_fields["dense_every"], 0)
        config.check_fraction("explore", global_fields["explore"])
        if not isinstance(global_fields["error_feedback"], bool):
            raise TypeError("Invalid error_feedback: expected a bool, got "
                            f"{type(global_fields['error_feedback']).__name__}")
        if global_fields["update"] not in RULES and global_fields["update"] != "auto":
            raise ValueError(f"Invalid update rule: {global_fields['update']!r} (expected one "
                             f"of {sorted(RULES)})")
        warm = global_fields["warmup_steps"]
        config.check_int("warmup_steps", warm, 0)
        if global_fields["split"] not in (None, "auto", "gain"):
            raise ValueError(f"Invalid split: {global_fields['split']!r} (expected None, "
                             "'auto' or 'gain')")
        config.check_int("split_every", global_fields["split_every"], 1)
        if global_fields["split"] == "gain" and not _measures_noise(global_fields["update"]):
            raise ValueError(f"split={global_fields['split']!r} needs a rule that keeps the "
                             "local noise estimate (the catchup_agree* and catchup_snr rules), "
                             f"got update={global_fields['update']!r}")

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
        if self._asked is not None:  # the first shard: every bucket is laid out
            sparse = {b.group for b in self.buckets if self.param_groups[b.group]["sparsity"] > 0}
            self.update, self.split = resolve(*self._asked, n_sparse_groups=len(sparse))
            self._asked = None
        master = bucket.param_flat[bucket.shard].to(torch.float32).clone()
        rule = RULES[self.update]
        return ShardState(master=master, m=torch.zeros_like(master),
                          age=torch.zeros(bucket.shard_size, dtype=torch.int32,
                                          device=bucket.device),
                          extra={k: torch.zeros_like(master) for k in rule.extra})

    def _observe(self, i: int) -> None:
        """Give the rule (and the split's meter) the owner's slice of its own buffer (before
        the take; the meter first: it reads the rule's ``prev`` before the rule moves it)."""
        if self.meter is not None and i == 0:
            self.meter.observe()
        if self.rule.observe is not None and self.masks[i] is not None:
            b = self.buckets[i]
            self.rule.observe(self.shards[i], b.grad_flat[b.shard], self.error_feedback)

    def _after_skip(self) -> None:
        """The residuals were cleared: let the rule forget what it kept of the buffer."""
        if self.rule.reset is not None:
            for s in self.shards:
                self.rule.reset(s)

    def _schedule_dense(self, t: int) -> bool:
        return t <= self.warmup_steps or (self.dense_every > 0 and t % self.dense_every == 0)

    def _is_dense(self, i: int) -> bool:
        mask = self.masks[i]
        return mask is None or self._schedule_dense(self._step) or mask.next is None

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

    def _dense_finish(self, i: int, hp: dict) -> Any:
        drift, b = self.drifts[i], self.buckets[i]
        if drift is None:
            return None
        lr = hp["lr"]
        return lambda: drift.sync_dense(b.param_flat, lr)

    # ------------------------------------------------------------------ sparse path
    def _sparse_launch(self, i: int) -> tuple[torch.Tensor, Any]:
        b, mask_state = self.buckets[i], self.masks[i]
        assert mask_state is not None  # _is_dense routes mask-less buckets to the dense path
        with phase("scape/mask_sync", b.device):
            mask = mask_state.wait()
        assert mask is not None
        with phase("scape/take", b.device):
            c = take_(b.grad_flat, mask, self.block_size, out_dtype=self.grad_comm_dtype)
            diag = self.diagnostics[i]
            if self.error_feedback:
                taken = c.float().square().sum()
                diag["residual_norm"] = (self._pre_sumsq[i] - taken).clamp(min=0).sqrt()
            else:
                b.grad_flat.zero_()
                diag["residual_norm"] = torch.zeros((), device=b.device)
        self._take_bufs[i] = c
        g = torch.empty(mask_state.n_local * mask.shape[1], dtype=self.grad_comm_dtype,
                        device=b.device)
        with phase("scape/reduce_scatter", b.device):
            work = self.comm.reduce_scatter(g, c, op="avg")
        return g, work

    def _sparse_update(self, i: int, g: torch.Tensor, hp: dict) -> _Pending:
        b, mask_state = self.buckets[i], self.masks[i]
        assert mask_state is not None and mask_state.next is not None
        mask = mask_state.next
        rows = mask[b.rank * mask_state.n_local:(b.rank + 1) * mask_state.n_local]
        values = torch.empty(rows.numel(), dtype=b.dtype, device=b.device)
        drift = self.drifts[i]
        with phase("scape/update", b.device):
            shard = self.shards[i]
            if drift is not None and drift.spec.commit:  # keep the drift: step from there
                local = mask_positions(rows, self.block_size)
                shard.master[local] += drift.offset(local + b.shard_start, hp["lr"])
            self.rule.update(shard, g, rows, self.block_size, hp, values)
        gathered = torch.empty(mask.numel(), dtype=b.dtype, device=b.device)
        with phase("scape/all_gather", b.device):
            work = self.comm.all_gather(gathered, values)
        self._take_bufs[i] = None
        mask_state.current = mask

        lr = hp["lr"]

        def finish() -> None:
            if drift is None:
                scatter_(b.param_flat, mask, self.block_size, gathered)
                return
            drift.sync_sparse(mask_positions(mask, self.block_size), gathered, lr)
            drift.apply(b.param_flat, lr)

        return _Pending(b, work, finish, (values, gathered, mask))

    def _after_update(self, dense_flags: list[bool]) -> None:
        """Make and launch the next masks (only when the next step is sparse)."""
        if self._schedule_dense(self._step + 1):
            for m in self.masks:
                if m is not None:
                    m.next, m.local, m.work = None, None, None
            return
        with phase("scape/mask", self.buckets[0].device):  # the split is the masks' budget
            self.split_sparsity = self._next_split()
        for i, (b, mask_state) in enumerate(zip(self.buckets, self.masks)):
            if mask_state is None:
                continue
            s = self.shards[i]
            mask_state.k, mask_state.k_explore = block_budget(
                self.split_sparsity[b.group], self.block_size, self.explore)
            with phase("scape/mask", b.device):
                if self.rule.score is None:
                    score = s.m
                elif self.rule.score_reads_hp:
                    score = self.rule.score(s, self._hp(b))
                else:
                    score = self.rule.score(s)
                idx = blockwise_topk(score, mask_state.k, self.block_size,
                                     age=s.age if mask_state.k_explore else None,
                                     k_explore=mask_state.k_explore)
                age_blocks = s.age.view(mask_state.n_local, self.block_size)
                diag = self.diagnostics[i]
                diag["mask_overlap"] = (age_blocks.gather(1, idx.long()) == 0).float().mean()
                if self._step % DIAG_FULL_EVERY == 0 or "updated_last_100" not in diag:
                    # a pass over the whole shard: refreshed every DIAG_FULL_EVERY steps
                    diag["updated_last_100"] = (s.age < 100).float().mean()
            full = torch.empty(mask_state.n_blocks, mask_state.k, dtype=torch.int16,
                               device=b.device)
            with phase("scape/mask_sync", b.device):
                mask_state.work = self.comm.all_gather(full.view(-1), idx.view(-1))
            mask_state.next, mask_state.local = full, idx

    def _next_split(self) -> dict[int, float]:
        """The sparsity of each sparse group's next mask (``split`` in the class docstring).

        Under ``split="gain"`` the budget is read from the groups' ``sparsity`` at every mask
        (a schedule may move it) and split by the gain last read, which is read again every
        ``split_every`` masks (the first time at the first sparse mask, from the warm-up's
        gradients). Every rank reads the same all-reduced gain: the masks stay consistent. The
        budget counts the coordinates the masks cover, padding blocks included (a mask picks
        ``k_b`` in every block, padding or not), so the bytes per step stay those of every group
        at its own sparsity up to each block's rounding, whatever the padding."""
        own = {b.group: float(self.param_groups[b.group]["sparsity"])
               for b, m in zip(self.buckets, self.masks) if m is not None}
        if self.meter is None:
            return own
        if self._split_made % self.split_every == 0 or not self.split_gain:
            self.split_gain = self.meter.gain()
        self._split_made += 1
        numels = self._mask_numels
        total = sum(numels.values())
        density = sum(numels[g] * (1.0 - own[g]) for g in numels) / total
        if density < 1.0 / self.block_size:  # under one coordinate per block: nothing to split
            return own
        return allot(self.split_gain, numels, 1.0 - density, self.block_size, power=1.0,
                     max_density=max(0.5, density))

    def _hp(self, bucket: Bucket) -> dict:
        """The group's hyperparameters, with ``lr_peak``: the largest lr it has had (read by
        ``catchup_agree_trustlr``; kept per group and checkpointed)."""
        hp = super()._hp(bucket)
        peak = max(self.lr_peak.get(bucket.group, 0.0), hp["lr"])
        self.lr_peak[bucket.group] = hp["lr_peak"] = peak
        return hp

    def _counters(self) -> dict[str, Any]:
        out: dict[str, Any] = {"lr_peak": dict(self.lr_peak)}
        if self.meter is not None:
            out.update(split_made=self._split_made, split_weight=self.meter.weight,
                       split_gain=dict(self.split_gain))
        return out

    def _load_counters(self, counters: dict[str, Any]) -> None:
        self.lr_peak = {int(g): float(v) for g, v in counters.get("lr_peak", {}).items()}
        if self.meter is None:
            return
        self._split_made = int(counters.get("split_made", 0))
        self.meter.weight = float(counters.get("split_weight", 0.0))
        self.split_gain = {int(g): float(v) for g, v in counters.get("split_gain", {}).items()}

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """This rank's shard: master weights, ``m``, ages, residual, masks, step, groups."""
        self.finish_param_sync()
        for m in self.masks:
            if m is not None:
                m.wait()
        return sharded_state(self, extra_per_bucket=[
            {"mask_next": None if m is None or m.next is None else m.next.clone(),
             "mask_current": None if m is None or m.current is None else m.current.clone(),
             **({} if d is None else d.state())}
            for m, d in zip(self.masks, self.drifts)])

    def load_state_dict(self, state_dict: Any) -> None:  # type: ignore[override]
        """Load this rank's ``state_dict()``, or a list of every old rank's (any world size).

        A state saved with another rule loads too: the per-coordinate statistics this rule
        keeps and the state lacks start at zero (as at construction), those it does not keep
        are dropped. (:func:`scape.io.load_checkpoint` refuses such files instead.)"""
        self.finish_param_sync()
        extras = load_sharded_state(self, self._fit_split_state(state_dict))
        for b, d, extra in zip(self.buckets, self.drifts, extras):
            if d is not None:
                if "drift_anchor" not in extra:
                    raise ValueError(f"state dict has no drift state; update={self.update!r} "
                                     "drifts (saved with another update rule?)")
                d.load(extra, b.numel, b.param_flat)
        for b, m, extra in zip(self.buckets, self.masks, extras):
            if m is None:
                continue
            m.k, m.k_explore = block_budget(self.param_groups[b.group]["sparsity"],
                                            self.block_size, self.explore)
            m.work = None
            m.next = _fit_mask(extra.get("mask_next"), m, self.block_size)
            m.current = _fit_mask(extra.get("mask_current"), m, self.block_size)
            m.local = None if m.next is None else \
                m.next[self.comm.rank * m.n_local:(self.comm.rank + 1) * m.n_local]

    def _fit_split_state(self, state: Any) -> Any:
        """``state`` with the split's meter EMA as this optimizer keeps it: dropped when it
        does not split; zeros when the checkpoint was saved without a split (the meter
        starts again, as :class:`scape.allot.AgreementMeter` does after a resume)."""
        def fit(sd: Any) -> Any:
            if not isinstance(sd, dict) or not isinstance(sd.get("buckets"), list):
                return sd  # load_sharded_state explains what is wrong with it
            buckets = []
            for e, s in zip(sd["buckets"], self.shards):
                if not isinstance(e, dict) or not isinstance(e.get("extra"), dict):
                    return sd
                extra = {k: v for k, v in e["extra"].items() if k != SPLIT_STATE}
                if SPLIT_STATE in s.extra and "m" in e:
                    extra[SPLIT_STATE] = e["extra"].get(SPLIT_STATE, torch.zeros_like(e["m"]))
                buckets.append(dict(e, extra=extra))
            buckets += sd["buckets"][len(buckets):]  # a count mismatch is reported later
            return dict(sd, buckets=buckets)
        return [fit(sd) for sd in state] if isinstance(state, (list, tuple)) else fit(state)


def _measures_noise(update: str) -> bool:
    """Whether the rule keeps the local noise estimate the gain is read from."""
    return update == "auto" or set(NOISE_STATE) <= set(RULES[update].extra)


def _selects_by_gain(update: str) -> bool:
    """Whether the rule's masks take each coordinate's fresh gain (:data:`rules.GAIN_SCORES`)."""
    return RULES[update].score in GAIN_SCORES


def resolve(update: str, split: str | None, n_sparse_groups: int) -> tuple[str, str | None]:
    """The rule and the split ``update`` and ``split`` name (``"auto"`` resolved) for an
    optimizer with ``n_sparse_groups`` sparse param groups (class docstring): the rule
    :data:`AUTO_RULE`; a split by gain only where there are groups to split and the rule
    sizes its catch-up by the noise estimate but takes its masks by accumulated mass (a gain
    rule already sends the coordinates worth sending; a split on top showed no clear gain,
    one seed each with opposite signs on one process and on 4 ranks: hypothesis 19)."""
    if update == "auto":
        update = AUTO_RULE
    if split == "auto":
        split = "gain" if n_sparse_groups > 1 and _measures_noise(update) and \
            not _selects_by_gain(update) else None
    return update, split


def _fit_mask(mask: torch.Tensor | None, m: _MaskState,
              block_size: int) -> torch.Tensor | None:
    """A saved mask on this world size's block count: extra padding blocks select 0..k-1.
    It keeps its own ``k`` (the sparsity it was made at)."""
    if mask is None:
        return None
    k = mask.shape[1]
    if not 1 <= k <= block_size or bool((mask < 0).any()) or \
            bool((mask >= block_size).any()):
        raise ValueError(f"checkpoint mask has {k} coordinates per block with offsets outside "
                         f"[0, {block_size}) (block_size changed?)")
    if mask.shape[0] >= m.n_blocks:
        return mask[: m.n_blocks].contiguous()
    pad = torch.arange(k, dtype=torch.int16).expand(m.n_blocks - mask.shape[0], k)
    return torch.cat([mask, pad.to(mask.device)]).contiguous()
