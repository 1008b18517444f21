"""``scape.SparsityRamp``, ``scape.schedules.run_bytes`` and ``longest_ramp``: the scheduler
writes what the documented hand-written loop writes (same parameters, bit for bit, also across
a checkpoint), and the byte formula equals what the optimizer's steps count, so a ramp sized to
a budget keeps it."""

from __future__ import annotations

import pytest
import torch

import scape
from bench.engine.nullcomm import NullCommunicator
from scape.schedules import longest_ramp, ramp_start, run_bytes


def _groups(seed: int, mixed: bool) -> list[dict]:
    """Fresh parameters from ``seed``: one group, or a 0.99, a 0.9 and a dense group."""
    g = torch.Generator().manual_seed(seed)
    ps = [torch.nn.Parameter(torch.randn(n, generator=g)) for n in (3 * 4096 + 100, 5000, 700)]
    if not mixed:
        return [{"params": ps}]
    return [{"params": [ps[0]]}, {"params": [ps[1]], "sparsity": 0.9},
            {"params": [ps[2]], "sparsity": 0.0}]


def _opt(groups: list[dict], warmup: int = 1, every: int = 0, comm=None,
         wire: torch.dtype = torch.float32) -> scape.SCAPE:
    return scape.SCAPE(groups, lr=1e-3, sparsity=0.99, block_size=256, warmup_steps=warmup,
                       dense_every=every, comm=comm, grad_comm_dtype=wire)


def _grads(opt: scape.SCAPE, t: int) -> None:
    g = torch.Generator().manual_seed(1000 + t)
    for group in opt.param_groups:
        for p in group["params"]:
            p.grad = torch.randn(p.shape, generator=g)


@pytest.mark.parametrize("warmup,every,ramp,mixed,wire", [
    (1, 0, None, False, torch.float32), (2, 0, 5, False, torch.float32),
    (1, 4, 5, False, torch.float32), (3, 5, 4, True, torch.float32),
    (2, 3, 0, True, torch.float32), (2, 0, 5, False, torch.int8), (3, 5, 4, True, torch.int8),
    (1, 2, 3, False, torch.float32)])
def test_run_bytes_is_what_the_steps_send(warmup, every, ramp, mixed, wire):
    steps = 14  # past the ramp too, where run_bytes counts steps by kind instead of one by one
    groups = _groups(0, mixed)
    opt = _opt(groups, warmup, every, wire=wire)
    sched = None if ramp is None else scape.SparsityRamp(opt, start=0.5, ramp_steps=ramp)
    ends = [0.99, 0.9, 0.0] if mixed else [0.99]
    predicted = run_bytes(opt, steps, start=None if ramp is None else 0.5,
                          ramp_steps=ramp or 0, ends=ends)
    sent, seen = 0, set()
    for t in range(steps):
        _grads(opt, t)
        opt.step()
        sent += sum(opt.last_step.bytes.values())
        seen.add(opt.last_step.dense)
        if sched is not None:
            sched.step()
    n = sum(p.numel() for g in groups for p in g["params"])
    assert seen == {True, False}  # both kinds of step were counted
    assert predicted * steps * (8 * n + 8) == pytest.approx(sent, rel=1e-12)
    assert 0 < predicted < 1


def test_longest_ramp_fits_the_budget_and_one_more_step_does_not():
    steps, budget = 60, 1 / 20
    opt = _opt(_groups(1, False), comm=NullCommunicator(4, 0))  # a 4-rank layout, no peers
    r = longest_ramp(opt, steps, budget=budget, start=0.5)
    assert 0 < r < steps
    assert run_bytes(opt, steps, start=0.5, ramp_steps=r) <= budget
    assert run_bytes(opt, steps, start=0.5, ramp_steps=r + 1) > budget
    assert longest_ramp(opt, steps, budget=budget, start=0.8) > r  # a sparser start: longer
    # no start given: each group from ramp_start of its own sparsity, 0.9 at 0.99
    own = longest_ramp(opt, steps, budget=budget)
    assert own == longest_ramp(opt, steps, budget=budget, start=ramp_start(0.99)) > r
    ramp = scape.SparsityRamp(opt, start=0.5, total_steps=steps, budget=budget)
    assert ramp.ramp_steps == r
    with pytest.raises(ValueError, match="without a ramp"):
        longest_ramp(opt, 5, budget=1 / 50)  # the dense warm-up step alone is 1/5 of 5 steps
    for bad in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError, match="Invalid budget"):
            longest_ramp(opt, steps, budget=bad)


