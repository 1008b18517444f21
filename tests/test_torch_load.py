"""``torch.save`` per rank, then ``torch.load`` with torch's defaults (``weights_only=True``
since torch 2.6), the checkpoint pattern most trainers use:

    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, f"ckpt/r{rank}.pt")
    ck = torch.load(f"ckpt/r{rank}.pt")

- On 2 ranks (flat) and 4 ranks as 2 nodes x 2 (two levels) the file loads with the defaults
  and ``opt.load_state_dict`` of it continues bitwise as the uninterrupted run, in the same
  processes and in fresh ones that read the files the first ones wrote.
- Nothing else is let through: a per-rank file that also carries a foreign global is refused
  by the default ``torch.load`` (its code never runs), and a state dict whose mask bytes carry
  one is refused by ``load_state_dict`` with a ``ValueError`` on every rank, nothing changed.
"""

from __future__ import annotations

import io
import os
import pickle

import numpy as np
import pytest
import torch
import torch.distributed as dist
from dist import run_ranks
from reliability_common import differing, make_model, make_opt, snapshot, train_step

SAVE_AT = 6  # past the warm-up (3 steps) and a dense refresh (step 5): masks in flight
MORE = 4
LAYOUTS = {"flat": 2, "two_level": 4}


def _comm(layout: str):
    if layout == "flat":
        return None
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))


def _np(snap):
    return {k: v.numpy().copy() for k, v in snap.items()}


def _differing(a, b):
    return differing({k: torch.from_numpy(v) for k, v in a.items()},
                     {k: torch.from_numpy(v) for k, v in b.items()})


def _straight(rank, world, layout):
    """The uninterrupted run: ``SAVE_AT + MORE`` steps."""
    model = make_model()
    opt = make_opt(model, comm=_comm(layout))
    for t in range(1, SAVE_AT + MORE + 1):
        train_step(model, opt, t, rank)
    return _np(snapshot(opt))


def _resume(rank, world, layout, path, save):
    """``save``: train ``SAVE_AT`` steps and ``torch.save`` the model's and the optimizer's
    state dicts to this rank's file. Then (in these processes, or in fresh ones when not
    ``save``) a model of other initial weights and a new optimizer load that file with
    ``torch.load``'s defaults and train ``MORE`` steps."""
    f = f"{path}.r{rank}.pt"
    if save:
        model = make_model()
        opt = make_opt(model, comm=_comm(layout))
        for t in range(1, SAVE_AT + 1):
            train_step(model, opt, t, rank)
        torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, f)
        dist.barrier()
    model = make_model(seed=1)
    opt = make_opt(model, comm=_comm(layout))
    ck = torch.load(f)  # torch's defaults: weights_only=True
    model.load_state_dict(ck["model"])
    opt.load_state_dict(ck["opt"])
    for t in range(SAVE_AT + 1, SAVE_AT + MORE + 1):
        train_step(model, opt, t, rank)
    return _np(snapshot(opt))


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_default_torch_load_resumes_bit_exactly(tmp_path, layout):
    world = LAYOUTS[layout]
    straight = run_ranks(_straight, world, layout, timeout=180)
    path = str(tmp_path / "ckpt")
    same = run_ranks(_resume, world, layout, path, True, timeout=180)  # saves, then resumes
    fresh = run_ranks(_resume, world, layout, path, False, timeout=180)  # new processes
    for rank in range(world):
        assert straight[rank]["0.params"].size > 0
        assert np.isfinite(straight[rank]["0.params"]).all()
        assert _differing(straight[rank], same[rank]) == [], rank
        assert _differing(straight[rank], fresh[rank]) == [], rank
    # the run really is sharded: the ranks' optimizer state differs, their parameters agree
    assert _differing(straight[0], straight[1]) != []
    assert all(np.array_equal(s["0.params"], straight[0]["0.params"]) for s in straight)


class _WritesAFile:
    """An object whose unpickling would write a file (a stand-in for code in a pickle)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _foreign_global(rank, world, path):
    model = make_model()
    opt = make_opt(model)
    for t in range(1, SAVE_AT + 1):
        train_step(model, opt, t, rank)
    pwned = f"{path}.pwned{rank}"
    f = f"{path}.r{rank}.pt"
    torch.save({"opt": opt.state_dict(), "x": _WritesAFile(pwned)}, f)
    try:
        torch.load(f)
        refused = None
    except pickle.UnpicklingError as e:
        refused = str(e)
    written = os.path.exists(pwned)

    # the mask bytes of the state dict (replicated, saved with torch.save) carrying a global
    before = snapshot(opt)
    sd = opt.state_dict()
    buf = io.BytesIO()
    torch.save(_WritesAFile(pwned), buf)
    sd["param_groups"][0]["scape"]["buckets"][0]["mask_next"] = buf.getvalue()
    try:
        opt.load_state_dict(sd)
        error = None
    except ValueError as e:
        error = str(e)
    return {"refused": refused, "written": written or os.path.exists(pwned), "error": error,
            "unchanged": not differing(before, snapshot(opt))}


def test_foreign_globals_are_refused(tmp_path):
    out = run_ranks(_foreign_global, 2, str(tmp_path / "f"), timeout=180)
    for r in out:
        assert r["refused"] is not None and "Unsupported global" in r["refused"], r
        assert "io.open" in r["refused"], r
        assert not r["written"]
        assert r["error"] is not None and "mask_next" in r["error"], r
        assert "weights_only" in r["error"] and "io.open" in r["error"], r
        assert r["unchanged"]
