"""bench.research.update_codes, the research hook on the 8-bit parameter wire: with the e4m3
code every replica applies the same bytes and the gap left at a sent entry is within 1/16 of
its own update, and closing the gaps makes the model copy the masters (after the last step,
and after every N-th with ``close_every``); with ``follow`` the owner's master equals every
replica after each step, for both codes; with ``repay`` the replicas stay identical and the
gaps of the previous mask shrink to within ``s / 3825``; the recording alone changes nothing
(bit for bit the library's run); the statistics are rank 0's; wires and options it does not
fit are refused."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist import run_ranks

import scape
from bench.research import update_codes

BLOCK = 256
SHAPES = [(40, 33), (700,), (3, 250)]


def _params() -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(11)
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]


def _opt(params: list[torch.nn.Parameter]) -> scape.SCAPE:
    opt = scape.SCAPE(params, lr=3e-2, sparsity=0.9, block_size=BLOCK, warmup_steps=2,
                      param_comm_dtype=torch.int8)
    opt.ramp_steps = 0
    return opt


def _grads(params: list[torch.nn.Parameter], t: int, rank: int) -> None:
    g = torch.Generator().manual_seed(1000 * t + rank)
    for p in params:  # heavy-tailed per coordinate, as a mask row's updates are
        p.grad = torch.randn(p.shape, generator=g) * torch.exp(2 * torch.randn(p.shape,
                                                                            generator=g))


def _e4m3_body(rank: int, world: int, steps: int) -> dict:
    params = _params()
    opt = _opt(params)
    hook = update_codes.factory(None, torch.nn.Module(), opt, code="e4m3", stats_every=1)
    b, s = opt.buckets[0], opt.shards[0]
    n_local = b.shard_size // BLOCK
    sparse = 0
    for t in range(1, steps + 1):
        master0, model0 = s.master.clone(), b.param_flat[b.shard].clone()
        _grads(params, t, rank)
        opt.step()
        out = [torch.empty_like(b.param_flat) for _ in range(world)]
        dist.all_gather(out, b.param_flat)
        assert all(torch.equal(o, out[0]) for o in out), f"step {t}: replicas differ"
        mask = opt.last_sync[0]["mask"]
        gap = s.master - b.param_flat[b.shard]
        if mask is None:
            assert bool((gap.abs() <= 1e-7 * s.master.abs()).all()), f"step {t}: dense gap"
            continue
        sparse += 1
        own = mask[rank * n_local:(rank + 1) * n_local].long()
        flat = (torch.arange(n_local)[:, None] * BLOCK + own).view(-1)
        delta = (s.master - model0)[flat].view(n_local, -1)
        bound = delta.abs() / 16 + delta.abs().amax(1, keepdim=True) / 448 * 2.0 ** -10
        got = gap[flat].view(n_local, -1).abs()
        rounding = 1.2e-7 * b.param_flat[b.shard][flat].view(n_local, -1).abs()
        assert bool((got <= bound * (1 + 1e-6) + rounding).all()), f"step {t}: gap over 1/16"
        rest = torch.ones(b.shard_size, dtype=torch.bool)
        rest[flat] = False
        assert torch.equal(s.master[rest], master0[rest]) and torch.equal(
            b.param_flat[b.shard][rest], model0[rest]), f"step {t}: moved off the mask"
    assert float((s.master - b.param_flat[b.shard]).abs().max()) > 0, "no gap to close"
    hook.close_after = steps  # as factory(close_at_end=True) sets it for a run of steps + 1
    hook.after_step(steps)
    assert torch.equal(b.param_flat[b.shard], s.master), "a gap stayed"
    return {"sparse": sparse, **hook.result()}


def test_e4m3_updates_keep_replicas_identical_and_the_gap_within_a_sixteenth():
    results = run_ranks(_e4m3_body, 2, 12, timeout=180)
    for rank, r in enumerate(results):
        assert r["code"] == "e4m3" and r["calls"] == r["sparse"] > 0 and r["closed_at_end"]
        assert len(r["stats"]) == (r["calls"] if rank == 0 else 0)
    first = results[0]["stats"][0]
    assert first["k"] == 26 and 0 < first["frac_below_1_255"] < first["frac_below_1_15"] < 1
    assert first["ratio_q"] == sorted(first["ratio_q"]) and 0 < first["ratio_q"][-1] <= 1
    for st in results[0]["stats"]:  # e4m3's error is relative; more levels, less error
        assert st["e4m3_rel_err_median"] <= 1 / 16
        assert st["uniform8_l1_err"] < st["uniform4_l1_err"]


def _trained_bytes(opt: scape.SCAPE, params: list[torch.nn.Parameter], steps: int,
                   rank: int) -> list[bytes]:
    """The parameters' bytes after each of ``steps`` steps of :func:`_grads`' gradients."""
    out = []
    for t in range(1, steps + 1):
        _grads(params, t, rank)
        opt.step()
        opt.finish_param_sync()
        out.append(b"".join(p.detach().numpy().tobytes() for p in params))
    return out


def _hashes_body(rank: int, world: int, steps: int, hooked: bool) -> list[bytes]:
    params = _params()
    opt = _opt(params)
    if hooked:
        update_codes.factory(None, torch.nn.Module(), opt, code="uniform", stats_every=1)
    return _trained_bytes(opt, params, steps, rank)


def test_recording_alone_trains_bit_for_bit_as_the_library():
    plain = run_ranks(_hashes_body, 2, 8, False, timeout=180)
    hooked = run_ranks(_hashes_body, 2, 8, True, timeout=180)
    assert plain == hooked


def test_wires_it_does_not_fit_are_refused():
    params = [torch.nn.Parameter(torch.randn(300))]
    opt = scape.SCAPE(params, lr=1e-3)
    with pytest.raises(ValueError, match="param_comm_dtype=torch.int8"):
        update_codes.factory(None, torch.nn.Module(), opt, code="e4m3")
    opt8 = scape.SCAPE([torch.nn.Parameter(torch.randn(300))], lr=1e-3,
                       param_comm_dtype=torch.int8)
    with pytest.raises(ValueError, match="code must be 'uniform' or 'e4m3'"):
        update_codes.factory(None, torch.nn.Module(), opt8, code="fp4")
    with pytest.raises(ValueError, match="stats_every must be an int >= 0"):
        update_codes.factory(None, torch.nn.Module(), opt8, stats_every=-1)
    with pytest.raises(ValueError, match="close_every must be an int >= 0"):
        update_codes.factory(None, torch.nn.Module(), opt8, close_every=-2)
    with pytest.raises(ValueError, match="follow must be a bool"):
        update_codes.factory(None, torch.nn.Module(), opt8, follow=1)
    with pytest.raises(ValueError, match="repay takes the uniform code alone"):
        update_codes.factory(None, torch.nn.Module(), opt8, code="e4m3", repay=True)


def _step(opt: scape.SCAPE, params: list[torch.nn.Parameter], t: int, rank: int,
          world: int) -> None:
    """Step ``t`` with fresh gradients, its parameters landed, and every replica checked equal
    to rank 0's."""
    b = opt.buckets[0]
    _grads(params, t, rank)
    opt.step()
    opt.finish_param_sync()
    out = [torch.full_like(b.param_flat, float("nan")) for _ in range(world)]
    dist.all_gather(out, b.param_flat)
    assert all(torch.equal(o, out[0]) for o in out), f"step {t}: replicas differ"