def _manual(steps: int, mixed: bool) -> list[torch.Tensor]:
    """The loop docs/research.md's runs used: the ramp written by hand before each step, in
    place of the optimizer's own."""
    opt = _opt(_groups(2, mixed))
    opt.ramp_steps = 0
    ends = [g["sparsity"] for g in opt.param_groups]
    for t in range(steps):
        for g, end in zip(opt.param_groups, ends):
            if end:
                g["sparsity"] = scape.sparsity_ramp(opt.step_count + 1 - opt.warmup_steps,
                                                    start=0.5, end=end, ramp_steps=6)
        _grads(opt, t)
        opt.step()
    opt.finish_param_sync()
    return [p.detach().clone() for g in opt.param_groups for p in g["params"]]


@pytest.mark.parametrize("mixed", [False, True])
def test_scheduler_equals_the_hand_written_ramp(mixed):
    steps = 12
    opt = _opt(_groups(2, mixed))
    ramp = scape.SparsityRamp(opt, start=0.5, ramp_steps=6)
    written = []
    for t in range(steps):
        written.append([g["sparsity"] for g in opt.param_groups])
        _grads(opt, t)
        opt.step()
        ramp.step()
    opt.finish_param_sync()
    got = [p.detach() for g in opt.param_groups for p in g["params"]]
    for a, b in zip(got, _manual(steps, mixed)):
        assert torch.equal(a, b)
    first = [w[0] for w in written]
    assert first[0] == 0.5 and first[-1] == 0.99  # ramped, then at the target
    assert all(a >= b for a, b in zip(first[1:], first))  # never less sparse
    if mixed:
        assert {w[2] for w in written} == {0.0} and written[-1][1] == 0.9


def test_scheduler_resumes_from_a_checkpoint(tmp_path):
    steps, cut = 12, 4
    opt = _opt(_groups(3, False))
    ramp = scape.SparsityRamp(opt, start=0.5, ramp_steps=6)
    for t in range(steps):
        if t == cut:
            scape.save_checkpoint(opt, tmp_path, extra={"ramp": ramp})
        _grads(opt, t)
        opt.step()
        ramp.step()
    opt.finish_param_sync()
    straight = [p.detach().clone() for p in opt.param_groups[0]["params"]]

    opt = _opt(_groups(3, False))
    ramp = scape.SparsityRamp(opt, start=0.9, ramp_steps=1)  # replaced by the checkpoint's
    assert scape.load_checkpoint(opt, tmp_path, extra={"ramp": ramp}) == cut
    assert (ramp.start, ramp.ramp_steps, ramp.ends) == (0.5, 6, [0.99])
    for t in range(cut, steps):
        _grads(opt, t)
        opt.step()
        ramp.step()
    opt.finish_param_sync()
    for a, b in zip(opt.param_groups[0]["params"], straight):
        assert torch.equal(a.detach(), b)


def test_bad_input():
    opt = _opt(_groups(4, False))
    with pytest.raises(TypeError, match="scape.SCAPE"):
        scape.SparsityRamp(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1),
                           ramp_steps=3)
    with pytest.raises(ValueError, match="ramp_steps, or total_steps and budget"):
        scape.SparsityRamp(opt)
    with pytest.raises(ValueError, match="ramp_steps, or total_steps and budget"):
        scape.SparsityRamp(opt, ramp_steps=3, total_steps=100, budget=0.1)
    with pytest.raises(ValueError):
        scape.SparsityRamp(opt, start=1.0, ramp_steps=3)
    with pytest.raises(ValueError, match="param groups"):
        scape.SparsityRamp(opt, ramp_steps=3).load_state_dict(
            {"start": 0.5, "ramp_steps": 3, "ends": [0.99, 0.9]})


def test_a_group_below_start_keeps_its_target_and_bytes_count_it():
    """A ramp from 0.95: the 0.99 group ramps, the 0.9 group (denser than the start) stays at
    0.9 from the first step (the ramp would otherwise make it sparser than its target), and
    run_bytes counts it the same way."""
    steps = 10
    groups = _groups(5, True)
    groups[1]["sparsity"] = 0.9
    opt = _opt(groups)
    predicted = run_bytes(opt, steps, start=0.95, ramp_steps=6)
    ramp = scape.SparsityRamp(opt, start=0.95, ramp_steps=6)
    written, sent = [], 0
    for t in range(steps):
        written.append([g["sparsity"] for g in opt.param_groups])
        _grads(opt, t)
        opt.step()
        sent += sum(opt.last_step.bytes.values())
        ramp.step()
    assert {w[1] for w in written} == {0.9}
    assert written[0][0] == 0.95 and written[-1][0] == 0.99
    dense = sum(p.numel() for g in opt.param_groups for p in g["params"]) * 8 + 8
    assert sent == pytest.approx(predicted * dense * steps, rel=1e-12)


