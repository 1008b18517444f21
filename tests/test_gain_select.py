"""The masks by fresh gain (``catchup_agree_trust2_gain``, ``catchup_agree_trust4_gain``):
:func:`scape.rules.gain_score`, the local moments it reads, and the optimizer using it."""

from __future__ import annotations

import io
import math

import pytest
import torch
from dist import run_ranks

import bench.research.rules  # noqa: F401 (registers the research rules named below)
import scape
from scape.comm import TorchCommunicator
from scape.rules import (
    GAIN_STATE,
    NOISE_BETA,
    RULES,
    ShardState,
    gain_score,
    gain_score_residual,
    observe_local_moments,
)

HP = dict(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0, world=4)


def _gain_f64(mu, s2, s2w, age, hp):
    """The score in float64, written out from its docstring."""
    mean, w = mu.double() / s2w.double(), s2w.double()
    var = (s2.double() / w - mean ** 2).clamp(min=0.0)
    sig = (mean ** 2 - var * (1 - NOISE_BETA) / (1 + NOISE_BETA)).clamp(min=0.0).sqrt()
    sigma_m = (var / hp["world"] * (1 - hp["beta1"]) / (1 + hp["beta1"])).sqrt()
    frac = torch.special.erf(sig / (sigma_m * math.sqrt(2.0) + 1e-300))
    return sig * (frac * (age.double() + 1)).clamp(min=1.0)


def _state(seed: int, n: int = 2048) -> ShardState:
    g = torch.Generator().manual_seed(seed)
    mean = torch.randn(n, generator=g) * 0.1
    var = torch.rand(n, generator=g) * 0.05
    w = torch.rand(n, generator=g) * 0.5 + 0.5
    extra = {"prev": torch.zeros(n), "s2": (var + mean ** 2) * w, "s2w": w, "mu": mean * w}
    return ShardState(master=torch.randn(n, generator=g), m=torch.randn(n, generator=g),
                      age=torch.randint(0, 300, (n,), generator=g, dtype=torch.int32),
                      extra=extra)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gain_score_matches_float64(seed):
    s = _state(seed)
    before = {k: v.clone() for k, v in s.extra.items()}
    score = torch.full_like(s.m, float("nan"))
    score.copy_(gain_score(s, HP))
    want = _gain_f64(s.extra["mu"], s.extra["s2"], s.extra["s2w"], s.age, HP)
    torch.testing.assert_close(score.double(), want, rtol=2e-4, atol=1e-7)
    assert all(torch.equal(v, before[k]) for k, v in s.extra.items()), "state written"
    # invariants: never negative, never below the signal, never above (age + 1) times it
    sig = _gain_f64(s.extra["mu"], s.extra["s2"], s.extra["s2w"], torch.zeros_like(s.age),
                    HP)
    assert bool((score >= 0).all())
    assert bool((score.double() >= sig * (1 - 1e-5)).all())
    assert bool((score.double() <= sig * (s.age.double() + 1) * (1 + 1e-5) + 1e-12).all())


def test_gain_score_ranks_signal_above_noise_and_grows_with_the_wait():
    """A steady gradient outranks a larger one that is a coin toss per step (the frozen
    ``|m| * (age + 1)`` ranks them the other way); at equal statistics the longer wait wins.
    """
    n = 4
    s = ShardState(master=torch.zeros(n), m=torch.tensor([0.01, 0.01, 0.5, 0.5]),
                   age=torch.tensor([10, 20, 10, 20], dtype=torch.int32),
                   extra={k: torch.zeros(n) for k in GAIN_STATE})
    mean = torch.tensor([0.01, 0.01, 0.02, 0.02])  # steady 0.01, noise of std 1 around 0.02
    var = torch.tensor([1e-6, 1e-6, 1.0, 1.0])
    s.extra["s2w"].fill_(1.0)
    s.extra["mu"].copy_(mean)
    s.extra["s2"].copy_(var + mean ** 2)
    score = gain_score(s, dict(HP, world=1))
    assert score[0] > score[2] and score[1] > score[3]
    assert score[1] > score[0]
    accum = s.m * (s.age + 1)
    assert accum[2] > accum[0]  # the stale score would send the noisy coordinate


