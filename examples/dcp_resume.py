"""Save with torch.distributed.checkpoint (DCP) on one world size, resume on another.

    torchrun --standalone --nproc-per-node=2 examples/dcp_resume.py --ckpt /tmp/ck --stop-at 30
    torchrun --standalone --nproc-per-node=3 examples/dcp_resume.py --ckpt /tmp/ck --resume

The first run trains a small model with ``scape.SCAPE`` and saves model, optimizer and LR
scheduler through DCP (``get_state_dict`` + ``dcp.save``), as a torchtitan-style trainer does.
The second run, on another number of ranks, builds everything anew, loads with ``dcp.load``
(``scape.dcp.ReshardPlanner`` lets the per-rank parts be re-cut: master weights and moments
exactly, every rank's error-feedback residual as the mean of the old ranks') and trains on.
Each run writes ``--out`` (JSON): its losses and the bytes of its last (sparse) step next to
the formula of README "Cost".
"""

from __future__ import annotations

import argparse
import json
import math
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import scape

STEPS, BLOCK, SPARSITY = 60, 256, 0.99


def batch(step: int, rank: int, world: int, true_w: torch.Tensor):
    """Rank ``rank``'s share of step ``step``'s global batch of 64 (any world size)."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(64, 32, generator=g)
    y = torch.tanh(x @ true_w)
    share = torch.arange(64).tensor_split(world)[rank]
    return x[share], y[share]


def expected_sparse_bytes(opt: scape.SCAPE) -> int:
    """README "Cost": ``K * (b_g + b_p) + W * ceil(K / W * log2(B) / 8)`` per sparse bucket,
    summed (the next mask's offsets packed to ``log2(B)`` bits), plus ``W * (b_g + 4)``: each
    rank's non-finite count and sum of squares riding in the step's two collectives."""
    total = opt.comm.world_size * (4 + 4)
    bits = max(8, BLOCK.bit_length() - 1)
    for b in opt.buckets:
        k_b = max(1, round((1 - opt.param_groups[b.group]["sparsity"]) * BLOCK))
        n_pad = -(-b.numel // (b.world * BLOCK)) * b.world * BLOCK
        total += (n_pad // BLOCK) * k_b * (4 + b.param_flat.element_size())
        total += b.world * -(-(n_pad // BLOCK // b.world * k_b * bits) // 8)
    return total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--stop-at", type=int, default=STEPS, help="save here and stop")
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same initial weights on every rank
    model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.GELU(),
                                torch.nn.Linear(128, 128), torch.nn.GELU(),
                                torch.nn.Linear(128, 8))
    true_w = torch.randn(32, 8, generator=torch.Generator().manual_seed(7))
    opt = scape.SCAPE(model.parameters(), lr=3e-3, sparsity=SPARSITY, block_size=BLOCK,
                      total_steps=STEPS, warmup_steps=5)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 5) * 0.5 * (1 + math.cos(math.pi * s / STEPS)))
    start = 0
    if args.resume:
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd, "sched": sched.state_dict()}
        dcp.load(state, checkpoint_id=args.ckpt, planner=scape.dcp.ReshardPlanner())
        set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
        sched.load_state_dict(state["sched"])
        start = opt.step_count
    losses = []
    for step in range(start + 1, (STEPS if args.resume else args.stop_at) + 1):
        x, y = batch(step, rank, world, true_w)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        losses.append(loss.item())
        if rank == 0 and step % 10 == 0:
            print(f"[{world} ranks] step {step} loss {loss.item():.4f}", flush=True)
    if not args.resume:
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd, "sched": sched.state_dict()},
                 checkpoint_id=args.ckpt)
    if rank == 0 and args.out:
        with open(args.out, "w") as f:
            json.dump({"world": world, "start": start, "losses": losses,
                       "last_step_dense": opt.last_step.dense,
                       "last_step_bytes": sum(opt.last_step.bytes.values()),
                       "expected_sparse_bytes": expected_sparse_bytes(opt)}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
