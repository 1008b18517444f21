"""Transform-domain selection for the quality research: SCAPE on a rotated parametrization.

DeMo's idea, in SCAPE's terms: pick the sparse set in a fixed orthogonal transform domain, so
that a sparse set of coefficients is a dense parameter update. With ``D`` an orthonormal
``c x c`` matrix applied to each run of ``c`` consecutive entries of a weight (a row chunk of a
row-major matrix), the optimizer trains ``theta_hat = D theta`` instead of ``theta``:

- the gradient is ``D g`` (``D`` orthogonal), added into ``theta_hat.grad`` every step, so
  SCAPE's error feedback keeps its residual in the coefficient domain;
- after the step the model's weights are rebuilt as ``theta = D^T theta_hat``.

This is exactly SCAPE (masks, take, reduce-scatter, AdamS, all-gather of the new coefficient
values, bytes) run on the rotated model; no optimizer code changes. AdamS normalizes per
coefficient, so the rotation changes the dynamics; dense AdamS on the rotated model is a
different optimizer, which is why the rows compare with dense AdamS on the plain model.
Transforms: ``dct`` (DCT-II, DeMo's choice), ``hadamard`` (``c`` a power of two), ``random``
(a fixed random orthogonal matrix from seed 0).
"""

from __future__ import annotations

import math
import weakref
from typing import Any

import torch

TRANSFORMS = ("dct", "hadamard", "random")


def transform_matrix(kind: str, c: int) -> torch.Tensor:
    """The orthonormal ``c x c`` matrix of ``kind`` (rows are the basis vectors), fp32."""
    if kind not in TRANSFORMS:
        raise ValueError(f"transform must be one of {TRANSFORMS}, got {kind!r}")
    if not isinstance(c, int) or isinstance(c, bool) or c < 2:
        raise ValueError(f"transform chunk must be an int >= 2, got {c!r}")
    if kind == "dct":
        n = torch.arange(c, dtype=torch.float64)
        d = math.sqrt(2.0 / c) * torch.cos(math.pi * (n[None, :] + 0.5) * n[:, None] / c)
        d[0] /= math.sqrt(2.0)
    elif kind == "hadamard":
        if c & (c - 1):
            raise ValueError(f"the hadamard transform needs a power-of-two chunk, got {c}")
        d = torch.ones(1, 1, dtype=torch.float64)
        while d.shape[0] < c:
            d = torch.cat([torch.cat([d, d], 1), torch.cat([d, -d], 1)], 0)
        d /= math.sqrt(c)
    else:
        g = torch.Generator().manual_seed(0)
        d, _ = torch.linalg.qr(torch.randn(c, c, generator=g, dtype=torch.float64))
    return d.float()


class Rotated:
    """Shadow parameters ``theta_hat = D theta`` for ``params`` (each a multiple of ``c`` long).

    ``shadows`` go to the optimizer in place of ``params``; call :meth:`push_grads` after
    backward (adds ``D g`` into each shadow's grad and clears the model's) and :meth:`pull`
    after ``opt.step()`` (writes ``D^T theta_hat`` back into the model).
    """

    def __init__(self, params: list[torch.nn.Parameter], kind: str, c: int) -> None:
        self.d = transform_matrix(kind, c)
        self.c = c
        for p in params:
            if p.numel() % c:
                raise ValueError(f"a parameter of shape {tuple(p.shape)} is not a multiple of "
                                 f"the transform chunk {c}")
        self.params = list(params)
        self.shadows = [torch.nn.Parameter(self._fwd(p.detach())) for p in self.params]
        self._pushed = [False] * len(self.shadows)  # a grad of ours is in the shadow

    def _fwd(self, x: torch.Tensor) -> torch.Tensor:
        return (x.reshape(-1, self.c) @ self.d.T).reshape(-1)

    def push_grads(self) -> None:
        """Hand ``D g`` to the optimizer as a new tensor in each shadow's ``grad`` (the
        optimizer adds it into its buffer; an in-place add into its ``grad`` view would write
        the residual outside backward, which it refuses); pushes before one step are summed
        here."""
        for i, (p, s) in enumerate(zip(self.params, self.shadows)):
            if p.grad is None:
                continue
            g = self._fwd(p.grad)
            if not self._pushed[i]:
                s.grad = g
                self._pushed[i] = True
            else:
                s.grad.add_(g)
            p.grad = None

    @torch.no_grad()
    def pull(self) -> None:
        self._pushed = [False] * len(self.shadows)
        for p, s in zip(self.params, self.shadows):
            p.copy_((s.reshape(-1, self.c) @ self.d).reshape(p.shape))


_MADE: weakref.WeakKeyDictionary[torch.nn.Module, Rotated] = weakref.WeakKeyDictionary()
"""The :class:`Rotated` that :meth:`Rotation.param_groups` made for a model, until the hook of
the same rank takes it."""


class Rotation:
    """The ``RunConfig.hooks`` factory of a transform-domain row (``-dct64``,
    ``-hadamard128``): the optimizer is built over the shadows of the first param group (the
    weight matrices) in the ``kind`` domain of chunk ``chunk``; after the backward pass the
    gradients move there (:meth:`Rotated.push_grads`), after the step the weights come back
    (:meth:`Rotated.pull`)."""

    def __init__(self, cfg: Any, module: torch.nn.Module, opt: Any, kind: str,
                 chunk: int) -> None:
        self.rotated = _MADE.pop(module)

    @staticmethod
    def check(cfg: Any, kind: str, chunk: int) -> None:
        transform_matrix(kind, chunk)  # its checks, before launch
        if cfg.one_group:
            raise ValueError("a transform row rotates the weight matrices' group: one_group "
                             "must be False")

    @staticmethod
    def param_groups(cfg: Any, module: torch.nn.Module, groups: list[dict[str, Any]],
                     kind: str, chunk: int) -> list[dict[str, Any]]:
        rotated = Rotated(groups[0]["params"], kind, chunk)
        _MADE[module] = rotated
        return [dict(groups[0], params=rotated.shadows), *groups[1:]]

    def after_backward(self, step: int) -> None:
        self.rotated.push_grads()

    def after_step(self, step: int) -> None:
        self.rotated.pull()
