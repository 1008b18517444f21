"""A Hugging Face causal LM trained with SCAPE the plain way: no DDP, no Trainer.

    torchrun --standalone --nproc-per-node=2 examples/hf_causal_lm.py --steps 40 --out run.json

Gloo on CPU, NCCL when CUDA is available (one GPU per rank). A tiny GPT-2 (random weights
from a config: nothing is downloaded) learns the bytes of the Python standard library's
source, each rank its own share of every global batch. It is README "Use in your own trainer"
step by step: ``broadcast_parameters``, ``scape.SCAPE`` with two param groups (weight decay on
matrices only), ``opt.attach``, a warm-up + cosine ``LambdaLR``, clipping by SCAPE
(``max_grad_norm=``, never ``clip_grad_norm_``) and a checkpoint that holds the scheduler.
Rank 0 prints the loss (mean over ranks) and writes ``--out``: the losses and what a dense and
a sparse step sent (``opt.last_step.bytes``, by collective).
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel

import scape


def stdlib_bytes() -> torch.Tensor:
    """The source of 200 standard-library modules as one byte string (every Python has it)."""
    files = sorted(Path(os.__file__).parent.glob("*.py"))[:200]
    return torch.frombuffer(bytearray(b"".join(f.read_bytes() for f in files)), dtype=torch.uint8)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--sparsity", type=float, default=0.99)
    ap.add_argument("--block-size", type=int, default=256)
    ap.add_argument("--warmup-steps", type=int, default=10, help="SCAPE's dense steps")
    ap.add_argument("--batch", type=int, default=8, help="sequences per rank and step")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--ckpt", default=None, help="save a SCAPE checkpoint here at the end")
    ap.add_argument("--out", default="hf_causal_lm.json")
    args = ap.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=256, n_positions=args.seq, n_embd=64, n_layer=2, n_head=4,
                     bos_token_id=None, eos_token_id=None)
    model = GPT2LMHeadModel(cfg).to(device)  # on its device *before* the optimizer is built
    scape.broadcast_parameters(model)  # every rank starts from rank 0's weights
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = scape.SCAPE([{"params": decay, "weight_decay": 0.1},
                       {"params": no_decay, "weight_decay": 0.0}],
                      lr=args.lr, sparsity=args.sparsity, block_size=args.block_size,
                      total_steps=args.steps, warmup_steps=args.warmup_steps,
                      max_grad_norm=1.0)
    opt.attach(model)  # the parameter all-gather is waited at the next forward

    def lr_factor(t: int) -> float:  # linear warm-up, then cosine down to 10%
        warm = max(1, args.steps // 10)
        done = min(1.0, max(0, t - warm) / max(1, args.steps - warm))
        return min(1.0, (t + 1) / warm) * (0.1 + 0.45 * (1 + math.cos(math.pi * done)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    data = stdlib_bytes()
    losses, seen = [], {}
    for step in range(args.steps):
        g = torch.Generator().manual_seed(step)  # global batch `step`; this rank's share
        starts = torch.randint(0, len(data) - args.seq, (world, args.batch), generator=g)[rank]
        x = torch.stack([data[s:s + args.seq] for s in starts]).long().to(device)
        loss = model(input_ids=x, labels=x).loss  # the model shifts the labels itself
        loss.backward()
        opt.step()
        opt.zero_grad()  # keeps SCAPE's buffer: it holds the error-feedback residual
        sched.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)  # for the log only (gloo has no AVG)
        losses.append(mean.item() / world)
        info = opt.last_step
        seen.setdefault("dense" if info.dense else "sparse", {
            "step": info.step, "dense": info.dense, "bytes": dict(info.bytes)})
        if rank == 0:
            print(f"step {step + 1:4d}  loss {losses[-1]:.4f}  lr {sched.get_last_lr()[0]:.2e}  "
                  f"{'dense ' if info.dense else 'sparse'} {sum(info.bytes.values()):9,} B",
                  flush=True)
    if args.ckpt:  # every rank writes its own shard; resume with scape.load_checkpoint
        scape.save_checkpoint(opt, args.ckpt, extra={"sched": sched})

    if rank == 0:
        print("bytes of a sparse step:", seen.get("sparse", {}).get("bytes"))
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"world": world, "sparsity": args.sparsity, "block_size": args.block_size,
                       "max_grad_norm": opt.max_grad_norm, "grad_bytes": 4,
                       "param_bytes": next(model.parameters()).element_size(),
                       "losses": losses, "first_loss": losses[0], "last_loss": losses[-1],
                       "group_numels": [sum(p.numel() for p in g) for g in (decay, no_decay)],
                       "bucket_n_pad": [b.n_pad for b in opt.buckets],
                       "bucket_group": [b.group for b in opt.buckets],
                       "bucket_apart": [b.apart for b in opt.buckets],
                       "dense_step": seen.get("dense"), "sparse_step": seen.get("sparse")},
                      f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
