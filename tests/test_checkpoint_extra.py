"""``save_checkpoint(..., extra=)``: the LR scheduler, RNG states and a user dict travel in the
same atomic checkpoint as the optimizer, come back through ``load_checkpoint(..., extra=)``,
also onto another world size; a name the checkpoint lacks raises before anything loads."""

from __future__ import annotations

import pytest
import torch
from dist import run_ranks

import scape


def _setup(comm=None):
    torch.manual_seed(0)
    model = torch.nn.Linear(30, 20)
    opt = scape.SCAPE(model.parameters(), lr=1e-2, sparsity=0.9, block_size=256,
                      warmup_steps=1, comm=comm)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 0.9 ** t)
    return model, opt, sched


def _train(model, opt, sched, steps, rank=0):
    for t in range(steps):
        g = torch.Generator().manual_seed(100 * t + rank)
        model(torch.randn(4, 30, generator=g)).square().mean().backward()
        opt.step()
        sched.step()


def _save_body(rank: int, world: int, root: str) -> dict:
    model, opt, sched = _setup()
    _train(model, opt, sched, 4, rank)
    torch.manual_seed(1000 + rank)
    scape.save_checkpoint(opt, root, extra={"scheduler": sched, "rng": torch.get_rng_state(),
                                            "user": {"epoch": 3, "rank": rank}})
    return {"lr": opt.param_groups[0]["lr"], "rng": torch.get_rng_state().tolist()}


def test_extras_round_trip_and_reshard(tmp_path):
    root = str(tmp_path / "ckpt")
    saved = run_ranks(_save_body, 2, root, timeout=120)
    model, opt, sched = _setup()  # one process: the checkpoint of 2 ranks reshards
    extra = {"scheduler": sched, "rng": None, "user": None}
    step = scape.load_checkpoint(opt, root, extra=extra)
    assert step == 4 and opt.param_groups[0]["lr"] == pytest.approx(saved[0]["lr"])
    assert sched.last_epoch == 4 and sched.get_last_lr()[0] == pytest.approx(saved[0]["lr"])
    assert extra["user"] == {"epoch": 3, "rank": 0}  # rank 0 of the new world reads old rank 0
    assert extra["rng"].tolist() == saved[0]["rng"]
    torch.set_rng_state(extra["rng"])


def test_missing_extra_raises_before_loading(tmp_path):
    model, opt, sched = _setup()
    _train(model, opt, sched, 3)
    scape.save_checkpoint(opt, tmp_path, extra={"user": {"epoch": 1}})
    fresh_model, fresh, fresh_sched = _setup()
    before = fresh.shards[0].master.clone()
    with pytest.raises(scape.CheckpointError, match="no extra \\['scheduler'\\]"):
        scape.load_checkpoint(fresh, tmp_path, extra={"scheduler": fresh_sched})
    assert torch.equal(fresh.shards[0].master, before) and fresh.step_count == 0
    got = {"user": None}
    assert scape.load_checkpoint(fresh, tmp_path, extra=got) == 3
    assert got == {"user": {"epoch": 1}}


def test_extra_must_be_a_dict_of_names(tmp_path):
    model, opt, sched = _setup()
    with pytest.raises(OSError, match="extra must be a dict"):
        scape.save_checkpoint(opt, tmp_path, extra=[sched])
