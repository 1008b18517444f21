"""Promises 3, 11, 12 and 13 (issue 6) on real gloo processes.

3. Ranks that disagree on sparsity, block size, param shapes or order, dtypes, lr or betas:
   construction raises on every rank, naming the field; one all-gather was issued, nothing else,
   and the group still works.
11. Bad input (torch.optim-style ``ValueError``/``TypeError``) on every rank before any
   collective but the one agreement all-gather, also when only one rank's arguments are bad.
   Sparse gradients raise ``TypeError`` in ``step()`` before any collective; when only some
   ranks have one, the others get ``CommError`` at the timeout (gradients are per rank and
   there is no collective before the reduce-scatter to agree on them).
12. Parameters without gradients (``None`` on every rank, or on one rank only) behave exactly
   like a zero gradient, with no hang; frozen parameters are not sharded at all.
13. ``state_dict()`` twice is equal; ``load_state_dict(state_dict())`` changes nothing (also the
   steps after it); mismatched param groups raise and change nothing.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from dist import run_ranks, run_ranks_outcomes
from reliability_common import differing, make_model, make_opt, snapshot

import scape
from scape.comm import TorchCommunicator

DISAGREE = {  # field -> what rank 1 changes
    "sparsity": dict(sparsity=0.8), "block_size": dict(block_size=512),
    "param_shapes": "shape", "param_order": "order", "param_dtypes": "dtype",
    "lr": dict(lr=3e-2), "betas": dict(betas=(0.9, 0.99)), "update": dict(update="sqrt"),
}


def _disagreeing_opt(rank, change, comm):
    model = make_model()
    if rank == 1 and change == "shape":
        model[2] = torch.nn.Linear(40, 7)
    if rank == 1 and change == "dtype":
        model = model.to(torch.bfloat16)
    if rank == 1 and change == "order":
        return scape.SCAPE(list(model.parameters())[::-1], lr=2e-2, block_size=256,
                           warmup_steps=3, comm=comm)
    if change == "order":
        return scape.SCAPE(list(model.parameters()), lr=2e-2, block_size=256,
                           warmup_steps=3, comm=comm)
    return make_opt(model, comm, **(change if rank == 1 and isinstance(change, dict) else {}))


def _p(*shape, dtype=torch.float32, device="cpu"):
    return torch.nn.Parameter(torch.zeros(*shape, dtype=dtype, device=device),
                              requires_grad=dtype.is_floating_point)


BAD = {  # name -> (builder of SCAPE(...) arguments, exception, words in the message)
    "negative_lr": (lambda: ([_p(4)], dict(lr=-1.0)), ValueError, "Invalid learning rate"),
    "nan_lr": (lambda: ([_p(4)], dict(lr=math.nan)), ValueError, "Invalid learning rate"),
    "beta1_1": (lambda: ([_p(4)], dict(lr=1e-3, betas=(1.0, 0.9))), ValueError,
                "Invalid beta parameter at index 0"),
    "beta2_neg": (lambda: ([_p(4)], dict(lr=1e-3, betas=(0.9, -0.1))), ValueError,
                  "Invalid beta parameter at index 1"),
    "eps_0": (lambda: ([_p(4)], dict(lr=1e-3, eps=0.0)), ValueError, "Invalid epsilon"),
    "negative_wd": (lambda: ([_p(4)], dict(lr=1e-3, weight_decay=-0.1)), ValueError,
                    "Invalid weight_decay"),
    "sparsity_1": (lambda: ([_p(4)], dict(lr=1e-3, sparsity=1.0)), ValueError,
                   "Invalid sparsity"),
    "sparsity_neg": (lambda: ([_p(4)], dict(lr=1e-3, sparsity=-0.1)), ValueError,
                     "Invalid sparsity"),
    "block_300": (lambda: ([_p(4)], dict(lr=1e-3, block_size=300)), ValueError,
                  "Invalid block_size"),
    "block_128": (lambda: ([_p(4)], dict(lr=1e-3, block_size=128)), ValueError,
                  "Invalid block_size"),
    "unknown_update": (lambda: ([_p(4)], dict(lr=1e-3, update="adam")), ValueError,
                       "Invalid update rule"),
    "warmup_0": (lambda: ([_p(4)], dict(lr=1e-3, warmup_steps=0)), ValueError,
                 "Invalid warmup_steps"),
    "empty": (lambda: ([], dict(lr=1e-3)), ValueError, "empty parameter list"),
    "bare_tensor": (lambda: (_p(4), dict(lr=1e-3)), TypeError, "iterable of Tensors"),
    "duplicate": (lambda: ([p := _p(4), p], dict(lr=1e-3)), ValueError,
                  "appears more than once"),
    "integer": (lambda: ([_p(4, dtype=torch.int64)], dict(lr=1e-3)), TypeError, "torch.int64"),
    "complex": (lambda: ([_p(4, dtype=torch.complex64)], dict(lr=1e-3)), TypeError,
                "torch.complex64"),
    "mixed_devices": (lambda: ([_p(4), _p(4, device="meta")], dict(lr=1e-3)), ValueError,
                      "several devices"),
}


def _config_body(rank, world):
    report = {}
    check = torch.tensor([float(rank + 1)])

    def group_is_healthy():
        t = check.clone()
        dist.all_reduce(t)
        return float(t) == world * (world + 1) / 2

    for field, change in DISAGREE.items():
        comm = TorchCommunicator()
        try:
            _disagreeing_opt(rank, change, comm)
        except ValueError as e:
            report[f"disagree:{field}"] = str(e)
        calls = {op: v["calls"] for op, v in comm.stats.items() if v["calls"]}
        assert calls == {"all_gather": 1}, (field, calls)
        assert group_is_healthy()
    for name, (build, _, _) in BAD.items():
        for only_rank1 in (False, True):
            comm = TorchCommunicator()
            params, kw = build() if (rank == 1 or not only_rank1) else ([_p(4)], dict(lr=1e-3))
            try:
                scape.SCAPE(params, comm=comm, **kw)
            except (ValueError, TypeError) as e:
                report[f"bad:{name}:{only_rank1}"] = (type(e).__name__, str(e))
            calls = {op: v["calls"] for op, v in comm.stats.items() if v["calls"]}
            assert calls == {"all_gather": 1}, (name, calls)
            assert group_is_healthy()
    # sparse gradients on every rank: TypeError in step(), before any collective
    torch.manual_seed(0)
    emb = torch.nn.Embedding(10, 8, sparse=True)
    comm = TorchCommunicator()
    opt = scape.SCAPE(emb.parameters(), lr=1e-2, sparsity=0.0, comm=comm)
    emb.zero_grad(set_to_none=True)  # backward now makes a sparse p.grad
    comm.reset_stats()
    emb(torch.tensor([1, 2])).sum().backward()
    assert emb.weight.grad.is_sparse
    try:
        opt.step()
    except TypeError as e:
        report["sparse_grad"] = str(e)
    assert all(v["calls"] == 0 for v in comm.stats.values())
    assert group_is_healthy()
    return report


def test_disagreement_and_bad_input_raise_on_every_rank():
    reports = run_ranks(_config_body, 2, timeout=200)
    for rank, rep in enumerate(reports):
        for field in DISAGREE:
            text = rep[f"disagree:{field}"]
            named = "param_shapes" if field == "param_order" else field
            assert "differs across ranks in:" in text and named in text, (field, text)
        for name, (_, exc, words) in BAD.items():
            for only_rank1 in (False, True):
                kind, text = rep[f"bad:{name}:{only_rank1}"]
                assert words in text, (rank, name, text)
                if rank == 1 or not only_rank1:
                    assert kind == exc.__name__, (rank, name, kind)
                else:  # the healthy rank raises the same type, naming the bad rank
                    assert kind == exc.__name__ and text.startswith("rank 1: "), (name, text)
        assert "sparse" in rep["sparse_grad"]


def _sparse_on_one_rank(rank, world):
    torch.manual_seed(0)
    emb = torch.nn.Embedding(10, 8, sparse=(rank == 1))
    opt = scape.SCAPE(emb.parameters(), lr=1e-2, sparsity=0.0,
                      comm=TorchCommunicator(timeout=2.0))
    emb.zero_grad(set_to_none=True)
    emb(torch.tensor([1, 2])).sum().backward()
    opt.step()


def test_sparse_gradient_on_one_rank_does_not_hang():
    out = run_ranks_outcomes(_sparse_on_one_rank, 2, timeout=90, pg_timeout=6)
    assert out[1].exc_type == "TypeError" and "sparse" in out[1].error
    assert out[0].exc_type == "CommError" and "reduce_scatter failed on rank 0, step 1" \
        in out[0].error, out[0].error


# ------------------------------------------------------------- gradients missing, state dicts
class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = make_model()
        g = torch.Generator().manual_seed(5)
        self.unused = torch.nn.Parameter(torch.randn(50, generator=g))
        self.unused_bf16 = torch.nn.Parameter(torch.randn(30, generator=g).bfloat16())
        self.rank0_only = torch.nn.Parameter(torch.randn(6, generator=g))
        self.frozen = torch.nn.Parameter(torch.randn(9, generator=g), requires_grad=False)

    def loss(self, step: int, rank: int, zeros: bool) -> torch.Tensor:
        from reliability_common import batch

        x, y = batch(step, rank)
        out = self.body(x)
        if rank == 0:
            out = out + self.rank0_only
        loss = torch.nn.functional.mse_loss(out, y) + (self.frozen.sum() * 0)
        if zeros:  # the same gradients, spelled as explicit zeros instead of None
            loss = loss + 0 * (self.unused.sum() + self.unused_bf16.float().sum())
            if rank != 0:
                loss = loss + 0 * self.rank0_only.sum()
        return loss


def _contract_body(rank, world):
    nets = [_Net(), _Net()]
    opts = [scape.SCAPE(n.parameters(), lr=2e-2, sparsity=0.9, block_size=256,
                        warmup_steps=2) for n in nets]
    frozen0 = nets[0].frozen.detach().clone()
    for t in range(1, 7):
        for zeros, (net, opt) in enumerate(zip(nets, opts, strict=True)):
            net.loss(t, rank, bool(zeros)).backward()
            opt.step()
            opt.zero_grad()
        assert not differing(snapshot(opts[0]), snapshot(opts[1])), f"step {t}: None != zero"
    opt, net = opts[0], nets[0]
    assert torch.equal(net.frozen, frozen0)
    ptrs = [(b.param_flat.data_ptr(), b.param_flat.data_ptr() + b.param_flat.nbytes)
            for b in opt.buckets]
    assert not any(lo <= net.frozen.data_ptr() < hi for lo, hi in ptrs), "frozen param sharded"
    trainable = sum(p.numel() for p in net.parameters() if p.requires_grad)
    assert sum(b.numel for b in opt.buckets) == trainable

    # state_dict contract
    sd1, sd2 = opt.state_dict(), opt.state_dict()
    assert _same(sd1, sd2), "state_dict() twice differs"
    before = snapshot(opt)
    opt.load_state_dict(opt.state_dict())
    assert not differing(before, snapshot(opt)), "load_state_dict(state_dict()) changed state"
    for t in range(7, 10):  # and the steps after it are those of the untouched twin
        for zeros, (n, o) in enumerate(zip(nets, opts, strict=True)):
            n.loss(t, rank, bool(zeros)).backward()
            o.step()
        assert not differing(snapshot(opts[0]), snapshot(opts[1]))
    errors = []
    for other in (scape.SCAPE([{"params": [p]} for p in net.body.parameters()], lr=2e-2,
                              sparsity=0.9, block_size=256, warmup_steps=2),
                  scape.SCAPE(make_model().parameters(), lr=2e-2, sparsity=0.9,
                              block_size=256, warmup_steps=2)):
        keep = snapshot(other)
        try:
            other.load_state_dict(opt.state_dict())
        except ValueError as e:
            errors.append(str(e))
        assert not differing(keep, snapshot(other))
    return errors


def _same(a, b) -> bool:
    if hasattr(a, "local_shards"):  # a ShardedTensor: this rank's parts and where they lie
        return hasattr(b, "local_shards") and a.size() == b.size() and _same(
            [(s.metadata.shard_offsets, s.tensor) for s in a.local_shards()],
            [(s.metadata.shard_offsets, s.tensor) for s in b.local_shards()])
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return a == b


def test_missing_gradients_and_state_dict_contract():
    for errors in run_ranks(_contract_body, 2, timeout=200):
        assert len(errors) == 2
        assert "param groups" in errors[0] and "bucket" in errors[1], errors


@pytest.mark.parametrize("value", [0.0, -1.0])
def test_single_rank_validation_is_the_same(value):
    """Without a process group the same checks raise, in the same words."""
    with pytest.raises(ValueError, match="Invalid epsilon value"):
        scape.SCAPE([_p(4)], lr=1e-3, eps=value)