def _two_level_ramp(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    opt = _opt(_groups(6, False), comm=mesh)
    ramp = scape.SparsityRamp(opt, start=0.5, ramp_steps=4)  # no bytes counted: accepted
    seen = []
    for t in range(6):
        seen.append(opt.param_groups[0]["sparsity"])
        _grads(opt, t)
        opt.step()
        ramp.step()
    try:
        scape.SparsityRamp(opt, total_steps=100, budget=0.1)
        refused = None
    except ValueError as e:
        refused = str(e)
    return seen, refused


def test_the_ramp_runs_on_two_levels_and_only_the_byte_budget_is_refused():
    from dist import run_ranks

    for seen, refused in run_ranks(_two_level_ramp, 4, timeout=180):
        assert seen[0] == 0.5 and seen[-1] == 0.99 and seen == sorted(seen)
        assert refused is not None and "two-level" in refused


def _train_sent(opt: scape.SCAPE, steps: int, sched=None) -> int:
    sent = 0
    for t in range(steps):
        _grads(opt, t)
        opt.step()
        sent += sum(opt.last_step.bytes.values())
        if sched is not None:
            sched.step()
    opt.finish_param_sync()
    return sent


def test_the_optimizers_own_ramp_is_the_scheduler_sized_to_the_run():
    """``total_steps=T`` trains bit for bit as a ``SparsityRamp`` of the same length and its
    default start (:func:`ramp_start` of the target) on an optimizer without its own ramp,
    and sends what ``run_bytes`` says: at most 1/50 of dense AdamS's bytes. The length is
    sized on the reference wire (fp32 values, int16 offsets), which sends more than the
    packed offsets do: a ramp sized on this optimizer's own bytes (``longest_ramp``, what
    ``SparsityRamp(total_steps=T, budget=1/50)`` takes) is at least as long."""
    steps = 400
    own = scape.SCAPE(_groups(4, False), lr=1e-3, sparsity=0.99, block_size=4096,
                      total_steps=steps)
    outside = scape.SCAPE(_groups(4, False), lr=1e-3, sparsity=0.99, block_size=4096)
    sized = longest_ramp(outside, steps, budget=1 / 50)
    sched = scape.SparsityRamp(outside, ramp_steps=own.ramp_steps)
    assert outside.ramp_steps == 0 and 0 < own.ramp_steps <= sized
    sent = _train_sent(own, steps)
    assert _train_sent(outside, steps, sched) == sent
    for a, b in zip(own.param_groups[0]["params"], outside.param_groups[0]["params"]):
        assert torch.equal(a, b)
    assert own.param_groups[0]["sparsity"] == 0.99  # the group keeps its own value
    n = sum(p.numel() for p in own.param_groups[0]["params"])
    assert run_bytes(own, steps) * steps * (8 * n + 8) == pytest.approx(sent, rel=1e-12)
    assert run_bytes(own, steps) <= 1 / 50


def test_the_start_is_ten_times_the_density_at_most_half():
    """``ramp_start(s)`` has ``RAMP_FACTOR`` times the density ``1 - s``, no denser than
    ``RAMP_START``, never sparser than ``s``: sparser targets start sparser; and the
    optimizer's first sparse mask and a ``SparsityRamp`` without ``start`` are made there."""
    from scape.schedules import RAMP_FACTOR, RAMP_START

    ends = torch.linspace(0.0, 0.9999, 97, dtype=torch.float64).tolist()
    starts = [ramp_start(e) for e in ends]
    for e, s0 in zip(ends, starts):
        assert s0 <= e
        if e <= RAMP_START:
            assert s0 == e  # no ramp
        else:
            assert RAMP_START <= s0 < e
            assert 1 - s0 == pytest.approx(min(1 - RAMP_START, RAMP_FACTOR * (1 - e)),
                                           abs=1e-12)
    assert starts == sorted(starts)
    assert (ramp_start(0.99), ramp_start(0.9), ramp_start(0.98)) == pytest.approx((0.9, 0.5, 0.8))
    with pytest.raises(ValueError):
        ramp_start(1.0)
    for sparsity in (0.99, 0.9):
        opt = scape.SCAPE(_groups(2, False), lr=1e-3, sparsity=sparsity, block_size=256,
                          total_steps=2000)
        assert opt.ramp_steps > 0
        assert opt.sparsity_at(0, opt.warmup_steps) == pytest.approx(ramp_start(sparsity))
        assert opt.sparsity_at(0, opt.warmup_steps + opt.ramp_steps) == sparsity
        outside = scape.SCAPE(_groups(2, False), lr=1e-3, sparsity=sparsity, block_size=256)
        ramp = scape.SparsityRamp(outside, ramp_steps=opt.ramp_steps)
        assert ramp.start is None and ramp.state_dict()["start"] is None
        assert outside.param_groups[0]["sparsity"] == opt.sparsity_at(0, opt.warmup_steps)


def test_each_group_ramps_from_its_own_start_over_its_own_length():
    """A 0.99 and a 0.9 group in one optimizer, each on its own ramp (from 0.9 and from 0.5,
    over lengths sized for each start), train bit for bit as the hand-written loop that writes
    each group's sparsity on that ramp into an optimizer without its own, and send what
    ``run_bytes`` counts."""
    steps = 40  # of a 600-step run: past the 0.9 group's ramp, into the 0.99 group's
    groups = _groups(7, True)[:2]
    own = scape.SCAPE(groups, lr=1e-3, sparsity=0.99, block_size=256, total_steps=600)
    lengths = [own.ramp_steps_of(g) for g in range(2)]
    assert lengths[0] > steps > lengths[1] > 0
    hand = scape.SCAPE(_groups(7, True)[:2], lr=1e-3, sparsity=0.99, block_size=256)
    hand.ramp_steps = 0
    ends = [g["sparsity"] for g in hand.param_groups]
    sent = 0
    for t in range(steps):
        for g, end, r in zip(hand.param_groups, ends, lengths):
            g["sparsity"] = scape.sparsity_ramp(hand.step_count + 1 - hand.warmup_steps,
                                                start=ramp_start(end), end=end, ramp_steps=r)
        _grads(hand, t)
        hand.step()
    hand.finish_param_sync()
    sent = _train_sent(own, steps)
    for a, b in zip([p for g in own.param_groups for p in g["params"]],
                    [p for g in hand.param_groups for p in g["params"]]):
        assert torch.equal(a, b)
    n = sum(p.numel() for g in own.param_groups for p in g["params"])
    assert run_bytes(own, steps) * steps * (8 * n + 8) == pytest.approx(sent, rel=1e-12)


def test_the_ramps_length_without_the_runs_and_for_a_short_run():
    """No ``total_steps``: sized as a ``RUN_STEPS_UNSIZED``-step run; a run too short for any
    ramp within the budget (its dense step alone is more): none. A group ramps as long as a
    0.99 group could from its start: a 0.9 group (from 0.5) as a 0.99 run from 0.5 would,
    which is shorter than a 0.99 group's from 0.9; in one optimizer each group has its own."""
    from scape.schedules import RUN_STEPS_UNSIZED, start_ramp_steps

    unsized = scape.SCAPE(_groups(5, False), lr=1e-3, block_size=4096)
    sized = scape.SCAPE(_groups(5, False), lr=1e-3, block_size=4096,
                        total_steps=RUN_STEPS_UNSIZED)
    assert unsized.ramp_steps == sized.ramp_steps > 0
    assert scape.SCAPE(_groups(5, False), lr=1e-3, block_size=4096,
                       total_steps=20).ramp_steps == 0
    at_099 = scape.SCAPE(_groups(5, False), lr=1e-3, block_size=4096, total_steps=1000)
    at_09 = scape.SCAPE(_groups(5, False), lr=1e-3, sparsity=0.9, block_size=4096,
                        total_steps=1000)
    from_05 = longest_ramp(at_099, 1000, budget=1 / 50, start=0.5)  # fp32 wire: packed offsets
    assert 0 < at_09.ramp_steps == start_ramp_steps(at_099, 1000, 0.5) <= from_05
    assert at_099.ramp_steps == start_ramp_steps(at_099, 1000) > at_09.ramp_steps
    groups = _groups(5, True)  # 0.99, 0.9, dense: the dense group alone is over the budget
    assert scape.SCAPE(groups, lr=1e-3, block_size=4096, total_steps=1000).ramp_steps == 0
    mixed = scape.SCAPE(groups[:2], lr=1e-3, sparsity=0.99, block_size=256, total_steps=1000)
    lengths = [mixed.ramp_steps_of(g) for g in range(2)]
    assert lengths[0] > lengths[1] > 0 and mixed.ramp_steps == lengths[0]
    mixed.ramp_steps = 7  # the setter: one length for every group
    assert [mixed.ramp_steps_of(g) for g in range(2)] == [7, 7]
    with pytest.raises(ValueError, match="total_steps"):
        scape.SCAPE(_groups(5, False), lr=1e-3, total_steps=0)
