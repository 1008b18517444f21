"""Promises 4 and 5 (issue 6) on real gloo processes.

4. A NaN or +Inf in one rank's gradient buffer, in its own shard or in a shard another rank
   owns, on a sparse or a dense step: every rank skips the step; parameters, master weights,
   first moments, ages, the current and the pending mask are bitwise unchanged; the buffer
   (gradient and residual) is cleared; ``last_step.skipped`` is true; the next clean step runs.
5. Degenerate statistics (all-zero and all-equal gradients, so every score ties): the masks
   are valid, identical on every rank (hash compared) and identical across two fresh runs.
"""

from __future__ import annotations

import hashlib

import pytest
import torch
import torch.distributed as dist
from dist import run_ranks
from reliability_common import differing, make_model, make_opt, snapshot, train_step

import scape.sharded

KEEP = ("params", "master", ".m", "age", "mask_current", "mask_next")
# (step, value, whose shard): steps 7, 9, 13 are sparse, 15 is a dense refresh (dense_every=5)
BAD_STEPS = {7: ("nan", "own"), 9: ("nan", "other"), 11: ("inf", "own"),
             13: ("inf", "other"), 15: ("nan", "other")}
BAD_RANK = 1


def _nonfinite_body(rank, world, update):
    model = make_model()
    opt = make_opt(model, update=update)
    b = opt.buckets[0]
    noise = opt.shards[0].extra  # the local-noise rules' state (empty for sqrt)
    for t in range(1, 17):
        if t not in BAD_STEPS:
            before = snapshot(opt)
            train_step(model, opt, t, rank)
            after = snapshot(opt)
            assert not opt.last_step.skipped, f"clean step {t} skipped"
            assert differing(before, after, skip=("step", "residual", "mask_current",
                                                  "mask_next")), f"step {t} changed nothing"
            assert all(bool(torch.isfinite(v).all()) for v in after.values()
                       if v.dtype.is_floating_point)
            continue
        kind, where = BAD_STEPS[t]
        before = snapshot(opt)
        x = torch.randn(32, 24, generator=torch.Generator().manual_seed(t))
        model(x).square().mean().backward()
        if rank == BAD_RANK:
            owner = BAD_RANK if where == "own" else (BAD_RANK + 1) % world
            index = owner * b.shard_size + 37  # inside the real parameters, not padding
            assert index < b.numel
            values = b.grad_flat.clone()
            values[index] = float(kind)
            b.write_grad_(values)  # a direct write of p.grad would be refused
        opt.step()
        opt.zero_grad()
        after = snapshot(opt)
        assert opt.last_step.skipped and opt.last_step.step == t, (t, opt.last_step)
        keys = [k for k in before if k.endswith(KEEP)]
        bad = differing({k: before[k] for k in keys}, {k: after[k] for k in keys})
        assert not bad, f"step {t} ({kind} in {where} shard) changed {bad}"
        assert all(float(bk.grad_flat.abs().max()) == 0.0 for bk in opt.buckets)
        assert all(float(d["residual_norm"]) == 0.0 for d in opt.diagnostics), t
        if noise:  # the skip cleared the residual, so the rule's copy of the buffer is zero
            assert float(noise["prev"].abs().max()) == 0.0, f"step {t}: prev not reset"
            assert all(bool(torch.isfinite(noise[k]).all()) for k in noise), t
    # every rank ends with the same parameters
    digest = torch.tensor(list(hashlib.sha256(b.param_flat.numpy().tobytes()).digest()),
                          dtype=torch.uint8)
    out = torch.empty(world * 32, dtype=torch.uint8)
    dist.all_gather_into_tensor(out, digest)
    assert bool((out.view(world, 32) == digest).all()), "ranks differ after skips"
    return opt.step_count


@pytest.mark.parametrize("update", ["sqrt", "agree"],
                         ids=["sqrt", "agree"])
def test_nonfinite_gradient_skips_on_every_rank(update):
    """Also for a rule with local noise state: one bad gradient must not poison it (a NaN
    kept in ``s2`` would reach the parameters the next time that coordinate is sent)."""
    assert run_ranks(_nonfinite_body, 2, update, timeout=180) == [16, 16]


def _mask_hashes(opt, steps, fill):
    hashes, firsts = [], None
    for _ in range(steps):
        for b in opt.buckets:
            values = b.grad_flat.clone()
            values[: b.numel] = fill
            b.write_grad_(values)
        opt.step()
        m = opt.masks[0]
        mask = m.wait()
        if mask is None:
            hashes.append("dense")
            continue
        k = m.k
        assert mask.dtype == torch.int16 and mask.shape == (m.n_blocks, k)
        rows = mask.long()
        assert bool((rows >= 0).all()) and bool((rows < opt.block_size).all())
        assert bool((rows[:, 1:] > rows[:, :-1]).all()), "offsets not strictly ascending"
        if firsts is None:
            firsts = mask.clone()
        hashes.append(hashlib.sha256(mask.numpy().tobytes()).hexdigest())
    return hashes, firsts


