"""What happens to the gradient buffers between two steps.

The sharded optimizers keep one fp32 gradient buffer per bucket that holds this step's
gradient *and* the error-feedback residual (what earlier sparse steps did not send); for fp32
parameters ``p.grad`` is a view into it. An in-place write to ``p.grad`` outside ``backward()``
therefore also writes the residual: ``torch.nn.utils.clip_grad_norm_`` scales it,
``p.grad.mul_(1 / accum)`` divides it, ``model.zero_grad(set_to_none=False)`` erases it. So
every write is watched through the buffer's version counter (shared by all its views):

- a hook that runs before each gradient is accumulated checks that nothing wrote the buffer
  since the last step or the last accumulation;
- a hook after each accumulation records the version backward left;
- ``step()`` checks that nothing wrote it after backward.

A write found raises ``ValueError`` in ``step()`` (before anything is sent), naming the fix.
Assigning a new tensor to ``p.grad`` is not a write: ``step()`` adds it into the buffer (as
:meth:`scape.buffers.Bucket.fold_stray_grads`, which may also run before ``step()``).

With clipping on, the pre-accumulation hook also counts the norm of each incoming gradient,
per parameter, summed over the micro-batches of the step (:meth:`GradWatch.fresh_sumsq`):
the local *fresh* gradient, without the residual, which the dense-comparable clipping norm
needs (:func:`clip_norm`, which turns the step's all-reduced sums into that norm).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

OUTSIDE_WRITE = (
    "the gradient buffer was written in place outside backward() since the last step "
    "(torch.nn.utils.clip_grad_norm_, p.grad.mul_/div_/zero_, GradScaler.unscale_, "
    "model.zero_grad(set_to_none=False)). For this optimizer p.grad also holds the "
    "error-feedback residual, which such writes scale or erase. Clip with the optimizer's "
    "max_grad_norm= or opt.clip_grad_norm_(max_norm); scale the loss instead of the "
    "gradients; clear with opt.zero_grad() or model.zero_grad() (set_to_none=True); to "
    "change a gradient, assign a new tensor to p.grad (it is added into the buffer)")


class GradWatch:
    """Hooks on every parameter of ``buckets``: the version checks of the module docstring,
    and the fresh gradient norms when ``count_norms``."""

    def __init__(self, buckets: list[Any], count_norms: bool) -> None:
        self.buckets = buckets
        self.enabled = True
        self.count_norms = count_norms
        self.norms = [torch.zeros(len(b.params), dtype=torch.float32, device=b.device)
                      for b in buckets]
        self.counted = count_norms  # the norms cover every backward since the last step
        self.outside = [False] * len(buckets)
        self.expected = [b.grad_flat._version for b in buckets]
        self.handles: list[Any] = []
        ref = weakref.ref(self)
        for i, b in enumerate(buckets):
            if b.dtensor:  # FSDP2 assigns the gradient: the bucket's own hook reports it
                pre = _pre_hook(ref, i, None)
                b.on_grad = lambda j, grad, pre=pre: pre(grad, j)
            for j, p in enumerate(b.params):
                if not b.dtensor:
                    self.handles.append(p.register_hook(_pre_hook(ref, i, j)))
                self.handles.append(p.register_post_accumulate_grad_hook(_post_hook(ref, i)))

    def check(self) -> None:
        """Raise ``ValueError`` if a bucket was written outside backward since the last step."""
        if not self.enabled:
            return
        for i, b in enumerate(self.buckets):
            version = b.grad_flat._version
            if self.outside[i] or version not in (self.expected[i], b.folded_version):
                raise ValueError(OUTSIDE_WRITE)

    def reset(self) -> None:
        """After the optimizer wrote the buffers itself (a step, a load): take them as seen;
        the fresh norms count again from zero."""
        self.expected = [b.grad_flat._version for b in self.buckets]
        self.outside = [False] * len(self.buckets)
        for n in self.norms:
            n.zero_()
        self.counted = self.count_norms

    def fresh_sumsq(self, i: int) -> torch.Tensor | None:
        """Sum over bucket ``i``'s parameters of the squared norm of the gradient that
        backward produced since the last step (micro-batches summed by norm: exact for one
        backward per step, an upper bound with accumulation); None if not counted."""
        return self.norms[i].square().sum() if self.counted else None

    def remove(self) -> None:
        for b in self.buckets:
            b.on_grad = None
        for h in self.handles:
            h.remove()
        self.handles.clear()


def _pre_hook(ref: Any, i: int, j: int | None) -> Any:
    def hook(grad: torch.Tensor, at: int | None = None) -> None:
        j_ = j if at is None else at
        watch = ref()
        if watch is None:
            return
        if watch.buckets[i].grad_flat._version != watch.expected[i]:
            watch.outside[i] = True
        if watch.count_norms:
            watch.norms[i][j_] += torch.linalg.vector_norm(grad.detach(), dtype=torch.float32)
    return hook


def _post_hook(ref: Any, i: int) -> Any:
    def hook(p: torch.Tensor) -> None:
        watch = ref()
        if watch is not None:
            watch.expected[i] = watch.buckets[i].grad_flat._version
    return hook


def clip_norm(stats: torch.Tensor, world: int) -> torch.Tensor:
    """The gradient norm that clipping compares with ``max_grad_norm``, from the step's
    all-reduced ``stats`` = [sum of squares of the synchronized gradient, non-finite count,
    the part of the first on sparse buckets (A), the ranks' own sums of squares of what they
    sent there (W * B), the ranks' fresh-gradient sums of squares there (W * F)].

    On a dense bucket it is exact: the norm of the averaged gradient, as DDP + AdamW clips.
    On a sparse bucket only the sent coordinates are averaged, and they carry the residual
    too; the norm a dense step would see is estimated as ``rho * F``: the ranks' mean squared
    norm of this step's own gradient (counted as backward produces it, without the residual)
    times how much averaging shrank what was sent, ``rho = A / B`` in ``[1/W, 1]`` (1 when
    the ranks' gradients agree, 1/W when they are independent noise)."""
    a, b, f = stats[2], stats[3] / world, stats[4] / world
    rho = torch.where(b > 0, a / b.clamp(min=1e-30), torch.ones_like(a)).clamp(1.0 / world, 1.0)
    return ((stats[0] - a).clamp(min=0) + rho * f).sqrt()
