"""Two levels: dense inside the node, sparse across nodes (docs/design.md §1, "Two levels").

With a :class:`scape.comm.HierarchicalCommunicator` (R nodes of G ranks; rank
``o = l * R + n`` is place ``l`` of node ``n``), the flat buffer of a sparse bucket is cut
into G *slices*, slice ``l`` being the shards of the R ranks ``l * R .. l * R + R - 1``: the
ranks with place ``l`` in every node. Every step of such a bucket then runs in two parts:

1. **Inside the node, dense**: a sum reduce-scatter of the whole gradient buffer over the
   node's G ranks; rank ``(n, l)`` adds what it receives (the node's gradient over slice l)
   to the node's residual for its slice, :attr:`NodeLevel.res`, and its own buffer is
   emptied. Nothing of the node's gradient is lost or approximated inside the node.
2. **Across nodes, sparse**: the R ranks of slice l run the flat SCAPE step among
   themselves on ``res`` (the node's gradient plus what it has not sent yet): take at the
   slice's mask, reduce-scatter across nodes, update, all-gather the new values. The masks
   are made by the shards' owners, one step late, as in the flat optimizer. A dense step
   (warm-up, ``dense_every``) sends the whole residual across instead.

The parameter all-gather and the mask all-gather are the communicator's two-level ones
(across nodes first: only the slice's ``K / G`` values cross the node's link per rank; then
inside the node). The residual is kept at the scale of a node's *sum* of gradients, so that
the sum over all ranks of what they keep is the sum of every gradient not yet sent, as in
the flat optimizer: checkpoints store it in the ``residual`` of the rank's buffer, and load
on either layout.
"""

from __future__ import annotations

from typing import Any

import torch

from scape.buffers import Bucket
from scape.comm import HierarchicalCommunicator
from scape.kernels import grad_stats


class NodeLevel:
    """Per sparse bucket, the node's residual over this rank's slice, and the norm of the
    node's fresh gradient (for clipping, :func:`scape.grad_watch.clip_norm`)."""

    def __init__(self, comm: HierarchicalCommunicator, buckets: list[Bucket],
                 sparse: list[bool]) -> None:
        self.comm = comm
        self.nodes, self.per_node = comm.nodes, comm.per_node
        self.place = comm.intra.rank
        self.res: list[torch.Tensor | None] = [
            torch.zeros(b.n_pad // self.per_node, dtype=torch.float32, device=b.device)
            if s else None for b, s in zip(buckets, sparse)]
        self.fresh: list[torch.Tensor | None] = [None] * len(buckets)

    def slice_of(self, b: Bucket) -> slice:
        """This rank's slice of bucket ``b``'s flat buffer."""
        size = b.n_pad // self.per_node
        return slice(self.place * size, (self.place + 1) * size)

    def shard_in_slice(self, b: Bucket) -> slice:
        """This rank's shard, as a range of its slice."""
        start = b.shard_start - self.slice_of(b).start
        return slice(start, start + b.shard_size)

    def mask_rows(self, mask: torch.Tensor, n_local: int) -> torch.Tensor:
        """The rows of a whole mask (``[W * n_local, k]``) that fall in this rank's slice."""
        rows = self.nodes * n_local
        return mask[self.place * rows:(self.place + 1) * rows]

    def launch(self, b: Bucket, dtype: torch.dtype) -> tuple[torch.Tensor, Any]:
        """Start the node's dense reduce-scatter (sum) of ``b``'s gradient buffer."""
        inp = b.grad_flat if dtype == torch.float32 else b.grad_flat.to(dtype)
        out = torch.empty(b.n_pad // self.per_node, dtype=dtype, device=b.device)
        return out, self.comm.intra.reduce_scatter(out, inp, op="sum")

    def land(self, i: int, b: Bucket, recv: torch.Tensor, count_fresh: bool) -> None:
        """Add what the node sent this rank into its residual; empty the rank's buffer."""
        recv = recv.float()
        res = self.res[i]
        assert res is not None
        if count_fresh:  # the node's mean fresh gradient over the slice (clip_norm's F)
            self.fresh[i] = grad_stats(recv)[0] / float(self.per_node ** 2)
        res.add_(recv)
        b.grad_flat.zero_()

    def residual(self, i: int, b: Bucket) -> torch.Tensor:
        """The rank's buffer with the residual added over its slice (what checkpoints keep)."""
        full = b.grad_flat.detach().clone()
        res = self.res[i]
        if res is not None:
            full[self.slice_of(b)].add_(res)
        return full

    def adopt(self, buckets: list[Bucket]) -> None:
        """After a load wrote the residuals into the buffers: this rank's slice of its buffer
        becomes the node's residual again (bit-exact resume); the rest of a buffer (a
        checkpoint of another layout) is sent with the next step's gradient."""
        for b, res in zip(buckets, self.res):
            if res is not None:
                part = b.grad_flat[self.slice_of(b)]
                res.copy_(part)
                part.zero_()
        self.fresh = [None] * len(self.res)

    def clear(self) -> None:
        """Forget the residuals (after a skipped step, or a load that wrote the buffers)."""
        for res in self.res:
            if res is not None:
                res.zero_()
        self.fresh = [None] * len(self.res)
