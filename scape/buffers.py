"""Flat parameter and gradient buffers, and the shard each rank owns.

One :class:`Bucket` per (param group, dtype), and one more per dtype for parameters set apart
within their group (:mod:`scape.embeddings`). Its parameters become views into one flat
buffer of the model dtype (``param_flat``), so the parameter all-gather writes straight into
the model. Gradients land in one flat fp32 buffer (``grad_flat``) that also holds the
error-feedback residual:

- fp32 params: ``p.grad`` *is* a view into ``grad_flat``; backward accumulates into it.
- bf16/fp16 params: a post-accumulate-grad hook adds ``p.grad`` into ``grad_flat`` (in fp32)
  and frees it (Megatron's main-grad pattern).

Layout (W ranks, block size B)::

    | p0 | p1 | ... | p_last | padding |      length N_pad, a multiple of W * B
    |<- rank 0 shard ->|<- rank 1 shard ->| ...   each S = N_pad / W, block-aligned

Padding coordinates have zero gradient forever, so they never move.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from scape.local_shards import is_dtensor, local, norm_weight

DENSE_ALIGN = 128
"""Shard alignment (elements) of buckets that are always dense (no block structure)."""

HOOK_ATTR = "_scape_grad_hook"
"""Attribute of a bf16/fp16 parameter holding its gradient hook's handle: an optimizer built
later over the same parameter removes the earlier one's hook (one owner per parameter)."""