def _follow_body(rank: int, world: int, steps: int, code: str) -> dict:
    params = _params()
    opt = _opt(params)
    update_codes.factory(None, torch.nn.Module(), opt, code=code, follow=True)
    b, s = opt.buckets[0], opt.shards[0]
    sparse, moved = 0, 0.0
    for t in range(1, steps + 1):
        model0 = b.param_flat.clone()
        _step(opt, params, t, rank, world)
        # the owner's master is what every rank stored: no gap, on the mask or off it
        assert torch.equal(s.master, b.param_flat[b.shard]), f"step {t}: a gap is left"
        if opt.last_sync[0]["mask"] is not None:
            sparse += 1
            moved += float((b.param_flat - model0).abs().sum())
    return {"sparse": sparse, "moved": moved}


@pytest.mark.parametrize("code", ["uniform", "e4m3"])
def test_following_leaves_the_master_equal_to_every_replica(code):
    results = run_ranks(_follow_body, 2, 10, code, timeout=180)
    assert all(r["sparse"] > 0 and r["moved"] > 0 for r in results)


def _close_every_body(rank: int, world: int, steps: int) -> list[bool]:
    params = _params()
    opt = _opt(params)
    hook = update_codes.factory(None, torch.nn.Module(), opt, close_every=3)
    b, s = opt.buckets[0], opt.shards[0]
    closed = []
    for t in range(steps):
        _grads(params, t + 1, rank)
        opt.step()
        hook.after_step(t)
        opt.finish_param_sync()
        closed.append(torch.equal(s.master, b.param_flat[b.shard]))
    assert hook.result()["closes"] == steps // 3 and not hook.result()["closed_at_end"]
    return closed


def test_closing_every_third_step_closes_the_gaps_then():
    for closed in run_ranks(_close_every_body, 2, 9, timeout=180):
        assert closed[2] and closed[5] and closed[8]
        assert not all(closed), "no gap opened between the closes"


def _repay_body(rank: int, world: int, steps: int) -> dict:
    params = _params()
    opt = _opt(params)
    hook = update_codes.factory(None, torch.nn.Module(), opt, repay=True)
    b, s = opt.buckets[0], opt.shards[0]
    n_local = b.shard_size // BLOCK
    key = s.master.data_ptr()

    def flat(rows: torch.Tensor) -> torch.Tensor:
        return (torch.arange(rows.shape[0])[:, None] * BLOCK + rows.long()).view(-1)

    repaid, before, after = 0, 0.0, 0.0
    for t in range(1, steps + 1):
        prev = hook.repay.owned.get(key)
        gap0 = (s.master - b.param_flat[b.shard]).abs()
        _step(opt, params, t, rank, world)
        if prev is None or opt.last_sync[0]["mask"] is None:
            continue
        rows, scales = prev
        cur = opt.last_sync[0]["mask"][rank * n_local:(rank + 1) * n_local]
        at = flat(rows).view(n_local, -1)
        keep = ~torch.isin(at, flat(cur))  # entries sent again now carry their gap anyway
        gap = (s.master - b.param_flat[b.shard])[at.view(-1)].view(n_local, -1).abs()
        bound = (scales / 255 / 15).view(-1, 1).expand_as(gap)
        rounding = 1.2e-7 * b.param_flat[b.shard][at.view(-1)].view(n_local, -1).abs()
        assert bool((gap[keep] <= bound[keep] * (1 + 1e-5) + rounding[keep]).all()), \
            f"step {t}: a repaid gap over s / 3825"
        repaid += 1
        before += float(gap0[at.view(-1)].view(n_local, -1)[keep].sum())
        after += float(gap[keep].sum())
    return {"repaid": repaid, "before": before, "after": after}


def test_repaying_keeps_replicas_identical_and_shrinks_the_last_masks_gaps():
    for r in run_ranks(_repay_body, 2, 12, timeout=180):
        assert r["repaid"] > 0 and 0 < r["after"] < r["before"] / 8, r
