"""Promises 6, 7 and 10 (issue 6) on real gloo processes.

6. Exact resume: 8 steps straight versus k steps, ``scape.save_checkpoint``, new processes,
   ``scape.load_checkpoint``, 8 - k more: bitwise identical parameters and optimizer state
   after every step, for k inside the warm-up, at its end, and around the dense refresh at
   step 5. Negative control: a checkpoint without the pending (one-step-late) mask diverges.
7. Resharding: save at 4 ranks, load at 2 and at 1, and 2 -> 4: master weights, first moments,
   ages and masks equal the old ones with padding removed; every new rank's residual is the
   mean of the old residuals; training goes on and the loss falls.
10. Determinism: two fresh runs with the same seed and world size are bitwise identical at
   every step (one of them also saves checkpoints: saving changes nothing).
"""

from __future__ import annotations

import io as io_bytes

import pytest
import torch
from dist import run_ranks
from reliability_common import (
    BLOCK,
    eval_loss,
    make_model,
    make_opt,
    snapshot,
    state_hash,
    train_step,
)

import scape
from scape import io

STEPS = 8
SAVE_AT = (2, 3, 4, 5, 6)  # warm-up ends at 3; step 5 is a dense refresh (dense_every=5)


def _straight(rank, world, root, save_at):
    model = make_model()
    opt = make_opt(model)
    hashes = []
    for t in range(1, STEPS + 1):
        train_step(model, opt, t, rank)
        hashes.append(state_hash(snapshot(opt)))
        if t in save_at:
            scape.save_checkpoint(opt, f"{root}/k{t}")
    return hashes


def _resume(rank, world, root, ks, control):
    out = {}
    for k in ks:
        model = make_model(seed=1234)  # other initial values: loading must overwrite them
        opt = make_opt(model)
        assert scape.load_checkpoint(opt, f"{root}/k{k}") == k
        hashes = [state_hash(snapshot(opt))]
        for t in range(k + 1, STEPS + 1):
            train_step(model, opt, t, rank)
            hashes.append(state_hash(snapshot(opt)))
        out[k] = hashes
    for k in control:  # the same checkpoint without the pending mask
        model = make_model(seed=1234)
        opt = make_opt(model)
        ckpt = io.resolve(f"{root}/k{k}")
        sd = io.read_state(ckpt, io.read_manifest(ckpt)["files"][rank])
        assert sd["buckets"][0]["mask_next"] is not None, "no pending mask to omit"
        sd["buckets"][0]["mask_next"] = None
        opt.load_state_dict(sd)
        for t in range(k + 1, STEPS + 1):
            train_step(model, opt, t, rank)
        out[f"control{k}"] = [state_hash(snapshot(opt))]
    return out


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    first = run_ranks(_straight, 2, str(root), SAVE_AT, timeout=150)
    return root, first


def test_two_fresh_runs_are_bitwise_identical(straight):
    _, first = straight
    second = run_ranks(_straight, 2, "", (), timeout=150)
    for rank in range(2):
        assert len(first[rank]) == STEPS
        for t, (a, b) in enumerate(zip(first[rank], second[rank], strict=True), 1):
            assert a == b, f"rank {rank}: runs differ at step {t}"
    assert first[0] != first[1]  # the hashes cover rank-local state (residuals, shards)


def test_exact_resume_and_negative_control(straight):
    root, first = straight
    results = run_ranks(_resume, 2, str(root), SAVE_AT, (3, 6), timeout=200)
    for rank, res in enumerate(results):
        for k in SAVE_AT:
            # after loading: the state of step k; then every later step bitwise equal
            assert res[k] == first[rank][k - 1:], f"rank {rank}: resume from step {k} differs"
        for k in (3, 6):
            assert res[f"control{k}"][0] != first[rank][-1], \
                f"rank {rank}: dropping the pending mask at {k} went unnoticed"


