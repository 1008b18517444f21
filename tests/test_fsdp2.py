"""SCAPE across the replicas of an FSDP2-sharded model: ``fully_shard`` over ``mesh["dp_shard"]``,
the optimizer over ``comm=mesh["dp_replicate"]`` (4 gloo ranks as 2 x 2).

- at sparsity 0 it gives the parameters of flat dense SCAPE on the 4 ranks fed the same
  batches (fp32 rounding), with clipping by the global norm over shards and replicas;
- at 0.99 every rank's full parameters are identical after every step, the loss falls, a
  sparse step sends the bytes of the formula on the local shard sizes, and a non-finite
  gradient on one rank skips the step on all;
- bf16 mixed precision (FSDP2's ``MixedPrecisionPolicy``) trains, and the state allocated per
  rank is what docs/design.md states;
- HSDP, and a ``comm`` that overlaps the shard mesh, are refused on every rank.
"""

from __future__ import annotations

import hashlib
import math

import fsdp2_common as fc
import pytest
import torch
from dist import run_ranks

LR, BLOCK = 3e-3, 256


def _mesh(shape=(2, 2)):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", shape, mesh_dim_names=("dp_replicate", "dp_shard"))


def _train(model, opt, rank, steps, every=None):
    losses = []
    for s in range(steps):
        loss = fc.loss_of(model, s, rank)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if every is not None:
            every(s)
    return losses


def _norm_logger(opt, norms):
    return lambda s: norms.append(float(opt.last_step.grad_norm))


def _fsdp_run(rank, world, steps, clip):
    import scape

    mesh = _mesh()
    out = {}
    for which in ("scape", "adamw"):
        model = fc.shard(fc.make_model(), mesh["dp_shard"])
        if which == "scape":
            opt = scape.SCAPE(model.parameters(), lr=LR, sparsity=0.0, block_size=BLOCK,
                              max_grad_norm=clip, comm=mesh["dp_replicate"])
        else:
            opt = scape.DistributedAdamW(model.parameters(), lr=LR, max_grad_norm=clip,
                                         comm=mesh["dp_replicate"])
        norms: list[float] = []
        losses = _train(model, opt, rank, steps, _norm_logger(opt, norms))
        out[which] = (losses, norms, {k: v.tolist() for k, v in fc.full_params(model).items()})
    return out


def _flat_run(rank, world, steps, clip):
    import scape

    out = {}
    for which in ("scape", "adamw"):
        model = fc.make_model()
        if which == "scape":
            opt = scape.SCAPE(model.parameters(), lr=LR, sparsity=0.0, block_size=BLOCK,
                              max_grad_norm=clip)
        else:
            opt = scape.DistributedAdamW(model.parameters(), lr=LR, max_grad_norm=clip)
        norms: list[float] = []
        losses = _train(model, opt, rank, steps, _norm_logger(opt, norms))
        out[which] = (losses, norms, {k: v.tolist() for k, v in fc.full_params(model).items()})
    return out


def test_dense_equals_flat_dense_on_the_same_ranks():
    """Sparsity 0 (SCAPE) and DistributedAdamW, clipping on at a norm the gradients exceed:
    the FSDP2 run's parameters, losses and clipping norms are the flat run's to fp32
    rounding."""
    steps, clip = 6, 0.5
    fsdp_all = run_ranks(_fsdp_run, 4, steps, clip, timeout=240)
    flat_all = run_ranks(_flat_run, 4, steps, clip, timeout=240)
    for which in ("scape", "adamw"):
        fsdp = [o[which] for o in fsdp_all]
        flat = [o[which] for o in flat_all]
        for r in range(4):
            assert fsdp[r][2] == fsdp[0][2], f"{which}: rank {r}'s parameters differ from rank 0's"
            assert fsdp[r][0] == pytest.approx(flat[r][0], rel=1e-5, abs=1e-6)
            assert fsdp[r][1] == pytest.approx(flat[r][1], rel=1e-5)  # the global norm
        assert max(fsdp[0][1]) > clip, "clipping never engaged: the test would not see the norm"
        a, b = fsdp[0][2], flat[0][2]
        assert a.keys() == b.keys()
        for k in a:
            diff = (torch.tensor(a[k]) - torch.tensor(b[k])).abs().max().item()
            assert diff <= 1e-6, (which, k, diff)


