"""SCAPE in a 2-D layout: tensor parallel (TP) inside, SCAPE's data parallel (DP) across.

    torchrun --standalone --nproc-per-node=4 examples/tp_dp.py --steps 40 --out run.json

Gloo on CPU, NCCL when CUDA is available. A ``DeviceMesh`` (dp, tp) = (W / tp, tp): a small
byte-level model splits its MLP Megatron-style over the TP group (the first linear by
columns, the second by rows); embedding and head are replicated. The ranks at one TP position
hold the same slice and form a DP group with its own SCAPE, ``comm=mesh["dp"]``, which reduces
over that group only. Replicated and TP-sharded parameters go in two param groups, so no mask
block mixes them and the replicated ones stay identical at every TP position; for the same
reason no ``max_grad_norm=``: SCAPE's norm covers the DP group's buckets only, and differs
between TP positions. Rank 0 writes ``--out``: losses, the bytes of a sparse step, and per rank
digests of the replicated and sharded parameters.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import scape


def _all_reduce(t: torch.Tensor, group) -> torch.Tensor:
    t = t.clone()
    dist.all_reduce(t, group=group)
    return t


class _TP(torch.autograd.Function):
    """Megatron's f (identity forward, all-reduce backward) or g (all-reduce forward)."""

    @staticmethod
    def forward(ctx, x, group, reduce_forward: bool):
        ctx.group, ctx.reduce_backward = group, not reduce_forward
        return _all_reduce(x, group) if reduce_forward else x

    @staticmethod
    def backward(ctx, g):
        return (_all_reduce(g, ctx.group) if ctx.reduce_backward else g), None, None


class TPByteModel(torch.nn.Module):
    """Byte embedding -> residual MLP split over the TP group -> head (bigram-style LM)."""

    def __init__(self, tp_rank: int, tp: int, group, d: int = 64, hidden: int = 256) -> None:
        super().__init__()
        torch.manual_seed(0)  # every rank builds the same full model, then keeps its slice
        self.emb, self.head = torch.nn.Embedding(256, d), torch.nn.Linear(d, 256)
        fc1, fc2 = torch.nn.Linear(d, hidden), torch.nn.Linear(hidden, d)
        cols = slice(tp_rank * hidden // tp, (tp_rank + 1) * hidden // tp)
        self.fc1_w = torch.nn.Parameter(fc1.weight.detach()[cols].clone())
        self.fc1_b = torch.nn.Parameter(fc1.bias.detach()[cols].clone())
        self.fc2_w = torch.nn.Parameter(fc2.weight.detach()[:, cols].clone())
        self.fc2_b, self.group = fc2.bias, group  # the bias is added once, after the reduce
        self.replicated = [self.emb.weight, self.head.weight, self.head.bias, self.fc2_b]
        self.sharded = [self.fc1_w, self.fc1_b, self.fc2_w]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        y = F.gelu(F.linear(_TP.apply(h, self.group, False), self.fc1_w, self.fc1_b))
        h = h + _TP.apply(F.linear(y, self.fc2_w), self.group, True) + self.fc2_b
        return self.head(h)


def digest(params) -> str:
    return hashlib.sha256(b"".join(p.detach().cpu().numpy().tobytes() for p in params)).hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--sparsity", type=float, default=0.99)
    ap.add_argument("--block-size", type=int, default=256)
    ap.add_argument("--warmup-steps", type=int, default=10)
    ap.add_argument("--batch", type=int, default=16, help="sequences per DP rank and step")
    ap.add_argument("--out", default="tp_dp.json")
    args = ap.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dp = dist.get_world_size() // args.tp
    mesh = init_device_mesh("cuda" if cuda else "cpu", (dp, args.tp), mesh_dim_names=("dp", "tp"))
    dp_rank, tp_rank = mesh["dp"].get_local_rank(), mesh["tp"].get_local_rank()
    model = TPByteModel(tp_rank, args.tp, mesh["tp"].get_group()).to(mesh.device_type)
    scape.broadcast_parameters(model, comm=mesh["dp"])  # the DP replicas start equal
    opt = scape.SCAPE([{"params": model.replicated}, {"params": model.sharded}], lr=args.lr,
                      sparsity=args.sparsity, block_size=args.block_size,
                      total_steps=args.steps, warmup_steps=args.warmup_steps,
                      comm=mesh["dp"])
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, args.steps, eta_min=args.lr / 10)

    files = sorted(Path(os.__file__).parent.glob("*.py"))[:200]  # the stdlib's source bytes
    text = b"".join(f.read_bytes() for f in files)
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    losses, sparse = [], None
    for step in range(args.steps):  # one global batch per step, each DP rank its share
        g = torch.Generator().manual_seed(step)
        starts = torch.randint(0, len(data) - 65, (args.batch * dp,), generator=g)
        x = torch.stack([data[s:s + 65] for s in starts.view(dp, -1)[dp_rank]])
        x = x.to(mesh.device_type)  # 65 bytes: 64 inputs, each followed by its target
        loss = F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=mesh["dp"].get_group())  # log: the mean over DP replicas
        losses.append(mean.item() / dp)
        if not opt.last_step.dense and sparse is None:
            sparse = {"step": opt.last_step.step, "dense": False,
                      "bytes": dict(opt.last_step.bytes)}
        if dist.get_rank() == 0:
            print(f"step {step + 1:4d}  loss {losses[-1]:.4f}  "
                  f"{sum(opt.last_step.bytes.values()):,} B", flush=True)

    me = {"rank": dist.get_rank(), "dp": dp_rank, "tp": tp_rank,
          "replicated": digest(model.replicated), "sharded": digest(model.sharded)}
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, me)
    if dist.get_rank() == 0:
        print("bytes of a sparse step:", sparse and sparse["bytes"])
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"world": dp, "dp": dp, "tp": args.tp, "sparsity": args.sparsity,
                       "block_size": args.block_size, "max_grad_norm": opt.max_grad_norm,
                       "grad_bytes": 4, "param_bytes": 4,
                       "losses": losses, "first_loss": losses[0], "last_loss": losses[-1],
                       "group_numels": [sum(p.numel() for p in g)
                                        for g in (model.replicated, model.sharded)],
                       "bucket_n_pad": [b.n_pad for b in opt.buckets],
                       "bucket_group": [b.group for b in opt.buckets],
                       "bucket_apart": [b.apart for b in opt.buckets], "sparse_step": sparse,
                       "ranks": ranks}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
