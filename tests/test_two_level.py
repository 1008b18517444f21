"""SCAPE on two levels (4 gloo ranks as 2 nodes x 2): dense inside the node, sparse across.

What must hold (docs/design.md §1, "Two levels"):
- it is flat SCAPE among the nodes, each sending its node's mean gradient: the same
  parameters as flat SCAPE on 2 ranks fed those means;
- dense mode equals flat dense mode on the 4 ranks;
- every rank holds the same parameters; nothing is lost (residuals + what was delivered =
  every gradient); the bytes of a sparse step per level equal the formula;
- checkpoints resume bit-exactly, and load on another layout (flat, or one node of 4).
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.dist import run_ranks

NODES, PER_NODE, B = 2, 2, 256
SHAPES = ((64, 48), (1024,))  # 4096 coordinates: no padding on 4 ranks nor on 2


def _grads(step: int, node: int, place: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 10 * node + place)
    return [torch.randn(s, generator=g) for s in SHAPES]


def _model(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]


def _comm(layout: str):
    from torch.distributed.device_mesh import init_device_mesh

    if layout == "hier":
        return init_device_mesh("cpu", (NODES, PER_NODE), mesh_dim_names=("replicate", "shard"))
    if layout == "one_node":
        return init_device_mesh("cpu", (1, 4), mesh_dim_names=("replicate", "shard"))
    return None  # the default group (flat)


def _backward(params, step: int, rank: int, layout: str) -> None:
    """This rank's gradient at ``step``: rank (node, place)'s own, or (flat2) the mean of the
    node's; plus a term that depends on the parameters."""
    if layout == "flat2":
        parts = [_grads(step, rank, p) for p in range(PER_NODE)]
        gs = [sum(x[j] for x in parts) / PER_NODE for j in range(len(SHAPES))]
    else:
        gs = _grads(step, *divmod(rank, PER_NODE))
    loss = sum((p * g).sum() + 0.05 * p.square().sum() for p, g in zip(params, gs))
    loss.backward()


def _flat_indices(opt, i: int) -> torch.Tensor:
    """The coordinates of the buffer this rank's shard received on the last step."""
    b, sync = opt.buckets[i], opt.last_sync[i]
    if sync["mask"] is None:
        return torch.arange(b.shard_start, b.shard_start + b.shard_size)
    n_local = b.shard_size // B
    rows = sync["mask"][b.rank * n_local:(b.rank + 1) * n_local].long()
    return (rows + (b.shard_start + torch.arange(n_local) * B).view(-1, 1)).view(-1)


def _train(rank: int, world: int, layout: str, sparsity: float, steps: int,
           save: str | None = None, load: str | None = None, start: int = 0,
           rule: str = "agree") -> dict:
    import scape
    from scape.comm import TorchCommunicator

    params = _model()
    opt = scape.SCAPE(params, lr=1e-2, sparsity=sparsity, block_size=B, warmup_steps=3, update=rule,
                      weight_decay=0.1, comm=_comm(layout))
    opt.ramp_steps = 0  # the group's sparsity from the first sparse step
    if load is not None:
        opt.load_state_dict(torch.load(os.path.join(load, f"{opt.comm.rank}.pt")))
    flat = TorchCommunicator()
    n_pad = opt.buckets[0].n_pad
    delivered = torch.zeros(n_pad, dtype=torch.float64)
    sent_in = torch.zeros(n_pad, dtype=torch.float64)
    residual0 = opt.residual(0).double()
    flat.all_reduce(residual0, op="sum").wait()
    infos = []
    for t in range(start + 1, start + steps + 1):
        before = opt.buckets[0].grad_flat.double()  # (a copy)
        _backward(params, t, rank, layout)
        sent_in += opt.buckets[0].grad_flat.double() - before  # what backward added
        opt.step()
        opt.zero_grad()
        d = torch.zeros(n_pad, dtype=torch.float64)
        d[_flat_indices(opt, 0)] = opt.last_sync[0]["g"].double()
        delivered += d
        infos.append({"dense": opt.last_step.dense, "bytes": dict(opt.last_step.bytes),
                      "mask_size": opt.last_step.mask_size,
                      "levels": (opt.last_step.intra_bytes, opt.last_step.inter_bytes)})
    for t in (delivered, sent_in):
        flat.all_reduce(t, op="sum").wait()
    residual = opt.residual(0).double()
    flat.all_reduce(residual, op="sum").wait()
    if save is not None:
        torch.save(opt.rank_state_dict(), os.path.join(save, f"{opt.comm.rank}.pt"))
    return {"params": torch.cat([p.detach().reshape(-1) for p in params]).numpy(),
            "infos": infos, "me": opt.comm.rank, "n_pad": n_pad,
            # every gradient (and the residual loaded) = residuals + W * what was delivered
            "mass_err": float((residual0 + sent_in - residual - 4 * delivered).abs().max()
                              if world == 4 else 0.0),
            "mass_scale": float(sent_in.abs().max())}


