"""A communicator that plays rank ``rank`` of ``world_size`` without talking to anyone.

Used to measure an optimizer step's *local compute* -- every kernel and copy a rank runs,
with the collectives' waiting removed -- and for the compute-only floor of the benchmarks.
Collectives complete at once and touch the same buffers a real one would:
``all_gather`` writes ``inp`` into every rank's slot of ``out`` (so the model receives this
rank's values everywhere -- fine for timing, meaningless for training across ranks);
``reduce_scatter`` copies this rank's slice of ``inp``; ``all_to_all`` writes this rank's own
segment of ``inp`` into every rank's segment of ``out`` (as if every rank sent what this one
sends); ``all_reduce`` and ``broadcast`` leave the tensor as it is. Bytes are counted exactly
as the real backends count them, so ``comm.stats`` of a step equals what a real run sends.
"""

from __future__ import annotations

import torch

from scape.comm.base import Communicator, CompletedWork, Work

REDUCIBLE_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16,
                    torch.int8, torch.uint8, torch.int32, torch.int64)
"""The dtypes gloo and nccl both reduce, as ``scape.comm.TorchCommunicator`` lists them (a
copy: the list is not part of ``scape.comm``'s public surface), so this communicator refuses
what the real backends refuse."""


class NullCommunicator(Communicator):
    def __init__(self, world_size: int, rank: int = 0, device: str = "cpu") -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, "
                             f"world_size={world_size}")
        self.world_size, self.rank = world_size, rank
        self.device = torch.device(device)
        self._init_stats()

    def _reducible_dtypes(self) -> tuple[torch.dtype, ...]:
        return REDUCIBLE_DTYPES

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> Work:
        self._check_all_gather(out, inp)
        out.view(self.world_size, -1).copy_(inp.view(1, -1).expand(self.world_size, -1))
        self._count("all_gather", out.nbytes)
        return CompletedWork()

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, op: str = "avg") -> Work:
        self._check_reduce_scatter(out, inp, op)
        out.copy_(inp.view(self.world_size, -1)[self.rank])
        self._count("reduce_scatter", inp.nbytes)
        return CompletedWork()

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor) -> Work:
        self._check_all_to_all(out, inp)
        mine = inp.view(self.world_size, -1)[self.rank]
        out.view(self.world_size, -1).copy_(mine.view(1, -1).expand(self.world_size, -1))
        self._count("all_to_all", inp.nbytes)
        return CompletedWork()

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> Work:
        self._check_all_reduce(t, op)
        self._count("all_reduce", t.nbytes)
        return CompletedWork()

    def broadcast(self, t: torch.Tensor, src: int) -> Work:
        self._check_broadcast(t, src)
        self._count("broadcast", t.nbytes)
        return CompletedWork()

    def barrier(self) -> None:
        return None
