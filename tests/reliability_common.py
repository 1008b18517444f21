"""Shared pieces of the reliability tests: a tiny seeded model with two param groups (a sparse
bucket and an always-dense one), data that depends only on (step, rank), and bitwise
snapshots of everything the optimizer and the model hold."""

from __future__ import annotations

import dataclasses
import hashlib
import time
from collections.abc import Mapping

import torch

import scape
from scape import faults

BLOCK = 256
OPT_KW = dict(lr=2e-2, sparsity=0.9, block_size=BLOCK, warmup_steps=3, dense_every=5,
              update="agree", weight_decay=0.01)
EXPLORE = 0.25
"""The masks take a quarter of each block's budget by age: the age path runs every step."""


def explore_rule(update: str) -> str:
    """The rule ``update`` at :data:`EXPLORE`, registered (idempotent) under a name of its own
    (in every process that builds an optimizer: the registry is per process)."""
    name = f"{update}-explore{EXPLORE:g}"
    if name not in scape.rules.RULES:
        base = scape.rules.get(update)
        scape.rules.register(name, dataclasses.replace(base, explore=EXPLORE))
    return name


FAULT_ENV = "SCAPE_FAULT"
"""Where ``tests/torchrun_train.py`` reads its fault spec (:func:`scape.faults.parse`'s format):
the process that torchrun starts can be told nothing else."""


def env_faults(rank: int, environ: Mapping[str, str]) -> list[faults.Fault]:
    """This rank's faults of ``environ[FAULT_ENV]``; none when it is unset or empty, or in a
    restarted attempt of a torchrun job (``TORCHELASTIC_RESTART_COUNT`` > 0), so that a
    restarted job runs clean."""
    spec = environ.get(FAULT_ENV, "").strip()
    if not spec:
        return []
    mine = faults.parse(spec, rank)
    if int(environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0:
        return []
    return mine


def make_model(seed: int = 0) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.Tanh(), torch.nn.Linear(40, 6))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model


def make_opt(model: torch.nn.Module, comm=None, **over) -> scape.SCAPE:
    kw = {**OPT_KW, **over}
    kw["update"] = explore_rule(kw["update"])
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    other = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    groups = [{"params": decay}, {"params": other, "sparsity": 0.0, "weight_decay": 0.0}]
    return scape.SCAPE(groups, comm=comm, **kw)


_W_TRUE = torch.randn(24, 6, generator=torch.Generator().manual_seed(99))


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7919 * step + 104729 * rank + 1)
    x = torch.randn(32, 24, generator=g)
    return x, torch.tanh(x @ _W_TRUE)


def eval_loss(model: torch.nn.Module) -> float:
    """Loss on a fixed held-out batch, the same on every rank and world size."""
    x, y = batch(0, 10_000)
    with torch.no_grad():
        return float(torch.nn.functional.mse_loss(model(x), y))


def train_step(model: torch.nn.Module, opt, step: int, rank: int) -> float:
    """Forward, backward and ``opt.step()`` on the batch of (step, rank); returns the loss."""
    x, y = batch(step, rank)
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return float(loss.detach())


def snapshot(opt, wait: bool = True) -> dict[str, torch.Tensor]:
    """Clones of the parameters, master weights, moments, ages, residuals and both masks.

    ``wait=False`` waits for nothing (no collective is completed here): a mask still in
    flight is left out.
    """
    if wait:
        opt.finish_param_sync()
    out: dict[str, torch.Tensor] = {}
    for i, (b, s) in enumerate(zip(opt.buckets, opt.shards)):
        out[f"{i}.params"] = b.param_flat.clone()
        out[f"{i}.master"] = s.master.clone()
        out[f"{i}.m"] = s.m.clone()
        out[f"{i}.age"] = s.age.clone()
        out[f"{i}.residual"] = b.grad_flat.clone()
        mask = opt.masks[i]
        if mask is not None:
            if wait:
                mask.wait()
            elif mask.work is not None:
                out[f"{i}.mask_current"] = mask.current.clone() if mask.current is not None \
                    else torch.empty(0, dtype=torch.int16)
                continue
            for key in ("current", "next"):
                t = getattr(mask, key)
                out[f"{i}.mask_{key}"] = torch.empty(0, dtype=torch.int16) if t is None \
                    else t.clone()
    out["step"] = torch.tensor([opt.step_count])
    return out


def differing(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor],
              skip: tuple[str, ...] = ()) -> list[str]:
    """Keys whose tensors are not bitwise equal (dtype, shape and every byte)."""
    bad = []
    for k in sorted(set(a) | set(b)):
        if any(k.endswith(s) for s in skip):
            continue
        x, y = a.get(k), b.get(k)
        if x is None or y is None or x.dtype != y.dtype or x.shape != y.shape or \
                not torch.equal(x.contiguous().view(-1).view(torch.uint8),
                                y.contiguous().view(-1).view(torch.uint8)):
            bad.append(k)
    return bad


def state_hash(snap: dict[str, torch.Tensor], skip: tuple[str, ...] = ()) -> str:
    h = hashlib.sha256()
    for k in sorted(snap):
        if any(k.endswith(s) for s in skip):
            continue
        h.update(k.encode())
        h.update(snap[k].contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class Clock:
    """Seconds since construction (for "within the timeout plus a margin")."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()

    def __call__(self) -> float:
        return time.monotonic() - self.t0
