"""The embedding matrices set apart (``update="agree"`` with ``attach(model)``): the budget
split holds the group's bytes, the layout is rebuilt before the first step only, training and
checkpoints work on the new layout, and the ranks must agree on it."""

from __future__ import annotations

import pytest
import torch
from dist import run_ranks, run_ranks_outcomes
from torch import nn

import scape
from scape import embeddings
from scape.rules import block_budget, reads_wait

B = 256
VOCAB, DIM = 64, 32


class Tiny(nn.Module):
    """A token embedding, a tied head, an MLP and a norm."""

    def __init__(self, seed: int = 0, plain: bool = False) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(VOCAB, DIM)
        if plain:  # the same shape, not an nn.Embedding
            self.emb = _Plain(self.emb.weight.detach().clone())
        self.mix = nn.Sequential(nn.Linear(DIM, 128), nn.Tanh(), nn.Linear(128, DIM))
        self.norm = nn.LayerNorm(DIM)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.norm(self.mix(self.emb(idx)))
        return x @ self.emb.weight.t()


class _Plain(nn.Module):
    def __init__(self, w: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(w)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.weight[idx]


def _loss(model: nn.Module, g: torch.Generator) -> torch.Tensor:
    idx = torch.randint(0, VOCAB, (4, 8), generator=g)
    return nn.functional.cross_entropy(model(idx).flatten(0, 1), idx.roll(1, 1).flatten())


def _opt(model: nn.Module, update: str = "agree", sparsity: float = 0.9,
         comm=None) -> scape.SCAPE:
    return scape.SCAPE(model.parameters(), lr=3e-3, weight_decay=0.1, sparsity=sparsity,
                       update=update, warmup_steps=1, block_size=B, comm=comm)


@pytest.mark.parametrize("seed", [0, 1])
def test_the_split_keeps_the_group_bytes(seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(300):
        k = int(torch.randint(1, 4096, (1,), generator=g))
        share = float(torch.rand(1, generator=g)) * 0.6 + 1e-3
        k_e, k_r = embeddings.split_budget(k, 4096, share)
        assert k <= k_e <= 4096 and 1 <= k_r <= k
        assert share * k_e <= embeddings.MAX_SHARE * k + 1e-9 or k_e == k
        # what the group sends per block, up to the rest's rounding
        assert abs(share * k_e + (1 - share) * k_r - k) <= 0.5 * (1 - share) + 1e-9 or k_r == 1
        if not reads_wait(k, 4096):  # early keeps the group's bound and EMAs there
            assert not reads_wait(k_e, 4096) or k_e == k
        else:
            assert k_e <= max(k, min(2048, embeddings.SHORT_FACTOR * k))
    with pytest.raises(ValueError, match="share"):
        embeddings.split_budget(41, 4096, 0.0)


def test_the_documented_points():
    """The module docstring's figures: 0.9 -> 0.5 for the embeddings, 0.99 -> 0.98."""
    for sp, want in ((0.9, 0.5), (0.99, 0.98)):
        k, _ = block_budget(sp, 4096, 0.1)
        k_e, k_r = embeddings.split_budget(k, 4096, 0.06)
        assert round(1 - k_e / 4096, 2) == want and k_r < k


def test_attach_sets_the_embeddings_apart_and_keeps_values_and_grads():
    model = Tiny()
    opt = _opt(model)
    before = [p.detach().clone() for p in model.parameters()]
    loss = _loss(model, torch.Generator().manual_seed(5))
    loss.backward()  # a gradient computed before attach is kept
    grads = [p.grad.detach().clone() for p in model.parameters()]
    assert len(opt.buckets) == 1
    hooks = [len(p._backward_hooks or {}) for p in model.parameters()]
    opt.attach(model)
    assert [len(p._backward_hooks or {}) for p in model.parameters()] == hooks  # old ones gone
    apart = [b for b in opt.buckets if b.apart]
    assert len(opt.buckets) == 2 and len(apart) == 1
    assert apart[0].params == [model.emb.weight]  # the tied head is the same tensor
    for p, v, gr in zip(model.parameters(), before, grads):
        assert torch.equal(p.detach(), v) and torch.equal(p.grad, gr)
        b = next(b for b in opt.buckets if any(q is p for q in b.params))
        assert b.param_flat.data_ptr() <= p.data_ptr() < b.param_flat.data_ptr() + 4 * b.n_pad
    share = apart[0].n_pad / sum(b.n_pad for b in opt.buckets)
    for sp in (0.9, 0.6):
        opt.param_groups[0]["sparsity"] = sp
        k, _ = block_budget(sp, B, opt.explore)
        k_e, k_r = embeddings.split_budget(k, B, share)
        assert [opt.mask_budget(b)[0] for b in opt.buckets] == \
            [k_e if b.apart else k_r for b in opt.buckets]
        assert k_e > k_r
    opt.param_groups[0]["sparsity"] = 0.9
    g = torch.Generator().manual_seed(6)
    for _ in range(4):
        opt.step()
        opt.zero_grad()
        _loss(model, g).backward()
    ks = {b.apart: m.current.shape[1] for b, m in zip(opt.buckets, opt.masks)}
    assert ks[True] > ks[False]  # the sparse steps sent the embeddings' larger budget
    assert all(torch.isfinite(p).all() for p in model.parameters())
    _loss(model, g).backward()
    model.emb.weight.grad.mul_(0.5)  # the new buffers are watched
    with pytest.raises(ValueError, match="outside backward"):
        opt.step()


@pytest.mark.parametrize("case", ["sqrt", "no_attach", "after_a_step", "only_embeddings",
                                  "dense_group"])
def test_nothing_is_set_apart(case):
    model = Tiny()
    if case == "only_embeddings":
        opt = scape.SCAPE([{"params": [model.emb.weight]},
                           {"params": list(model.mix.parameters()) + list(
                               model.norm.parameters())}],
                          lr=3e-3, sparsity=0.9, update="agree", warmup_steps=1, block_size=B)
    elif case == "dense_group":
        opt = scape.SCAPE(model.parameters(), lr=3e-3, sparsity=0.0, update="agree",
                          block_size=B)
    else:
        opt = _opt(model, "sqrt" if case == "sqrt" else "agree")
    layout = [[id(p) for p in b.params] for b in opt.buckets]
    if case == "after_a_step":
        _loss(model, torch.Generator().manual_seed(1)).backward()
        opt.step()
    if case != "no_attach":
        opt.attach(model)
    assert [[id(p) for p in b.params] for b in opt.buckets] == layout
    assert not any(b.apart for b in opt.buckets)


def test_a_state_dict_needs_the_same_layout(tmp_path):
    model = Tiny()
    opt = _opt(model)
    opt.attach(model)
    g = torch.Generator().manual_seed(2)
    for _ in range(3):
        _loss(model, g).backward()
        opt.step()
        opt.zero_grad()
    sd = opt.state_dict()
    other = Tiny(seed=1)
    plain = _opt(other)  # not attached: one bucket
    with pytest.raises(ValueError, match=r"attach\(model\)"):
        plain.load_state_dict(sd)
    plain.attach(other)
    plain.load_state_dict(sd)
    for p, q in zip(model.parameters(), other.parameters()):
        assert torch.equal(p.detach(), q.detach())
    unsplit = _opt(Tiny())
    unsplit_sd = unsplit.state_dict()
    with pytest.raises(ValueError, match=r"attach\(model\)"):
        opt.load_state_dict(unsplit_sd)
    path = scape.save_checkpoint(opt, tmp_path)  # the files, with the same checks
    third = Tiny(seed=2)
    with pytest.raises(scape.CheckpointError, match=r"attach\(model\)"):
        scape.load_checkpoint(_opt(third), path)
    again = _opt(third)
    again.attach(third)
    assert scape.load_checkpoint(again, path) == 3
    for p, q in zip(model.parameters(), third.parameters()):
        assert torch.equal(p.detach(), q.detach())


def _train_body(rank: int, world: int, resume_at: int | None) -> list:
    model = Tiny()
    opt = _opt(model, sparsity=0.8)
    opt.attach(model)
    g = torch.Generator().manual_seed(100 + rank)
    for t in range(8):
        if t == resume_at:  # a fresh model and optimizer from the state dict
            sd = opt.state_dict()
            model = Tiny(seed=7)
            opt = _opt(model, sparsity=0.8)
            opt.attach(model)
            opt.load_state_dict(sd)
        loss = _loss(model, g)
        loss.backward()
        opt.step()
        opt.zero_grad()
    opt.finish_param_sync()
    assert any(b.apart for b in opt.buckets)
    return [p.detach().numpy().copy() for p in model.parameters()]  # by value through the queue


def test_ranks_train_on_the_split_and_resume_bit_exact():
    straight = [[torch.from_numpy(a) for a in r] for r in run_ranks(_train_body, 2, None,
                                                                      timeout=180)]
    resumed = [[torch.from_numpy(a) for a in r] for r in run_ranks(_train_body, 2, 4,
                                                                     timeout=180)]
    for a, b in zip(straight[0], straight[1]):
        assert torch.equal(a, b)  # every rank holds the same parameters
    for a, b in zip(straight[0], resumed[0]):
        assert torch.equal(a, b)
    assert not all(torch.equal(a, b) for a, b in zip(straight[0], Tiny().parameters()))


def _disagree_body(rank: int, world: int) -> None:
    model = Tiny(plain=rank == 1)  # the same shapes and values; rank 1 has no nn.Embedding
    opt = _opt(model)
    opt.attach(model)


def test_ranks_that_set_apart_different_tensors_raise_on_every_rank():
    outcomes = run_ranks_outcomes(_disagree_body, 2, timeout=120)
    for o in outcomes:
        assert not o.ok and "embedding_params" in o.error, o


@pytest.mark.parametrize("sparsity", [0.9, 0.99])
def test_run_bytes_counts_each_bucket_budget(sparsity):
    """The bytes formula (``scape.schedules.run_bytes``) follows the split step by step, and
    the split sends about what one group sends."""
    model = Tiny()
    opt = _opt(model, sparsity=sparsity)
    one_group = scape.schedules.run_bytes(_opt(Tiny(), sparsity=sparsity), 12, start=0.5,
                                          ramp_steps=5)
    opt.attach(model)
    assert any(b.apart for b in opt.buckets)
    predicted = scape.schedules.run_bytes(opt, 12, start=0.5, ramp_steps=5)
    sched = scape.SparsityRamp(opt, start=0.5, ramp_steps=5)
    g, sent = torch.Generator().manual_seed(8), 0
    for _ in range(12):
        _loss(model, g).backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        sent += sum(opt.last_step.bytes.values())
    n = sum(p.numel() for p in model.parameters())
    assert predicted * 12 * (8 * n + 8) == pytest.approx(sent, rel=1e-12)
    assert predicted == pytest.approx(one_group, rel=0.1)