def _sparse_run(rank, world, steps, bad_step):
    import scape

    mesh = _mesh()
    model = fc.shard(fc.make_model(), mesh["dp_shard"])
    opt = scape.SCAPE(model.parameters(), lr=LR, sparsity=0.99, block_size=BLOCK,
                      total_steps=steps, warmup_steps=2, max_grad_norm=1.0,
                      comm=mesh["dp_replicate"])  # a short run: no ramp fits 1/50
    opt.attach(model)
    digests, infos, losses = [], [], []
    for s in range(steps):
        loss = fc.loss_of(model, s, rank)
        loss.backward()
        if s == bad_step and rank == 3:  # one rank's gradient turns non-finite (a gradient
            p = next(model.parameters())  # assigned after backward is added to the buffer)
            p.grad = torch.full_like(p, float("nan"))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        opt.finish_param_sync()
        digests.append(fc.digest(fc.full_params(model)))
        infos.append((opt.last_step.dense, opt.last_step.skipped,
                      sum(opt.last_step.bytes.values())))
    return losses, digests, infos, fc.sparse_step_bytes(opt, clip=True)


def test_sparse_replicas_identical_loss_falls_bytes_and_skip():
    steps, bad = 40, 9
    out = run_ranks(_sparse_run, 4, steps, bad, timeout=300)
    losses = [o[0] for o in out]
    for r in range(4):
        assert out[r][1] == out[0][1], f"rank {r}'s full parameters differ from rank 0's"
        assert out[r][2] == out[0][2]
    infos, formula = out[0][2], out[0][3]
    assert [i[1] for i in infos] == [s == bad for s in range(steps)], "skip not on all ranks"
    assert out[0][1][bad] == out[0][1][bad - 1], "a skipped step changed the parameters"
    sparse = [i for i in infos if not i[0] and not i[1]]
    assert len(sparse) >= steps - 4
    assert {i[2] for i in sparse} == {formula}, (sparse[:3], formula)
    first = sum(sum(lo[:5]) for lo in losses) / 20
    last = sum(sum(lo[-5:]) for lo in losses) / 20
    assert math.isfinite(last) and last < first - 0.1, (first, last)


def _mixed_run(rank, world, steps):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    import scape

    mesh = _mesh()
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = fc.shard(fc.make_model(), mesh["dp_shard"], mp)
    opt = scape.SCAPE(model.parameters(), lr=LR, sparsity=0.99, block_size=BLOCK,
                      warmup_steps=2, comm=mesh["dp_replicate"])
    losses = _train(model, opt, rank, steps)
    # what docs/design.md states: the state for 1/(R*G) of the model (the shard of the local
    # shard this rank owns), the gradient buffer over the local shard
    local_numel = sum(p.to_local().numel() for p in model.parameters())
    total = sum(p.numel() for p in model.parameters())
    state = {}
    for s in opt.shards:
        for name, t in opt.state_tensors(s).items():
            state[name] = state.get(name, 0) + t.numel()
    sizes = {"grad": sum(b.grad_flat.numel() for b in opt.buckets),
             "params": sum(b.param_flat.numel() for b in opt.buckets),
             "n_pad": sum(b.n_pad for b in opt.buckets), "buckets": len(opt.buckets),
             "dtype": str(opt.buckets[0].param_flat.dtype)}
    return losses, fc.digest(fc.full_params(model)), local_numel, total, state, sizes


