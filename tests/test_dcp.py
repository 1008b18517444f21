"""``torch.distributed.checkpoint`` (DCP) with the sharded optimizers, on real gloo ranks.

- ``get_state_dict``/``dcp.save``, new processes with other initial weights, ``dcp.load``/
  ``set_state_dict``: the optimizer state (master weights, moments, ages, residuals, masks,
  step) and the parameters are bitwise those at the save, and training goes on bitwise as if
  never stopped.
- Saving has no side effect: ``get_state_dict`` takes no hidden step and the run after a save
  is bitwise the run without one.
- Every rank writes its own part: a checkpoint holds every rank's residual row and every
  coordinate of the moments once (the ranks' shards are not mixed).
- Another world size (2 -> 3, 2 -> 1) with :class:`scape.dcp.ReshardPlanner`: master weights
  and moments are the old ones, every rank's residual is the mean of the old residuals (as
  ``scape.load_checkpoint`` gives); the default planner refuses with a size mismatch.
- A state dict of another layout raises ``ValueError`` on every rank before anything changes.
- ``torch.save`` of ``state_dict()`` per rank loads back bitwise on that rank; one rank's file
  loaded on every rank (the Hugging Face Trainer's ``optimizer.pt``) raises on every rank.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist import run_ranks, run_ranks_outcomes
from reliability_common import differing, make_model, make_opt, snapshot, train_step

import scape

SAVE_AT = 6  # after the warm-up (3 steps) and a dense refresh (step 5): masks in flight
MORE = 4


def _np(snap):
    """A snapshot as numpy arrays (tensors cannot leave a rank's process through the queue)."""
    return {k: v.numpy().copy() for k, v in snap.items()}


def _t(snap):
    return {k: torch.from_numpy(v) for k, v in snap.items()}


def _trained(rank):
    """The model and optimizer of ``rank`` after ``SAVE_AT`` steps (masks in flight)."""
    model = make_model()
    opt = make_opt(model)
    for t in range(1, SAVE_AT + 1):
        train_step(model, opt, t, rank)
    return model, opt


def _dcp():
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    return dcp, get_state_dict, set_state_dict


def _save_run(rank, world, path, save):
    dcp, get_state_dict, _ = _dcp()
    model, opt = _trained(rank)
    at_save = snapshot(opt)
    if save:
        msd, osd = get_state_dict(model, opt)
        assert not differing(at_save, snapshot(opt)), "get_state_dict changed the optimizer"
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    after = []
    for t in range(SAVE_AT + 1, SAVE_AT + MORE + 1):
        train_step(model, opt, t, rank)
        after.append(_np(snapshot(opt)))
    return _np(at_save), after


def _load_run(rank, world, path):
    dcp, get_state_dict, set_state_dict = _dcp()
    model = make_model(seed=1234)  # other initial values: loading must overwrite them
    opt = make_opt(model)
    msd, osd = get_state_dict(model, opt)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    loaded = _np(snapshot(opt))
    after = []
    for t in range(SAVE_AT + 1, SAVE_AT + MORE + 1):
        train_step(model, opt, t, rank)
        after.append(_np(snapshot(opt)))
    return loaded, after


@pytest.mark.parametrize("world", [1, 2])
def test_dcp_round_trip_is_bit_exact_and_training_goes_on(tmp_path, world):
    path = str(tmp_path / "ckpt")
    saved = run_ranks(_save_run, world, path, True, timeout=180)
    plain = run_ranks(_save_run, world, path + "-unused", False, timeout=180)
    loaded = run_ranks(_load_run, world, path, timeout=180)
    saved = [(_t(a), [_t(x) for x in b]) for a, b in saved]
    plain = [(_t(a), [_t(x) for x in b]) for a, b in plain]
    loaded = [(_t(a), [_t(x) for x in b]) for a, b in loaded]
    for rank in range(world):
        at_save, after = saved[rank]
        assert any(k.endswith("mask_next") and v.numel() for k, v in at_save.items())
        assert any(k.endswith("residual") and bool(v.abs().sum() > 0)
                   for k, v in at_save.items()), "nothing in the residual: the test is weak"
        assert not differing(at_save, loaded[rank][0]), f"rank {rank}: state after load"
        for t, (a, b, c) in enumerate(zip(after, loaded[rank][1], plain[rank][1])):
            assert not differing(a, b), f"rank {rank}, step {SAVE_AT + 1 + t}: resumed run"
            assert not differing(a, c), f"rank {rank}, step {SAVE_AT + 1 + t}: save had effects"
    if world == 2:  # the ranks hold different residuals, so a mix-up would show above
        assert differing(saved[0][0], saved[1][0])


def _checkpoint_parts(rank, world, path):
    dcp, get_state_dict, _ = _dcp()
    model, opt = _trained(rank)
    _, osd = get_state_dict(model, opt)
    dcp.save({"optim": osd}, checkpoint_id=path)
    md = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    out = {}
    for key, m in md.items():
        if key.startswith("optim.state.") and hasattr(m, "chunks"):
            out[key] = (list(m.size), sorted((list(c.offsets), list(c.sizes)) for c in m.chunks))
    return out, {n: p.numel() for n, p in model.named_parameters()}


def test_every_rank_writes_its_own_part(tmp_path):
    world = 2
    meta, numels = run_ranks(_checkpoint_parts, world, str(tmp_path / "c"), timeout=180)[0]
    for name, n in numels.items():
        rows = meta[f"optim.state.{name}.residual"]
        assert rows == ([world, n], [([r, 0], [1, n]) for r in range(world)])
        for key in ("exp_avg", "master", "age"):
            size, chunks = meta[f"optim.state.{name}.{key}"]
            assert size == [n]
            covered = sorted((o[0], o[0] + s[0]) for o, s in chunks)
            assert covered[0][0] == 0 and covered[-1][1] == n, (name, key, covered)
            assert all(a[1] == b[0] for a, b in zip(covered, covered[1:])), covered


def _reshard_load(rank, world, path, planner):
    dcp, get_state_dict, set_state_dict = _dcp()
    model = make_model(seed=1234)
    opt = make_opt(model)
    msd, osd = get_state_dict(model, opt)
    kw = {"planner": scape.dcp.ReshardPlanner()} if planner else {}
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=path, **kw)
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    snap = snapshot(opt)
    losses = [train_step(model, opt, t, rank) for t in range(SAVE_AT + 1, SAVE_AT + 9)]
    return _np(snap), [(b.shard_start, b.numel) for b in opt.buckets], losses


