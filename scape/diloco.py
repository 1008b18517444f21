"""Local-step training with an outer step: the machinery shared by ``scape.DiLoCo`` and
``scape.SparseLoCo``, and ``scape.DiLoCo`` itself (the dense baseline, arXiv 2311.08105).

Every rank trains ``H = sync_every`` steps with its own ``inner`` optimizer and no
communication. At a sync, each rank computes its pseudo-gradient

    delta = theta_synced - theta_local

(how far its local training moved the parameters since the last sync), the ranks combine
their pseudo-gradients, every rank applies the same outer step to ``theta_synced``, and the
model restarts from it: ``theta_local <- theta_synced``. After every sync all ranks hold
bitwise-identical parameters. The inner optimizer's state (e.g. AdamW moments) stays local
and persists across syncs.

Layout: the trainable parameters (in the order given) are viewed through one flat fp32
buffer ``synced`` of length ``N_pad`` (``N`` padded to a multiple of the subclass's
alignment; padding never moves). ``synced`` is the outer master copy in fp32; the model holds
it cast to the model dtype, and ``delta`` is taken against that cast value, so a bf16 model's
rounding is not mistaken for training progress. The parameters themselves are left where they
are (the inner optimizer owns them); a sync copies them in and out of the flat buffers.

DiLoCo's outer step: the average of the pseudo-gradients, as a ring all-reduce does it
(reduce-scatter with ``avg``, then all-gather of the averaged shards, so every rank holds the
same bytes), then Nesterov momentum SGD on ``theta_synced`` (``torch.optim.SGD``'s rule:
``buf = mu * buf + mean``; ``update = mean + mu * buf`` with Nesterov, else ``buf``;
``theta -= outer_lr * update``). Bytes per sync in ``comm.stats``: ``4 * N_pad`` for the
reduce-scatter plus ``4 * N_pad`` for the all-gather (``N_pad``: ``N`` padded to a multiple of
``W``), the same count as one dense fp32 sharded step; nothing between syncs.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch

from scape import config
from scape.agreement import agree, digest, tensor_digest
from scape.buffers import flat_layout
from scape.comm import Communicator, as_communicator
from scape.optim_hooks import load_state_dict_hooks, refuse_copy, state_dict_hooks
from scape.profiling import phase
from scape.step_info import StepInfo
from scape.wrappers import check_not_wrapped

FORMAT = "scape.local_sgd/1"


def _flatten_params(params: Any) -> list[torch.Tensor]:
    """Tensors from an iterable of tensors or of param-group dicts."""
    params = list(params)
    out: list[torch.Tensor] = []
    for item in params:
        if isinstance(item, dict):
            if "params" not in item:
                raise ValueError("a param group dict must have a 'params' entry; got keys "
                                 f"{sorted(item)}")
            group = item["params"]
            out.extend([group] if isinstance(group, torch.Tensor) else list(group))
        else:
            out.append(item)
    return out


class LocalSGD(torch.optim.Optimizer):
    """Base of :class:`DiLoCo` and :class:`scape.SparseLoCo` (not used directly).

    ``param_groups`` *is* the inner optimizer's list, so an LR scheduler built on this
    optimizer drives the inner learning rate (as ``Lookahead`` wrappers do). ``step()``
    steps the inner optimizer and, every ``sync_every`` steps, runs the outer sync. A sync
    where any rank's pseudo-gradient is non-finite is skipped on every rank
    (``last_step.skipped``): the outer state is unchanged, the parameters go back to
    ``theta_synced``, and non-finite entries of the inner optimizer's state restart at zero.
    """

    name = "local SGD"
    __getstate__ = refuse_copy

    def __init__(self, params: Any, inner: Any, *, sync_every: int, comm: Communicator | None,
                 align: int, fields: dict[str, Any], align_to_world: bool = False) -> None:
        error: Exception | None = None
        trainable: list[torch.Tensor] = []
        given: list[torch.Tensor] = []
        try:
            config.check_int("sync_every", sync_every, 1)
            self._validate(fields)
            given = _flatten_params(params)
            trainable = config.check_params(given)
            if not trainable:
                raise ValueError("optimizer got no trainable parameter (all have "
                                 "requires_grad=False)")
            self._check_inner(inner, given)
        except (ValueError, TypeError) as e:
            error = e
            trainable = []
        self.comm: Communicator = as_communicator(comm)
        valid = error is None
        agreed = {k: digest(v) for k, v in fields.items()}
        agreed["sync_every"] = digest(sync_every)
        agreed["inner"] = digest(type(inner).__name__)
        agreed["param_shapes"] = digest([tuple(p.shape) for p in trainable]) if valid else 0
        agreed["param_dtypes"] = digest([str(p.dtype) for p in trainable]) if valid else 0
        agreed["param_values"] = tensor_digest(trainable) if valid else 0
        agree(self.comm, agreed, error, what=self.name)

        super().__init__(trainable, {})
        self.inner = inner
        self.param_groups = inner.param_groups
        self.defaults = inner.defaults
        self.state = inner.state
        self.sync_every = sync_every
        self.params = trainable
        self.device = trainable[0].device
        if align_to_world:
            align *= self.comm.world_size
        self.numels, self.offsets, self.n_pad = flat_layout(trainable, align)
        self.numel = self.offsets[-1]
        self.synced = torch.zeros(self.n_pad, dtype=torch.float32, device=self.device)
        """theta_synced, the outer master weights (fp32, padded)."""
        for p, o, n in zip(self.params, self.offsets, self.numels):
            self.synced[o:o + n].copy_(p.detach().reshape(-1))
        self._delta = torch.zeros(self.n_pad, dtype=torch.float32, device=self.device)
        self._step = 0
        self.sync_count = 0
        """Number of outer syncs run so far."""
        self.last_step = StepInfo(dense=False)

    # ----------------------------------------------------------------- subclass interface
    def _validate(self, fields: dict[str, Any]) -> None:
        """Check the subclass's hyperparameters (raise ValueError/TypeError)."""
        raise NotImplementedError

    def _outer_sync(self) -> tuple[bool, int, bool]:
        """Combine the pseudo-gradients in ``self._delta`` and update ``self.synced``.
        Returns (dense, entries synchronized, skipped) for ``last_step``: a sync with a
        non-finite pseudo-gradient on any rank is skipped on every rank, state unchanged."""
        raise NotImplementedError

    def _outer_state(self) -> dict[str, torch.Tensor]:
        """Outer-optimizer tensors saved in checkpoints (momentum, error feedback)."""
        raise NotImplementedError

    # ------------------------------------------------------------------- checks
    @staticmethod
    def _check_inner(inner: Any, given: list[torch.Tensor]) -> None:
        if not isinstance(inner, torch.optim.Optimizer):
            raise TypeError(f"inner must be a torch.optim.Optimizer built over the same params "
                            f"(e.g. torch.optim.AdamW(model.parameters())); got "
                            f"{type(inner).__name__}")
        inner_ids = {id(p) for g in inner.param_groups for p in g["params"]}
        ids = {id(p) for p in given}
        if inner_ids != ids:
            raise ValueError(
                f"inner must optimize exactly the params given: inner has {len(inner_ids)} "
                f"tensors, params has {len(ids)}, {len(inner_ids ^ ids)} differ; build both "
                "from the same model.parameters()")

    # ------------------------------------------------------------------- public API
    @property
    def step_count(self) -> int:
        return self._step

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The inner optimizer's ``zero_grad`` (gradients are local to each rank)."""
        self.inner.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict) -> None:
        if hasattr(self, "inner"):
            raise RuntimeError(f"{self.name}: param groups are fixed at construction (the "
                               "flat buffers are built once); build a new optimizer")
        super().add_param_group(param_group)

    @torch.compiler.disable  # host-side counters and collectives: kept out of dynamo graphs
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One inner step; every ``sync_every``-th step also runs the outer sync."""
        if self._step == 0 and not getattr(self, "_wrap_checked", False):
            check_not_wrapped(self.params, self.name)  # DDP would sync every step
            self._wrap_checked = True
        loss = self.inner.step(closure) if closure is not None else self.inner.step()
        self._step += 1
        set_step = getattr(self.comm, "set_step", None)
        if set_step is not None:
            set_step(self._step)
        dense, entries, sent, skipped = False, 0, {}, False
        if self._step % self.sync_every == 0:
            before = {k: int(v["bytes"]) for k, v in self.comm.stats.items()}
            with torch.no_grad(), phase("scape/outer_sync", self.device):
                self._pseudo_gradient()
                dense, entries, skipped = self._outer_sync()
                self._write_params()  # a skipped sync: every rank back at theta_synced
                if skipped:
                    self._clear_nonfinite_inner_state()
            self.sync_count += 1
            sent = {k: int(v["bytes"]) - before.get(k, 0) for k, v in self.comm.stats.items()
                    if int(v["bytes"]) - before.get(k, 0)}
        self.last_step = StepInfo(step=self._step, dense=dense, skipped=skipped,
                                  grad_norm=None, bytes=sent, mask_size=entries)
        return loss

    def _clear_nonfinite_inner_state(self) -> None:
        """After a skipped sync: non-finite entries of the inner optimizer's state (a NaN
        gradient reaches AdamW's moments) restart from zero; the others are kept."""
        for st in self.inner.state.values():
            for v in st.values():
                if isinstance(v, torch.Tensor) and v.is_floating_point():
                    v.masked_fill_(~torch.isfinite(v), 0.0)

    # ------------------------------------------------------------------- flat buffers
    def _pseudo_gradient(self) -> None:
        """``self._delta = cast(theta_synced) - theta_local`` (fp32; padding stays 0)."""
        for p, o, n in zip(self.params, self.offsets, self.numels):
            start = self.synced[o:o + n].to(p.dtype).to(torch.float32)
            torch.sub(start, p.detach().reshape(-1).to(torch.float32), out=self._delta[o:o + n])

    def _write_params(self) -> None:
        """``theta_local <- theta_synced`` (cast to each parameter's dtype)."""
        for p, o, n in zip(self.params, self.offsets, self.numels):
            p.detach().copy_(self.synced[o:o + n].view_as(p))

    # ------------------------------------------------------------------- checkpoints
    @state_dict_hooks
    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """This rank's state: the step, ``theta_synced``, the model's local parameters
        (training may be between syncs), the outer state and the inner optimizer's state
        dict. Loading it resumes bit-exactly on the same rank of the same world size."""
        return {"format": FORMAT, "optimizer": self.name, "world_size": self.comm.world_size,
                "rank": self.comm.rank, "step": self._step, "sync_count": self.sync_count,
                "sync_every": self.sync_every, "numel": self.numel,
                "synced": self.synced.detach().clone(),
                "local": [p.detach().clone() for p in self.params],
                "outer": {k: v.detach().clone() for k, v in self._outer_state().items()},
                "inner": copy.deepcopy(self.inner.state_dict())}

    @load_state_dict_hooks
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        sd = state_dict
        if not isinstance(sd, dict) or sd.get("format") != FORMAT:
            got = sd.get("format") if isinstance(sd, dict) else type(sd).__name__
            raise ValueError(f"not a {FORMAT} state dict (got format {got!r})")
        if sd["optimizer"] != self.name:
            raise ValueError(f"state dict is from {sd['optimizer']}, not {self.name}")
        if (sd["world_size"], sd["rank"]) != (self.comm.world_size, self.comm.rank):
            raise ValueError(f"state dict is rank {sd['rank']} of {sd['world_size']}; this is "
                             f"rank {self.comm.rank} of {self.comm.world_size} (each rank "
                             "loads its own state: its error feedback and inner state are "
                             "its own)")
        if sd["numel"] != self.numel or len(sd["local"]) != len(self.params):
            raise ValueError(f"state dict has {len(sd['local'])} params ({sd['numel']} "
                             f"elements); the optimizer has {len(self.params)} "
                             f"({self.numel} elements)")
        if sd["sync_every"] != self.sync_every:
            raise ValueError(f"state dict sync_every {sd['sync_every']} != {self.sync_every}")
        outer = self._outer_state()
        if set(sd["outer"]) != set(outer):
            raise ValueError(f"state dict outer state has {sorted(sd['outer'])}; expected "
                             f"{sorted(outer)}")
        with torch.no_grad():
            self.synced.copy_(sd["synced"])
            for p, saved in zip(self.params, sd["local"]):
                if saved.shape != p.shape:
                    raise ValueError(f"saved param of shape {tuple(saved.shape)} does not "
                                     f"match {tuple(p.shape)}")
                p.copy_(saved)
            for k, v in sd["outer"].items():
                outer[k].copy_(v)
        self.inner.load_state_dict(copy.deepcopy(sd["inner"]))
        self.param_groups = self.inner.param_groups
        self._step = int(sd["step"])
        self.sync_count = int(sd["sync_count"])


