"""The peer method SCAPE must beat: raw-gradient top-k with error feedback, then AdamS.

Classic sparsified data parallelism (Aji & Heafield 2017; Lin et al., "Deep Gradient
Compression", 2018), on the same buffers and kernels as ``scape.SCAPE``. One step on rank r,
per param group (one flat fp32 buffer ``buf`` of ``N_pad`` coordinates, padded as SCAPE pads,
holding this step's gradient plus everything not sent yet)::

    select      idx_r = blockwise_topk(buf, k_b, B)          per block the k_b largest |buf|
    take        v_r = buf[idx_r]; buf[idx_r] = 0             (the rest stays: error feedback)
    all-gather  (v_r, idx_r) of every rank, packed per rank as K fp32 values + K int16 offsets
    sum         g = 0; for every rank q: g[idx_q] += v_q / W (gather + scatter_, rank order)
    update      AdamS on the whole replicated buffer: adams_dense_(p, m, g)

with ``K = (N_pad / B) * k_b`` selected coordinates per rank and ``k_b = max(1, round((1 -
sparsity) * B))`` -- the same K as SCAPE's mask, so the two are compared at equal density. Every
rank selects from its *own* gradient, so the union of the selections (up to ``W*K``
coordinates) is not known in advance and every rank must receive every other rank's offsets:
bytes per step per rank ``W * K * (2 + b_g)`` on the all-gather (payload convention of
``scape.comm``: what every rank holds afterwards), against SCAPE's ``K * (b_g + b_p + 2)``;
with fp32 at W=4 that is ``24 K`` against ``10 K``. Every rank holds the full optimizer state
(``m`` over all ``N_pad`` coordinates) and every coordinate moves every step (AdamS with a
zero gradient still follows its decaying first moment).

The first ``warmup_steps`` steps are dense, as SCAPE's warm-up: reduce-scatter (avg) of the
whole buffer, all-gather of the averaged shards (``N_pad * (b_g + b_g)`` bytes, a ring
all-reduce), AdamS on the full buffer, buffer cleared. Non-finite gradients are not
screened (a benchmark baseline, not a library optimizer).
"""

from __future__ import annotations

from typing import Any

import torch

from scape import StepInfo
from scape.buffers import Bucket
from scape.comm import Communicator, TorchCommunicator
from scape.kernels import adams_dense_, blockwise_topk, gather, scatter_, take_
from scape.profiling import phase


