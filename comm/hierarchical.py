"""``HierarchicalCommunicator``: two levels of ranks, a fast one inside a node and a slow one
across nodes, seen as one group of ``R * G`` ranks.

``intra`` is the node's group (its G ranks, NVLink; the *shard* dimension of an FSDP2 HSDP
mesh) and ``inter`` the group of the ranks that have the same place in every node (R ranks,
one per node, over the network; the *replicate* dimension). The rank of the whole group is
``intra.rank * R + inter.rank``: the ranks of one node are G apart and the R ranks of one
``inter`` group are neighbours. With that order every collective is two plain collectives of
the levels, and each rank's slow-level payload is ``1/G`` of its flat payload (whether that
is less than a flat collective puts on the node's link depends on the flat algorithm: NCCL's
topology-aware rings already leave a node once; gloo's do not)::

    all_gather      inter (n values -> R*n), then intra (R*n -> W*n)
    reduce_scatter  intra (W*m -> R*m), then inter (R*m -> m)
    all_reduce      intra, then inter
    broadcast       inter from src's node, then intra from src's place in the node
    all_to_all      intra (segments of R*m), a local transpose, inter (segments of G*m),
                    and a local transpose into ``out`` inside ``wait()``

The second collective is launched inside ``wait()``: the chains of this communicator are
advanced in the order they were issued, whichever is waited first, so every rank launches
the second halves in the same order. What the first half moves overlaps with whatever runs
until then (the optimizer waits the slow half of a mask all-gather at the next step).

Byte counts (``stats``) are kept per level, ``"intra/<op>"`` and ``"inter/<op>"``, as each
level's communicator counts them (payload bytes, docs/design.md §1). An all_to_all counts its
whole payload, ``inp.nbytes``, at both levels: unlike the other collectives it does not shrink
the slow level's share (every segment for another node crosses the network once, and the
intra step first gathers in each rank the segments that go to its place in every node).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from .base import OPS, Communicator, FinishedWork, Work

LEVELS = ("intra", "inter")
"""The prefixes of the byte counters: inside a node, across nodes."""


class _Chain(Work):
    """A first collective in flight and the second one, launched once the first is done."""

    def __init__(self, owner: HierarchicalCommunicator, first: Work,
                 second: Callable[[], Work]):
        self._owner, self._first, self._second = owner, first, second
        self._work: Work | None = None
        self._done = False

    def launch(self) -> None:
        """Wait for the first collective and enqueue the second (once)."""
        if self._work is None:
            self._first.wait()
            self._work = self._second()

    def wait(self) -> None:
        if self._done:
            return
        self._owner._advance(self)
        assert self._work is not None
        self._work.wait()
        self._done = True

    def is_completed(self) -> bool:
        return self._done or (self._work is not None and self._work.is_completed())


class HierarchicalCommunicator(Communicator):
    """The Communicator protocol over two levels (module docstring).

    Args:
        intra: the ranks of this node (a :class:`Communicator` or a ``ProcessGroup``).
        inter: the ranks with this rank's place in every node, one per node (idem).

    ``scape.SCAPE(..., comm=mesh)`` with a two-dimensional ``DeviceMesh`` (``replicate``
    outermost, as FSDP2's HSDP takes it) builds one; the optimizer then reduces gradients
    densely inside the node and sends only its sparse traffic across nodes (docs/design.md
    §1, "Two levels").
    """

    def __init__(self, intra: Any, inter: Any) -> None:
        from . import as_communicator

        self.intra: Communicator = as_communicator(intra)
        self.inter: Communicator = as_communicator(inter)
        if self.intra.device != self.inter.device:
            raise ValueError(f"HierarchicalCommunicator: intra is on {self.intra.device} and "
                             f"inter on {self.inter.device}; both levels need one device")
        self.nodes, self.per_node = self.inter.world_size, self.intra.world_size
        self.rank = self.intra.rank * self.nodes + self.inter.rank
        self.world_size = self.nodes * self.per_node
        self.device = self.intra.device
        self._step = None
        self._queue: list[_Chain] = []

    def __repr__(self) -> str:
        return (f"HierarchicalCommunicator(nodes={self.nodes}, per_node={self.per_node}, "
                f"rank={self.rank}, intra={self.intra!r}, inter={self.inter!r})")

    # -- bookkeeping -----------------------------------------------------------------------
    @property
    def stats(self) -> Mapping[str, Mapping[str, int]]:
        """``{"intra/<op>" | "inter/<op>": {"calls", "bytes"}}``: each level's counters."""
        return {f"{level}/{op}": getattr(self, level).stats[op]
                for level in LEVELS for op in OPS}

    def reset_stats(self) -> None:
        self.intra.reset_stats()
        self.inter.reset_stats()

    def set_step(self, step: int | None) -> None:
        super().set_step(step)
        self.intra.set_step(step)
        self.inter.set_step(step)

    def global_ranks(self) -> list[int]:
        """The default group's rank of every rank of this one, in this group's order (one
        all-gather): for DCP, which places shards by global rank."""
        import torch.distributed as dist

        mine = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        rows = torch.empty(self.world_size, dtype=torch.int64, device=self.device)
        self.all_gather(rows, torch.tensor([mine], dtype=torch.int64,
                                           device=self.device)).wait()
        return [int(r) for r in rows.cpu()]

    def _advance(self, upto: _Chain) -> None:
        """Launch the second halves of every chain issued up to ``upto``, in issue order."""
        while self._queue:
            chain = self._queue.pop(0)
            chain.launch()
            if chain is upto:
                return
        upto.launch()

    def _chain(self, first: Work, second: Callable[[], Work]) -> Work:
        chain = _Chain(self, first, second)
        self._queue.append(chain)
        return chain

    # -- collectives -----------------------------------------------------------------------
    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> Work:
        self._check_all_gather(out, inp)
        mid = torch.empty(self.nodes * inp.numel(), dtype=inp.dtype, device=inp.device)
        first = self.inter.all_gather(mid, inp.view(-1))
        return self._chain(first, lambda: self.intra.all_gather(out.view(-1), mid))

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, op: str = "avg") -> Work:
        self._check_reduce_scatter(out, inp, op)
        mid = torch.empty(self.nodes * out.numel(), dtype=inp.dtype, device=inp.device)
        first = self.intra.reduce_scatter(mid, inp.view(-1), op=op)
        return self._chain(first, lambda: self.inter.reduce_scatter(out.view(-1), mid, op=op))

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor) -> Work:
        """Two one-level all-to-alls. The segment for rank ``a * R + b`` (place a, node b)
        first goes inside the node to place a (intra, the R segments for place a are
        contiguous), then across nodes to node b (inter), each time in one collective;
        local transposes between and after put the segments in the group's rank order."""
        self._check_all_to_all(out, inp)
        nodes, per_node = self.nodes, self.per_node
        m = inp.numel() // self.world_size
        mid = torch.empty_like(inp)
        first = self.intra.all_to_all(mid, inp)

        def second() -> Work:
            # mid[a_src, b'] came from (a_src, this node) for (this place, b'): group by b'
            send = mid.view(per_node, nodes, m).transpose(0, 1).contiguous().view(-1)
            recv = torch.empty_like(inp)  # recv[b_src, a_src]: from rank a_src * R + b_src
            work = self.inter.all_to_all(recv, send)

            def finish() -> None:  # back to the group's order: [a_src, b_src]
                out.view(per_node, nodes, m).copy_(recv.view(nodes, per_node, m).transpose(0, 1))

            return FinishedWork(work, finish)

        return self._chain(first, second)

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> Work:
        self._check_all_reduce(t, op)
        first = self.intra.all_reduce(t, op=op)
        return self._chain(first, lambda: self.inter.all_reduce(t, op=op))

    def broadcast(self, t: torch.Tensor, src: int) -> Work:
        self._check_broadcast(t, src)
        local, node = divmod(src, self.nodes)
        first = self.inter.broadcast(t, node)
        return self._chain(first, lambda: self.intra.broadcast(t, local))

    def barrier(self) -> None:
        for chain in list(self._queue):
            chain.wait()
        self.intra.barrier()
        self.inter.barrier()

    def _reducible_dtypes(self) -> tuple[torch.dtype, ...]:
        return self.intra._reducible_dtypes()
