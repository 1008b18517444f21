"""``scape.DistributedAdamW``: dense sharded AdamW on the same buffers as SCAPE.

The baseline users know: every step reduce-scatters (avg) the whole fp32 gradient buffer,
runs ``torch.optim.AdamW``'s exact update (bias-corrected, decoupled decay) on the owned
shard, and all-gathers the updated shard into every model. Bytes per rank and step:
``N_pad * (b_g + b_p)`` plus the 8-byte scalar all-reduce (norm and non-finite count).
Memory per rank: the fp32 gradient buffer (``4 * N_pad`` bytes) and, for the owned shard,
fp32 master weights, ``exp_avg`` and ``exp_avg_sq``: 12 bytes per shard coordinate.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from scape.buffers import DENSE_ALIGN, Bucket
from scape.checkpoint import load_sharded_state, sharded_state
from scape.comm import Communicator
from scape.dcp import is_torch_state_dict, load_torch_state_dict, torch_state_dict
from scape.kernels import adamw_dense_
from scape.optim_hooks import load_state_dict_hooks, state_dict_hooks
from scape.sharded import ShardedOptimizer, positional_error


@dataclasses.dataclass
class AdamWShard:
    """AdamW's state of the shard a rank owns (fp32, length S each: 12 bytes per coordinate)."""

    master: torch.Tensor
    m: torch.Tensor
    """The first moment (``exp_avg``)."""
    extra: dict[str, torch.Tensor]
    """``{"v": the second moment}`` (``exp_avg_sq``), where checkpoint records keep it."""

    def tensors(self) -> dict[str, torch.Tensor]:
        """The shard-sized state besides :attr:`extra`, by the names a checkpoint record
        gives it (a record's ``age``, which earlier versions saved, is dropped on load)."""
        return {"master": self.master, "m": self.m}


class DistributedAdamW(ShardedOptimizer):
    """Dense ZeRO-1 AdamW: ``torch.optim.AdamW`` semantics, sharded optimizer state.

    Args:
        params: parameters or param groups (per-group ``lr``, ``betas``, ``eps``,
            ``weight_decay``).
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW``.
        max_grad_norm: clip the synchronized gradient to this norm (None: no clipping).
        grad_comm_dtype: dtype of gradients on the wire.
        comm: the data-parallel group: a ProcessGroup, a 1-D DeviceMesh or a
            :class:`scape.comm.Communicator` (default: the default process group).

    A step whose gradient has a non-finite entry on any rank is skipped on every rank and
    does not advance the bias-correction step count.
    """

    name = "DistributedAdamW"

    def __init__(self, params: Any, *args: Any, lr: float | None = None,
                 betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0,
                 max_grad_norm: float | None = None,
                 grad_comm_dtype: torch.dtype = torch.float32,
                 comm: Communicator | None = None) -> None:
        self._call_error = positional_error(self.name, args, lr)
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults, comm=comm, block_size=4096,
                         max_grad_norm=max_grad_norm, grad_comm_dtype=grad_comm_dtype,
                         global_fields={})
        self._adam_step = 0

    def _bucket_align(self, group: dict) -> int:
        return DENSE_ALIGN

    def _init_shard(self, bucket: Bucket) -> AdamWShard:
        master = bucket.param_flat[bucket.shard].to(torch.float32).clone()
        return AdamWShard(master=master, m=torch.zeros_like(master),
                          extra={"v": torch.zeros_like(master)})

    def _is_dense(self, i: int) -> bool:
        return True

    def state_tensors(self, shard: AdamWShard) -> dict[str, torch.Tensor]:
        return {"exp_avg": shard.m, "exp_avg_sq": shard.extra["v"], "master": shard.master}

    def _apply(self, gs: list[torch.Tensor], dense_flags: list[bool]) -> None:
        self._adam_step += 1
        super()._apply(gs, dense_flags)

    def _dense_update(self, i: int, g: torch.Tensor, hp: dict, model_out: torch.Tensor) -> None:
        s = self.shards[i]
        adamw_dense_(s.master, s.m, s.extra["v"], g, lr=hp["lr"], beta1=hp["beta1"],
                     beta2=hp["beta2"], eps=hp["eps"], weight_decay=hp["weight_decay"],
                     step=self._adam_step, model_out=model_out)

    def counters(self) -> dict[str, int]:
        return {"adam_step": self._adam_step}

    def load_counters(self, counters: dict[str, Any], step: int) -> None:
        super().load_counters(counters, step)
        self._adam_step = int(counters["adam_step"])

    @state_dict_hooks
    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """torch.optim's shape, each tensor holding this rank's part (:mod:`scape.dcp`)."""
        self.finish_param_sync()
        return torch_state_dict(self, [{} for _ in self.buckets])

    def rank_state_dict(self) -> dict[str, Any]:
        """This rank's shard as one record (what :func:`scape.save_checkpoint` writes)."""
        self.finish_param_sync()
        return sharded_state(self, [{} for _ in self.buckets])

    @load_state_dict_hooks
    def load_state_dict(self, state_dict: Any) -> None:  # type: ignore[override]
        """Load a :meth:`state_dict` (also as DCP filled it), this rank's
        :meth:`rank_state_dict`, or a list of every old rank's (any world size).

        A :meth:`rank_state_dict` saved by earlier versions, which kept an unused int32
        ``age`` per coordinate, loads too: the ages are dropped."""
        self.finish_param_sync()
        if is_torch_state_dict(state_dict):
            load_torch_state_dict(self, state_dict)
        else:
            load_sharded_state(self, state_dict)
        self._watch.reset()
