"""The research rule ``early_steady``: ``early`` whose catch-up bound widens with each sent
coordinate's sign agreement. With no widening (floor 1) it is ``early`` bit for bit; with it,
no step is shorter than ``early``'s and some are longer where the bound binds."""

from __future__ import annotations

import pytest
import torch

import bench.research.rules  # noqa: F401  (registers the rules)
from scape import rules
from tests.test_rule_early import RISE_FALL, _build, _run, _same, _steps


@pytest.mark.parametrize("sparsity", [0.97, 0.99])
def test_no_widening_is_early(sparsity):
    lrs = [10 * lr for lr in RISE_FALL]  # large enough for the bounds to bind
    assert _same(_run("early_steady1", lrs, sparsity), _run("early", lrs, sparsity))


def test_while_the_lr_rises_the_w_rule_is_early():
    lrs = [10 * lr for lr in RISE_FALL[:6]]  # the rise only
    assert _same(_run("early_steady_w", lrs, 0.97), _run("early", lrs, 0.97))
    assert not _same(_run("early_steady_w", [10 * lr for lr in RISE_FALL], 0.97),
                     _run("early", [10 * lr for lr in RISE_FALL], 0.97))


@pytest.mark.parametrize("sparsity", [0.9, 0.97])  # where the 1/8 bound binds
def test_the_wider_bound_moves_further(sparsity):
    """From the same state (both trained as ``early`` up to the last step), one step of each:
    every sent coordinate ends at least as far along its descent step (against its new moment)
    as under ``early``, some further; the moments are the same."""
    lrs = [10 * lr for lr in RISE_FALL]
    moved, moment = {}, {}
    for name in ("early_steady1", "early_steady"):
        opt, params = _build("early_steady1", sparsity, lrs[0])
        _steps(opt, params, lrs[:-1], torch.Generator().manual_seed(11))
        opt.rule = rules.get(name)  # the same extra state: swapped between steps
        before = opt.shards[0].master.clone()
        gen = torch.Generator().manual_seed(12)
        _steps(opt, params, lrs[-1:], gen)
        moved[name] = opt.shards[0].master - before
        moment[name] = opt.shards[0].m.clone()
    assert torch.equal(moment["early_steady"], moment["early_steady1"])
    further = moved["early_steady"] - moved["early_steady1"]
    m = moment["early_steady"]
    assert torch.all(further * m <= 0)  # along -m / denom: the descent step
    assert int((further.abs() > 1e-4 * moved["early_steady1"].abs().max()).sum()) > 0
