"""A small model, its FSDP2 sharding on a (dp_replicate, dp_shard) mesh and per-rank batches,
shared by the FSDP2 tests (run inside gloo ranks started by :func:`dist.run_ranks`)."""

from __future__ import annotations

import hashlib
from typing import Any

import torch
import torch.nn.functional as F

from scape.wire import mask_bytes

D_IN, D_HID, D_OUT = 24, 40, 7  # dims not divisible by the shard count: uneven shards


class Block(torch.nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(d, d)
        self.norm = torch.nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.gelu(self.fc(self.norm(x)))


class Net(torch.nn.Module):
    """Embedding-free MLP with blocks, as torchtitan shards a transformer: each block, then the
    root."""

    def __init__(self, blocks: int = 2) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(D_IN, D_HID)
        self.blocks = torch.nn.ModuleList(Block(D_HID) for _ in range(blocks))
        self.out = torch.nn.Linear(D_HID, D_OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.out(h)


def make_model(seed: int = 0, blocks: int = 2) -> Net:
    torch.manual_seed(seed)
    return Net(blocks)


def shard(model: Net, mesh: Any, mp: Any = None) -> Net:
    from torch.distributed.fsdp import fully_shard

    kw = {} if mp is None else {"mp_policy": mp}
    for b in model.blocks:
        fully_shard(b, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    return model


def batch(step: int, rank: int, n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Global rank ``rank``'s batch at ``step`` (fresh random inputs from a fixed seed)."""
    g = torch.Generator().manual_seed(10_000 * step + rank)
    x = torch.randn(n, D_IN, generator=g)
    teacher = torch.randn(D_IN, D_OUT, generator=torch.Generator().manual_seed(123))
    return x, (x @ teacher).argmax(1)  # a target the model can learn: the loss falls


def loss_of(model: torch.nn.Module, step: int, rank: int) -> torch.Tensor:
    x, y = batch(step, rank)
    return F.cross_entropy(model(x).float(), y)


def full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter in full (a DTensor gathered), by name."""
    out = {}
    for name, p in model.named_parameters():
        t = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name] = t.detach().clone()
    return out


def sparse_step_bytes(opt: Any, clip: bool) -> int:
    """docs/design.md's bytes of a sparse step over ``comm``, from the buckets' (local)
    sizes: ``K * (b_g + b_p)`` per bucket and every rank's next mask on the wire
    (:func:`scape.wire.mask_bytes`), plus the step's scalar all-reduce."""
    total = 4 * (5 if clip else 2)
    for b in opt.buckets:
        k = max(1, round((1 - opt.param_groups[b.group]["sparsity"]) * opt.block_size))
        total += (b.n_pad // opt.block_size) * k * (4 + b.param_flat.element_size())
        total += b.world * mask_bytes(b.shard_size // opt.block_size, k, opt.block_size)
    return total


def digest(params: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(params):
        h.update(name.encode())
        h.update(params[name].float().contiguous().numpy().tobytes())
    return h.hexdigest()
