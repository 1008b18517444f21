"""noise_gain_topk_ (a sparse step's shard pass before the take, fused): on each backend it
leaves exactly the state, ages and mask of noise_ema_, the ages advanced at the step's mask and
gain_topk called in turn; the CPU path equals the plain torch twins and a brute-force
selection; restore_ages_ undoes the advance; the catch-up given the old ages at the mask
equals the catch-up that advances them itself."""

from __future__ import annotations

import pytest
import torch
from conftest import nan_empty
from kernel_cases import brute_topk, flat_positions, gain_inputs, random_mask, seeded

from scape import kernels
from scape.kernels import reference as ref

KW = dict(beta=0.95, beta1=0.9, world=4)
SPAN, SCALE = (1 + 0.95) / (1 - 0.95), (1 - 0.9) / (1 + 0.9) / 4

CASES = [  # block_size, n_blocks, k_cur (this step's mask), k (next), k_explore, feedback,
    # residual (the score with the wait, as the default's masks up to sparsity 0.974)
    pytest.param(256, 3, 5, 5, 1, True, True, id="b256-nb3-k5-x1"),
    pytest.param(256, 2, 40, 7, 0, True, False, id="b256-nb2-kcur40-k7-fresh"),
    pytest.param(1024, 3, 11, 11, 2, False, True, id="b1024-nb3-k11-x2-noef"),
    pytest.param(4096, 2, 41, 41, 4, True, False, id="b4096-nb2-k41-x4-fresh"),
    pytest.param(4096, 1, 1100, 410, 41, True, True, id="b4096-nb1-kcur1100-k410-x41"),
    pytest.param(8192, 1, 82, 82, 8, True, False, id="b8192-three-ops-fresh"),
]


