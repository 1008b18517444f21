"""scape.SparseLoCo and scape.DiLoCo on 1, 2 and 4 gloo ranks.

Multi-rank bodies check, after every sync: all ranks hold bitwise-identical parameters (and
they differed before it); the all-gather bytes equal the documented formula computed here
from the layout; the error-feedback accumulator conserves what was not sent, with the
quantization error staying in it; the loss falls. Single-rank tests check the same identities
for every value width, the bf16 cast rule, and validation. Also: SparseLoCo at 32 bits,
density 1 and no error feedback equals DiLoCo without momentum; DiLoCo equals
torch.optim.SGD(nesterov) applied to the averaged pseudo-gradient; resume is bit-exact between
syncs and exactly at a sync.
"""

from __future__ import annotations

import math

import pytest
import torch
from dist import run_ranks, run_ranks_outcomes

import scape
from scape.comm import TorchCommunicator

B = 256  # block size of every test: the smallest allowed, so small models have many blocks


def _model(seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(12, 40), torch.nn.Tanh(), torch.nn.Linear(40, 1))
    return m.to(dtype)  # 12*40 + 40 + 40 + 1 = 561 params -> 768 padded, 3 blocks


def _batch(step: int, rank: int, n: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Each rank's own data (a different sample per rank and step), one target function."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(n, 12, generator=g)
    return x, torch.sin(x[:, :3].sum(1, keepdim=True))


def _eval_loss(m: torch.nn.Module) -> float:
    x, y = _batch(10**6, 0, 512)
    with torch.no_grad():
        return float(((m(x.to(next(m.parameters()).dtype)).float() - y) ** 2).mean())


def _flat(m: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).float() for p in m.parameters()])


