"""Named phase ranges: NVTX on CUDA (for ``nsys profile``), ``record_function`` on CPU.

The names are part of the public contract (users filter traces by them): ``scape/take``,
``scape/reduce_scatter``, ``scape/update``, ``scape/mask``, ``scape/all_gather``,
``scape/mask_sync`` (SCAPE and DistributedAdamW), and ``scape/outer_sync`` (the sync of
SparseLoCo and DiLoCo).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

PHASES = ("scape/take", "scape/reduce_scatter", "scape/update", "scape/mask",
          "scape/all_gather", "scape/mask_sync", "scape/outer_sync")


@contextlib.contextmanager
def phase(name: str, device: torch.device) -> Iterator[None]:
    if device.type == "cuda":
        torch.cuda.nvtx.range_push(name)
        try:
            yield
        finally:
            torch.cuda.nvtx.range_pop()
    else:
        with torch.profiler.record_function(name):
            yield