def _degenerate_body(rank, world):
    out = {}
    for name, fill in (("zeros", 0.0), ("equal", 0.5)):
        runs = []
        for _ in range(2):  # two fresh optimizers: the same masks
            model = make_model()
            opt = make_opt(model, dense_every=0)
            runs.append(_mask_hashes(opt, 9, fill))
        assert runs[0][0] == runs[1][0], f"{name}: masks differ between two fresh runs"
        first = runs[0][1]
        # all scores tie and all ages tie at the first mask: ties go to the lowest offsets
        k = first.shape[1]
        assert torch.equal(first, torch.arange(k, dtype=torch.int16).expand_as(first)), name
        out[name] = runs[0][0]
    return out


def test_degenerate_statistics_give_identical_masks():
    results = run_ranks(_degenerate_body, 2, timeout=180)
    for name in ("zeros", "equal"):
        hashes = [r[name] for r in results]
        assert hashes[0] == hashes[1], f"{name}: ranks made different masks"
        assert sum(h != "dense" for h in hashes[0]) >= 6
        # explore > 0 rotates the tied coordinates by age: the mask does not stay put
        assert len(set(hashes[0]) - {"dense"}) > 1


# (step, value written at every entry of BAD_RANK's first buffer, also on the other ranks):
# steps 7 and 9 are sparse, 15 a dense refresh; 1e5 is past fp16's range, 2e4 within it but
# past the fp16 wire's limit on 2 ranks (32752 / 2), so its sum of two is past the range
WIDE_STEPS = {7: (1e5, False), 9: (2e4, True), 15: (1e5, False)}


def _wire_overflow_body(rank, world):
    model = make_model()
    opt = make_opt(model, grad_comm_dtype=torch.float16)
    b = opt.buckets[0]
    limit = scape.sharded.wire_limit(torch.float16, world)
    assert limit == 32752.0 / world
    skipped = []
    for t in range(1, 17):
        before = snapshot(opt)
        if t not in WIDE_STEPS:
            train_step(model, opt, t, rank)
        else:
            value, everyone = WIDE_STEPS[t]
            assert value > limit and value < float(torch.finfo(torch.float32).max)
            x = torch.randn(32, 24, generator=torch.Generator().manual_seed(t))
            model(x).square().mean().backward()
            if rank == BAD_RANK or everyone:
                values = b.grad_flat.clone()
                values[: b.numel] = value  # finite: no NaN or Inf anywhere
                b.write_grad_(values)
            opt.step()
            opt.zero_grad()
        after = snapshot(opt)
        assert all(bool(torch.isfinite(v).all()) for v in after.values()
                   if v.dtype.is_floating_point), f"step {t}: a non-finite value was kept"
        if opt.last_step.skipped:
            skipped.append(t)
            keys = [k for k in before if k.endswith(KEEP)]
            bad = differing({k: before[k] for k in keys}, {k: after[k] for k in keys})
            assert not bad, f"step {t} skipped but changed {bad}"
    digest = torch.tensor(list(hashlib.sha256(b.param_flat.numpy().tobytes()).digest()),
                          dtype=torch.uint8)
    out = torch.empty(world * 32, dtype=torch.uint8)
    dist.all_gather_into_tensor(out, digest)
    assert bool((out.view(world, 32) == digest).all()), "ranks differ"
    return skipped


def test_fp16_wire_skips_a_step_whose_sum_it_cannot_carry():
    """A finite gradient entry past what the float16 wire sums over the ranks
    (:func:`scape.sharded.wire_limit`) skips the step on every rank, as a NaN does, on sparse
    and dense steps; before, the wire's sum overflowed and wrote inf into every replica's
    parameters, and every later step was skipped."""
    assert run_ranks(_wire_overflow_body, 2, timeout=180) == [sorted(WIDE_STEPS)] * 2


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32],
                         ids=["f16", "bf16", "f32"])
def test_wire_limit_keeps_every_partial_sum_in_range(dtype):
    """W entries at the limit (either sign), each rounded to the wire and added in the wire's
    dtype, stay finite at every partial sum; W entries a little over twice it sum past the
    range in exact arithmetic (the bound is within 2x of tight)."""
    top = float(torch.finfo(dtype).max)
    for world in (1, 2, 3, 8, 61, 1024):
        limit = scape.sharded.wire_limit(dtype, world)
        for sign in (1.0, -1.0):
            x = torch.full((world,), sign * limit, dtype=torch.float64).to(dtype)
            acc = torch.zeros((), dtype=dtype)
            for v in x:
                acc = acc + v
                assert abs(float(acc)) <= top, (world, sign)
        wide = torch.full((world,), 2.01 * limit, dtype=torch.float64).to(dtype)
        assert float(wide.double().sum()) > top, world
