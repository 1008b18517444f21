"""How far above its best learning rate each sparse-step rule stays stable.

A 2.6k-parameter MLP regresses a random linear map (the model of the optimizer's loss test)
with SCAPE at 0.9 and 0.99 sparsity, for every rule and a few learning rates; prints the mean
training loss of the first and last 10 of 120 steps. A rule that moves a stale coordinate
many AdamS steps at once diverges where the plain rule does not.

Each cell is one run of the engine's loop (:func:`bench.engine.runner.run`, one rank) on the
:class:`Regression` workload (``RunConfig.workload``) at a constant learning rate
(:class:`ConstantLr`, a ``RunConfig.hooks`` entry).

    python -m bench.research.lr_stability            # about two minutes on one core
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.nn.functional as F

from bench.engine.runner import RunConfig, run

STEPS = 120
"""Optimizer steps of every cell."""
MODULE = "bench.research.lr_stability"
"""This module's name in the ranks (``__name__`` is ``__main__`` under ``python -m``)."""


class _MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(),
                                       torch.nn.Linear(64, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self(x), y)


class Regression:
    """The ``RunConfig.workload`` of this study: the MLP (initialised from seed 0) regresses
    ``x @ w_true`` (``w_true`` from seed 123) on a fresh batch of 64 Gaussian inputs per step
    (micro-batch ``index`` from seed ``index``; each of W ranks takes its rows ``rank::W``); the
    validation loss is that of the batch of seed ``2**31 - 1``."""

    def __init__(self, cfg: RunConfig) -> None:
        self.w_true = torch.randn(32, 8, generator=torch.Generator().manual_seed(123))

    def model(self) -> torch.nn.Module:
        torch.manual_seed(0)
        return _MLP()

    def batch(self, index: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(64, 32, generator=torch.Generator().manual_seed(index))[rank::world]
        return x, x @ self.w_true

    @torch.no_grad()
    def val_loss(self, module: torch.nn.Module) -> float:
        x, y = self.batch(2**31 - 1, 0, 1)
        return float(module.loss(x, y))  # type: ignore[operator]


class ConstantLr:
    """The ``RunConfig.hooks`` factory that holds every group at ``RunConfig.lr`` (in place of
    the engine's warm-up and cosine schedule)."""

    def __init__(self, cfg: RunConfig, module: Any, opt: Any) -> None:
        self.lr, self.opt = cfg.lr, opt

    def before_step(self, step: int) -> None:
        for g in self.opt.param_groups:
            g["lr"] = self.lr


def config(sparsity: float, lr: float, update: str, steps: int = STEPS) -> RunConfig:
    """The run of one cell: rule ``update`` (any registered name) at ``sparsity`` (0: dense
    AdamS), one param group without weight decay, block 256, 3 dense warm-up steps."""
    return RunConfig(optimizer="scape" if sparsity > 0 else "adams", sparsity=sparsity,
                     optimizer_kwargs=dict(block_size=256, warmup_steps=3, update=update),
                     workload=f"{MODULE}:Regression", hooks={f"{MODULE}:ConstantLr": {}},
                     one_group=True, weight_decay=0.0, world=1, steps=steps, lr=lr,
                     eval_every=steps, threads=1, log_every=0, timeout_s=300.0,
                     name=f"{update}@{sparsity:g}-lr{lr:g}")


def run_cell(sparsity: float, lr: float, update: str, steps: int = STEPS) -> tuple[float, float]:
    """Mean training loss of the first and the last 10 steps of :func:`config`'s run."""
    losses = run(config(sparsity, lr, update, steps))["train_curve"]
    return sum(losses[:10]) / 10, sum(losses[-10:]) / 10


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lrs", type=float, nargs="+", default=[3e-2, 1e-2, 3e-3])
    ap.add_argument("--rules", nargs="+",
                    default=["lazy", "catchup_mean", "catchup_accum", "catchup_sqrt_accum"])
    ap.add_argument("--dense", action="store_true",
                    help="add a column of dense AdamS (sparsity 0; the same in both rows)")
    args = ap.parse_args(argv)
    names = args.rules + ["dense AdamS"] * args.dense
    print("| lr | sparsity | " + " | ".join(names) + " |")
    print("|---|---|" + "---|" * len(names))
    for lr in args.lrs:
        dense = run_cell(0.0, lr, "lazy") if args.dense else None
        for sp in (0.9, 0.99):
            cells = []
            for rule in args.rules:
                first, last = run_cell(sp, lr, rule)
                cells.append(f"{first:.1f} -> {last:.1f}")
            if dense is not None:
                cells.append(f"{dense[0]:.1f} -> {dense[1]:.1f}")
            print(f"| {lr:g} | {sp:g} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
