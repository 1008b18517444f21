"""The multi-process harness itself: results come back by rank, failures and hangs fail."""

import time

import pytest
import torch
import torch.distributed as dist
from dist import run_ranks, run_ranks_outcomes


def _sum_ranks(rank, world):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item()


def _fail_on_one(rank, world):
    if rank == 1:
        raise ValueError("boom on rank 1")
    return rank


def _hang(rank, world):
    time.sleep(60)


def test_results_by_rank():
    assert run_ranks(_sum_ranks, 3, timeout=60) == [6.0, 6.0, 6.0]


def test_failure_is_reported():
    with pytest.raises(AssertionError, match="boom on rank 1"):
        run_ranks(_fail_on_one, 2, timeout=60)
    out = run_ranks_outcomes(_fail_on_one, 2, timeout=60)
    assert out[0].ok and not out[1].ok and out[1].exc_type == "ValueError"


def test_hang_is_a_failure():
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        run_ranks(_hang, 2, timeout=8)
    assert time.monotonic() - t0 < 30
