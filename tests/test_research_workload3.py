"""bench.research.workload3: the best lr by seed 0, the two-seed mean there, steps to reach
dense AdamS's loss, on synthetic runs whose answers are known by construction."""

from __future__ import annotations

import json
import random

import pytest

from bench.research import workload3 as w3

CAND = "cand"


def _curve(rng: random.Random, start: float, end: float, steps: int) -> list[list[float]]:
    """A decreasing curve from ``start`` to ``end``, evaluated every 50 steps, with noise that
    keeps it decreasing."""
    xs = list(range(50, steps + 1, 50))
    ys = sorted((start + (end - start) * (x / steps) ** 0.5 + rng.uniform(-1e-3, 1e-3)
                 for x in xs), reverse=True)
    ys[-1] = end
    return [[x, y] for x, y in zip(xs, ys)]


def _run(cand: str, sp: float, lr: float, seed: int, curve: list[list[float]]) -> dict:
    return {"candidate": cand, "sparsity": sp, "lr": lr, "steps": 2000, "seed": seed,
            "final_val_loss": curve[-1][1], "val_curve": curve}


@pytest.fixture
def runs() -> list[dict]:
    rng = random.Random(1234)
    out = []
    finals = {(w3.DENSE, 0.0): {3e-4: 2.7, 1e-3: 2.4, 2e-3: 2.5},
              (CAND, 0.99): {3e-4: 2.9, 1e-3: 2.6, 2e-3: 2.55},
              (CAND, 0.9): {3e-4: 2.6, 1e-3: 2.45, 2e-3: 2.5}}
    for (cand, sp), by_lr in finals.items():
        for lr, end in by_lr.items():
            out.append(_run(cand, sp, lr, 0, _curve(rng, 7.0, end, 2000)))
    best_lr = {(w3.DENSE, 0.0): 1e-3, (CAND, 0.99): 2e-3, (CAND, 0.9): 1e-3}
    for (cand, sp), lr in best_lr.items():  # seed 1 at the best lr only, a little higher
        end = finals[(cand, sp)][lr] + 0.02
        out.append(_run(cand, sp, lr, 1, _curve(rng, 7.0, end, 2000)))
    # a seed-1 run at a lr that is not seed 0's best, better than anything: must not count
    out.append(_run(CAND, 0.99, 3e-4, 1, _curve(rng, 7.0, 2.0, 2000)))
    return out


def test_best_lr_is_seed_zeros_and_the_mean_is_over_the_seeds_run_there(runs):
    b = w3.best(runs, CAND, 0.99, 2000)
    assert b is not None and b["lr"] == 2e-3
    assert b["grid"] == [3e-4, 1e-3, 2e-3]
    assert b["seeds"] == {0: pytest.approx(2.55), 1: pytest.approx(2.57)}
    assert b["mean"] == pytest.approx(2.56)
    assert w3.best(runs, CAND, 0.5, 2000) is None
    assert w3.best(runs, CAND, 0.99, 600) is None


def test_steps_to_reach_is_the_first_step_at_or_below(runs):
    rng = random.Random(7)
    curve = _curve(rng, 6.0, 3.0, 1000)
    for _ in range(20):
        target = rng.uniform(2.5, 6.5)
        got = w3.steps_to_reach(curve, target)
        below = [s for s, v in curve if v <= target]
        assert got == (below[0] if below else None)
        if got is not None:  # every earlier point is above the target
            assert all(v > target for s, v in curve if s < got)
    with pytest.raises(ValueError):
        w3.loss_at(curve, 75)


def test_report_ratios_and_reach_follow_the_curves(runs, tmp_path):
    rep = w3.report(runs, CAND)
    dense = rep["dense"]
    assert dense["lr"] == 1e-3 and dense["mean"] == pytest.approx(2.41)
    for sp in ("0.99", "0.9"):
        b = rep["sparse"][sp]
        assert b["ratio"] == pytest.approx(b["mean"] / dense["mean"])
        for seed, reach in b["reach"].items():
            mine = w3.curve_of(runs, CAND, float(sp), 2000, b["lr"], seed)
            ref = w3.curve_of(runs, w3.DENSE, 0.0, 2000, dense["lr"], seed)
            for at in ("600", "2000"):
                target = w3.loss_at(ref, int(at))
                got = reach[at]
                assert got == w3.steps_to_reach(mine, target)
    # every sparse final is above dense's at the end (by construction): never reached there
    assert all(r["2000"] is None for b in rep["sparse"].values() for r in b["reach"].values())
    table = w3.markdown(rep)
    assert table.count("\n") == 4 and "SCAPE-0.99" in table and "2.5600" in table
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"runs": runs}))
    assert w3.load(path) == runs
    with pytest.raises(ValueError, match="no dense"):
        w3.report([r for r in runs if r["candidate"] != w3.DENSE], CAND)


def test_plot_writes_a_png(runs, tmp_path):
    pytest.importorskip("matplotlib")
    rep = w3.report(runs, CAND)
    path = tmp_path / "curves.png"
    w3.plot(runs, rep, CAND, str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
