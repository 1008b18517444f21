"""``SCAPE(split="gain")``: the optimizer splits one budget across its sparse groups by the
gain it measures itself (scape.allot wired into the step)."""

from __future__ import annotations

import math

import pytest
import torch
from dist import run_ranks

import scape
from scape import allot as al
from scape.comm import TorchCommunicator
from scape.io import CheckpointError, validate_state
from scape.optimizer import block_budget, resolve
from scape.rules import RULES

SP, BS, WARM = 0.97, 256, 5


def _opt(seed: int, comm=None, **kw):
    torch.manual_seed(seed)  # the same parameters on every rank
    steady = torch.nn.Parameter(torch.randn(3000))
    noisy = torch.nn.Parameter(torch.randn(5000))
    vec = torch.nn.Parameter(torch.randn(10))
    args = dict(lr=1e-3, sparsity=SP, block_size=BS, warmup_steps=WARM,
                update="catchup_agree_trust2_accum", split="gain", split_every=4)
    args.update(kw)
    opt = scape.SCAPE([{"params": [steady]}, {"params": [noisy]},
                       {"params": [vec], "sparsity": 0.0}], comm=comm, **args)
    return opt, (steady, noisy, vec)


def _grads(params, g: torch.Generator, direction: torch.Tensor) -> None:
    steady, noisy, vec = params
    steady.grad = direction + 0.1 * torch.randn(steady.numel(), generator=g)
    noisy.grad = torch.randn(noisy.numel(), generator=g)  # zero-mean noise: little gain
    vec.grad = torch.randn(vec.numel(), generator=g)


def _run(opt, params, g, direction, steps):
    for _ in range(steps):
        _grads(params, g, direction)
        opt.step()


def _mask_numels(opt) -> dict[int, int]:
    """Coordinates each sparse group's masks cover, padding blocks included."""
    out: dict[int, int] = {}
    for b, m in zip(opt.buckets, opt.masks):
        if m is not None:
            out[b.group] = out.get(b.group, 0) + m.n_blocks * BS
    return out


def _coords(opt, group: int) -> int:
    """Coordinates per step the group's current mask synchronizes."""
    return sum(m.current.numel() for b, m in zip(opt.buckets, opt.masks)
               if m is not None and b.group == group)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_split_follows_gain_and_keeps_the_budget(seed):
    """The steady group gets the coordinates, the noisy one gives them up; the sum is every
    group at SP (up to each block's rounding); the groups' own ``sparsity`` is untouched; the
    split is what :func:`scape.allot.allot` makes of a meter observing the same gradients."""
    opt, params = _opt(seed)
    meter = al.AgreementMeter(opt)  # a second meter, fed by hand: the reference
    g = torch.Generator().manual_seed(100 + seed)
    direction = torch.randn(3000, generator=g)
    numels = _mask_numels(opt)
    for t in range(1, WARM + 12):
        _grads(params, g, direction)
        meter.observe()
        opt.step()
        if t >= WARM and (t - WARM) % opt.split_every == 0:  # a reading was taken
            ref = al.allot(meter.gain(), numels, SP, BS, power=1.0)
            assert opt.split_sparsity == pytest.approx(ref, rel=1e-6, abs=1e-9)
    split = opt.split_sparsity
    assert split[0] < SP < split[1]
    assert [grp["sparsity"] for grp in opt.param_groups] == [SP, SP, 0.0]
    assert opt.last_step.dense is False
    got = {grp: _coords(opt, grp) for grp in (0, 1)}
    for grp, n in got.items():
        n_blocks = sum(m.n_blocks for b, m in zip(opt.buckets, opt.masks)
                       if m is not None and b.group == grp)
        assert n == n_blocks * block_budget(split[grp], BS, opt.explore)[0]
    budget = sum(n * (1 - SP) for n in numels.values())
    assert abs(sum(got.values()) - budget) <= sum(
        m.n_blocks for m in opt.masks if m is not None)  # half a coordinate per block, each
    assert got[0] / numels[0] > 2 * got[1] / numels[1]


