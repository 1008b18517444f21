"""How a step's gradients leave the rank: one level (:class:`FlatLevel`) or two
(:class:`NodeLevel`: dense inside the node, sparse across nodes; docs/design.md §1, "Two
levels"). The optimizer holds one of these as ``opt.level`` and asks it, per bucket, which
buffer a step sends from, over which group, and what a checkpoint keeps as the residual.

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
from scape.comm import Communicator, HierarchicalCommunicator
from scape.grad_watch import GradWatch
from scape.kernels import grad_stats
from scape.profiling import phase


class FlatLevel:
    """One level: every rank sends from its own gradient buffer over the whole group."""

    def __init__(self, comm: Communicator) -> None:
        self.comm = comm

    @property
    def senders(self) -> int:
        """How many independent contributions a step averages (``hp["world"]`` of the
        rules, and the clipping norm's count): the ranks."""
        return self.comm.world_size

    def gather_inside(self, buckets: list[Bucket], dtype: torch.dtype,
                      count_fresh: bool) -> None:
        """Called at the start of every step, before the rule observes anything: nothing on
        one level."""

    def buffer(self, i: int, b: Bucket) -> torch.Tensor:
        """What bucket ``i`` sends from this step: its gradient and residual (the non-finite
        check and the residual's norm read it)."""
        return b.grad_flat

    def own(self, i: int, b: Bucket) -> torch.Tensor:
        """This rank's shard of :meth:`buffer` (what the rule observes)."""
        return b.grad_flat[b.shard]

    def fresh_sumsq(self, i: int, watch: GradWatch) -> torch.Tensor | None:
        """This step's own gradient's sum of squares over bucket ``i`` (clipping)."""
        return watch.fresh_sumsq(i)

    def residual(self, i: int, b: Bucket) -> torch.Tensor:
        """Bucket ``i``'s gradient and residual as a whole buffer (what checkpoints keep)."""
        return b.grad_flat.detach().clone()

    def dense_launch(self, i: int, b: Bucket, dtype: torch.dtype) -> tuple[torch.Tensor, Any]:
        """Start a dense step's averaging reduce-scatter of bucket ``i``:
        ``(received, work)``."""
        inp = b.grad_flat if dtype == torch.float32 else b.grad_flat.to(dtype)
        g = torch.empty(b.shard_size, dtype=dtype, device=b.device)
        return g, self.comm.reduce_scatter(g, inp, op="avg")

    def sparse_source(self, i: int, b: Bucket, mask: torch.Tensor, n_local: int,
                      dtype: torch.dtype) -> tuple[Communicator, torch.Tensor, torch.Tensor,
                                                   torch.dtype]:
        """A sparse step of bucket ``i`` with the whole ``mask``: the group its values are
        reduce-scattered over, the buffer they are taken from, the mask rows that apply
        there, and the dtype to take them in."""
        return self.comm, b.grad_flat, mask, dtype

    def to_wire(self, c: torch.Tensor, taken: torch.Tensor | None, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The taken values ``c`` (and their sum of squares) as they are sent."""
        return c, taken

    def clear(self) -> None:
        """Forget what the level keeps of the residuals (after a skipped step)."""

    def adopt(self, buckets: list[Bucket]) -> None:
        """After a load wrote the residuals into the buffers."""


class NodeLevel(FlatLevel):
    """Two levels (module docstring): per sparse bucket, the node's residual over this
    rank's slice, and the norm of the node's fresh gradient (for clipping,
    :func:`scape.grad_watch.clip_norm`). Buckets of dense groups go as on one level."""

    def __init__(self, comm: HierarchicalCommunicator, buckets: list[Bucket],
                 sparse: list[bool]) -> None:
        super().__init__(comm)
        self.hier = comm
        self.nodes, self.per_node = comm.nodes, comm.per_node
        self.place = comm.intra.rank
        self.res: list[torch.Tensor | None] = [
            torch.zeros(b.n_pad // self.per_node, dtype=torch.float32, device=b.device)
            if s else None for b, s in zip(buckets, sparse)]
        self.fresh: list[torch.Tensor | None] = [None] * len(buckets)

    @property
    def senders(self) -> int:
        """The nodes: each sends its node's mean gradient."""
        return self.nodes

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

    def gather_inside(self, buckets: list[Bucket], dtype: torch.dtype,
                      count_fresh: bool) -> None:
        """Every step of a sparse bucket first reduces the node's gradient densely into the
        node's residual (what the rule observes and the step sends)."""
        launched = []
        with phase("scape/reduce_scatter", buckets[0].device):
            for i, b in enumerate(buckets):
                if self.res[i] is not None:
                    launched.append((i, *self._launch(b, dtype)))
            for i, recv, work in launched:
                work.wait()
                self._land(i, buckets[i], recv, count_fresh)

    def _launch(self, b: Bucket, dtype: torch.dtype) -> tuple[torch.Tensor, Any]:
        """Start the node's dense reduce-scatter (sum) of ``b``'s gradient buffer."""
        inp = b.grad_flat if dtype == torch.float32 else b.grad_flat.to(dtype)
        out = torch.empty(b.n_pad // self.per_node, dtype=dtype, device=b.device)
        return out, self.hier.intra.reduce_scatter(out, inp, op="sum")

    def _land(self, i: int, b: Bucket, recv: torch.Tensor, count_fresh: bool) -> None:
        """Add what the node sent this rank into its residual; empty the rank's buffer."""
        recv = recv.float()
        res = self.res[i]
        assert res is not None
        if count_fresh:  # the node's mean fresh gradient over the slice (clip_norm's F)
            self.fresh[i] = grad_stats(recv)[0] / float(self.per_node ** 2)
        res.add_(recv)
        b.grad_flat.zero_()

    def buffer(self, i: int, b: Bucket) -> torch.Tensor:
        res = self.res[i]
        return b.grad_flat if res is None else res

    def own(self, i: int, b: Bucket) -> torch.Tensor:
        res = self.res[i]
        return b.grad_flat[b.shard] if res is None else res[self.shard_in_slice(b)]

    def fresh_sumsq(self, i: int, watch: GradWatch) -> torch.Tensor | None:
        return watch.fresh_sumsq(i) if self.res[i] is None else self.fresh[i]

    def residual(self, i: int, b: Bucket) -> torch.Tensor:
        """The rank's buffer with the residual added over its slice (what checkpoints keep)."""
        full = b.grad_flat.detach().clone()
        res = self.res[i]
        if res is not None:
            full[self.slice_of(b)].add_(res)
        return full

    def dense_launch(self, i: int, b: Bucket, dtype: torch.dtype) -> tuple[torch.Tensor, Any]:
        """A sparse bucket's dense step: the node's residual, all of it, across nodes."""
        res = self.res[i]
        if res is None:
            return super().dense_launch(i, b, dtype)
        inp = res.div(self.per_node).to(dtype)
        res.zero_()
        g = torch.empty(b.shard_size, dtype=dtype, device=b.device)
        return g, self.hier.inter.reduce_scatter(g, inp, op="avg")

    def sparse_source(self, i: int, b: Bucket, mask: torch.Tensor, n_local: int,
                      dtype: torch.dtype) -> tuple[Communicator, torch.Tensor, torch.Tensor,
                                                   torch.dtype]:
        """Across nodes only, from the node's residual over the slice (taken in fp32: it is
        scaled to the node's mean before it goes on the wire)."""
        return self.hier.inter, self.buffer(i, b), self.mask_rows(mask, n_local), torch.float32

    def to_wire(self, c: torch.Tensor, taken: torch.Tensor | None, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The node's sum -> its mean, so that the average across nodes is every rank's."""
        c = c.div_(self.per_node).to(dtype)
        return c, None if taken is None else taken / float(self.per_node ** 2)

    def adopt(self, buckets: list[Bucket]) -> None:
        """This rank's slice of its buffer becomes the node's residual again (bit-exact
        resume); the rest of a buffer (a checkpoint of another layout) is sent with the next
        step's gradient."""
        for b, res in zip(buckets, self.res):
            if res is not None:
                part = b.grad_flat[self.slice_of(b)]
                res.copy_(part)
                part.zero_()
        self.fresh = [None] * len(self.res)

    def clear(self) -> None:
        for res in self.res:
            if res is not None:
                res.zero_()
        self.fresh = [None] * len(self.res)