def _inputs(block_size, n_blocks, k_cur, key):
    """Fresh state: a buffer with a few non-finite entries (an about-to-be-skipped step),
    many zero and equal ages (the residual test and explore ties), this step's mask."""
    gen = seeded("noise-gain-topk", block_size, n_blocks, k_cur, key)
    n = block_size * n_blocks
    mu, s2, s2w, age = gain_inputs(gen, n)
    age[: n // 3] = age[: n // 3] % 4
    buf = torch.randn(n, generator=gen) * 0.1
    buf[5], buf[n // 2 + 1] = float("nan"), float("inf")
    prev = torch.randn(n, generator=gen) * 0.1
    cur = random_mask(n_blocks, block_size, k_cur, gen)
    return [buf, prev, age, s2, s2w, mu, cur]


def _in_turn(state, k, block_size, k_explore, error_feedback, residual):
    buf, prev, age, s2, s2w, mu, cur = state
    kernels.noise_ema_(buf, prev, age, s2, s2w, beta=0.95, error_feedback=error_feedback,
                       mu=mu)
    waited = ref.advance_ages_(age, cur, block_size)
    idx = kernels.gain_topk(mu, s2, s2w, age, k, block_size, k_explore=k_explore,
                            prev=prev if residual else None, **KW)
    return idx, waited


@pytest.mark.parametrize("block_size,n_blocks,k_cur,k,k_explore,ef,residual", CASES)
def test_fused_equals_the_ops_in_turn(kernel_backend, block_size, n_blocks, k_cur, k, k_explore,
                                      ef, residual):
    for mode in ("triton", "torch"):
        kernel_backend(mode)
        fused = _inputs(block_size, n_blocks, k_cur, k)
        turn = [t.clone() for t in fused]
        old_age = fused[2].clone()
        idx, waited = kernels.noise_gain_topk_(*fused, k, block_size, k_explore=k_explore,
                                               error_feedback=ef, residual=residual, **KW)
        want_idx, want_waited = _in_turn(turn, k, block_size, k_explore, ef, residual)
        assert idx.dtype == torch.int16 and idx.shape == (n_blocks, k)
        assert torch.equal(idx, want_idx), f"{mode}: another mask"
        assert torch.equal(waited, want_waited), f"{mode}: other old ages"
        for name, a, b in zip(("buf", "prev", "age", "s2", "s2w", "mu"), fused, turn):
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True,
                                       msg=f"{mode}: {name} differs")
        # invariants: the old ages out, every age advanced, the mask's reset, the buffer kept
        flat = flat_positions(fused[6], block_size)
        assert torch.equal(waited, old_age[flat])
        advanced = old_age + 1
        advanced[flat] = 0
        assert torch.equal(fused[2], advanced)
        rows = idx.long()
        assert bool((rows[:, 1:] > rows[:, :-1]).all()), "offsets ascending and distinct"
        torch.testing.assert_close(fused[1], fused[0], rtol=0, atol=0, equal_nan=True,
                                   msg="prev is this buffer")
        ok = torch.isfinite(fused[0])
        assert torch.equal(fused[4][~ok], turn[4][~ok]) and not torch.equal(
            fused[4][ok], _inputs(block_size, n_blocks, k_cur, k)[4][ok]), \
            "s2w moves where the buffer is finite only"


@pytest.mark.parametrize("block_size,n_blocks,k_cur,k,k_explore,ef,residual", CASES[:4])
def test_cpu_path_is_the_plain_twins(kernel_backend, block_size, n_blocks, k_cur, k, k_explore,
                                     ef, residual):
    kernel_backend("torch")
    state = _inputs(block_size, n_blocks, k_cur, ("twin", k))
    twin = [t.clone() for t in state]
    score_out = nan_empty(state[0].numel())
    idx, waited = kernels.noise_gain_topk_(*state, k, block_size, k_explore=k_explore,
                                           error_feedback=ef, residual=residual, out=score_out,
                                           **KW)
    want_idx, want_waited = ref.noise_gain_topk_(
        *twin, k, block_size, k_explore=k_explore, beta=0.95, span=SPAN, var_m_scale=SCALE,
        error_feedback=ef, residual=residual)
    assert torch.equal(idx, want_idx) and torch.equal(waited, want_waited)
    buf, prev, age, s2, s2w, mu, _ = twin
    score = ref.gain_score(mu, s2, s2w, age, span=SPAN, var_m_scale=SCALE,
                           prev=prev if residual else None)
    torch.testing.assert_close(score_out, score, rtol=0, atol=0, equal_nan=True,
                               msg="the CPU path's score is written into out")
    assert torch.equal(idx, brute_topk(score, k, block_size, age if k_explore else None,
                                       k_explore))
    assert bool((score == 0).any()), "no ties at zero: the test cannot tell"


def test_restore_ages_undoes_the_advance():
    gen = seeded("restore-ages")
    age = torch.randint(0, 1000, (4 * 512,), generator=gen, dtype=torch.int32)
    before = age.clone()
    cur = random_mask(4, 512, 9, gen)
    waited = ref.advance_ages_(age, cur, 512)
    assert not torch.equal(age, before)
    kernels.restore_ages_(age, cur, 512, waited)
    assert torch.equal(age, before)


@pytest.mark.parametrize("mode", ["triton", "torch"])
@pytest.mark.parametrize("block_size,k", [(256, 9), (4096, 41)])
def test_catchup_with_the_old_ages_equals_the_catchup_that_ages(kernel_backend, mode,
                                                                 block_size, k):
    kernel_backend(mode)
    gen = seeded("catchup-aged", block_size, k)
    n = 3 * block_size
    mu, s2, s2w, age = gain_inputs(gen, n)
    p, m = torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 0.01
    idx = random_mask(3, block_size, k, gen)
    g = torch.randn(3 * k, generator=gen) * 0.05
    hp = dict(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, world=4, trust=0.5)
    outs = []
    for aged in (False, True):
        pa, ma, agea = p.clone(), m.clone(), age.clone()
        waited = ref.advance_ages_(agea, idx, block_size) if aged else None
        out = nan_empty(3 * k)
        kernels.catchup_agree_(pa, ma, agea, s2, s2w, g, idx, block_size, model_out=out,
                               age_at_mask=waited, **hp)
        outs.append((pa, ma, agea, out))
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    assert not bool(torch.isnan(outs[1][3]).any())
    assert not torch.equal(outs[1][0], p), "the catch-up moved nothing: the test cannot tell"


def test_validates(kernel_backend):
    kernel_backend("torch")
    state = _inputs(256, 2, 5, "validate")
    with pytest.raises(ValueError, match="cur must have one row per block"):
        kernels.noise_gain_topk_(*state[:6], state[6][:1], 5, 256, **KW)
    with pytest.raises(TypeError, match="cur"):
        kernels.noise_gain_topk_(*state[:6], state[6].int(), 5, 256, **KW)
    with pytest.raises(ValueError, match=r"buf must have \d+ elements \(same length as mu\)"):
        kernels.noise_gain_topk_(state[0][:256], *state[1:], 5, 256, **KW)
    with pytest.raises(ValueError, match="k_explore must be in"):
        kernels.noise_gain_topk_(*state, 5, 256, k_explore=6, **KW)
    with pytest.raises(ValueError, match="age_at_mask"):
        kernels.catchup_agree_(state[5].clone(), state[5].clone(), state[2], state[3],
                               state[4], torch.zeros(10), state[6], 256, lr=1e-3, beta1=0.9,
                               beta2=0.95, eps=1e-8, weight_decay=0.0, world=1,
                               age_at_mask=torch.zeros(3, dtype=torch.int32))