def flat_layout(params: Sequence[torch.Tensor], unit: int) -> tuple[list[int], list[int], int]:
    """``(numels, offsets, n_pad)`` of ``params`` laid end to end in one flat buffer:
    ``offsets[i]`` is where parameter ``i`` starts (``offsets[-1]`` is the total) and ``n_pad``
    the total rounded up to a multiple of ``unit``."""
    numels = [p.numel() for p in params]
    offsets = [0]
    for n in numels:
        offsets.append(offsets[-1] + n)
    return numels, offsets, max(1, -(-offsets[-1] // unit)) * unit


class Bucket:
    """The flat buffers of one param group and dtype, and this rank's shard of them."""

    def __init__(self, params: Sequence[torch.nn.Parameter], group: int, world: int, rank: int,
                 align: int, apart: bool = False) -> None:
        if not params:
            raise ValueError("a bucket needs at least one parameter")
        self.params = list(params)
        self.group = group
        self.apart = apart
        """Whether these parameters were set apart from the rest of their group (SCAPE's
        embedding matrices: :mod:`scape.embeddings`)."""
        self.dtensor = is_dtensor(self.params[0])
        """Whether the parameters are DTensors (FSDP2, tensor parallel): the buffers then hold
        copies of their local shards (:mod:`scape.local_shards`)."""
        shards = [local(p) for p in self.params]
        self.shapes = [tuple(t.shape) for t in shards]
        """The shape of each parameter as the buffers hold it (a DTensor's: its local shard)."""
        self.norm_weight = norm_weight(self.params[0])
        """What this rank's buffers count for in a sum over the parameters' mesh (1: all)."""
        self.dtype = shards[0].dtype
        self.device = shards[0].device
        self.numels, self.offsets, self.n_pad = flat_layout(shards, world * align)
        self.numel = self.offsets[-1]
        self.shard_size = self.n_pad // world
        self.shard_start = rank * self.shard_size
        self.world, self.rank = world, rank

        self.param_flat = torch.zeros(self.n_pad, dtype=self.dtype, device=self.device)
        self.grad_flat = torch.zeros(self.n_pad, dtype=torch.float32, device=self.device)
        self._views: list[torch.Tensor] = []
        self._param_views: list[torch.Tensor] = []
        self._hooks = []
        self._moved = False
        self.on_grad: Callable[[int, torch.Tensor], None] | None = None
        """Called with (index, gradient) before a DTensor parameter's gradient is added into
        the buffer (:class:`scape.grad_watch.GradWatch` watches through it)."""
        self.folded_version = -1
        """The buffer's version right after :meth:`fold_stray_grads` last added a gradient."""
        for j, (p, t, o, n) in enumerate(zip(self.params, shards, self.offsets, self.numels)):
            view = self.param_flat[o:o + n].view_as(t)
            view.copy_(t.detach())
            if not self.dtensor:
                p.data = view
            self._param_views.append(view)
            g_view = self.grad_flat[o:o + n].view_as(t)
            if p.grad is not None:  # a gradient computed before the optimizer existed
                g_view.add_(local(p.grad).detach().to(torch.float32))
                p.grad = None
            old = getattr(p, HOOK_ATTR, None)
            if old is not None:  # an earlier optimizer's hook: the newest optimizer owns p
                old.remove()
            if self.dtype == torch.float32 and not self.dtensor:
                p.grad = g_view
            else:
                handle = p.register_post_accumulate_grad_hook(self._make_hook(j, g_view))
                setattr(p, HOOK_ATTR, handle)
                self._hooks.append(handle)
            self._views.append(g_view)
        self._versions = self._seen()

    def _make_hook(self, j: int, g_view: torch.Tensor):
        def hook(p: torch.Tensor) -> None:
            if p.grad is not None:
                grad = local(p.grad)
                if self.on_grad is not None:
                    self.on_grad(j, grad)
                g_view.add_(grad.view_as(g_view))
                p.grad = None
        return hook

    def _seen(self) -> list:
        """What :meth:`written` compares: each parameter's version counter (a DTensor's
        local shard's, with where it lies: FSDP2 may give it new storage)."""
        if self.dtensor:
            return [(local(p).data_ptr(), local(p)._version) for p in self.params]
        return [p._version for p in self.params]

    def publish(self) -> None:
        """Write the parameter values of the buffer into DTensor parameters' local shards
        (plain parameters are views of it already)."""
        if not self.dtensor:
            return
        for p, view in zip(self.params, self._param_views):
            local(p).copy_(view)
        self._versions = self._seen()

    @property
    def shard(self) -> slice:
        return slice(self.shard_start, self.shard_start + self.shard_size)

    def fold_stray_grads(self) -> None:
        """Restore ``p.grad`` views replaced or cleared by the user, folding new gradients in.

        ``model.zero_grad(set_to_none=True)`` followed by backward leaves fresh ``p.grad``
        tensors: their values are added into the buffer (nothing is lost) and the view is put
        back. A Python loop over parameters, but it only compares pointers unless something
        was replaced.
        """
        fp32 = self.dtype == torch.float32 and not self.dtensor
        for i, (p, o, n) in enumerate(zip(self.params, self.offsets, self.numels)):
            g_view = self._views[i]
            if g_view.data_ptr() != self.grad_flat[o:].data_ptr():
                # ``g_view.data`` was replaced (``model.to(...)`` moves ``p.grad`` in place
                # of its data): its values are the gradient, a new view takes its place
                g_view = self._views[i] = self.grad_flat[o:o + n].view(self.shapes[i])
            g = p.grad
            if g is None:
                if fp32:
                    p.grad = g_view
                continue
            if g.is_sparse:  # checked first: a sparse tensor has no data pointer
                raise TypeError("SCAPE does not support sparse gradients (got a sparse grad "
                                f"for a parameter of shape {tuple(p.shape)}); use dense "
                                "embeddings (sparse=False)")
            if fp32 and g.data_ptr() == g_view.data_ptr() and g.shape == g_view.shape:
                continue
            g_view.add_(local(g).detach().to(torch.float32).view_as(g_view))
            p.grad = g_view if fp32 else None
            self.folded_version = self.grad_flat._version  # a write of ours (grad_watch)

    def write_grad_(self, values: torch.Tensor) -> None:
        """Overwrite the whole gradient buffer (gradient and residual) with ``values``, for a
        harness that feeds gradients without autograd; the optimizer takes it as written by
        backward (an in-place write of ``p.grad`` otherwise raises in ``step()``)."""
        self.grad_flat.copy_(values)
        self.folded_version = self.grad_flat._version

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def written(self) -> bool:
        """Whether a parameter was written from outside since :meth:`mark_written`
        (``model.load_state_dict``, an in-place edit). An in-place op on ``p`` bumps ``p``'s
        version counter; the optimizer writes ``param_flat``, which does not, and a write
        through ``p.data`` does not either (it is not seen)."""
        return self._moved or self._seen() != self._versions

    def mark_written(self) -> None:
        """Take the parameters' current values as seen (after adopting them)."""
        self._versions = self._seen()
        self._moved = False

    def reattach(self) -> None:
        """Put back parameters moved out of ``param_flat`` (``model.to(...)`` after the
        optimizer was built copies them, as the Hugging Face Trainer does): their values go
        into the buffer and ``p.data`` is its view again (:meth:`written` then reports them,
        so the optimizer adopts the values). A move to another device or dtype raises: the
        buffers stay where the optimizer was built. DTensor parameters' local shards written
        from outside are copied into the buffer the same way."""
        if self.dtensor:
            if self._seen() != self._versions:
                for p, view in zip(self.params, self._param_views):
                    view.copy_(local(p).detach().view_as(view))
                self._moved = True
            return
        for p, view in zip(self.params, self._param_views):
            if p.data_ptr() == view.data_ptr() and p.shape == view.shape:
                continue
            if p.device != self.device or p.dtype != self.dtype or p.shape != view.shape:
                raise ValueError(
                    f"a parameter of shape {tuple(p.shape)} moved to {p.device}/{p.dtype} "
                    f"after the optimizer was built on {self.device}/{self.dtype}; its "
                    "buffers cannot follow. Call model.to(...) before building the optimizer")
            view.copy_(p.detach())
            p.data = view
            self._moved = True