@pytest.mark.parametrize("world", [1, 4])
def test_split_keeps_the_bytes_whatever_the_padding(world):
    """A small group padded to whole blocks of W ranks (50 coordinates in 256 x W) takes a
    larger share under the split; the budget counts the padding blocks too, so the coordinates
    per step (the bytes) stay those of every group at SP, up to half a coordinate per block."""
    from bench.nullcomm import NullCommunicator

    sizes, budgets = {}, {}
    for split in (None, "gain"):
        torch.manual_seed(0)
        big = torch.nn.Parameter(torch.randn(5000))
        small = torch.nn.Parameter(torch.randn(50))
        opt = scape.SCAPE([{"params": [big]}, {"params": [small]}], lr=1e-3, sparsity=SP,
                          block_size=BS, warmup_steps=WARM, split=split,
                          update="catchup_agree_trust2_accum", comm=NullCommunicator(world, 0))
        gen = torch.Generator().manual_seed(15)
        direction = torch.randn(50, generator=gen)
        for _ in range(WARM + 2):
            big.grad = torch.randn(5000, generator=gen)                     # noise
            small.grad = direction + 0.01 * torch.randn(50, generator=gen)  # steady
            opt.step()
        n_blocks = sum(m.n_blocks for m in opt.masks if m is not None)
        sizes[split], budgets[split] = opt.last_step.mask_size, (1 - SP) * n_blocks * BS
        assert abs(sizes[split] - budgets[split]) <= n_blocks / 2, (split, sizes, budgets)
        if split == "gain":
            assert opt.split_sparsity[1] < 0.95 < SP < opt.split_sparsity[0]
    assert budgets["gain"] == budgets[None]


def test_split_reads_the_budget_from_the_groups_every_step():
    """A schedule that moves the groups' ``sparsity`` moves the budget the split shares."""
    opt, params = _opt(0)
    g = torch.Generator().manual_seed(7)
    direction = torch.randn(3000, generator=g)
    _run(opt, params, g, direction, WARM + 3)
    before = sum(_coords(opt, grp) for grp in (0, 1))
    for grp in opt.param_groups[:2]:
        grp["sparsity"] = 0.9
    _run(opt, params, g, direction, 2)  # the next mask is made at the new value
    after = sum(_coords(opt, grp) for grp in (0, 1))
    assert after == pytest.approx(before * (1 - 0.9) / (1 - SP), rel=0.1)
    assert opt.split_sparsity[0] < 0.9 < opt.split_sparsity[1]


def test_split_off_uses_each_groups_own_sparsity():
    opt, params = _opt(0, split=None)
    assert opt.meter is None
    g = torch.Generator().manual_seed(8)
    direction = torch.randn(3000, generator=g)
    _run(opt, params, g, direction, WARM + 2)
    assert opt.split_sparsity == {0: SP, 1: SP}
    assert all("split_mu" not in s.extra for s in opt.shards)


@pytest.mark.parametrize("update,want", [("catchup_agree_trust2_accum", "gain"),
                                          ("catchup_snr_accum", "gain"),
                                          ("catchup_agree_trust2_gain", None),
                                          ("catchup_sqrt_accum", None), ("lazy", None)])
def test_split_auto_follows_the_rule(update, want):
    """``split="auto"`` splits by gain where the rule keeps the noise estimate and takes its
    masks by accumulated mass, else not (a gain rule's masks already follow the gain)."""
    opt, params = _opt(0, split="auto", update=update)
    assert opt.split == want
    assert (opt.meter is not None) == (want == "gain")
    g = torch.Generator().manual_seed(12)
    _run(opt, params, g, torch.randn(3000, generator=g), WARM + 5)
    if want is None:
        assert opt.split_sparsity == {0: SP, 1: SP}
    else:
        assert opt.split_sparsity[0] < SP < opt.split_sparsity[1]


@pytest.mark.parametrize("update,split,n,want", [
    ("auto", "auto", 2, ("catchup_agree_trust2_gainr", None)),
    ("auto", "auto", 1, ("catchup_agree_trust2_gainr", None)),
    ("auto", None, 3, ("catchup_agree_trust2_gainr", None)),
    ("auto", "gain", 2, ("catchup_agree_trust2_gainr", "gain")),
    ("auto", "gain", 1, ("catchup_agree_trust2_gainr", "gain")),  # asked for: kept, no meter
    ("catchup_agree_trust2_accum", "auto", 2, ("catchup_agree_trust2_accum", "gain")),
    ("catchup_agree_trust4_accum", "auto", 1, ("catchup_agree_trust4_accum", None)),
    ("catchup_agree_trust4_gain", "auto", 2, ("catchup_agree_trust4_gain", None)),
    ("catchup_agree_trust4_gainr", "auto", 2, ("catchup_agree_trust4_gainr", None)),
    ("catchup_snr_accum", "auto", 2, ("catchup_snr_accum", "gain")),
    ("catchup_sqrt_accum", "auto", 2, ("catchup_sqrt_accum", None)),
    ("lazy", None, 2, ("lazy", None)),
])
def test_resolve_auto(update, split, n, want):
    assert resolve(update, split, n_sparse_groups=n) == want


