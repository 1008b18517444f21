"""bench.research.update_rounding, the research hook that rounds each sent update on the fp32
parameter wire: its rounding is bf16's and fp16's at 7 and 10 bits and within half a unit of
the kept mantissa; the replicas stay identical; with the error dropped the owner's master is
every replica after each step, with it carried each sent entry's gap is within the rounding's
bound of that send's update; stochastic rounding picks a neighbour, up as often as the dropped
part's share; 23 bits trains bit for bit as the library; what it does not fit is refused."""

from __future__ import annotations

import pytest
import torch
from dist import run_ranks
from test_research_update_codes import _params, _step, _trained_bytes

import scape
from bench.research import update_rounding
from bench.research.update_rounding import round_mantissa

BLOCK = 256


def test_rounding_is_bf16s_and_fp16s_and_within_half_a_unit():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(50_000, generator=g) * torch.exp(3 * torch.randn(50_000, generator=g))
    assert torch.equal(round_mantissa(x.clone(), 7), x.to(torch.bfloat16).float())
    normal = x[(x.abs() > 1e-4) & (x.abs() < 6e4)]
    assert torch.equal(round_mantissa(normal.clone(), 10), normal.half().float())
    assert torch.equal(round_mantissa(x.clone(), 23), x)
    for bits in (1, 3, 12):
        r = round_mantissa(x.clone(), bits)
        assert bool(((r - x).abs() <= x.abs() * 2.0 ** -(bits + 1)).all()), bits
        assert torch.equal(round_mantissa(r.clone(), bits), r), "rounding is not idempotent"
        assert torch.equal(r.sign(), x.sign())


def test_stochastic_rounding_is_unbiased_and_picks_a_neighbour():
    g = torch.Generator().manual_seed(6)
    x = torch.randn(2_000, generator=g) * torch.exp(3 * torch.randn(2_000, generator=g))
    reps = torch.stack([round_mantissa(x.clone(), 3, g) for _ in range(400)])
    down = round_mantissa(x.clone(), 3)  # a neighbour, then the other one
    unit = torch.ldexp(torch.ones_like(x), torch.frexp(x.abs())[1] - 4)  # 2**(e - 3), |x| < 2**e
    lo = torch.where(down.abs() <= x.abs(), down, down - unit * x.sign())
    lo_up = lo.abs() + unit
    assert bool(((reps.abs() == lo.abs()) | (reps.abs() == lo_up)).all()), "not a neighbour"
    assert torch.equal(reps.sign(), x.sign().expand_as(reps))
    frac = (x.abs() - lo.abs()) / unit  # P(up)
    up = (reps.abs() == lo_up).float().mean(0)
    assert float((up - frac).abs().max()) < 0.1, "rounded up more or less often than its share"
    assert torch.equal(round_mantissa(down.clone(), 3, g), down), "moved a kept value"
    assert torch.equal(round_mantissa(x.clone(), 23, g), x)


def _opt(params: list[torch.nn.Parameter]) -> scape.SCAPE:
    opt = scape.SCAPE(params, lr=3e-2, sparsity=0.9, block_size=BLOCK, warmup_steps=2)
    opt.ramp_steps = 0
    return opt


def _body(rank: int, world: int, steps: int, bits: int, carry: bool,
          stochastic: bool = False) -> dict:
    params = _params()
    opt = _opt(params)
    hook = update_rounding.factory(None, torch.nn.Module(), opt, bits=bits, carry=carry,
                                   stochastic=stochastic)
    b, s = opt.buckets[0], opt.shards[0]
    n_local = b.shard_size // BLOCK
    sparse, gaps = 0, 0
    for t in range(1, steps + 1):
        model0 = b.param_flat[b.shard].clone()
        _step(opt, params, t, rank, world)  # the replicas checked equal
        mask = opt.last_sync[0]["mask"]
        gap = s.master - b.param_flat[b.shard]
        if not carry:
            assert torch.equal(s.master, b.param_flat[b.shard]), f"step {t}: a gap is left"
        if mask is None:
            continue
        sparse += 1
        own = mask[rank * n_local:(rank + 1) * n_local].long()
        flat = (torch.arange(n_local)[:, None] * BLOCK + own).view(-1)
        sent = b.param_flat[b.shard][flat] - model0[flat]
        bound = sent.abs() * 2.0 ** -bits + 1.2e-7 * b.param_flat[b.shard][flat].abs()
        assert bool((gap[flat].abs() <= bound).all()), f"step {t}: a sent gap over its bound"
        gaps += int((gap[flat] != 0).sum())
    return {"sparse": sparse, "gaps": gaps, **hook.result()}


@pytest.mark.parametrize(("carry", "stochastic"), [(False, False), (True, False), (True, True)])
def test_rounded_updates_keep_replicas_identical_and_gaps_bounded(carry, stochastic):
    for r in run_ranks(_body, 2, 10, 3, carry, stochastic, timeout=180):
        assert r["sparse"] == r["sends"] > 0 and r["entries"] > 0 and r["carry"] is carry
        assert r["stochastic"] is stochastic
        assert (r["gaps"] > 0) is carry, "a carried error left no gap, or a dropped one did"


def _hashes_body(rank: int, world: int, steps: int, bits: int | None) -> list[bytes]:
    params = _params()
    opt = _opt(params)
    if bits is not None:
        update_rounding.factory(None, torch.nn.Module(), opt, bits=bits)
    return _trained_bytes(opt, params, steps, rank)


def test_all_23_bits_train_bit_for_bit_as_the_library_and_fewer_do_not():
    plain = run_ranks(_hashes_body, 2, 8, None, timeout=180)
    assert run_ranks(_hashes_body, 2, 8, 23, timeout=180) == plain
    assert run_ranks(_hashes_body, 2, 8, 10, timeout=180) != plain


def test_what_it_does_not_fit_is_refused():
    opt = scape.SCAPE([torch.nn.Parameter(torch.randn(300))], lr=1e-3)
    for bad in (0, 24, True, 2.5):
        with pytest.raises(ValueError, match="bits must be an int in 1..23"):
            update_rounding.factory(None, torch.nn.Module(), opt, bits=bad)
    with pytest.raises(ValueError, match="carry must be a bool"):
        update_rounding.factory(None, torch.nn.Module(), opt, carry=1)
    with pytest.raises(ValueError, match="stochastic must be a bool"):
        update_rounding.factory(None, torch.nn.Module(), opt, stochastic="yes")
    opt8 = scape.SCAPE([torch.nn.Parameter(torch.randn(300))], lr=1e-3,
                       param_comm_dtype=torch.int8)
    with pytest.raises(ValueError, match="fp32 parameter wire"):
        update_rounding.factory(None, torch.nn.Module(), opt8)
    half = scape.SCAPE([torch.nn.Parameter(torch.randn(300, dtype=torch.bfloat16))], lr=1e-3)
    with pytest.raises(ValueError, match="an fp32 model"):
        update_rounding.factory(None, torch.nn.Module(), half)
    with pytest.raises(TypeError, match="takes fp32"):
        round_mantissa(torch.zeros(3, dtype=torch.float64), 3)
