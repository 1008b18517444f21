"""scape.SCAPE and scape.DistributedAdamW on real gloo processes (W = 1..4).

Dense mode must equal a float64 single-process AdamS/AdamW on the averaged gradient; SCAPE
mode must keep every rank's parameters identical, change only mask coordinates, put exactly
the DESIGN formula's bytes on the wire, conserve gradient mass (residual + delivered), and use
at step t+1 the mask computed at step t.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from dist import run_ranks

import scape
from scape.rules import block_budget
from scape.wire import PARAM_BITS, mask_bytes, segment_bytes

SHAPES = [(37, 19), (300,), (5, 7, 11)]  # sizes that need padding
WIRE16 = (torch.bfloat16, torch.float16)  # gradient wires that round each value


def _params(seed: int, dtype=torch.float32, shapes=SHAPES) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in shapes]


def _grads(step: int, rank: int, shapes=SHAPES) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank + 7)
    return [torch.randn(s, generator=g) * (1 + rank) for s in shapes]


def _backward(params, grads) -> None:
    """A loss whose gradient is exactly ``grads`` (so the test controls the gradient)."""
    loss = sum((p.float() * g).sum() for p, g in zip(params, grads))
    loss.backward()


def _adams_ref(p, m, g, lr, b1, b2, eps, wd):
    v = b2 * m * m + (1 - b2) * g * g
    m = b1 * m + (1 - b1) * g
    p = p - lr * (m / (v.sqrt() + eps) + wd * p)
    return p, m


def _rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.double() - ref).abs().max() / ref.abs().max())


# ----------------------------------------------------------------------------- dense
def _dense_body(rank, world, steps):
    torch.manual_seed(0)
    params = _params(1)
    # two param groups with their own hyperparameters
    groups = [{"params": params[:2], "lr": 1e-2, "weight_decay": 0.1},
              {"params": params[2:], "lr": 3e-3, "betas": (0.8, 0.9)}]
    opt = scape.SCAPE(groups, lr=1e-2, sparsity=0.0, eps=1e-8)
    ref_p = [p.detach().double().clone() for p in params]
    ref_m = [torch.zeros_like(p) for p in ref_p]
    hps = [(1e-2, 0.9, 0.95, 0.1)] * 2 + [(3e-3, 0.8, 0.9, 0.0)]

    params_w = _params(2)
    opt_w = scape.DistributedAdamW([{"params": params_w[:1], "weight_decay": 0.05},
                                    {"params": params_w[1:]}], lr=2e-3)
    ref_w = [p.detach().clone() for p in params_w]
    for p in ref_w:
        p.requires_grad_(True)
    torch_w = torch.optim.AdamW([{"params": ref_w[:1], "weight_decay": 0.05},
                                 {"params": ref_w[1:]}], lr=2e-3, weight_decay=0.0)
    torch_w.param_groups[1]["weight_decay"] = 0.0
    for t in range(1, steps + 1):
        grads = _grads(t, rank)
        _backward(params, grads)
        opt.step()
        opt.zero_grad()
        _backward(params_w, grads)
        opt_w.step()
        avg = [sum(_grads(t, r)[i] for r in range(max(world, 1))) / max(world, 1)
               for i in range(len(SHAPES))]
        for i, (lr, b1, b2, wd) in enumerate(hps):
            ref_p[i], ref_m[i] = _adams_ref(ref_p[i], ref_m[i], avg[i].double(), lr, b1, b2,
                                            1e-8, wd)
        for p, g in zip(ref_w, avg):
            p.grad = g.clone()
        torch_w.step()
        assert opt.last_step.dense and not opt.last_step.skipped
    err_s = max(_rel_err(p.detach(), r) for p, r in zip(params, ref_p))
    err_w = max(_rel_err(p.detach(), r.detach().double()) for p, r in zip(params_w, ref_w))
    return err_s, err_w


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_dense_equals_single_process_reference(world):
    if world == 1:  # no process group at all: the single-rank communicator
        results = [_dense_body(0, 0, 20)]
    else:
        results = run_ranks(_dense_body, world, 20, timeout=180)
    for err_s, err_w in results:
        assert err_s <= 1e-5, f"dense sharded AdamS vs float64 reference: {err_s:.3g}"
        assert err_w <= 1e-5, f"DistributedAdamW vs torch.optim.AdamW: {err_w:.3g}"


# ----------------------------------------------------------------------------- sparse
CONFIGS = {
    "base": dict(sparsity=0.9, warmup_steps=2),
    "dense_every": dict(sparsity=0.9, warmup_steps=1, dense_every=4),
    "explore0": dict(sparsity=0.99, warmup_steps=2, explore=0.0),
    "explore1": dict(sparsity=0.9, warmup_steps=2, explore=1.0),
    "no_ef": dict(sparsity=0.9, warmup_steps=2, error_feedback=False),
    "bf16": dict(sparsity=0.9, warmup_steps=2, dtype=torch.bfloat16),
    # the 8-bit wire (scape.wire): codes and row scales, the coding error kept as residual
    "int8": dict(sparsity=0.9, warmup_steps=2, grad_comm_dtype=torch.int8),
    # 16-bit gradient values: each value's rounding error kept in the sender's residual
    "grad_bf16": dict(sparsity=0.9, warmup_steps=2, grad_comm_dtype=torch.bfloat16),
    "grad_fp16": dict(sparsity=0.99, warmup_steps=2, grad_comm_dtype=torch.float16,
                      param_comm_dtype=torch.float16),
    "int8_bf16": dict(sparsity=0.99, warmup_steps=2, grad_comm_dtype=torch.int8,
                      dtype=torch.bfloat16),
    # 8-bit parameter updates (scape.wire.ParamWire): the replicas stay bitwise identical
    "param8": dict(sparsity=0.9, warmup_steps=2, param_comm_dtype=torch.int8),
    "param16": dict(sparsity=0.9, warmup_steps=2, param_comm_dtype=torch.float16),
    "wire8_bf16": dict(sparsity=0.99, warmup_steps=2, grad_comm_dtype=torch.int8,
                       param_comm_dtype=torch.int8, dtype=torch.bfloat16),
    "set_to_none": dict(sparsity=0.9, warmup_steps=2, set_to_none=True),
    "lazy": dict(sparsity=0.9, warmup_steps=2, update="lazy"),
    "sqrt": dict(sparsity=0.9, warmup_steps=2, update="sqrt"),
    "ramp": dict(sparsity=0.9, warmup_steps=2, ramp=4),  # the start's ramp over 4 steps
    # the group's sparsity changed before every step (a sparsity warm-up and back)
    "schedule": dict(sparsity=0.9, warmup_steps=2,
                     schedule=[0.9, 0.9, 0.95, 0.8, 0.99, 0.97, 0.9, 0.9, 0.95]),
}


def _rule_options(cfg: dict) -> dict:
    """``cfg`` with ``explore``/``error_feedback`` turned into a registered variant of its rule
    (they are fields of a rule, not optimizer arguments)."""
    opts = {k: cfg.pop(k) for k in ("explore", "error_feedback") if k in cfg}
    if opts:
        base = cfg.get("update", "agree")
        name = base + "".join(f"-{k}{v}" for k, v in sorted(opts.items()))
        if name not in scape.rules.RULES:
            scape.rules.register(name, dataclasses.replace(scape.rules.get(base), **opts))
        cfg["update"] = name
    return cfg


def _gather_cat(t: torch.Tensor, world: int) -> torch.Tensor:
    out = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(out, t)
    return torch.cat(out)


def _flat_index(mask: torch.Tensor, block: int) -> torch.Tensor:
    rows = torch.arange(mask.shape[0], dtype=torch.int64)[:, None] * block
    return (rows + mask.long()).view(-1)


def _sparse_body(rank, world, names, steps):
    block = 256
    report = {}
    for name in names:
        cfg = dict(CONFIGS[name])
        dtype = cfg.pop("dtype", torch.float32)
        set_to_none = cfg.pop("set_to_none", False)
        schedule = cfg.pop("schedule", None)
        ramp = cfg.pop("ramp", 0)
        params = _params(3, dtype)
        opt = scape.SCAPE(params, lr=1e-2, block_size=block, **_rule_options(dict(cfg)))
        opt.ramp_steps = ramp
        b = opt.buckets[0]
        delivered = torch.zeros(b.shard_size, dtype=torch.float64)
        grad_sum = torch.zeros(b.n_pad, dtype=torch.float64)
        made_mask = made_k = None
        for t in range(1, steps + 1):
            if schedule is not None:
                opt.param_groups[0]["sparsity"] = schedule[t - 1]
            before = b.param_flat.clone()
            grads = _grads(t, rank)
            if set_to_none:  # model.zero_grad(set_to_none=True): backward makes new tensors
                for p in params:
                    p.grad = None
            _backward(params, grads)
            pre = b.grad_flat.clone()  # what the step's take reads: residual + this gradient
            for i, g in enumerate(grads):
                o = b.offsets[i]
                grad_sum[o:o + g.numel()] += g.reshape(-1).to(dtype).double()
            opt.step()
            opt.zero_grad(set_to_none=True)
            info = opt.last_step
            # all ranks hold bitwise-identical parameters
            allp = _gather_cat(b.param_flat.view(torch.uint8), world).view(world, -1)
            assert bool((allp == allp[0]).all()), f"{name} step {t}: ranks differ"
            sync = opt.last_sync[0]
            changed = (b.param_flat != before).nonzero().view(-1)
            # the diagnostic is the norm of what the step left in this rank's buffer
            left = float(b.grad_flat.double().norm())
            told = float(opt.diagnostics[0].get("residual_norm", float("nan")))
            assert abs(told - left) <= 1e-4 * left + 1e-30, (name, t, told, left)
            if info.dense:
                assert sync["mask"] is None
                g_full = torch.zeros(b.shard_size, dtype=torch.float64)
                g_full += sync["g"].double()
                delivered += g_full
                assert info.mask_size == b.n_pad
            else:
                mask = sync["mask"]
                k = made_k  # the budget of the group's sparsity when the mask was made
                K = (b.n_pad // block) * k
                assert mask.shape == (b.n_pad // block, k) and mask.numel() == K
                assert info.mask_size == K
                # the mask used at step t is the one computed at the end of step t-1
                assert made_mask is not None and torch.equal(mask, made_mask), name
                flat = _flat_index(mask, block)
                assert bool(torch.isin(changed, flat).all()), f"{name}: change outside mask"
                bp = b.param_flat.element_size()
                k_next, _ = block_budget(opt.sparsity_at(0, opt.step_count), block,
                                         cfg.get("explore", 0.1))  # the next mask's budget
                n_local = b.shard_size // block
                # two collectives: the gradient's, whose every owner segment also carries the
                # sender's non-finite count, and one all-gather of each owner's values, next
                # mask (Elias-Fano rows, or packed offsets where smaller) and sum of squares
                values = n_local * k * bp  # or every owner's 8-bit segment
                if opt.param_comm_dtype is not None:
                    values = segment_bytes(n_local, k, bits=PARAM_BITS[opt.param_comm_dtype])
                offsets = mask_bytes(n_local, k_next, block)
                if opt.masks[0].next is None:  # next step dense: no mask rides along
                    offsets = 0
                narrow = opt.grad_comm_dtype in WIRE16
                if narrow:  # every rank keeps what its values lost on the wire, bitwise
                    sent = pre[flat].to(opt.grad_comm_dtype).float()
                    assert torch.equal(b.grad_flat[flat], pre[flat] - sent), \
                        f"{name} step {t}: the wire's rounding error is not the residual"
                    assert torch.equal(b.grad_flat[flat] + sent, pre[flat]), (name, t)
                b_g = 2 if narrow else 4
                expect = {"reduce_scatter": (K + world) * b_g,
                          "all_gather": world * (values + offsets + 4)}
                if opt.grad_comm_dtype == torch.int8:  # every owner's segment instead
                    del expect["reduce_scatter"]
                    expect["all_to_all"] = world * segment_bytes(n_local, k, 1)
                assert info.collectives == 2, (name, t, info.collectives)
                assert info.bytes == expect, (name, t, info.bytes, expect)
                own = mask[rank * (b.shard_size // block):(rank + 1) * (b.shard_size // block)]
                local_flat = _flat_index(own, block)
                delivered.index_add_(0, local_flat, sync["g"].double())
            pending = opt.masks[0].wait()  # in flight until the next step's take otherwise
            made_mask = None if pending is None else pending.clone()
            made_k, _ = block_budget(opt.sparsity_at(0, opt.step_count), block,
                                     cfg.get("explore", 0.1))
            assert made_mask is None or made_mask.shape[1] == made_k, (name, t)
        # conservation: sum of residuals + W * delivered == sum of all gradients
        residual = b.grad_flat.double().clone()
        dist.all_reduce(residual)
        total = grad_sum.clone()
        dist.all_reduce(total)
        all_delivered = _gather_cat(delivered, world)
        if cfg.get("error_feedback", True):
            err = float((residual + world * all_delivered - total).abs().max())
            scale = float(total.abs().max())
            # a 16-bit wire's sum over ranks is rounded by the backend: that is what is lost
            tol = 1e-5 if opt.grad_comm_dtype not in WIRE16 \
                else 2 * world * torch.finfo(opt.grad_comm_dtype).eps
            assert err <= tol * scale * steps, f"{name}: conservation error {err:.3g}"
        else:
            assert float(b.grad_flat.abs().max()) == 0.0
        report[name] = (opt.step_count, float(opt.diagnostics[0].get("mask_overlap", -1)))
    return report


@pytest.mark.parametrize("world", [2, 3, 4])
def test_scape_step_invariants(world):
    names = list(CONFIGS) if world != 3 else ["base", "bf16", "explore1", "lazy", "int8",
                                              "param8", "grad_bf16"]
    results = run_ranks(_sparse_body, world, names, 9, timeout=300)
    assert all(set(r) == set(names) for r in results)


# ----------------------------------------------------------------------------- training
def _train_body(rank, world, sparsity):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(),
                                torch.nn.Linear(64, 8))
    opt = scape.SCAPE(model.parameters(), lr=1e-2, sparsity=sparsity, block_size=256,
                      warmup_steps=3)
    gen = torch.Generator().manual_seed(123)
    w_true = torch.randn(32, 8, generator=gen)
    losses = []
    for t in range(120):
        g = torch.Generator().manual_seed(10_000 * rank + t)
        x = torch.randn(64, 32, generator=g)
        y = x @ w_true
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("sparsity", [0.9, 0.99])
def test_loss_falls(world, sparsity):
    results = run_ranks(_train_body, world, sparsity, timeout=180)
    for losses in results:
        first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
        assert last < 0.75 * first, f"loss did not fall: {first:.3f} -> {last:.3f}"


# ----------------------------------------------------------------------------- sparsity schedule
def _schedule_run(params, sparsity, steps, rank, opt=None, state=None, first=1):
    """Steps ``first..steps`` with the group's sparsity set by a ramp before each step; the
    parameters after each step."""
    opt = opt or scape.SCAPE(params, lr=1e-2, block_size=256, sparsity=sparsity,
                             warmup_steps=2)
    if state is not None:
        opt.load_state_dict(state)
    out = []
    for t in range(first, steps + 1):
        opt.param_groups[0]["sparsity"] = scape.sparsity_ramp(t - 3, start=0.8, end=0.99,
                                                              ramp_steps=5)
        _backward(params, _grads(t, rank))
        opt.step()
        opt.zero_grad()
        out.append(torch.cat([p.detach().reshape(-1) for p in params]).clone())
    return opt, out


def _schedule_resume_body(rank, world):
    _, straight = _schedule_run(_params(5), 0.8, 10, rank)
    opt, first = _schedule_run(_params(5), 0.8, 5, rank)
    state = opt.state_dict()
    saved_sp = opt.param_groups[0]["sparsity"]
    params = _params(6)  # other values: the load restores them from the master weights
    fresh = scape.SCAPE(params, lr=1e-2, block_size=256, sparsity=0.99, warmup_steps=2)
    _, rest = _schedule_run(params, 0.99, 10, rank, opt=fresh, state=state, first=6)
    resumed_equal = all(torch.equal(a, b) for a, b in zip(first + rest, straight))
    # a sparse group cannot become dense, by a checkpoint or by the schedule
    dense = scape.SCAPE(_params(5), lr=1e-2, block_size=256, sparsity=0.0)
    before = [p.detach().clone() for g in dense.param_groups for p in g["params"]]
    try:
        dense.load_state_dict(state)
        load_error = ""
    except ValueError as e:
        load_error = str(e)
    unchanged = all(torch.equal(a, p.detach()) for a, p in
                    zip(before, (p for g in dense.param_groups for p in g["params"])))
    fresh.param_groups[0]["sparsity"] = 0.0
    _backward(params, _grads(11, rank))
    snap, count = [p.detach().clone() for p in params], fresh.step_count
    try:
        fresh.step()
        step_error = ""
    except ValueError as e:
        step_error = str(e)
    step_unchanged = fresh.step_count == count and all(
        torch.equal(a, p.detach()) for a, p in zip(snap, params))
    return (resumed_equal, saved_sp, load_error, unchanged, step_error, step_unchanged,
            straight[-1].isfinite().all().item())


def test_sparsity_schedule_resumes_exactly_and_stays_sparse():
    for (equal, saved_sp, load_error, unchanged, step_error, step_unchanged,
         finite) in run_ranks(_schedule_resume_body, 2, timeout=180):
        assert 0.8 < saved_sp < 0.99  # saved mid-ramp, loaded into an optimizer built at 0.99
        assert equal, "a run resumed mid-ramp differs from the straight run"
        assert "sparsity" in load_error and unchanged
        assert "sparsity" in step_error and step_unchanged
        assert finite


def test_sparsity_ramp_values():
    ramp = [scape.sparsity_ramp(t, start=0.9, end=0.99, ramp_steps=10) for t in range(-2, 14)]
    assert ramp[:3] == [0.9, 0.9, 0.9] and ramp[12:] == [0.99] * 4
    dens = torch.tensor([1.0 - s for s in ramp[2:13]], dtype=torch.float64)
    assert bool((dens[1:] < dens[:-1]).all())  # density falls at every step of the ramp
    ratios = dens[1:] / dens[:-1]  # geometric: the same factor each step, 10^(-1/10)
    assert torch.allclose(ratios, torch.full_like(ratios, 10 ** -0.1), rtol=1e-12)
    from scape.schedules import mean_ramp_density
    n = 100_000
    mean = sum(1 - scape.sparsity_ramp(t, start=0.9, end=0.99, ramp_steps=n)
               for t in range(n)) / n
    assert abs(mean - mean_ramp_density(0.9, 0.99)) < 1e-5
    assert scape.sparsity_ramp(5, start=0.9, end=0.99, ramp_steps=0) == 0.99
    for bad in (dict(start=0.0, end=0.99, ramp_steps=5), dict(start=0.9, end=1.0, ramp_steps=5),
                dict(start=0.9, end=0.99, ramp_steps=-1)):
        with pytest.raises(ValueError):
            scape.sparsity_ramp(3, **bad)