def test_bf16_mixed_precision_trains_and_state_is_what_the_docs_state():
    steps = 30
    out = run_ranks(_mixed_run, 4, steps, timeout=300)
    assert len({o[1] for o in out}) == 1, "replicas differ"
    for losses, _, local_numel, total, state, sizes in out:
        assert all(math.isfinite(x) for x in losses)
        assert sum(losses[-5:]) < sum(losses[:5]) - 0.5
        n_pad = sizes["n_pad"]  # one bucket: one param group, one dtype
        # the buffers cover the local shard (about 1/G of the model), padded to R * B
        assert n_pad == -(-local_numel // (2 * BLOCK)) * 2 * BLOCK
        assert abs(local_numel - total / 2) <= total * 0.05
        assert sizes["buckets"] == 1
        assert sizes["grad"] == sizes["params"] == n_pad
        assert sizes["dtype"] == "torch.float32"  # FSDP2 keeps the sharded parameters in fp32
        for name, numel in state.items():  # each rank owns 1/R of its local shard
            assert numel == n_pad // 2, (name, numel, n_pad)


def _refused(rank, world):
    from torch.distributed.fsdp import fully_shard

    import scape

    mesh = _mesh()
    out = {}
    for how in ("hsdp", "overlap", "mixed"):
        model = fc.make_model()
        if how == "hsdp":
            fc.shard(model, mesh["dp_replicate", "dp_shard"])
            comm = mesh["dp_replicate"]
        elif how == "overlap":
            fc.shard(model, mesh["dp_shard"])
            comm = mesh["dp_shard"]
        else:  # some parameters left plain
            fully_shard(model.blocks[0], mesh=mesh["dp_shard"])
            comm = mesh["dp_replicate"]
        try:
            scape.SCAPE(model.parameters(), lr=LR, comm=comm)
            out[how] = None
        except Exception as e:  # noqa: BLE001 - the test checks which
            out[how] = (type(e).__name__, str(e))
    return out


WRONG = [("hsdp", "ValueError", ["HSDP", "mesh['dp_shard']", "comm=mesh['dp_replicate']"]),
         ("overlap", "ValueError", ["comm must be the ranks that hold the same shard",
                                    "comm=mesh['dp_replicate']"]),
         ("mixed", "TypeError", ["DTensors", "fully_shard"])]


def test_wrong_layouts_are_refused_on_every_rank():
    out = run_ranks(_refused, 4, timeout=120)
    for how, kind, words in WRONG:
        for r in out:
            got = r[how]
            assert got is not None, f"{how}: accepted"
            assert got[0] == kind, got
            for w in words:
                assert w in got[1], (how, w, got[1])

SAVE_AT, MORE = 8, 4


def _ckpt_opt(model, mesh):
    import scape

    return scape.SCAPE(model.parameters(), lr=LR, sparsity=0.99, block_size=BLOCK,
                       warmup_steps=2, comm=mesh["dp_replicate"])


def _state_digest(opt, model):
    """The full parameters and every tensor of this rank's optimizer state, bit by bit."""
    def sha(t):
        return hashlib.sha256(t.detach().cpu().contiguous().view(-1).view(torch.uint8)
                              .numpy().tobytes()).hexdigest()

    h = [fc.digest(fc.full_params(model))]
    for i, s in enumerate(opt.shards):
        h += [(name, sha(t)) for name, t in sorted(opt.state_tensors(s).items())]
        h.append(("residual", sha(opt.residual(i))))
        m = opt.masks[i]
        nxt = None if m is None else m.wait()  # the next mask, its all-gather completed
        h.append(("mask", None if nxt is None else sha(nxt)))
    return h


def _dcp_save(rank, world, path):
    """The run that saves at SAVE_AT, and the same run without saving (no side effect)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    mesh = _mesh()
    runs = []
    for save in (True, False):
        model = fc.shard(fc.make_model(), mesh["dp_shard"])
        opt = _ckpt_opt(model, mesh)
        after = []
        for s in range(SAVE_AT + MORE):
            fc.loss_of(model, s, rank).backward()
            opt.step()
            if s + 1 == SAVE_AT and save:
                msd, osd = get_state_dict(model, opt)
                dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
            if s + 1 >= SAVE_AT:
                after.append(_state_digest(opt, model))
        runs.append(after)
    return runs


def _dcp_load(rank, world, path, shape):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import scape

    mesh = _mesh(shape)
    model = fc.shard(fc.make_model(seed=77), mesh["dp_shard"])  # other values: load must
    opt = _ckpt_opt(model, mesh)  # overwrite them
    msd, osd = get_state_dict(model, opt)
    try:
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=path,
                 planner=scape.dcp.ReshardPlanner())
        set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    except ValueError as e:
        return "ValueError", str(e)
    after = [_state_digest(opt, model)]
    losses = []
    for s in range(SAVE_AT, SAVE_AT + MORE):
        loss = fc.loss_of(model, s, rank)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        after.append(_state_digest(opt, model))
    return after, losses


def test_dcp_round_trip_is_bit_exact_and_loads_onto_another_replicate_count(tmp_path):
    path = str(tmp_path / "ckpt")
    both = run_ranks(_dcp_save, 4, path, timeout=240)
    saved, plain = [b[0] for b in both], [b[1] for b in both]
    loaded = run_ranks(_dcp_load, 4, path, (2, 2), timeout=240)
    for r in range(4):
        assert saved[r] == plain[r], f"rank {r}: saving changed the run"
        assert loaded[r][0] == saved[r], f"rank {r}: the resumed run differs from the saved one"
    assert saved[0][0] != saved[2][0]  # the two replicas of a shard hold their own residual
    # one replica of the two shards: the state loads (residual: the mean of the old ones)
    one = run_ranks(_dcp_load, 2, path, (1, 2), timeout=240)
    for r in range(2):
        after, losses = one[r]
        assert all(math.isfinite(x) for x in losses)
        assert after[0][0] == saved[0][0][0], "the parameters are not the saved ones"
    # another shard count is refused on every rank, naming the limit
    other = run_ranks(_dcp_load, 4, path, (1, 4), timeout=240)
    for r in other:
        assert r[0] == "ValueError" and "dp_shard" in r[1], r