# ------------------------------------------------------------------------------- resharding
def _train_save(rank, world, load_from, save_to, first_step, steps):
    model = make_model(seed=1234)
    opt = make_opt(model)
    if load_from:
        assert scape.load_checkpoint(opt, load_from) == first_step - 1
    buf = io_bytes.BytesIO()  # tensors cross the process boundary as bytes
    torch.save(opt.rank_state_dict(), buf)
    losses = [eval_loss(model)]
    for t in range(first_step, first_step + steps):
        train_step(model, opt, t, rank)
    losses.append(eval_loss(model))
    if save_to:
        scape.save_checkpoint(opt, save_to)
    return buf.getvalue(), losses


def _state(data: bytes):
    return torch.load(io_bytes.BytesIO(data), weights_only=True)


def _old_layout(root):
    """Every old rank's state dict, read and checked by scape.io."""
    ckpt = io.resolve(root)
    manifest = io.read_manifest(ckpt)
    return [io.read_state(ckpt, f) for f in manifest["files"]]


def _expect_same_state(old, new, what):
    """Sharded tensors equal with padding removed, residual = mean of old, masks per block."""
    numels = [b["numel"] for b in old[0]["buckets"]]
    for i, numel in enumerate(numels):
        for name in ("master", "m", "age"):
            a = torch.cat([sd["buckets"][i][name] for sd in old])[:numel]
            b = torch.cat([sd["buckets"][i][name] for sd in new])[:numel]
            assert torch.equal(a, b), f"{what}: bucket {i} {name} differs after resharding"
        mean = torch.stack([sd["buckets"][i]["residual"][:numel] for sd in old]).mean(0)
        for sd in new:
            assert torch.equal(sd["buckets"][i]["residual"][:numel], mean), \
                f"{what}: bucket {i} residual is not the mean of the old residuals"
            assert float(sd["buckets"][i]["residual"][numel:].abs().sum()) == 0.0
        n_real = -(-numel // BLOCK)
        for key in ("mask_next", "mask_current"):
            a = old[0]["buckets"][i].get(key)
            for sd in new:
                b = sd["buckets"][i].get(key)
                if a is None:
                    assert b is None, (what, i, key)
                    continue
                assert torch.equal(a[:n_real], b[:n_real]), f"{what}: bucket {i} {key}"
    assert all(sd["step"] == old[0]["step"] for sd in new)


def _falls(losses, what):
    before, after = losses
    assert after < 0.97 * before, f"{what}: held-out loss did not fall ({before:.4f} -> " \
        f"{after:.4f})"


def test_resharding_4_to_2_to_4_and_4_to_1(tmp_path):
    w4, w2 = str(tmp_path / "w4"), str(tmp_path / "w2")
    res4 = run_ranks(_train_save, 4, "", w4, 1, 7, timeout=200)
    for r in res4:
        _falls(r[1], "at 4 ranks")
    old4 = _old_layout(w4)
    assert old4[0]["buckets"][0]["mask_next"] is not None  # a pending mask crosses over

    res2 = run_ranks(_train_save, 2, w4, w2, 8, 12, timeout=200)
    _expect_same_state(old4, [_state(r[0]) for r in res2], "4 -> 2")
    for r in res2:
        _falls(r[1], "after 4 -> 2")
        assert r[1][0] == res4[0][1][1]  # the model after loading is the model that was saved

    res1 = _train_save(0, 1, w4, "", 8, 12)  # one rank: no process group at all
    _expect_same_state(old4, [_state(res1[0])], "4 -> 1")
    _falls(res1[1], "after 4 -> 1")

    old2 = _old_layout(w2)
    res = run_ranks(_train_save, 4, w2, "", 20, 20, timeout=200)
    _expect_same_state(old2, [_state(r[0]) for r in res], "2 -> 4")
    for r in res:
        _falls(r[1], "after 2 -> 4")
        assert r[1][0] == res2[0][1][1]
