"""How far above its best learning rate each sparse-step rule stays stable.

A 2.6k-parameter MLP regresses a random linear map (the model of the optimizer's loss test)
with SCAPE at 0.9 and 0.99 sparsity, for every rule and a few learning rates; prints the mean
training loss of the first and last 10 of 120 steps. A rule that moves a stale coordinate
many AdamS steps at once diverges where the plain rule does not.

    python -m bench.research.lr_stability            # about a minute on one core
"""

from __future__ import annotations

import argparse

import torch

from bench.engine.optimizers import Spec, build


def run(sparsity: float, lr: float, update: str, steps: int = 120) -> tuple[float, float]:
    """Mean training loss of the first and the last 10 steps with rule ``update`` (any name of
    :mod:`bench.research.rules` too) at ``sparsity`` (0: dense AdamS)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(),
                                torch.nn.Linear(64, 8))
    spec = Spec(lr=lr, sparsity=sparsity,
                kwargs=dict(block_size=256, warmup_steps=3, update=update))
    opt = build("scape" if sparsity > 0 else "adams", list(model.parameters()), spec)
    w_true = torch.randn(32, 8, generator=torch.Generator().manual_seed(123))
    losses = []
    for t in range(steps):
        x = torch.randn(64, 32, generator=torch.Generator().manual_seed(t))
        loss = torch.nn.functional.mse_loss(model(x), x @ w_true)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return sum(losses[:10]) / 10, sum(losses[-10:]) / 10


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lrs", type=float, nargs="+", default=[3e-2, 1e-2, 3e-3])
    ap.add_argument("--rules", nargs="+",
                    default=["lazy", "catchup_mean", "catchup_accum", "catchup_sqrt_accum"])
    ap.add_argument("--dense", action="store_true",
                    help="add a column of dense AdamS (sparsity 0; the same in both rows)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    names = args.rules + ["dense AdamS"] * args.dense
    print("| lr | sparsity | " + " | ".join(names) + " |")
    print("|---|---|" + "---|" * len(names))
    for lr in args.lrs:
        dense = run(0.0, lr, "lazy") if args.dense else None
        for sp in (0.9, 0.99):
            cells = []
            for rule in args.rules:
                first, last = run(sp, lr, rule)
                cells.append(f"{first:.1f} -> {last:.1f}")
            if dense is not None:
                cells.append(f"{dense[0]:.1f} -> {dense[1]:.1f}")
            print(f"| {lr:g} | {sp:g} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