def _train_step(m: torch.nn.Module, opt: torch.optim.Optimizer, step: int, rank: int) -> None:
    x, y = _batch(step, rank)
    loss = ((m(x) - y) ** 2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()


def _expected_record(n_params: int, density: float, bits: int) -> int:
    """Bytes per rank and sync, from the documented layout (sparseloco module docstring)."""
    n_blocks = math.ceil(n_params / B)
    k = max(1, round(density * B))
    n = n_blocks * k
    scales, offsets = 4 * n_blocks, 2 * n
    return {2: scales + offsets + math.ceil(n * 2 / 8), 4: scales + offsets + math.ceil(n / 2),
            8: scales + offsets + n, 16: offsets + 2 * n, 32: offsets + 4 * n}[bits]


def _sync_checks(opt: scape.SparseLoCo, a_before: torch.Tensor, synced_before: torch.Tensor,
                 local: torch.Tensor) -> None:
    """EF conservation at a sync: a_after + sent == beta * a_before + delta (float64 model)."""
    delta = synced_before[: local.numel()].double() - local.double()
    sent = torch.zeros(opt.n_pad, dtype=torch.float64)
    flat = (torch.arange(opt.n_blocks)[:, None] * B + opt.last_sync["idx"].long()).view(-1)
    assert flat.unique().numel() == flat.numel()  # k distinct offsets per block
    sent[flat] = opt.last_sync["sent"].double()
    want = opt.ef_decay * a_before.double()
    want[: delta.numel()] += delta
    got = opt.error_feedback.double() + sent
    scale = want.abs().max().item()
    torch.testing.assert_close(got, want, rtol=0, atol=4e-7 * scale)
    # the selection is the top-k of |beta a + delta| per block: every selected entry is at
    # least as large as every unselected one of its block
    blocks = want.abs().view(opt.n_blocks, B)
    chosen = torch.zeros_like(blocks, dtype=torch.bool)
    chosen.view(-1)[flat] = True
    lo = torch.where(chosen, blocks, math.inf).amin(1)
    hi = torch.where(chosen, -math.inf, blocks).amax(1)
    assert (lo >= hi * (1 - 1e-6)).all()
    # what was sent is within one quantization step of what was selected
    if opt.value_bits < 32:
        err = (opt.error_feedback.double()[flat]).abs()
        per_block = want.abs().view(-1)[flat].view(opt.n_blocks, -1).amax(1)
        step = {2: 1 / 3, 4: 1 / 15, 8: 1 / 255, 16: 2**-8}[opt.value_bits]
        assert (err.view(opt.n_blocks, -1) <= per_block[:, None] * step * 1.001 + 1e-12).all()


# ----------------------------------------------------------------- multi-rank training
def _train_body(rank: int, world: int, bits: int, density: float, steps: int) -> dict:
    comm = TorchCommunicator()
    m = _model()
    inner = torch.optim.AdamW(m.parameters(), lr=1e-2)
    opt = scape.SparseLoCo(m.parameters(), inner, sync_every=4, density=density, block_size=B,
                           ef_decay=0.9, outer_lr=1.0, value_bits=bits, comm=comm)
    local: list[torch.Tensor] = []
    inner.register_step_post_hook(lambda *_: local.__setitem__(slice(None), [_flat(m)]))
    n_params = sum(p.numel() for p in m.parameters())
    losses, syncs = [_eval_loss(m)], 0
    for step in range(1, steps + 1):
        a_before, synced_before = opt.error_feedback.clone(), opt.synced.clone()
        gathered_before = torch.empty(world * n_params)
        comm.all_gather(gathered_before, _flat(m)).wait()
        stats_before = int(comm.stats["all_gather"]["bytes"])
        _train_step(m, opt, step, rank)
        sent_bytes = int(comm.stats["all_gather"]["bytes"]) - stats_before
        mine = _flat(m)
        gathered = torch.empty(world * n_params)
        comm.all_gather(gathered, mine).wait()
        rows = gathered.view(world, -1)
        if step % 4:
            assert sent_bytes == 0 and opt.last_step.bytes == {}
            continue
        syncs += 1
        # bitwise-identical parameters on every rank; they differed before the sync
        before = gathered_before.view(world, -1)
        assert all(torch.equal(rows[r].view(torch.int32), rows[0].view(torch.int32))
                   for r in range(world))
        assert torch.equal(mine, opt.synced[:n_params])
        if step > 4:  # after local steps on different data, the ranks had drifted apart
            assert not torch.equal(before[1], before[0])
        want = world * _expected_record(n_params, density, bits)
        assert sent_bytes == want == opt.last_step.bytes["all_gather"], (sent_bytes, want)
        _sync_checks(opt, a_before, synced_before, local[0][:n_params])
        losses.append(_eval_loss(m))
    return {"losses": losses, "syncs": syncs}


@pytest.mark.parametrize("world,bits,density", [
    pytest.param(2, 2, 0.03, id="w2-2bit-d3pct"),
    pytest.param(4, 4, 0.1, id="w4-4bit-d10pct"),
])
def test_sync_identity_bytes_error_feedback_and_loss(world, bits, density):
    res = run_ranks(_train_body, world, bits, density, 40, timeout=150)
    for r in res:
        assert r["syncs"] == 10
        first, last = r["losses"][0], r["losses"][-1]
        # 10 syncs of a few percent of the coordinates: a clear fall, not convergence
        assert last < 0.75 * first, r["losses"]
    assert all(r["losses"] == res[0]["losses"] for r in res)  # same model on every rank


# ----------------------------------------------------------------- equivalences
def _equivalence_body(rank: int, world: int) -> dict:
    comm = TorchCommunicator()
    m1, m2 = _model(), _model()
    in1 = torch.optim.SGD(m1.parameters(), lr=0.05, momentum=0.5)
    in2 = torch.optim.SGD(m2.parameters(), lr=0.05, momentum=0.5)
    sl = scape.SparseLoCo(m1.parameters(), in1, sync_every=3, density=1.0, block_size=B,
                          ef_decay=0.0, outer_lr=0.7, value_bits=32, comm=comm)
    dl = scape.DiLoCo(m2.parameters(), in2, sync_every=3, outer_lr=0.7, outer_momentum=0.0,
                      nesterov=False, comm=comm)
    max_diff = 0.0
    for step in range(1, 13):
        _train_step(m1, sl, step, rank)
        _train_step(m2, dl, step, rank)
        if step % 3 == 0:
            torch.testing.assert_close(_flat(m1), _flat(m2), rtol=0, atol=2e-6)
            max_diff = max(max_diff, float((_flat(m1) - _flat(m2)).abs().max()))
    return {"max_diff": max_diff}


def _nesterov_body(rank: int, world: int) -> float:
    """DiLoCo(outer_lr 0.7, momentum 0.9, Nesterov) == torch.optim.SGD on the mean delta."""
    comm = TorchCommunicator()
    m = _model()
    inner = torch.optim.AdamW(m.parameters(), lr=1e-2)
    opt = scape.DiLoCo(m.parameters(), inner, sync_every=3, comm=comm)
    local: list[torch.Tensor] = []
    inner.register_step_post_hook(lambda *_: local.__setitem__(slice(None), [_flat(m)]))
    ref = torch.nn.Parameter(_flat(m))
    ref_opt = torch.optim.SGD([ref], lr=0.7, momentum=0.9, nesterov=True)
    worst = 0.0
    for step in range(1, 13):
        before = {op: int(v["bytes"]) for op, v in comm.stats.items()}
        _train_step(m, opt, step, rank)
        sent = {op: int(v["bytes"]) - before[op] for op, v in comm.stats.items()
                if int(v["bytes"]) != before[op]}
        if step % 3:
            assert sent == {}
            continue
        n_pad = math.ceil(ref.numel() / world) * world  # an fp32 ring all-reduce of N_pad
        assert sent == {"reduce_scatter": 4 * n_pad, "all_gather": 4 * n_pad}
        assert opt.last_step.bytes == sent and opt.last_step.dense
        delta = ref.detach() - local[0]
        every = torch.empty(world * delta.numel())
        comm.all_gather(every, delta).wait()
        ref.grad = every.view(world, -1).double().mean(0).float()
        ref_opt.step()
        torch.testing.assert_close(_flat(m), ref.detach(), rtol=0, atol=1e-6)
        worst = max(worst, float((_flat(m) - ref.detach()).abs().max()))
    return worst


def test_sparseloco_dense_fp32_no_ef_equals_diloco_without_momentum():
    res = run_ranks(_equivalence_body, 2, timeout=120)
    assert all(r["max_diff"] <= 2e-6 for r in res)


def test_diloco_matches_torch_sgd_nesterov_on_mean_pseudo_gradient():
    worst = run_ranks(_nesterov_body, 3, timeout=120)
    assert max(worst) <= 1e-6


# ----------------------------------------------------------------- resume
def _resume_body(rank: int, world: int, cls_name: str) -> dict:
    comm = TorchCommunicator()

    def build(seed: int):
        m = _model(seed)
        inner = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
        if cls_name == "SparseLoCo":
            opt = scape.SparseLoCo(m.parameters(), inner, sync_every=4, density=0.05,
                                   block_size=B, value_bits=2, comm=comm)
        else:
            opt = scape.DiLoCo(m.parameters(), inner, sync_every=4, comm=comm)
        return m, inner, opt

    m, inner, opt = build(0)
    saved = {}
    for step in range(1, 15):
        _train_step(m, opt, step, rank)
        if step in (6, 8):  # between syncs, and exactly at a sync
            saved[step] = opt.state_dict()
    final = _flat(m)
    mismatches = {}
    for at, sd in saved.items():
        m2, inner2, opt2 = build(123)  # a different init: everything must come from sd
        opt2.load_state_dict(sd)
        assert opt2.step_count == at
        for step in range(at + 1, 15):
            _train_step(m2, opt2, step, rank)
        mismatches[at] = not torch.equal(_flat(m2).view(torch.int32), final.view(torch.int32))
        assert torch.equal(opt2.synced, opt.synced)
        assert inner2.state_dict()["state"][0]["step"] == inner.state_dict()["state"][0]["step"]
    return mismatches


@pytest.mark.parametrize("cls_name", ["SparseLoCo", "DiLoCo"])
def test_resume_is_bit_exact_between_syncs_and_at_a_sync(cls_name):
    res = run_ranks(_resume_body, 2, cls_name, timeout=120)
    assert res == [{6: False, 8: False}] * 2


# ----------------------------------------------------------------- cross-rank validation
def _bad_rank_body(rank: int, world: int) -> None:
    m = _model()
    inner = torch.optim.SGD(m.parameters(), lr=0.1)
    scape.SparseLoCo(m.parameters(), inner, density=2.0 if rank == 1 else 0.02, block_size=B)


def test_invalid_argument_on_one_rank_raises_on_every_rank():
    outcomes = run_ranks_outcomes(_bad_rank_body, 2, timeout=60)
    assert [o.exc_type for o in outcomes] == ["ValueError", "ValueError"]
    assert all("Invalid density: 2.0" in o.error for o in outcomes)


# ----------------------------------------------------------------- single rank
@pytest.mark.parametrize("bits", [2, 4, 8, 16, 32])
def test_every_value_width_conserves_and_counts_bytes_single_rank(bits):
    m = _model(1)
    inner = torch.optim.AdamW(m.parameters(), lr=1e-2)
    opt = scape.SparseLoCo(m.parameters(), inner, sync_every=2, density=0.07, block_size=B,
                           ef_decay=0.8, value_bits=bits)
    local: list[torch.Tensor] = []
    inner.register_step_post_hook(lambda *_: local.__setitem__(slice(None), [_flat(m)]))
    n_params = sum(p.numel() for p in m.parameters())
    assert opt.record_bytes == _expected_record(n_params, 0.07, bits)
    for step in range(1, 9):
        a_before, synced_before = opt.error_feedback.clone(), opt.synced.clone()
        before = int(opt.comm.stats["all_gather"]["bytes"])
        _train_step(m, opt, step, 0)
        got = int(opt.comm.stats["all_gather"]["bytes"]) - before
        if step % 2:
            assert got == 0
            continue
        assert got == _expected_record(n_params, 0.07, bits)
        assert opt.last_step.mask_size == opt.n_blocks * round(0.07 * B)
        _sync_checks(opt, a_before, synced_before, local[0][:n_params])
        # one rank: the outer step is exactly what this rank sent
        torch.testing.assert_close(opt.synced, synced_before - _sent_dense(opt), rtol=0,
                                   atol=1e-7)
        assert torch.equal(_flat(m), opt.synced[:n_params])


def _sent_dense(opt: scape.SparseLoCo) -> torch.Tensor:
    out = torch.zeros(opt.n_pad)
    flat = (torch.arange(opt.n_blocks)[:, None] * B + opt.last_sync["idx"].long()).view(-1)
    out[flat] = opt.last_sync["sent"]
    return out


def test_bf16_model_pseudo_gradient_ignores_cast_rounding():
    """theta_synced is fp32, the model bf16: with no local progress delta is exactly 0, so the
    outer step does not drift; with progress, the model equals theta_synced cast to bf16."""
    m = _model(2, torch.bfloat16)
    inner = torch.optim.SGD(m.parameters(), lr=0.0)
    opt = scape.SparseLoCo(m.parameters(), inner, sync_every=1, density=0.5, block_size=B,
                           value_bits=8)
    x, y = _batch(0, 0)
    synced0 = opt.synced.clone()
    for _ in range(3):
        ((m(x.bfloat16()).float() - y) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
    assert torch.equal(opt.synced, synced0) and not opt.error_feedback.any()
    inner.param_groups[0]["lr"] = 0.05
    for _ in range(3):
        ((m(x.bfloat16()).float() - y) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
    assert not torch.equal(opt.synced, synced0)
    for p, o, n in zip(opt.params, opt.offsets, opt.numels):
        assert p.dtype == torch.bfloat16
        assert torch.equal(p.detach().reshape(-1), opt.synced[o:o + n].bfloat16())


def test_param_groups_are_the_inner_groups_so_lr_schedulers_drive_the_inner_lr():
    m = _model()
    inner = torch.optim.AdamW(m.parameters(), lr=1e-2)
    opt = scape.SparseLoCo(m.parameters(), inner, block_size=B)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)
    x, y = _batch(0, 0)
    ((m(x) - y) ** 2).mean().backward()
    opt.step()
    sched.step()
    assert inner.param_groups[0]["lr"] == pytest.approx(5e-3)
    assert opt.last_step.step == 1 and opt.last_step.bytes == {}


def _inner(m):
    return torch.optim.SGD(m.parameters(), lr=0.1)


@pytest.mark.parametrize("kwargs,exc,msg", [
    (dict(density=0.0), ValueError, r"Invalid density: 0.0 \(expected a float in \(0, 1\]"),
    (dict(density=1.5), ValueError, r"Invalid density: 1.5"),
    (dict(block_size=300), ValueError, r"Invalid block_size: 300 \(expected a power of two"),
    (dict(ef_decay=1.5), ValueError, r"Invalid ef_decay: 1.5 \(expected a float in \[0, 1\]"),
    (dict(outer_lr=-1.0), ValueError, r"Invalid outer_lr: -1.0"),
    (dict(value_bits=3), ValueError, r"Invalid value_bits: 3 \(expected one of "
                                     r"\(2, 4, 8, 16, 32\)\)"),
    (dict(value_bits=2.0), TypeError, r"value_bits must be an int; got float"),
    (dict(sync_every=0), ValueError, r"Invalid sync_every: 0 \(expected an integer >= 1\)"),
])
def test_sparseloco_validation(kwargs, exc, msg):
    m = _model()
    with pytest.raises(exc, match=msg):
        scape.SparseLoCo(m.parameters(), _inner(m), **{"block_size": B, **kwargs})


@pytest.mark.parametrize("kwargs,exc,msg", [
    (dict(outer_momentum=1.0), ValueError, r"Invalid outer_momentum: 1.0"),
    (dict(outer_momentum=0.0), ValueError, r"Nesterov momentum requires outer_momentum > 0"),
    (dict(nesterov=1), TypeError, r"nesterov must be a bool; got int"),
    (dict(outer_lr=float("nan")), ValueError, r"Invalid outer_lr: nan"),
])
def test_diloco_validation(kwargs, exc, msg):
    m = _model()
    with pytest.raises(exc, match=msg):
        scape.DiLoCo(m.parameters(), _inner(m), **{"sync_every": 4, **kwargs})


def test_inner_must_be_an_optimizer_over_the_same_params():
    m, other = _model(), _model(1)
    with pytest.raises(TypeError, match="inner must be a torch.optim.Optimizer"):
        scape.SparseLoCo(m.parameters(), "adamw")
    with pytest.raises(ValueError, match="inner must optimize exactly the params given"):
        scape.SparseLoCo(m.parameters(), _inner(other), block_size=B)
    with pytest.raises(ValueError, match="inner must optimize exactly the params given"):
        scape.DiLoCo(list(m.parameters())[:2], _inner(m), sync_every=2)


def test_load_state_dict_rejects_other_optimizers_and_layouts():
    m = _model()
    sl = scape.SparseLoCo(m.parameters(), _inner(m), block_size=B)
    m2 = _model()
    dl = scape.DiLoCo(m2.parameters(), _inner(m2), sync_every=32)
    with pytest.raises(ValueError, match="state dict is from DiLoCo, not SparseLoCo"):
        sl.load_state_dict(dl.state_dict())
    with pytest.raises(ValueError, match="not a scape.local_sgd/1 state dict"):
        sl.load_state_dict({"state": {}})
    sd = sl.state_dict()
    sd["sync_every"] = 8
    with pytest.raises(ValueError, match="state dict sync_every 8 != 32"):
        sl.load_state_dict(sd)


def test_bench_runner_trains_sparseloco_and_counts_bytes_per_sync_period():
    """bench.engine.runner with optimizer="sparseloco": 2 syncs in 4 steps on the tiny GPT; the mean
    bytes per step are the record formula times W over the sync period."""
    from bench.engine.runner import RunConfig, run

    cfg = RunConfig(optimizer="sparseloco", model="tiny", world=2, steps=4, batch=1, seq=32,
                    eval_every=4, eval_seqs=2, log_every=0, timeout_s=120,
                    optimizer_kwargs={"sync_every": 2, "density": 0.01, "value_bits": 2})
    res = run(cfg)
    n_pad = math.ceil(res["params"] / 4096) * 4096
    n_blocks, k = n_pad // 4096, round(0.01 * 4096)
    record = 4 * n_blocks + 2 * n_blocks * k + math.ceil(n_blocks * k * 2 / 8)
    assert res["bytes_per_step_mean_all_steps"] == 2 * record / 2
    assert math.isfinite(res["final_val_loss"]) and res["dense_steps"] == 0
