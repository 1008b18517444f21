"""``opt.state`` of the sharded optimizers: per-parameter views of the state a rank owns, in
torch.optim's layout (``opt.state[p]["exp_avg"]``), so that memory reports, logging and tools
that walk an optimizer's state see it.

The optimizer state is sharded by coordinate, not by parameter: a rank owns one contiguous
slice of each flat buffer (:mod:`scape.buffers`). For a parameter that lies wholly inside that
slice (every parameter on one rank) the entries are views in the parameter's shape. For one
that straddles the slice's edge they are 1-D views of the owned coordinates, and ``"owned"``
gives their ``(start, stop)`` in the parameter's flattened index; a parameter outside the slice
has only its ``"residual"``: the whole fp32 gradient buffer (gradient + error-feedback
residual) is on every rank. Every entry is a view: it follows the optimizer, costs no memory,
and writing it writes the optimizer's state.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import torch


def param_state(buckets: Sequence[Any], shards: Sequence[Any],
                names: Callable[[Any], dict[str, torch.Tensor]]) -> defaultdict:
    """``{param: {name: view}}`` over every trainable parameter of ``buckets``; ``names(shard)``
    maps a shard to its shard-sized tensors by the name they get (``exp_avg``, ...)."""
    state: defaultdict = defaultdict(dict)
    for b, s in zip(buckets, shards):
        tensors = names(s)
        lo_shard, hi_shard = b.shard_start, b.shard_start + b.shard_size
        for p, shape, o, n in zip(b.params, b.shapes, b.offsets, b.numels):
            entry: dict[str, Any] = {"residual": b.grad_flat[o:o + n].view(shape)}
            lo, hi = max(o, lo_shard), min(o + n, hi_shard)
            if lo < hi:
                whole = (lo, hi) == (o, o + n)
                for name, t in tensors.items():
                    view = t[lo - lo_shard:hi - lo_shard]
                    entry[name] = view.view(shape) if whole else view
                if not whole:
                    entry["owned"] = (lo - o, hi - o)
            state[p] = entry
    return state