class DiLoCo(LocalSGD):
    """DiLoCo: ``sync_every`` local steps with ``inner``, then the averaged dense
    pseudo-gradient drives an outer Nesterov momentum SGD step on the synced weights.

    Args:
        params: the parameters (or param groups) ``inner`` optimizes.
        inner: a ``torch.optim.Optimizer`` over exactly those parameters.
        sync_every: ``H``, inner steps per outer sync.
        outer_lr: outer learning rate (0.7 in the DiLoCo paper).
        outer_momentum: outer momentum ``mu`` in [0, 1).
        nesterov: Nesterov momentum (needs ``outer_momentum > 0``).
        comm: the data-parallel group: a ProcessGroup, a 1-D DeviceMesh or a
            :class:`scape.comm.Communicator` (default: the default process group).

    Bytes per sync: ``8 * N_pad`` (an fp32 reduce-scatter and all-gather, ``comm.stats``).
    """

    name = "DiLoCo"

    def __init__(self, params: Any, inner: Any, *, sync_every: int, outer_lr: float = 0.7,
                 outer_momentum: float = 0.9, nesterov: bool = True,
                 comm: Communicator | None = None) -> None:
        super().__init__(params, inner, sync_every=sync_every, comm=comm, align=1,
                         fields=dict(outer_lr=outer_lr, outer_momentum=outer_momentum,
                                     nesterov=nesterov), align_to_world=True)
        self.outer_lr = float(outer_lr)
        self.outer_momentum = float(outer_momentum)
        self.nesterov = nesterov
        self.momentum = torch.zeros_like(self.synced)
        """The outer momentum buffer (fp32, all ranks identical)."""

    def _validate(self, fields: dict[str, Any]) -> None:
        outer_lr, outer_momentum = fields["outer_lr"], fields["outer_momentum"]
        nesterov = fields["nesterov"]
        config.check_lr(outer_lr, "outer_lr")
        if isinstance(outer_momentum, bool) or not isinstance(outer_momentum, (int, float)) \
                or not 0.0 <= outer_momentum < 1.0:
            raise ValueError(f"Invalid outer_momentum: {outer_momentum!r} (expected a float "
                             "in [0, 1))")
        if not isinstance(nesterov, bool):
            raise TypeError(f"nesterov must be a bool; got {type(nesterov).__name__}")
        if nesterov and outer_momentum == 0:
            raise ValueError("Nesterov momentum requires outer_momentum > 0; got "
                             "outer_momentum=0 with nesterov=True (pass nesterov=False)")

    def _outer_sync(self) -> tuple[bool, int, bool]:
        """One sync. A non-finite pseudo-gradient on any rank makes the all-gathered mean
        non-finite on every rank alike: the sync is skipped there, momentum and
        ``theta_synced`` unchanged (no extra byte)."""
        mean = self._delta
        shard = torch.empty(self.n_pad // self.comm.world_size, dtype=torch.float32,
                            device=self.device)
        self.comm.reduce_scatter(shard, mean, op="avg").wait()
        self.comm.all_gather(mean, shard).wait()
        if not bool(torch.isfinite(mean).all()):
            return True, self.numel, True
        mu = self.outer_momentum
        if mu > 0:
            self.momentum.mul_(mu).add_(mean)
            update = mean.add_(self.momentum, alpha=mu) if self.nesterov else self.momentum
        else:
            update = mean
        self.synced.sub_(update, alpha=self.outer_lr)
        return True, self.numel, False

    def _outer_state(self) -> dict[str, torch.Tensor]:
        return {"momentum": self.momentum}