def _run(layout: str, sparsity: float, steps: int, **kw) -> list[dict]:
    world = 2 if layout == "flat2" else 4
    out = run_ranks(_train, world, layout, sparsity, steps, kw.get("save"), kw.get("load"),
                    kw.get("start", 0), kw.get("rule", "agree"), timeout=180)
    for r in out:  # (tensors travel between processes as arrays)
        r["params"] = torch.from_numpy(r["params"])
    return out


def test_two_levels_are_flat_scape_among_nodes():
    # "sqrt" keeps no statistics of the owner's own gradient: with it every coordinate
    # follows the same arithmetic on two levels as on 2 flat ranks given the node means.
    # ("agree" estimates noise from the owner's node, and which node owns a coordinate
    # differs between the two layouts; its runs are checked below for invariants.)
    hier = _run("hier", 0.9, 10, rule="sqrt")
    ref = _run("flat2", 0.9, 10, rule="sqrt")
    assert [i["dense"] for i in hier[0]["infos"]] == [True] * 3 + [False] * 7
    torch.testing.assert_close(hier[0]["params"], ref[0]["params"], rtol=1e-5, atol=1e-6)
    moved = (hier[0]["params"] - torch.cat([p.detach().reshape(-1) for p in _model()])).abs()
    assert (moved > 0).float().mean() > 0.5  # the test is not about parameters that stand
    for run in (hier, _run("hier", 0.9, 10)):
        for r in run:
            assert torch.equal(r["params"], run[0]["params"])  # every rank alike
            assert r["mass_err"] < 1e-4 * r["mass_scale"]  # nothing lost


def test_two_levels_dense_equals_flat_dense():
    hier = _run("hier", 0.0, 4)
    flat = _run("flat4", 0.0, 4)
    torch.testing.assert_close(hier[0]["params"], flat[0]["params"], rtol=1e-6, atol=1e-6)
    assert all(i["levels"] == (None, None) for i in flat[0]["infos"])  # flat: no levels
    for r in hier:
        assert torch.equal(r["params"], hier[0]["params"])
        for info in r["infos"]:  # a dense step: N_pad fp32 each way, the level's share
            n = r["n_pad"]
            assert info["bytes"]["intra/reduce_scatter"] == n * 4
            assert info["bytes"]["inter/reduce_scatter"] == n * 4 // PER_NODE
            assert info["bytes"]["inter/all_gather"] == n * 4 // PER_NODE
            assert info["bytes"]["intra/all_gather"] == n * 4