def test_defaults_take_masks_by_gain_and_do_not_split():
    """The defaults: the gain masks and c = 1/2, with no split and no meter, whatever the
    number of sparse groups (a dense group beside them does not count)."""
    opt, _ = _opt(0, update="auto", split="auto")
    assert (opt.update, opt.split, opt.meter) == ("catchup_agree_trust2_gainr", None, None)
    assert opt.rule is RULES["catchup_agree_trust2_gainr"]
    assert all("mu" in s.extra and "split_mu" not in s.extra
               for s, m in zip(opt.shards, opt.masks) if m is not None)
    torch.manual_seed(0)
    one = scape.SCAPE([{"params": [torch.nn.Parameter(torch.randn(3000))]},
                       {"params": [torch.nn.Parameter(torch.randn(10))], "sparsity": 0.0}],
                      lr=1e-3)
    assert (one.update, one.split, one.meter) == ("catchup_agree_trust2_gainr", None, None)


def test_split_with_one_sparse_group_keeps_no_meter():
    """One sparse group has nothing to share with: no meter, no state, its own sparsity."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(3000))
    b = torch.nn.Parameter(torch.randn(10))
    opt = scape.SCAPE([{"params": [w]}, {"params": [b], "sparsity": 0.0}], lr=1e-3,
                      sparsity=SP, block_size=BS, warmup_steps=WARM,
                      update="catchup_agree_trust2_accum", split="gain")
    assert opt.split == "gain" and opt.meter is None
    assert all("split_mu" not in s.extra for s in opt.shards)
    gen = torch.Generator().manual_seed(13)
    for _ in range(WARM + 3):
        w.grad, b.grad = torch.randn(3000, generator=gen), torch.randn(10, generator=gen)
        opt.step()
    assert opt.split_sparsity == {0: SP}
    assert _coords(opt, 0) == opt.masks[0].n_blocks * block_budget(SP, BS, opt.explore)[0]


@pytest.mark.parametrize("kwargs,err,match", [
    (dict(split="agreement"), ValueError, "Invalid split"),
    (dict(split_every=0), ValueError, "split_every"),
    (dict(split_every=2.5), ValueError, "split_every"),
    (dict(update="catchup_sqrt_accum"), ValueError, "local noise estimate"),
    (dict(update="lazy"), ValueError, "local noise estimate"),
])
def test_split_rejects_bad_input(kwargs, err, match):
    with pytest.raises(err, match=match):
        _opt(0, **kwargs)


def test_split_state_is_checkpointed_and_resumes_bit_exact():
    """The meter's EMA, its weight, the last reading and the reading count travel in the state
    dict: a resumed optimizer makes the same splits and the same parameters."""
    opt, params = _opt(0)
    g = torch.Generator().manual_seed(9)
    direction = torch.randn(3000, generator=g)
    _run(opt, params, g, direction, WARM + 6)  # between two readings
    sd = opt.state_dict()
    assert all("split_mu" in e["extra"] for e in sd["buckets"][:2])
    gen_state = g.get_state()
    opt2, params2 = _opt(1)  # other parameters: all of them come from the checkpoint
    opt2.load_state_dict(sd)
    for p, q in zip(params, params2):
        assert torch.equal(p, q)
    g2 = torch.Generator()
    g2.set_state(gen_state)
    _run(opt, params, g, direction, 7)
    _run(opt2, params2, g2, direction, 7)
    assert opt2.split_sparsity == opt.split_sparsity
    for p, q in zip(params, params2):
        assert torch.equal(p, q)


def test_lr_peak_is_kept_per_group_and_checkpointed():
    """The optimizer hands every rule the largest lr each group has had (``hp["lr_peak"]``,
    what ``catchup_agree_trustlr_accum`` scales its bound by) and saves it."""
    opt, params = _opt(0, update="catchup_agree_trustlr_accum")
    g = torch.Generator().manual_seed(14)
    direction = torch.randn(3000, generator=g)
    lrs = [1e-4, 5e-4, 1e-3, 4e-4, 2e-4, 1e-4, 3e-4, 2e-4, 1e-4]
    for lr in lrs:
        for grp in opt.param_groups:
            grp["lr"] = lr
        _run(opt, params, g, direction, 1)
    assert opt.lr_peak == {0: 1e-3, 1: 1e-3, 2: 1e-3}
    assert opt._hp(opt.buckets[0])["lr_peak"] == 1e-3
    sd = opt.state_dict()
    fresh, _ = _opt(1, update="catchup_agree_trustlr_accum")
    fresh.load_state_dict(sd)
    assert fresh.lr_peak == opt.lr_peak


def test_split_state_travels_in_checkpoint_files(tmp_path):
    """Through ``scape.save_checkpoint``/``load_checkpoint`` (files, validated on load): the
    split's and ``lr_peak``'s float counters pass the validation and resume bit-exactly; a
    corrupted counter is refused with nothing loaded."""
    opt, params = _opt(0)
    g = torch.Generator().manual_seed(16)
    direction = torch.randn(3000, generator=g)
    _run(opt, params, g, direction, WARM + 6)
    path = scape.save_checkpoint(opt, tmp_path / "ckpt")
    gen_state = g.get_state()
    fresh, params2 = _opt(1)
    assert scape.load_checkpoint(fresh, path) == opt.step_count
    assert fresh.split_gain == opt.split_gain and fresh.lr_peak == opt.lr_peak
    g2 = torch.Generator()
    g2.set_state(gen_state)
    _run(opt, params, g, direction, 5)
    _run(fresh, params2, g2, direction, 5)
    for p, q in zip(params, params2):
        assert torch.equal(p, q)
    sd = torch.load(next(path.glob("rank-*.pt")), weights_only=False)
    manifest = dict(world_size=1, step=sd["step"], optimizer=sd["optimizer"])
    validate_state(fresh, sd, 0, manifest)  # the float counters are valid
    for bad in ({0: float("nan"), 1: 1.0}, {"0": 1.0}, "1.0", {0: {1: 1.0}}, True):
        broken = dict(sd, counters=dict(sd["counters"], split_gain=bad))
        with pytest.raises(CheckpointError, match="counters"):
            validate_state(fresh, broken, 0, manifest)


def test_split_state_loads_across_split_settings():
    """A checkpoint saved without a split loads into a splitting optimizer (its meter starts
    again) and one saved with a split loads into one that does not (the EMA is dropped)."""
    g = torch.Generator().manual_seed(11)
    direction = torch.randn(3000, generator=g)
    plain, params = _opt(0, split=None)
    _run(plain, params, g, direction, WARM + 3)
    splitting, params2 = _opt(0)
    splitting.load_state_dict(plain.state_dict())
    assert splitting.meter is not None and splitting.meter.weight == 0.0
    assert all(bool((mu == 0).all()) for mu in splitting.meter.mu if mu is not None)
    _run(splitting, params2, g, direction, 3)
    assert splitting.split_sparsity[0] < SP < splitting.split_sparsity[1]
    plain2, params3 = _opt(0, split=None)
    plain2.load_state_dict(splitting.state_dict())
    for p, q in zip(params2, params3):
        assert torch.equal(p, q)
    _run(plain2, params3, g, direction, 2)
    assert plain2.split_sparsity == {0: SP, 1: SP}


def _ranks_body(rank: int, world: int) -> dict:
    comm = TorchCommunicator()
    opt, params = _opt(0, comm=comm)
    g = torch.Generator().manual_seed(20 + rank)  # each rank its own noise
    direction = torch.randn(3000, generator=torch.Generator().manual_seed(5))
    splits = []
    for _ in range(WARM + 10):
        _grads(params, g, direction)
        opt.step()
        splits.append(dict(opt.split_sparsity))
    masks = [m.current.tolist() for m in opt.masks if m is not None]  # plain data: picklable
    return {"splits": splits, "masks": masks, "params": [p.detach().tolist() for p in params]}


def test_split_is_the_same_on_every_rank():
    """Each rank measures its own shard; the reading is all-reduced, so every rank makes the
    same split, the same masks and the same parameters."""
    res = run_ranks(_ranks_body, 2, timeout=120)
    assert res[0]["splits"] == res[1]["splits"]
    final = res[0]["splits"][-1]
    assert final[0] < SP < final[1]
    assert all(math.isfinite(v) for v in final.values())
    assert res[0]["masks"] == res[1]["masks"]
    assert res[0]["params"] == res[1]["params"]
