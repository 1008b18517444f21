"""Drift: every coordinate moves every step, from state that every rank already shares.

A sparse step moves a coordinate only when it is in the mask, so with density ``d`` a
coordinate moves about once every ``1/d`` steps, and between syncs the model stands still
there: the optimizer takes ``d`` times fewer steps per coordinate than dense AdamS, and each
one is a large-batch step built from the gradients that waited in the residuals. Drift keeps
the model moving in between, along the last synchronized direction, with no extra bytes:

    at a sync of coordinate i (after a steps without one), on every rank,
        from the new value p_new (the all-gathered one, identical on every rank):
        vel[i]    = (p_new - anchor[i]) / ((a + 1) * lr)      per-step rate, in units of lr
        anchor[i] = p_new;  age[i] = 0
    every step, for every coordinate, on every rank:
        model[i]  = anchor[i] + lr * vel[i] * G(age[i]),    G(s) = gamma + ... + gamma^s

``anchor``, ``vel`` and ``age`` are replicated (every rank holds them over the whole bucket:
12 bytes per parameter) and are computed only from what every rank already has: the mask,
the all-gathered values, and the LR of the step. Every rank therefore computes the same model
bit for bit, and the bytes per step are the plain SCAPE formula.

Two modes:

- ``commit=False`` (a forecast): the owner's fp32 master stays at the anchor, so the value at
  the next sync is the rule's step from the anchor; drift only changes where the model stands
  between syncs, and the next sync's gradient (taken at the drifted model) corrects it.
- ``commit=True``: before the rule's step the owner moves its master to the drifted value,
  so the drift is kept and the synchronized step corrects it from there (heavy-ball momentum
  over sync intervals; ``gamma < 1`` bounds it: ``G`` never exceeds ``gamma / (1 - gamma)``).

Dense steps set the state the same way (every coordinate is synced, ``a`` is its age).
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class DriftSpec:
    """How unsent coordinates move between syncs (see the module docstring)."""

    gamma: float
    """Per-step decay of the drift rate (1: constant rate until the next sync)."""
    commit: bool = False
    """Keep the drift in the owner's master (True) or only forecast with it (False)."""


class Drift:
    """The replicated drift state of one bucket (length ``n_pad`` each)."""

    def __init__(self, spec: DriftSpec, param_flat: torch.Tensor) -> None:
        self.spec = spec
        self.anchor = param_flat.detach().to(torch.float32).clone()
        self.vel = torch.zeros_like(self.anchor)
        self.age = torch.zeros(param_flat.numel(), dtype=torch.int32, device=param_flat.device)
        self.last_lr = 0.0
        """The LR of the last :meth:`apply` (a resumed run redraws the model with it)."""

    def growth(self, age: torch.Tensor) -> torch.Tensor:
        """``G(age) = gamma + gamma^2 + ... + gamma^age`` (fp32; 0 at age 0)."""
        g = self.spec.gamma
        a = age.to(torch.float32)
        if g == 1.0:
            return a
        return torch.pow(torch.full_like(a, g), a).neg_().add_(1.0).mul_(g / (1.0 - g))

    def offset(self, pos: torch.Tensor, lr: float) -> torch.Tensor:
        """The drift accumulated at flat positions ``pos`` (what the model has moved there)."""
        return self.vel[pos].mul_(self.growth(self.age[pos])).mul_(lr)

    def sync_sparse(self, pos: torch.Tensor, values: torch.Tensor, lr: float) -> None:
        """Coordinates ``pos`` were synced to ``values``; every other coordinate aged a step."""
        new = values.to(torch.float32)
        a1 = self.age[pos].to(torch.float32).add_(1.0)
        self.vel[pos] = (new - self.anchor[pos]).div_(a1.mul_(lr)) if lr > 0 else 0.0
        self.anchor[pos] = new
        self.age.add_(1)
        self.age[pos] = 0

    def sync_dense(self, values: torch.Tensor, lr: float) -> None:
        """Every coordinate was synced to ``values``."""
        new = values.to(torch.float32)
        if lr > 0:
            torch.div(new - self.anchor, self.age.to(torch.float32).add_(1.0).mul_(lr),
                      out=self.vel)
        else:
            self.vel.zero_()
        self.anchor.copy_(new)
        self.age.zero_()

    def apply(self, param_flat: torch.Tensor, lr: float) -> None:
        """``model = anchor + lr * vel * G(age)`` over the whole bucket (cast on write)."""
        moved = self.vel * self.growth(self.age)
        param_flat.copy_(moved.mul_(lr).add_(self.anchor))
        self.last_lr = lr

    def state(self) -> dict[str, torch.Tensor]:
        """Replicated state for a checkpoint (every rank saves the same tensors)."""
        return {"drift_anchor": self.anchor.clone(), "drift_vel": self.vel.clone(),
                "drift_age": self.age.clone(),
                "drift_lr": torch.tensor(self.last_lr, dtype=torch.float64)}

    def load(self, state: dict[str, torch.Tensor], numel: int, param_flat: torch.Tensor) -> None:
        """Restore :meth:`state` (saved at any world size: the first ``numel`` coordinates are
        the parameters, the rest padding) and redraw the model from it."""
        for name, dst in (("drift_anchor", self.anchor), ("drift_vel", self.vel),
                          ("drift_age", self.age)):
            dst.zero_()
            dst[:numel] = state[name][:numel].to(dst.device)
        self.apply(param_flat, float(state["drift_lr"]))
