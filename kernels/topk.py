"""Blockwise top-k mask selection (DESIGN §1 step 4)."""

from __future__ import annotations

import torch

from . import reference
from ._checks import (
    FLOAT_DTYPES,
    check_block_size,
    check_blocked,
    check_int,
    check_numel,
    check_same_device,
    check_tensor,
    use_triton,
)


def blockwise_topk(score: torch.Tensor, k: int, block_size: int, *,
                   age: torch.Tensor | None = None, k_explore: int = 0) -> torch.Tensor:
    """Exact per-block selection: int16 ``[n_blocks, k]`` block-local offsets, ascending.

    Per block, the ``k - k_explore`` entries of largest ``|score|``; then, if ``age`` (int32,
    same length) is given, the ``k_explore`` entries of largest ``age`` among the rest. Ties
    go to the lower offset; NaN ranks below every number; -0.0 equals 0.0. Deterministic.
    """
    check_tensor("score", score, dtypes=FLOAT_DTYPES, ndim=1)
    block_size = check_block_size(block_size)
    check_blocked("score", score, block_size)
    k = check_int("k", k, 1, block_size)
    k_explore = check_int("k_explore", k_explore, 0, k)
    if age is not None:
        check_tensor("age", age, dtypes=(torch.int32,), ndim=1)
        check_numel("age", age, score.numel(), "one per score entry")
        check_same_device(score=score, age=age)
    elif k_explore > 0:
        raise ValueError(f"k_explore={k_explore} needs age (an int32 tensor); got age=None")
    if use_triton(score):
        pass  # Triton kernel: not yet available, the torch path serves every device
    return reference.blockwise_topk(score, k, block_size, age=age, k_explore=k_explore)