def test_sparse_step_bytes_per_level_match_the_formula():
    from scape.rules import block_budget

    hier = _run("hier", 0.99, 6)
    k_b, _ = block_budget(0.99, B, 0.1)
    for r in hier:
        n_pad = r["n_pad"]
        k = (n_pad // B) * k_b  # K: every block of the buffer sends k_b
        for info in r["infos"][4:]:  # sparse steps after the first (whose mask came whole)
            by = info["bytes"]
            inter = sum(v for key, v in by.items() if key.startswith("inter/"))
            intra = sum(v for key, v in by.items() if key.startswith("intra/"))
            assert info["mask_size"] == k
            # across nodes: this slice's K/G values (fp32 gradient, fp32 parameter), the
            # offsets (8 bits at B=256) and the 8-byte scalar all-reduce
            assert inter == k // PER_NODE * (4 + 4 + 1) + 8
            # inside the node: the dense gradient, then the K new values and offsets
            assert intra == n_pad * 4 + k * (4 + 1) + 8
            assert info["levels"] == (intra, inter)  # StepInfo.intra_bytes, .inter_bytes


def test_two_level_checkpoints_resume_and_change_layout(tmp_path):
    whole = _run("hier", 0.9, 8)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    first = _run("hier", 0.9, 5, save=str(ckpt))
    resumed = _run("hier", 0.9, 3, load=str(ckpt), start=5)
    assert torch.equal(resumed[0]["params"], whole[0]["params"])  # bit-exact
    assert first[0]["mass_err"] < 1e-4 * first[0]["mass_scale"]
    for layout in ("flat4", "one_node"):  # same 4 shards, the residual carried over
        other = _run(layout, 0.9, 3, load=str(ckpt), start=5)
        for r in other:
            assert torch.equal(r["params"], other[0]["params"])
            assert r["mass_err"] < 1e-4 * r["mass_scale"]
            assert torch.isfinite(r["params"]).all()
    flat_ckpt = tmp_path / "flat"
    flat_ckpt.mkdir()
    _run("flat4", 0.9, 5, save=str(flat_ckpt))
    back = _run("hier", 0.9, 3, load=str(flat_ckpt), start=5)  # and the reverse
    for r in back:
        assert torch.equal(r["params"], back[0]["params"])
        assert r["mass_err"] < 1e-4 * r["mass_scale"]


def test_two_levels_with_bf16_wire_and_clipping():
    hier = [torch.from_numpy(r) for r in run_ranks(_train_bf16, 4, timeout=120)]
    for r in hier:
        assert torch.equal(r, hier[0])
        assert torch.isfinite(r).all()


def _train_bf16(rank: int, world: int) -> object:
    import scape

    params = _model()
    opt = scape.SCAPE(params, lr=1e-2, sparsity=0.9, block_size=B, warmup_steps=2,
                      grad_comm_dtype=torch.bfloat16, max_grad_norm=1.0, comm=_comm("hier"))
    opt.ramp_steps = 0  # the group's sparsity from the first sparse step
    for t in range(1, 6):
        _backward(params, t, rank, "hier")
        opt.step()
        assert opt.last_step.grad_norm is not None and float(opt.last_step.grad_norm) > 0
    return torch.cat([p.detach().reshape(-1) for p in params]).numpy()


def test_two_levels_with_clipping_are_flat_scape_among_nodes():
    # clipping counts nodes as senders (rho in [1/R, 1], F the node's mean fresh gradient):
    # the same norms, so the same parameters, as flat SCAPE on R ranks given the node means
    hier = run_ranks(_clipped, 4, "hier", timeout=180)
    ref = run_ranks(_clipped, 2, "flat2", timeout=180)
    torch.testing.assert_close(torch.from_numpy(hier[0]["params"]),
                               torch.from_numpy(ref[0]["params"]), rtol=1e-5, atol=1e-6)
    assert hier[0]["norms"] == pytest.approx(ref[0]["norms"], rel=1e-5)
    assert min(hier[0]["norms"][3:]) > 2.0  # clipped (max_grad_norm 1) on every sparse step


def _clipped(rank: int, world: int, layout: str) -> dict:
    import scape

    params = _model()
    opt = scape.SCAPE(params, lr=1e-2, sparsity=0.9, block_size=B, warmup_steps=3,
                      update="sqrt", max_grad_norm=1.0, comm=_comm(layout))
    opt.ramp_steps = 0  # the group's sparsity from the first sparse step
    norms = []
    for t in range(1, 9):
        _backward(params, t, rank, layout)
        opt.step()
        norms.append(float(opt.last_step.grad_norm))
    return {"params": torch.cat([p.detach().reshape(-1) for p in params]).numpy(),
            "norms": norms}


def _nonfinite(rank: int, world: int) -> dict:
    import scape

    params = _model()
    opt = scape.SCAPE(params, lr=1e-2, sparsity=0.9, block_size=B, warmup_steps=2,
                      comm=_comm("hier"))
    opt.ramp_steps = 0  # the group's sparsity from the first sparse step
    out: dict = {}
    for t in range(1, 9):
        _backward(params, t, rank, "hier")
        if t == 5 and rank == 1:  # one rank of one node sends a NaN on a sparse step
            (params[0][3, 4] * float("nan")).backward()
        before = torch.cat([p.detach().reshape(-1) for p in params])
        opt.step()
        if t == 5:
            after = torch.cat([p.detach().reshape(-1) for p in params])
            out = {"skipped": opt.last_step.skipped, "unchanged": torch.equal(before, after),
                   "residual_zero": bool((opt.residual(0) == 0).all())}
    out["finite"] = bool(all(torch.isfinite(p).all() for p in params))
    out["params"] = torch.cat([p.detach().reshape(-1) for p in params]).numpy()
    return out


def test_two_levels_skip_a_nonfinite_step_on_every_rank():
    res = run_ranks(_nonfinite, 4, timeout=180)
    for r in res:
        assert r["skipped"] and r["unchanged"] and r["residual_zero"] and r["finite"]
        assert (r["params"] == res[0]["params"]).all()


def _dcp_run(rank: int, world: int, path: str, mode: str, layout: str = "hier") -> object:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import scape

    model = torch.nn.ParameterList(_model(seed=0 if mode != "load" else 1))
    params = list(model)
    opt = scape.SCAPE(params, lr=1e-2, sparsity=0.9, block_size=B, warmup_steps=2,
                      comm=_comm(layout))
    opt.ramp_steps = 0  # the group's sparsity from the first sparse step
    first = 1
    if mode == "load":
        msd, osd = get_state_dict(model, opt)
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=path)
        set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
        first = 6
    for t in range(first, 9):
        _backward(params, t, rank, layout)
        opt.step()
        if mode == "save" and t == 5:
            msd, osd = get_state_dict(model, opt)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    return torch.cat([p.detach().reshape(-1) for p in params]).numpy()


