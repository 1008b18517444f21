"""Shared fixtures: outputs are pre-filled with NaN (or a sentinel for integers) so that an
element a kernel forgot to write fails the comparison."""

from __future__ import annotations

import os
import sys

# Triton kernels run on the CPU through the interpreter unless the caller says otherwise (on a
# GPU machine: TRITON_INTERPRET=0 python -m pytest). Must be set before triton is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))  # tests/dist.py importable from spawned ranks


@pytest.fixture
def kernel_backend():
    """``kernel_backend(name)`` sets the kernels' backend (``scape.kernels.set_backend``) for
    the rest of the test; the one before comes back after it."""
    from scape import kernels

    before = kernels.get_backend()
    yield kernels.set_backend
    kernels.set_backend(before)


def nan_empty(shape, dtype=torch.float32, device="cpu") -> torch.Tensor:
    """A tensor whose every element is NaN (floats) or the most negative value (integers)."""
    t = torch.empty(shape, dtype=dtype, device=device)
    if dtype.is_floating_point:
        t.fill_(float("nan"))
    else:
        t.fill_(torch.iinfo(dtype).min)
    return t


@pytest.fixture
def nan_out():
    return nan_empty
