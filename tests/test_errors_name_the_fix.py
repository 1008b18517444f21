"""Construction errors say what to write instead, on every rank: hyperparameters given by
position, no lr, another rank's hyperparameter (each rank's value shown), another rank's
parameter values (``scape.broadcast_parameters`` named)."""

from __future__ import annotations

import pytest
import torch
from dist import run_ranks

import scape


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(64, 80, generator=g)),
            torch.nn.Parameter(torch.randn(80, generator=g))]


def _build(rank, world, case):
    kw = {}
    params = _params()
    if case == "positional":
        args, kw = (1e-3, 0.1), {}
    elif case == "no_lr":
        args = ()
    elif case == "lr":
        args, kw = (), {"lr": 1e-3 * (rank + 1), "sparsity": 0.9}
    elif case == "betas":
        args, kw = (), {"lr": 1e-3, "betas": (0.9, 0.95 + 0.01 * rank)}
    else:  # "values": another seed on rank 1
        args, kw = (), {"lr": 1e-3}
        params = _params(seed=rank)
    try:
        scape.SCAPE(params, *args, block_size=256, **kw)
    except (TypeError, ValueError) as e:
        return type(e).__name__, str(e)
    return None


CASES = {  # case -> (the error's type, words it must hold)
    "positional": ("TypeError", ["by name", "lr=0.001", "0.001, 0.1"]),
    "no_lr": ("TypeError", ["needs a learning rate", "lr="]),
    "lr": ("ValueError", ["differs across ranks in: lr", "lr: rank 0 0.001, rank 1 0.002"]),
    "betas": ("ValueError", ["betas: rank 0 (0.9, 0.95), rank 1 (0.9, 0.96)"]),
    "values": ("ValueError", ["param_values", "scape.broadcast_parameters(model)"]),
}


def _build_all(rank, world):
    """Every case in turn in the same processes: each construction is its own agreement."""
    return {case: _build(rank, world, case) for case in CASES}


def test_errors_name_the_fix_on_every_rank():
    out = run_ranks(_build_all, 2, timeout=120)
    for case, (kind, words) in CASES.items():
        for r in (o[case] for o in out):
            assert r is not None and r[0] == kind, (case, r)
            for w in words:
                assert w in r[1], (case, w, r[1])
        assert out[0][case][0] == out[1][case][0]


def test_add_param_group_says_it_raises():
    doc = scape.SCAPE.add_param_group.__doc__ or ""
    assert "RuntimeError" in doc
    from bench.engine.nullcomm import NullCommunicator

    opt = scape.SCAPE(_params(), lr=1e-3, block_size=256, comm=NullCommunicator(1, 0))
    with pytest.raises(RuntimeError, match="fixed at construction"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))]})