@pytest.mark.parametrize("layout", ["hier", "flat4"])
def test_resume_through_dcp(tmp_path, layout):
    # (flat too: a parameter held by the last rank alone once lost its saved state to DCP's
    # de-duplication of chunks at the same offset, scape.dcp._spans)
    whole = run_ranks(_dcp_run, 4, str(tmp_path / "c"), "save", layout, timeout=180)
    resumed = run_ranks(_dcp_run, 4, str(tmp_path / "c"), "load", layout, timeout=180)
    for a, b in zip(whole, resumed):
        assert (a == b).all()  # bit-exact, on every rank


def _int8_refused(rank: int, world: int) -> list[str]:
    import scape

    said = []
    for make in (lambda: scape.SCAPE(_model(), lr=1e-2, block_size=B,
                                     grad_comm_dtype=torch.int8, comm=_comm("hier")),
                 lambda: scape.DistributedAdamW(_model(), lr=1e-2, grad_comm_dtype=torch.int8)):
        try:
            make()
        except ValueError as e:
            said.append(str(e))
    return said


def test_the_8bit_wire_is_refused_on_two_levels_and_by_adamw_on_every_rank():
    for said in run_ranks(_int8_refused, 4, timeout=120):
        assert len(said) == 2, said
        assert "one level only" in said[0]
        assert "Invalid grad_comm_dtype: torch.int8" in said[1]