class TopKAdamS(torch.optim.Optimizer):
    """Raw-gradient per-block top-k with error feedback, all-gathered, then replicated AdamS.

    Args:
        params: parameters or param groups (per-group ``lr``, ``betas``, ``eps``,
            ``weight_decay``).
        lr, betas, eps, weight_decay: AdamS hyperparameters (as ``scape.SCAPE``).
        sparsity: fraction of each rank's coordinates *not* sent per step, in (0, 1).
        block_size: coordinates per selection block (power of two).
        warmup_steps: dense steps at the start.
        comm: a :class:`scape.comm.Communicator` (default: ``TorchCommunicator()``).
    """

    def __init__(self, params: Any, *, lr: float, betas: tuple[float, float] = (0.9, 0.95),
                 eps: float = 1e-8, weight_decay: float = 0.0, sparsity: float = 0.99,
                 block_size: int = 4096, warmup_steps: int = 20,
                 comm: Communicator | None = None) -> None:
        if not isinstance(sparsity, (int, float)) or not 0.0 < sparsity < 1.0:
            raise ValueError(f"Invalid sparsity: expected a float in (0, 1), got {sparsity!r}")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 2 \
                or block_size & (block_size - 1) or block_size > 32768:
            raise ValueError(f"Invalid block_size: expected a power of two in [2, 32768], got "
                             f"{block_size!r}")
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) \
                or warmup_steps < 0:
            raise ValueError(f"Invalid warmup_steps: expected an int >= 0, got {warmup_steps!r}")
        if not lr > 0:
            raise ValueError(f"Invalid learning rate: expected > 0, got {lr!r}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.comm: Communicator = comm if comm is not None else TorchCommunicator()
        self.block_size = block_size
        self.warmup_steps = warmup_steps
        self.k = max(1, int(round((1.0 - sparsity) * block_size)))
        world, rank = self.comm.world_size, self.comm.rank
        self.buckets: list[Bucket] = []
        self.master: list[torch.Tensor] = []
        self.m: list[torch.Tensor] = []
        for gi, group in enumerate(self.param_groups):
            ps = [p for p in group["params"] if p.requires_grad]
            if not ps:
                continue
            if len({p.dtype for p in ps}) != 1:
                raise TypeError("TopKAdamS: every parameter of a group must have one dtype, "
                                f"got {sorted({str(p.dtype) for p in ps})}")
            b = Bucket(ps, gi, world, rank, block_size)
            self.buckets.append(b)
            fp32 = b.dtype == torch.float32
            self.master.append(b.param_flat if fp32 else b.param_flat.float())
            self.m.append(torch.zeros(b.n_pad, dtype=torch.float32, device=b.device))
        self._step = 0
        self.last_step = StepInfo()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Keeps the gradient buffers: they hold the error-feedback residual."""

    def k_local(self, bucket: Bucket) -> int:
        """Coordinates each rank selects in ``bucket`` per sparse step (``K``)."""
        return bucket.n_pad // self.block_size * self.k

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._step += 1
        self.comm.set_step(self._step)
        before = {op: int(v["bytes"]) for op, v in self.comm.stats.items()}
        dense = self._step <= self.warmup_steps
        for i, b in enumerate(self.buckets):
            b.fold_stray_grads()
            g = self._dense_gradient(b) if dense else self._sparse_gradient(b)
            group = self.param_groups[b.group]
            with phase("topk/update", b.device):
                fp32 = b.dtype == torch.float32
                adams_dense_(self.master[i], self.m[i], g, lr=float(group["lr"]),
                             beta1=group["betas"][0], beta2=group["betas"][1], eps=group["eps"],
                             weight_decay=group["weight_decay"],
                             model_out=None if fp32 else b.param_flat)
        after = self.comm.stats
        self.last_step = StepInfo(
            step=self._step, dense=dense, skipped=False,
            bytes={op: int(v["bytes"]) - before.get(op, 0) for op, v in after.items()
                   if int(v["bytes"]) - before.get(op, 0)},
            mask_size=sum(b.n_pad if dense else self.k_local(b) * b.world
                          for b in self.buckets))
        return loss

    def _dense_gradient(self, b: Bucket) -> torch.Tensor:
        """The average gradient over ranks, every coordinate (a ring all-reduce)."""
        with phase("topk/dense_sync", b.device):
            shard = torch.empty(b.shard_size, dtype=torch.float32, device=b.device)
            self.comm.reduce_scatter(shard, b.grad_flat, op="avg").wait()
            g = torch.empty(b.n_pad, dtype=torch.float32, device=b.device)
            self.comm.all_gather(g, shard).wait()
            b.grad_flat.zero_()
        return g

    def _sparse_gradient(self, b: Bucket) -> torch.Tensor:
        """Every rank's top-k of its ``gradient + residual``, summed and divided by W."""
        B, world, K = self.block_size, b.world, self.k_local(b)
        with phase("topk/select", b.device):
            idx = blockwise_topk(b.grad_flat, self.k, B)
        with phase("topk/take", b.device):
            packed = torch.empty(K * 6, dtype=torch.uint8, device=b.device)
            take_(b.grad_flat, idx, B, out=packed[:K * 4].view(torch.float32))
            packed[K * 4:].view(torch.int16).copy_(idx.view(-1))
        with phase("topk/all_gather", b.device):
            everyone = torch.empty(world, K * 6, dtype=torch.uint8, device=b.device)
            self.comm.all_gather(everyone.view(-1), packed).wait()
        with phase("topk/sum", b.device):
            values = everyone[:, :K * 4].contiguous().view(torch.float32).mul_(1.0 / world)
            offsets = everyone[:, K * 4:].contiguous().view(torch.int16)
            g = torch.zeros(b.n_pad, dtype=torch.float32, device=b.device)
            for q in range(world):
                idx_q = offsets[q].view(-1, self.k)
                total = gather(g, idx_q, B)
                total.add_(values[q])
                scatter_(g, idx_q, B, total)
        return g
