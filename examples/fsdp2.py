"""SCAPE across the replicas of an FSDP2-sharded model, as a torchtitan-style trainer runs it.

    torchrun --standalone --nproc-per-node=4 examples/fsdp2.py --replicate 2 --steps 40
    torchrun --standalone --nproc-per-node=4 examples/fsdp2.py --replicate 2 --steps 40 \\
        --ckpt /tmp/ck --save-at 20             # then, to resume from step 20:
    torchrun --standalone --nproc-per-node=4 examples/fsdp2.py --replicate 2 --steps 40 \\
        --ckpt /tmp/ck --resume

A ``(dp_replicate, dp_shard)`` mesh: ``fully_shard`` over ``mesh["dp_shard"]`` (each block, then
the root) keeps FSDP2's dense reduce-scatter and all-gather inside a replica; the optimizer,
``comm=mesh["dp_replicate"]``, replaces the dense all-reduce across replicas by SCAPE's sparse
step among the ranks that hold the same shard. bf16 mixed precision on CUDA (``--mixed``), gloo
and fp32 on the CPU. Checkpoints go through DCP (``get_state_dict`` / ``dcp.save`` /
``dcp.load`` / ``set_state_dict``); ``scape.dcp.ReshardPlanner`` lets a checkpoint load onto
another replicate count. Rank 0 writes ``--out`` (JSON): losses, the bytes of a sparse step,
and a digest of each rank's full parameters.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import scape


class Block(torch.nn.Module):
    """Pre-norm Llama-style block: RMSNorm, causal attention, RMSNorm, SwiGLU."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.attn_norm, self.mlp_norm = torch.nn.RMSNorm(d), torch.nn.RMSNorm(d)
        self.qkv = torch.nn.Linear(d, 3 * d, bias=False)
        self.proj = torch.nn.Linear(d, d, bias=False)
        self.gate_up = torch.nn.Linear(d, 2 * 4 * d, bias=False)
        self.down = torch.nn.Linear(4 * d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(b, t, 3, self.heads, -1).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class ByteLM(torch.nn.Module):
    def __init__(self, d: int = 64, layers: int = 2, heads: int = 4, seq: int = 64) -> None:
        super().__init__()
        self.emb, self.pos = torch.nn.Embedding(256, d), torch.nn.Embedding(seq, d)
        self.layers = torch.nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.norm, self.head = torch.nn.RMSNorm(d), torch.nn.Linear(d, 256, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x) + self.pos(torch.arange(x.shape[1], device=x.device))
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))


def full_digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for _, p in sorted(model.named_parameters()):
        h.update(p.full_tensor().detach().float().cpu().numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--replicate", type=int, default=2, help="dp_replicate size (the rest shards)")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--sparsity", type=float, default=0.99)
    ap.add_argument("--block-size", type=int, default=256)
    ap.add_argument("--warmup-steps", type=int, default=8)
    ap.add_argument("--batch", type=int, default=8, help="sequences per rank and step")
    ap.add_argument("--mixed", choices=["auto", "bf16", "fp32"], default="auto",
                    help="FSDP2 bf16 mixed precision (auto: on CUDA)")
    ap.add_argument("--ckpt", default=None)
    ap.add_argument("--save-at", type=int, default=None)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--out", default="fsdp2.json")
    args = ap.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cuda" if cuda else "cpu", (args.replicate, world // args.replicate),
                            mesh_dim_names=("dp_replicate", "dp_shard"))
    torch.manual_seed(0)  # the same initial model on every rank
    model = ByteLM().to(mesh.device_type)
    bf16 = args.mixed == "bf16" or (args.mixed == "auto" and cuda)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if bf16 else MixedPrecisionPolicy()
    for layer in model.layers:
        fully_shard(layer, mesh=mesh["dp_shard"], mp_policy=mp)
    fully_shard(model, mesh=mesh["dp_shard"], mp_policy=mp)
    opt = scape.SCAPE(model.parameters(), lr=args.lr, sparsity=args.sparsity, weight_decay=0.1,
                      block_size=args.block_size, total_steps=args.steps,
                      warmup_steps=args.warmup_steps, max_grad_norm=1.0,
                      comm=mesh["dp_replicate"])
    opt.attach(model)

    start = 0
    if args.resume:
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd, "step": torch.zeros((), dtype=torch.int64)}
        dcp.load(state, checkpoint_id=args.ckpt, planner=scape.dcp.ReshardPlanner())
        set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
        start = int(state["step"])

    files = sorted(Path(os.__file__).parent.glob("*.py"))[:200]  # the stdlib's source bytes
    data = torch.frombuffer(bytearray(b"".join(f.read_bytes() for f in files)), dtype=torch.uint8)
    data = data.long()
    losses, sparse = [], None
    for step in range(start, args.steps):  # one global batch per step, each rank its share
        g = torch.Generator().manual_seed(step)
        starts = torch.randint(0, len(data) - 65, (args.batch * world,), generator=g)
        x = torch.stack([data[s:s + 65] for s in starts.view(world, -1)[rank]])
        x = x.to(mesh.device_type)  # 65 bytes: 64 inputs, each followed by its target
        loss = F.cross_entropy(model(x[:, :-1]).flatten(0, 1).float(), x[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)  # log: the mean over every rank
        losses.append(mean.item() / world)
        if not opt.last_step.dense and sparse is None:
            sparse = {"step": opt.last_step.step, "dense": False,
                      "bytes": dict(opt.last_step.bytes)}
        if rank == 0:
            print(f"step {step + 1:4d}  loss {losses[-1]:.4f}  "
                  f"{sum(opt.last_step.bytes.values()):,} B across replicas", flush=True)
        if args.save_at is not None and step + 1 == args.save_at:
            msd, osd = get_state_dict(model, opt)
            dcp.save({"model": msd, "optim": osd, "step": torch.tensor(step + 1)},
                     checkpoint_id=args.ckpt)

    opt.finish_param_sync()
    digests = [None] * world
    dist.all_gather_object(digests, full_digest(model))
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"world": args.replicate, "replicate": args.replicate,
                       "shard": world // args.replicate, "start": start,
                       "sparsity": args.sparsity, "block_size": args.block_size,
                       "max_grad_norm": opt.max_grad_norm, "grad_bytes": 4, "param_bytes": 4,
                       "bf16": bf16, "losses": losses, "first_loss": losses[0],
                       "last_loss": losses[-1],
                       "group_numels": [sum(p.to_local().numel() for p in g["params"])
                                        for g in opt.param_groups],
                       "bucket_n_pad": [b.n_pad for b in opt.buckets],
                       "bucket_group": [b.group for b in opt.buckets],
                       "bucket_apart": [b.apart for b in opt.buckets], "sparse_step": sparse,
                       "digests": digests}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
