"""Tensor-parallel DTensor parameters (``parallelize_module`` over ``mesh["tp"]``), SCAPE over
``comm=mesh["dp"]`` (4 gloo ranks as dp 2 x tp 2): at sparsity 0 the parameters are those of
flat dense SCAPE on the 2 data-parallel ranks holding the whole model (fp32 rounding), with
clipping by the global norm (a bias replicated over ``tp`` counted once); at 0.99 the replicas
agree; ``state_dict()`` refuses a layout it cannot express, on every rank."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from dist import run_ranks

D_IN, D_HID, D_OUT, LR, BLOCK = 12, 32, 5, 3e-3, 256


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(D_IN, D_HID), torch.nn.ReLU(),
                               torch.nn.Linear(D_HID, D_OUT))


def _batch(step, dp_rank):
    g = torch.Generator().manual_seed(1000 * step + dp_rank)
    x = torch.randn(8, D_IN, generator=g)
    teacher = torch.randn(D_IN, D_OUT, generator=torch.Generator().manual_seed(5))
    return x, (x @ teacher).argmax(1)


def _full(model):
    return {k: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().tolist()
            for k, p in model.named_parameters()}


def _tp_run(rank, world, steps, clip):
    """Sparsity 0 with clipping (and the state dict's refusal), then 0.99."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    import scape

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    runs = {}
    for sparsity in (0.0, 0.99):
        model = parallelize_module(_model(), mesh["tp"], {"0": ColwiseParallel(),
                                                          "2": RowwiseParallel()})
        opt = scape.SCAPE(model.parameters(), lr=LR, sparsity=sparsity, block_size=BLOCK,
                          warmup_steps=2, max_grad_norm=clip if sparsity == 0 else None,
                          comm=mesh["dp"])
        norms = []
        for s in range(steps if sparsity == 0 else 12):
            x, y = _batch(s, mesh["dp"].get_local_rank())
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            norms.append(float(opt.last_step.grad_norm))
        out = {"params": _full(model), "norms": norms,
               "buckets": sorted(b.norm_weight for b in opt.buckets)}
        if sparsity == 0:
            try:
                opt.state_dict()
            except ValueError as e:
                out["state_dict"] = str(e)
        runs[sparsity] = out
    return runs


def _flat_run(rank, world, steps, clip):
    import scape

    model = _model()
    opt = scape.SCAPE(model.parameters(), lr=LR, sparsity=0.0, block_size=BLOCK,
                      max_grad_norm=clip)
    norms = []
    for s in range(steps):
        x, y = _batch(s, rank)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        norms.append(float(opt.last_step.grad_norm))
    return {"params": _full(model), "norms": norms}


def test_dense_equals_flat_dense_and_sparse_replicas_agree():
    steps, clip = 6, 0.5
    both = run_ranks(_tp_run, 4, steps, clip, timeout=240)
    flat = run_ranks(_flat_run, 2, steps, clip, timeout=240)
    tp = [b[0.0] for b in both]
    assert tp[0]["buckets"] == [0.5, 1.0]  # the Rowwise bias, replicated over tp, apart
    for r in range(4):
        assert tp[r]["params"] == tp[0]["params"], f"rank {r} differs"
        assert tp[r]["norms"] == pytest.approx(flat[0]["norms"], rel=1e-5)
        assert "placements" in tp[r]["state_dict"] and "tensor parallel" in tp[r]["state_dict"]
        assert both[r][0.99]["params"] == both[0][0.99]["params"], f"0.99: rank {r} differs"
    assert max(flat[0]["norms"]) > clip, "clipping never engaged"
    for k, v in flat[0]["params"].items():
        diff = (torch.tensor(tp[0]["params"][k]) - torch.tensor(v)).abs().max().item()
        assert diff <= 1e-6, (k, diff)
