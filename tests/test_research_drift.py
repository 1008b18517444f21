"""Dead reckoning of the unsent coordinates (``bench.research.drift``, the ``-drift`` rows):
it moves what the forward pass sees and nothing of the optimizer's state, each unsent
coordinate along its last catch-up's rate for at most that catch-up's wait."""

from __future__ import annotations

import pytest
import torch

import scape
from bench.engine.rows import resolve
from bench.research.drift import Drift


def _opt(sparsity: float) -> tuple[scape.SCAPE, torch.nn.Parameter]:
    torch.manual_seed(3)
    p = torch.nn.Parameter(torch.randn(4096))
    opt = scape.SCAPE([p], lr=1e-2, sparsity=sparsity, block_size=256, warmup_steps=1,
                      weight_decay=0.1, update="early")
    return opt, p


def _steps(opt: scape.SCAPE, p: torch.nn.Parameter, n: int, drift: Drift | None) -> list:
    gen = torch.Generator().manual_seed(7)
    seen = []
    for _ in range(n):
        p.grad = torch.randn(4096, generator=gen) * 0.1 + 0.05
        opt.step()
        opt.finish_param_sync()
        seen.append(p.detach().clone())
        if drift is not None:
            drift.after_step()
    return seen


@pytest.mark.parametrize("sparsity", [0.9, 0.99])
def test_the_optimizer_state_is_untouched(sparsity):
    """The same gradients with and without the reckoning: master weights, moments and ages
    bit for bit; the model differs from the plain run only where the last step sent nothing."""
    plain, p0 = _opt(sparsity)
    reckoned, p1 = _opt(sparsity)
    drift = Drift([p1])
    version = p1._version
    _steps(plain, p0, 12, None)
    seen = _steps(reckoned, p1, 12, drift)
    a, b = plain.shards[0], reckoned.shards[0]
    assert torch.equal(a.master, b.master) and torch.equal(a.m, b.m)
    assert torch.equal(a.age, b.age)
    assert p1._version == version  # written through .data: never adopted as an outside write
    sent = a.age[: p0.numel()] == 0
    assert torch.equal(seen[-1][sent], p0.detach()[sent])  # what arrived is what the owner sent
    assert torch.equal(p1.detach()[sent], p0.detach()[sent])
    assert not torch.equal(p1.detach()[~sent], p0.detach()[~sent])


def test_each_coordinate_follows_its_last_rate():
    """A hand-written sequence of sends: the rate of the last jump over its wait, applied for
    at most that wait, and a send replaces the reckoned position."""
    p = torch.nn.Parameter(torch.zeros(3))
    drift = Drift([p])
    p.data.copy_(torch.tensor([1.0, 2.0, 0.0]))  # step 1: coordinates 0 and 1 sent
    drift.after_step()
    assert torch.equal(p.detach(), torch.tensor([1.0, 2.0, 0.0]))  # as sent
    p.data[0] = 1.5  # step 2: coordinate 0 sent again (from 1 over 1 step: rate 0.5)
    drift.after_step()
    assert torch.equal(p.detach(), torch.tensor([1.5, 4.0, 0.0]))  # 1 a step on at rate 2
    for _ in range(3):
        drift.after_step()
    assert torch.equal(p.detach(), torch.tensor([2.0, 4.0, 0.0]))  # each held after its wait
    p.data[1] = 3.0  # step 6: coordinate 1 sent after 5 steps, from 2: rate 0.2
    drift.after_step()
    assert torch.equal(p.detach(), torch.tensor([2.0, 3.0, 0.0]))
    drift.after_step()
    drift.after_step()
    assert torch.allclose(p.detach(), torch.tensor([2.0, 3.4, 0.0]))
    for _ in range(7):
        drift.after_step()
    assert torch.allclose(p.detach(), torch.tensor([2.0, 4.0, 0.0]))  # held after 5 steps
    assert p.detach()[2] == 0.0  # never sent: never moved


def test_the_drift_row():
    """The research registers its ``-drift`` row by name: the hook entry, nothing parsed; the
    hook refuses a row that is not SCAPE before launch."""
    from bench.engine.runner import RunConfig

    assert resolve("scape-0.9-ramp0.5x20-drift@early") == (
        "scape-0.9-ramp0.5x20-drift@early",
        {"optimizer": "scape", "sparsity": 0.9, "optimizer_kwargs": {"update": "early"},
         "sparsity_ramp": (0.5, 20), "hooks": {"bench.research.drift:hook": {}}})
    with pytest.raises(ValueError, match="drift applies to scape rows"):
        RunConfig(optimizer="topk", sparsity=0.9, hooks={"bench.research.drift:hook": {}})
