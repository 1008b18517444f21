"""Gradient statistics for clipping and the non-finite skip decision (DESIGN §1)."""

from __future__ import annotations

import torch

from . import reference
from ._checks import FLOAT_DTYPES, check_tensor, use_triton


def grad_stats(x: torch.Tensor) -> torch.Tensor:
    """fp32 tensor ``[sum of squares of all entries, count of non-finite entries]``.

    The sum covers every entry, so it is inf or NaN whenever a non-finite entry exists: the
    skip decision reads the count (exact up to 2^24), clipping reads the sum.
    """
    check_tensor("x", x, dtypes=FLOAT_DTYPES, ndim=1)
    if use_triton(x):
        pass  # Triton kernel: not yet available
    return reference.grad_stats(x)