@pytest.mark.parametrize("new_world", [3, 1])
def test_dcp_reshards_with_the_planner(tmp_path, new_world):
    path = str(tmp_path / "ckpt")
    old = [(_t(a), b) for a, b in run_ranks(_save_run, 2, path, True, timeout=180)]
    new = [(_t(a), b, c) for a, b, c in run_ranks(_reshard_load, new_world, path, True,
                                                  timeout=180)]
    n_buckets = sum(1 for k in old[0][0] if k.endswith(".master"))
    for i in range(n_buckets):
        full_master = torch.cat([old[r][0][f"{i}.master"] for r in range(2)])
        full_m = torch.cat([old[r][0][f"{i}.m"] for r in range(2)])
        mean_res = torch.stack([old[r][0][f"{i}.residual"] for r in range(2)]).mean(0)
        for rank in range(new_world):
            snap, layout, losses = new[rank]
            start, numel = layout[i]
            master, m = snap[f"{i}.master"], snap[f"{i}.m"]
            stop = min(start + master.numel(), numel)
            if start < numel:
                assert torch.equal(master[:stop - start], full_master[start:stop])
                assert torch.equal(m[:stop - start], full_m[start:stop])
            assert torch.equal(snap[f"{i}.residual"][:numel], mean_res[:numel])
            assert torch.isfinite(torch.tensor(losses)).all()
            assert losses[-1] < losses[0] * 1.5


def test_dcp_default_planner_refuses_another_world_size(tmp_path):
    path = str(tmp_path / "ckpt")
    run_ranks(_save_run, 2, path, True, timeout=180)
    outcomes = run_ranks_outcomes(_reshard_load, 1, path, False, timeout=180)
    assert not outcomes[0].ok
    assert "Size mismatch" in outcomes[0].error and "residual" in outcomes[0].error


