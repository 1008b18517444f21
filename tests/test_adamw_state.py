"""What the sharded optimizers keep per shard coordinate, as docs/design.md §1 ("Layout") and
the README ("Memory per rank") state it: ``DistributedAdamW`` 12 bytes (fp32 master weights,
``exp_avg``, ``exp_avg_sq``), SCAPE 12 bytes (fp32 master weights and ``m``, int32 ``age``) plus
its rule's statistics. ``DistributedAdamW`` checkpoints hold no ages; those saved by earlier
versions, which kept an unused int32 ``age`` per coordinate, load with the ages dropped
(``opt.load_state_dict``, ``scape.load_checkpoint``, also onto another world size)."""

from __future__ import annotations

import copy
import hashlib
import io
import json

import pytest
import torch
from dist import run_ranks

import scape

ADAMW_BYTES = 12
"""fp32 master weights, exp_avg and exp_avg_sq."""
SCAPE_BYTES = {"agree": 28, "sqrt": 12, "lazy": 12}
"""fp32 master weights and m, int32 age; the rule's statistics: 16 bytes for agree (prev, s2,
s2w, mu), none for sqrt and lazy."""


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(30, 20), torch.nn.Linear(20, 7))


def _adamw(model: torch.nn.Module) -> scape.DistributedAdamW:
    return scape.DistributedAdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _train(model: torch.nn.Module, opt, steps: int, rank: int = 0, start: int = 0) -> None:
    for t in range(start, start + steps):
        g = torch.Generator().manual_seed(100 * t + rank)
        model(torch.randn(4, 30, generator=g)).square().mean().backward()
        opt.step()


def _state_bytes(shard) -> int:
    tensors = [*shard.tensors().values(), *shard.extra.values()]
    return sum(t.numel() * t.element_size() for t in tensors)


def _with_ages(record: dict) -> dict:
    """``record`` as earlier versions saved it: an int32 ``age`` per shard coordinate (the
    values differ from zero so that a load that read them would show it)."""
    old = copy.deepcopy(record)
    for e in old["buckets"]:
        e["age"] = torch.arange(e["shard_size"], dtype=torch.int32)
    return old


def _shard_state(opt) -> list[torch.Tensor]:
    return [t.clone() for b, s in zip(opt.buckets, opt.shards)
            for t in (s.master, s.m, s.extra["v"], b.grad_flat)]


def test_state_bytes_per_coordinate():
    model = _model()
    opt = _adamw(model)
    for s, b in zip(opt.shards, opt.buckets):
        assert not hasattr(s, "age")
        assert _state_bytes(s) == ADAMW_BYTES * b.shard_size
    assert all(set(v) == {"exp_avg", "exp_avg_sq", "master", "residual"}
               for v in opt.state.values())
    for update, per_coordinate in SCAPE_BYTES.items():
        sc = scape.SCAPE(_model().parameters(), lr=1e-2, sparsity=0.9, block_size=256,
                         update=update)
        for s, b in zip(sc.shards, sc.buckets):
            assert _state_bytes(s) == per_coordinate * b.shard_size, update


def test_records_hold_no_age():
    model = _model()
    opt = _adamw(model)
    _train(model, opt, 3)
    for e in opt.rank_state_dict()["buckets"]:
        assert "age" not in e and set(e["extra"]) == {"v"}
    for entry in opt.state_dict()["state"].values():
        assert set(entry) - {"padding"} == {"exp_avg", "exp_avg_sq", "master", "residual"}
        assert set(entry.get("padding", {})) <= {"exp_avg", "exp_avg_sq", "master"}


@pytest.mark.parametrize("form", ["record", "list"])
def test_record_saved_with_ages_loads(form):
    model = _model()
    opt = _adamw(model)
    _train(model, opt, 3)
    old = _with_ages(opt.rank_state_dict())
    fresh_model = _model()
    fresh = _adamw(fresh_model)
    fresh.load_state_dict(old if form == "record" else [old])
    assert all(torch.equal(a, b) for a, b in zip(_shard_state(fresh), _shard_state(opt)))
    assert fresh.step_count == opt.step_count == 3
    _train(model, opt, 2, start=3)
    _train(fresh_model, fresh, 2, start=3)
    for p, q in zip(model.parameters(), fresh_model.parameters()):
        assert torch.equal(p, q)


def _add_ages_to_files(ckpt) -> None:
    """Rewrite a checkpoint's rank files as earlier versions wrote them, manifest included."""
    manifest = json.loads((ckpt / "manifest.json").read_text())
    for f in manifest["files"]:
        path = ckpt / f["name"]
        buf = io.BytesIO()
        torch.save(_with_ages(torch.load(path, weights_only=True)), buf)
        data = buf.getvalue()
        path.write_bytes(data)
        f["sha256"], f["bytes"] = hashlib.sha256(data).hexdigest(), len(data)
    (ckpt / "manifest.json").write_text(json.dumps(manifest))


def _save_body(rank: int, world: int, root: str) -> list:
    model = _model()
    opt = _adamw(model)
    _train(model, opt, 3, rank)
    scape.save_checkpoint(opt, root)
    b, s = opt.buckets[0], opt.shards[0]
    return [t.numpy().copy() for t in (s.master, s.m, s.extra["v"])] + [
        b.grad_flat[:b.numel].numpy().copy()]


def test_checkpoint_files_saved_with_ages_load(tmp_path):
    # same world size (one process): bit-exact, and the run after it the uninterrupted one
    model = _model()
    opt = _adamw(model)
    _train(model, opt, 3)
    same = tmp_path / "same"
    _add_ages_to_files(scape.save_checkpoint(opt, same))
    fresh_model = _model()
    fresh = _adamw(fresh_model)
    assert scape.load_checkpoint(fresh, same) == 3
    assert all(torch.equal(a, b) for a, b in zip(_shard_state(fresh), _shard_state(opt)))
    _train(model, opt, 2, start=3)
    _train(fresh_model, fresh, 2, start=3)
    for p, q in zip(model.parameters(), fresh_model.parameters()):
        assert torch.equal(p, q)

    # 2 ranks -> 1: master weights and moments exact, the residual the mean of the old ones
    root = tmp_path / "two"
    old = run_ranks(_save_body, 2, str(root), timeout=120)
    _add_ages_to_files(scape.resolve_checkpoint(root))
    one = _adamw(_model())
    assert scape.load_checkpoint(one, root) == 3
    b, s = one.buckets[0], one.shards[0]
    for k, t in enumerate((s.master, s.m, s.extra["v"])):
        whole = torch.cat([torch.from_numpy(r[k]) for r in old])[:b.numel]
        assert torch.equal(t[:b.numel], whole)
    mean = torch.stack([torch.from_numpy(r[3]) for r in old]).mean(0)
    assert torch.equal(b.grad_flat[:b.numel], mean)