def test_observe_local_moments_tracks_the_local_gradient():
    """After many steps of one gradient with error feedback off, ``mu / s2w`` is that
    gradient and ``s2 / s2w`` its square: the score is ``|g| * (age + 1)`` (no noise)."""
    n = 512
    g0 = torch.randn(n, generator=torch.Generator().manual_seed(7))
    s = ShardState(master=torch.zeros(n), m=torch.zeros(n),
                   age=torch.full((n,), 5, dtype=torch.int32),
                   extra={k: torch.zeros(n) for k in GAIN_STATE})
    for _ in range(400):
        observe_local_moments(s, g0.clone(), error_feedback=False)
    torch.testing.assert_close(s.extra["mu"] / s.extra["s2w"], g0, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(s.extra["s2"] / s.extra["s2w"], g0 ** 2, rtol=1e-4, atol=1e-6)
    score = gain_score(s, dict(HP, world=1))
    torch.testing.assert_close(score, g0.abs() * 6, rtol=1e-2, atol=1e-5)


def _problem(seed: int, update: str, comm=None, rank: int = 0):
    """8,192 coordinates: every fourth a steady gradient of size 0.1 plus small noise (a
    quarter of every block: masks are made per block), the rest zero-mean noise of std 1
    (each rank its own noise)."""
    torch.manual_seed(seed)
    p = torch.nn.Parameter(torch.randn(8192))
    opt = scape.SCAPE([p], lr=1e-3, sparsity=0.97, block_size=256, warmup_steps=3,
                      update=update, comm=comm)
    opt.ramp_steps = 0  # the rule at ``sparsity`` from the first sparse step
    g = torch.Generator().manual_seed(100 + rank)
    sign = torch.randn(2048, generator=torch.Generator().manual_seed(seed)).sign()
    return p, opt, g, sign


def _train(p, opt, g, sign, steps):
    steady_sent = sent = 0
    for _ in range(steps):
        grad = torch.randn(8192, generator=g)
        grad[::4] = 0.1 * sign + 0.01 * grad[::4]
        grad[1::4].mul_(0.3), grad[2::4].mul_(0.3), grad[3::4].mul_(0.3)
        p.grad = grad
        opt.step()
        mask = opt.masks[0].current  # the mask this step synchronized (all ranks' blocks)
        if mask is None:  # a dense warm-up step
            continue
        pos = (torch.arange(mask.shape[0])[:, None] * 256 + mask.long()).view(-1)
        steady_sent += int((pos % 4 == 0).sum())
        sent += pos.numel()
    return steady_sent / sent


@pytest.mark.parametrize("seed", [0, 1])
def test_gain_masks_send_the_steady_coordinates(seed):
    """The gain masks send the steady quarter of the coordinates more often than the frozen
    ``|m| * (age + 1)`` does (measured: 0.41 of the budget against 0.33 on both seeds)."""
    shares = {}
    for update in ("catchup_agree_trust2_gain", "catchup_agree_trust2_accum"):
        p, opt, g, sign = _problem(seed, update)
        shares[update] = _train(p, opt, g, sign, 60)
        assert bool(torch.isfinite(p).all())
    assert shares["catchup_agree_trust2_gain"] > shares["catchup_agree_trust2_accum"] + 0.05


def test_gain_rules_keep_their_mean_in_the_checkpoint():
    p, opt, g, sign = _problem(0, "catchup_agree_trust4_gain")
    _train(p, opt, g, sign, 10)
    state = opt.state_dict()
    p2, opt2, g2, sign2 = _problem(0, "catchup_agree_trust4_gain")
    opt2.load_state_dict(state)
    torch.testing.assert_close(opt2.shards[0].extra["mu"], opt.shards[0].extra["mu"],
                               rtol=0, atol=0)
    assert float(opt.shards[0].extra["mu"].abs().sum()) > 0


def _ranks_body(rank: int, world: int) -> dict:
    p, opt, g, sign = _problem(0, "catchup_agree_trust2_gain", TorchCommunicator(), rank)
    share = _train(p, opt, g, sign, 30)
    return {"share": share, "p": p.detach().tolist(),
            "mask": opt.masks[0].current.tolist()}


def test_gain_masks_are_the_same_on_every_rank():
    """Each rank scores the shard it owns from its own gradient; the masks it makes are
    shared, so every rank ends with the same parameters."""
    res = run_ranks(_ranks_body, 2, timeout=120)
    assert res[0]["p"] == res[1]["p"]
    assert res[0]["mask"] == res[1]["mask"]
    assert res[0]["share"] == res[1]["share"] > 0.25  # above the steady coordinates' share


def test_gain_rules_are_registered_with_their_state():
    for name in ("catchup_agree_trust2_gain", "catchup_agree_trust4_gain"):
        rule = RULES[name]
        assert rule.score is gain_score and rule.score_reads_hp
        assert rule.extra == GAIN_STATE and rule.observe is observe_local_moments


def test_state_of_another_rule_loads():
    """The defaults changed rule: a state saved by ``catchup_agree_trust4_accum`` loads into
    a gain rule (its ``mu`` starts at zero, the noise EMA carries over) and back (``mu`` is
    dropped)."""
    p, old, g, sign = _problem(0, "catchup_agree_trust4_accum")
    _train(p, old, g, sign, 8)
    p2, new, g2, sign2 = _problem(0, "catchup_agree_trust2_gain")
    _train(p2, new, g2, sign2, 8)
    new.load_state_dict(old.state_dict())
    assert torch.equal(new.shards[0].extra["s2"], old.shards[0].extra["s2"])
    assert not bool(new.shards[0].extra["mu"].any())
    _train(p2, new, g2, sign2, 3)  # and it trains on
    assert bool(new.shards[0].extra["mu"].any()) and bool(torch.isfinite(p2).all())
    p3, back, g3, sign3 = _problem(0, "catchup_agree_trust4_accum")
    back.load_state_dict(new.state_dict())
    assert set(back.shards[0].extra) == set(RULES["catchup_agree_trust4_accum"].extra)
    assert torch.equal(back.shards[0].extra["s2"], new.shards[0].extra["s2"])


def _save_body(rank: int, world: int) -> bytes:
    p, opt, g, sign = _problem(0, "catchup_agree_trust4_accum", TorchCommunicator(), rank)
    _train(p, opt, g, sign, 8)
    buf = io.BytesIO()  # tensors cross the process boundary as bytes
    torch.save(opt.rank_state_dict(), buf)
    return buf.getvalue()


def test_state_of_another_rule_reshards():
    """Two ranks' states of a rule without ``mu`` reshard onto one process with a gain rule."""
    states = [torch.load(io.BytesIO(b), weights_only=False)
              for b in run_ranks(_save_body, 2, timeout=120)]
    p, opt, g, sign = _problem(0, "catchup_agree_trust2_gain")
    opt.load_state_dict(states)
    n = opt.buckets[0].numel
    s2 = torch.cat([sd["buckets"][0]["extra"]["s2"] for sd in states])[:n]
    assert torch.equal(opt.shards[0].extra["s2"][:n], s2)
    assert not bool(opt.shards[0].extra["mu"].any())


def test_residual_gain_score_matches_float64_and_reads_the_wait():
    """``gain_score_residual`` in float64 from its docstring; and a weak steady gradient that
    the EMA reads as noise (score 0 by ``gain_score``) scores above 0 once its summed wait
    shows it."""
    s = _state(5)
    s.extra["prev"] = torch.randn(s.m.numel(), generator=torch.Generator().manual_seed(9))
    hp = dict(HP)
    got = torch.full_like(s.m, float("nan"))
    got.copy_(gain_score_residual(s, hp))
    ex = {k: v.double() for k, v in s.extra.items()}
    age = s.age.double()
    ema = ex["mu"] / ex["s2w"]
    var = (ex["s2"] / ex["s2w"] - ema ** 2).clamp(min=0.0)
    span = (1 + NOISE_BETA) / (1 - NOISE_BETA)
    mean = (span * ema + torch.where(s.age > 0, ex["prev"], 0.0)) / (age + span)
    sig = (mean ** 2 - var / (age + span)).clamp(min=0.0).sqrt()
    sigma_m = (2 * var * (1 - hp["beta1"]) / (1 + hp["beta1"]) / hp["world"] + 1e-30).sqrt()
    want = sig * (torch.special.erf(sig / sigma_m) * (age + 1)).clamp(min=1.0)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-6)
    # per-step mean 0.1, noise std 1; the EMA reads 0.1 exactly, below its own noise (0.16)
    one = ShardState(master=torch.zeros(2), m=torch.zeros(2),
                     age=torch.tensor([0, 400], dtype=torch.int32),
                     extra={"prev": torch.tensor([0.0, 400 * 0.1]), "s2": torch.ones(2),
                            "s2w": torch.ones(2), "mu": torch.full((2,), 0.1)})
    assert float(gain_score(one, dict(HP, world=1)).max()) == 0.0
    res = gain_score_residual(one, dict(HP, world=1))
    assert float(res[0]) == 0.0 < float(res[1])  # the 400-step sum shows it