def _other_layout(rank, world):
    _, get_state_dict, set_state_dict = _dcp()
    model, opt = _trained(rank)
    _, osd = get_state_dict(model, opt)
    before = snapshot(opt)
    bad = {"state": osd["state"], "param_groups": [dict(g) for g in osd["param_groups"]]}
    info = dict(bad["param_groups"][0]["scape"])
    info["buckets"] = [dict(info["buckets"][0], shapes=[[1, 1]] + info["buckets"][0]["shapes"][1:]),
                       *info["buckets"][1:]]
    bad["param_groups"][0]["scape"] = info
    try:
        opt.load_state_dict(bad)
    except ValueError as e:
        assert not differing(before, snapshot(opt)), "state changed before the error"
        return str(e)
    return None


def test_another_layout_raises_on_every_rank_before_loading():
    msgs = run_ranks(_other_layout, 2, timeout=120)
    assert all(m is not None and "shapes" in m for m in msgs), msgs


def test_single_process_state_dict_round_trip():
    model, opt = _trained(0)
    sd = opt.state_dict()
    assert set(sd) == {"state", "param_groups"}
    p = next(model.parameters())
    entry = sd["state"][0]
    assert entry["exp_avg"].shape == (p.numel(),) and entry["residual"].shape == (1, p.numel())
    before = snapshot(opt)
    torch.nn.init.zeros_(sd["state"][0]["exp_avg"])  # a copy: the optimizer is not touched
    assert not differing(before, snapshot(opt))
    model2 = make_model(seed=5)
    opt2 = make_opt(model2)
    opt2.load_state_dict(opt.state_dict())
    assert not differing(before, snapshot(opt2))


def _one_rank_mismatched(rank, world, legacy):
    model, opt = _trained(rank)
    sd = opt.rank_state_dict() if legacy else opt.state_dict()
    if rank == 1:  # only this rank's state dict is of another layout
        if legacy:
            sd["buckets"][0]["shapes"] = [[1, 1]] + sd["buckets"][0]["shapes"][1:]
        else:
            info = sd["param_groups"][0]["scape"]
            info["buckets"][0]["shapes"] = [[1, 1]] + info["buckets"][0]["shapes"][1:]
    before = snapshot(opt)
    try:
        opt.load_state_dict(sd)
    except ValueError as e:
        assert not differing(before, snapshot(opt)), "state changed before the error"
        return str(e)
    return None


@pytest.mark.parametrize("legacy", [False, True], ids=["state_dict", "rank_state_dict"])
def test_a_mismatch_on_one_rank_raises_on_every_rank(legacy):
    msgs = run_ranks(_one_rank_mismatched, 2, legacy, timeout=120)
    assert msgs[1] is not None and "shapes" in msgs[1]
    assert msgs[0] is not None and msgs[0].startswith("rank 1:"), msgs


def _move(obj, device):
    """What accelerate does to an optimizer's state dict before loading it back."""
    if isinstance(obj, dict):
        return {k: _move(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_move(v, device) for v in obj)
    return obj.to(device) if isinstance(obj, torch.Tensor) else obj


def _moved_round_trip(rank, world):
    model, opt = _trained(rank)
    before = snapshot(opt)
    opt.load_state_dict(_move(opt.state_dict(), torch.device("cpu:0")))
    return not differing(before, snapshot(opt))


def test_state_dict_moved_to_its_own_device_loads_back():
    assert all(run_ranks(_moved_round_trip, 2, timeout=120))


def _torch_save_load(rank, world, path, own):
    model, opt = _trained(rank)
    before = snapshot(opt)
    f = f"{path}.{rank}" if own else path  # own: every rank its file; else rank 0's for all
    if own or rank == 0:
        torch.save(opt.state_dict(), f)
    dist.barrier()
    try:
        opt.load_state_dict(torch.load(f))  # torch's defaults: weights_only=True
    except ValueError as e:
        assert not differing(before, snapshot(opt)), "state changed before the error"
        return str(e)
    assert not differing(before, snapshot(opt)), "a rank's own file did not load back exactly"
    return None


def test_torch_save_per_rank_loads_back_and_another_ranks_file_raises_everywhere(tmp_path):
    assert run_ranks(_torch_save_load, 2, str(tmp_path / "opt.pt"), True, timeout=120) == \
        [None, None]
    msgs = run_ranks(_torch_save_load, 2, str(tmp_path / "rank0.pt"), False, timeout=120)
    assert all(m is not None and "another rank's part" in m for m in msgs), msgs
