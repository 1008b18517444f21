"""SCAPE inside the Hugging Face ``Trainer``: ``Trainer(..., optimizers=(opt, sched))``.

    torchrun --standalone --nproc-per-node=2 examples/hf_trainer.py --steps 40 --out run.json

Gloo on CPU, NCCL when CUDA is available. What must be set (transformers 5.x, accelerate 1.x):

- The Trainer wraps the model in DDP when the world size is > 1; SCAPE refuses a DDP that
  all-reduces. ``ScapeCallback.on_train_begin`` (after the wrap, before the first backward)
  calls ``scape.skip_ddp_allreduce(trainer.model_wrapped)``.
- ``max_grad_norm=0`` for the Trainer, ``max_grad_norm=`` for SCAPE: the Trainer would clip
  each rank's own unsynchronized gradient by its own norm.
- ``save_strategy="no"`` (or ``save_only_model=True``): the Trainer saves ``optimizer.pt`` from
  rank 0 only and loads it on every rank; SCAPE's state is per rank. The callback saves with
  ``scape.save_checkpoint`` on every rank, the scheduler and step with it (load with
  ``scape.load_checkpoint``; the Trainer's own data position is not in it).
- ``bf16`` or fp32, never ``fp16``: its GradScaler would unscale SCAPE's error-feedback
  residual, and SCAPE refuses it. ``gradient_accumulation_steps`` works as usual.
- The model on its device before SCAPE is built (accelerate's own ``model.to`` and its
  round trip of the optimizer's state dict to the device are then no-ops).

Rank 0 writes ``--out``: the losses the Trainer logged and what a sparse step sent.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

import scape


class StdlibBytes(torch.utils.data.Dataset):
    """``n`` windows of the standard library's source bytes (every Python has them)."""

    def __init__(self, n: int, seq: int, seed: int) -> None:
        files = sorted(Path(os.__file__).parent.glob("*.py"))[:200]
        text = b"".join(f.read_bytes() for f in files)
        self.data, self.seq = torch.frombuffer(bytearray(text), dtype=torch.uint8), seq
        self.starts = torch.randint(0, len(text) - seq, (n,),
                                    generator=torch.Generator().manual_seed(seed)).tolist()

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> dict:
        x = self.data[self.starts[i]:self.starts[i] + self.seq].long()
        return {"input_ids": x, "labels": x}  # the model shifts the labels itself


class ScapeCallback(TrainerCallback):
    """Makes the Trainer's DDP wrap safe, saves SCAPE checkpoints, records losses and bytes."""

    def __init__(self, trainer: Trainer, opt: scape.SCAPE, ckpt: str | None) -> None:
        self.trainer, self.opt, self.ckpt = trainer, opt, ckpt
        self.losses, self.steps, self.ddp = [], {}, False

    def on_train_begin(self, args, state, control, **kwargs):
        self.ddp = isinstance(self.trainer.model_wrapped, DistributedDataParallel)
        if self.ddp:
            scape.skip_ddp_allreduce(self.trainer.model_wrapped)

    def on_step_end(self, args, state, control, lr_scheduler=None, **kwargs):
        info = self.opt.last_step
        self.steps.setdefault("sparse" if not info.dense else "dense", {
            "step": info.step, "dense": info.dense, "bytes": dict(info.bytes)})
        if self.ckpt and state.global_step in (state.max_steps // 2, state.max_steps):
            scape.save_checkpoint(self.opt, self.ckpt, extra={
                "sched": lr_scheduler, "global_step": state.global_step})  # on every rank

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:  # the mean over ranks
            self.losses.append(logs["loss"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--sparsity", type=float, default=0.99)
    ap.add_argument("--block-size", type=int, default=256)
    ap.add_argument("--warmup-steps", type=int, default=10, help="SCAPE's dense steps")
    ap.add_argument("--batch", type=int, default=8, help="sequences per rank and micro-batch")
    ap.add_argument("--accum", type=int, default=1, help="gradient accumulation steps")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--ckpt", default=None)
    ap.add_argument("--out", default="hf_trainer.json")
    args = ap.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")  # first: SCAPE talks when it is built
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=256, n_positions=args.seq, n_embd=64, n_layer=2, n_head=4,
                     bos_token_id=None, eos_token_id=None)
    model = GPT2LMHeadModel(cfg).to(device)
    scape.broadcast_parameters(model)
    opt = scape.SCAPE(model.parameters(), lr=args.lr, sparsity=args.sparsity,
                      block_size=args.block_size, total_steps=args.steps,
                      warmup_steps=args.warmup_steps, weight_decay=0.1, max_grad_norm=1.0)

    def lr_factor(t: int) -> float:  # linear warm-up, then cosine down to 10%
        warm = max(1, args.steps // 10)
        done = min(1.0, max(0, t - warm) / max(1, args.steps - warm))
        return min(1.0, (t + 1) / warm) * (0.1 + 0.45 * (1 + math.cos(math.pi * done)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    targs = TrainingArguments(
        output_dir=os.path.join(os.path.dirname(os.path.abspath(args.out)), "trainer_out"),
        max_steps=args.steps, per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=args.accum, logging_steps=1, seed=0,
        max_grad_norm=0.0,  # SCAPE clips the synchronized gradient itself
        save_strategy="no",  # an optimizer.pt would hold rank 0's shard only
        bf16=cuda and torch.cuda.is_bf16_supported(), fp16=False,  # never a GradScaler
        ddp_find_unused_parameters=False,  # no per-step all-reduce of DDP's used-parameter map
        report_to="none", disable_tqdm=True, use_cpu=not cuda)
    data = StdlibBytes(args.steps * args.batch * args.accum * dist.get_world_size(), args.seq, 0)
    trainer = Trainer(model=model, args=targs, train_dataset=data, optimizers=(opt, sched))
    cb = ScapeCallback(trainer, opt, args.ckpt)
    trainer.add_callback(cb)
    trainer.train()

    if dist.get_rank() == 0:
        print("bytes of a sparse step:", cb.steps.get("sparse", {}).get("bytes"))
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"world": dist.get_world_size(), "sparsity": args.sparsity,
                       "block_size": args.block_size, "max_grad_norm": opt.max_grad_norm,
                       "grad_bytes": 4, "param_bytes": next(model.parameters()).element_size(),
                       "losses": cb.losses, "first_loss": cb.losses[0],
                       "last_loss": cb.losses[-1], "ddp_wrapped": cb.ddp,
                       "trainer_steps": trainer.state.global_step,
                       "group_numels": [sum(p.numel() for p in model.parameters())],
                       "bucket_n_pad": [b.n_pad for b in opt.buckets],
                       "bucket_group": [b.group for b in opt.buckets],
                       "bucket_apart": [b.apart for b in opt.buckets],
                       "dense_step": cb.steps.get("dense"), "sparse_step": cb.steps.get("sparse")},
                      f, indent=1)
    del trainer, cb  # its DDP wrap holds the process group: let it go first
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
