"""The benchmark workload: bench/workloads/gpt.py (model) and bench/workloads/data.py (corpus and
sampler)."""

from __future__ import annotations

import dataclasses
import hashlib

import pytest
import torch
from conftest import nan_empty

from bench.workloads import data, gpt


@pytest.mark.parametrize("name, lo, hi", [
    pytest.param("tiny", 0.05e6, 0.2e6, id="tiny"),
    pytest.param("small", 0.7e6, 1.5e6, id="small"),
    pytest.param("base", 2.5e6, 4.0e6, id="base"),
])
def test_param_counts_in_range_and_match_formula(name, lo, hi):
    cfg = gpt.get_config(name)
    n = gpt.num_params(gpt.GPT(cfg))
    assert lo <= n <= hi
    d, L = cfg.d_model, cfg.n_layers
    # per block: qkv 3d^2 + proj d^2 + mlp 2*ratio*d^2 + two LayerNorm scales; plus tied
    # token embedding, position table and the final norm (no biases in the presets)
    expected = L * ((4 + 2 * cfg.mlp_ratio) * d * d + 2 * d) + 256 * d + cfg.seq_len * d + d
    assert n == expected


@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("bias", [False, True])
def test_forward_backward_shapes(norm, bias):
    cfg = gpt.GPTConfig(d_model=32, n_layers=2, n_heads=4, seq_len=16, norm=norm, bias=bias)
    model = gpt.GPT(cfg, seed=3)
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (3, 11), generator=gen)
    logits = model(x)
    assert logits.shape == (3, 11, 256) and torch.isfinite(logits).all()
    loss = model.loss(x, torch.randint(0, 256, (3, 11), generator=gen))
    # at init the logits are small, so the loss is close to log(256)
    assert abs(float(loss.detach()) - torch.log(torch.tensor(256.0)).item()) < 0.5
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.shape == p.shape, name
        assert torch.isfinite(p.grad).all(), name
    assert model.head.weight is model.tok_emb.weight


def test_causal():
    """Changing a later byte never changes the logits at earlier positions."""
    model = gpt.GPT(gpt.get_config("tiny"), seed=1)
    gen = torch.Generator().manual_seed(5)
    x = torch.randint(0, 256, (2, 20), generator=gen)
    x2 = x.clone()
    x2[:, 12:] = torch.randint(0, 256, (2, 8), generator=gen)
    with torch.no_grad():
        a, b = model(x), model(x2)
    torch.testing.assert_close(a[:, :12], b[:, :12])
    assert not torch.allclose(a[:, 12:], b[:, 12:])


def test_init_deterministic_and_independent_of_global_rng():
    cfg = gpt.get_config("tiny")
    torch.manual_seed(123)
    a = gpt.GPT(cfg, seed=7).state_dict()
    torch.manual_seed(999)
    torch.rand(10)
    b = gpt.GPT(cfg, seed=7).state_dict()
    c = gpt.GPT(cfg, seed=8).state_dict()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert any(not torch.equal(a[k], c[k]) for k in a if a[k].ndim >= 2)


def test_param_groups_partition():
    cfg = gpt.GPTConfig(d_model=32, n_layers=2, n_heads=2, seq_len=16, bias=True)
    model = gpt.GPT(cfg)
    groups = gpt.param_groups(model, weight_decay=0.1)
    assert [g["name"] for g in groups] == ["decay", "no_decay"]
    assert groups[0]["weight_decay"] == 0.1 and groups[1]["weight_decay"] == 0.0
    ids = [id(p) for g in groups for p in g["params"]]
    assert len(ids) == len(set(ids)) == len(list(model.parameters()))  # a partition
    named = {id(p): n for n, p in model.named_parameters()}
    for p in groups[0]["params"]:
        assert p.ndim == 2 and "emb" not in named[id(p)]
    decayed = {named[id(p)] for p in groups[0]["params"]}
    assert "blocks.0.attn.qkv.weight" in decayed and "blocks.1.mlp.proj.weight" in decayed
    no_decay = {named[id(p)] for p in groups[1]["params"]}
    assert {"tok_emb.weight", "pos_emb.weight", "norm_f.weight", "norm_f.bias",
            "blocks.0.attn.qkv.bias"} <= no_decay
    with pytest.raises(ValueError, match="weight_decay"):
        gpt.param_groups(model, -1.0)


@pytest.mark.parametrize("embed_sparsity", [0.0, 0.9])
def test_param_groups_embed_group(embed_sparsity):
    cfg = gpt.GPTConfig(d_model=32, n_layers=2, n_heads=2, seq_len=16, bias=True)
    model = gpt.GPT(cfg)
    two = gpt.param_groups(model, weight_decay=0.1)
    three = gpt.param_groups(model, weight_decay=0.1,
                             sparsity={"embed": embed_sparsity, "no_decay": 0.0})
    assert [g["name"] for g in three] == ["decay", "no_decay", "embed"]
    named = {id(p): n for n, p in model.named_parameters()}
    embed = {named[id(p)] for p in three[2]["params"]}
    assert embed == {"tok_emb.weight", "pos_emb.weight"}  # the tied head is tok_emb
    assert three[2]["sparsity"] == embed_sparsity and three[2]["weight_decay"] == 0.0
    assert three[1]["sparsity"] == 0.0 and "sparsity" not in three[0]
    assert [id(p) for p in three[0]["params"]] == [id(p) for p in two[0]["params"]]
    # the same partition of the parameters, the embeddings moved out of no_decay
    assert {id(p) for g in three[1:] for p in g["params"]} == {id(p) for p in two[1]["params"]}
    assert all(p.ndim == 1 for p in three[1]["params"])
    assert [g["name"] for g in gpt.param_groups(model, 0.1, {"decay": 0.5})] == \
        ["decay", "no_decay"]  # no split unless "embed" is named
    four = gpt.param_groups(model, 0.1, {"embed": 0.99, "pos": 0.9})
    assert [(g["name"], g.get("sparsity")) for g in four] == \
        [("decay", None), ("no_decay", None), ("embed", 0.99), ("pos", 0.9)]
    assert [named[id(p)] for g in four[2:] for p in g["params"]] == \
        ["tok_emb.weight", "pos_emb.weight"]
    with pytest.raises(ValueError, match="name 'embed' as well"):
        gpt.param_groups(model, 0.1, {"pos": 0.9})
    no_pos = torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Linear(8, 8))
    with pytest.raises(ValueError, match="learned position embedding"):
        gpt.param_groups(no_pos, 0.1, {"embed": 0.9, "pos": 0.9})
    assert [g["name"] for g in gpt.param_groups(no_pos, 0.1, {"embed": 0.9})] == \
        ["decay", "no_decay", "embed"]
    for bad in ({"embed": 1.0}, {"embed": -0.1}, {"embed": True}, {"embed": "0.9"},
                {"head": 0.9}):
        with pytest.raises(ValueError, match="sparsity"):
            gpt.param_groups(model, 0.1, bad)


def test_untied_head_and_its_group():
    """``tie_head=False`` gives the head its own matrix (drawn after every tied parameter, so
    the rest of the model starts where the tied one does); ``sparsity={"head": s}`` moves it
    out of ``decay`` into a decayed group of its own."""
    cfg = gpt.GPTConfig(d_model=32, n_layers=2, n_heads=2, seq_len=16)
    untied_cfg = gpt.GPTConfig(d_model=32, n_layers=2, n_heads=2, seq_len=16, tie_head=False)
    tied, untied = gpt.GPT(cfg, seed=3), gpt.GPT(untied_cfg, seed=3)
    assert untied.head.weight is not untied.tok_emb.weight
    assert gpt.num_params(untied) == gpt.num_params(tied) + 256 * 32
    t_named = dict(tied.named_parameters())
    for name, p in untied.named_parameters():
        if name != "head.weight":
            assert torch.equal(p, t_named[name]), name
    assert not torch.equal(untied.head.weight, untied.tok_emb.weight)
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    assert torch.isfinite(untied.loss(x, x))
    two = gpt.param_groups(untied, 0.1)
    assert id(untied.head.weight) in {id(p) for p in two[0]["params"]}  # a matrix like the blocks'
    three = gpt.param_groups(untied, 0.1, {"head": 0.9})
    assert [(g["name"], g.get("sparsity"), g["weight_decay"]) for g in three] == \
        [("decay", None, 0.1), ("no_decay", None, 0.0), ("head", 0.9, 0.1)]
    assert [id(p) for p in three[2]["params"]] == [id(untied.head.weight)]
    assert {id(p) for g in three for p in g["params"]} == {id(p) for p in untied.parameters()}
    assert sum(len(g["params"]) for g in three) == len(list(untied.parameters()))
    with pytest.raises(ValueError, match="untied output head"):
        gpt.param_groups(tied, 0.1, {"head": 0.9})
    with pytest.raises(ValueError, match="tie_head"):
        gpt.GPTConfig(tie_head=1)  # type: ignore[arg-type]
    assert gpt.get_config("small-untied") == dataclasses.replace(gpt.get_config("small"),
                                                                 tie_head=False)


def test_config_validation():
    with pytest.raises(ValueError, match="n_heads"):
        gpt.GPTConfig(d_model=30, n_heads=4)
    with pytest.raises(ValueError, match="norm"):
        gpt.GPTConfig(norm="batchnorm")
    with pytest.raises(ValueError, match="model preset"):
        gpt.get_config("huge")
    with pytest.raises(ValueError, match="seq_len"):
        gpt.GPT(gpt.get_config("tiny"))(torch.zeros(1, 65, dtype=torch.long))


# ------------------------------------------------------------------------------------ data

@pytest.fixture(scope="module")
def corpus():
    return data.load_corpus()


def test_stdlib_split_disjoint_stable_and_real(corpus):
    assert corpus.split_rule == "path-hash"
    assert set(corpus.train_files).isdisjoint(corpus.val_files)
    assert len(corpus.train_files) > 100 and len(corpus.val_files) > 10
    assert corpus.train.dtype == torch.uint8 and corpus.val.dtype == torch.uint8
    assert corpus.train.numel() > 1_000_000 and corpus.val.numel() > 100_000
    for name in corpus.train_files + corpus.val_files:
        parts = name.split("/")
        assert name.endswith(".py") and not set(parts[:-1]) & data.EXCLUDED_DIRS, name
    # the rule is a pure function of the relative path, recomputed here from hashlib
    for name in corpus.val_files:
        assert int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big") < 0.1 * 2**64
    for name in corpus.train_files[:50]:
        assert int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big") >= 0.1 * 2**64
    # ~10% of files land in validation
    frac = len(corpus.val_files) / (len(corpus.val_files) + len(corpus.train_files))
    assert 0.05 < frac < 0.2
    # the token tensors are the files' bytes in sorted order
    root = data.Path(corpus.source)
    first = (root / corpus.val_files[0]).read_bytes()
    assert bytes(corpus.val[:len(first)].numpy()) == first


def test_batches_deterministic_and_rank_disjoint(corpus):
    batch, seq, seed = 8, 32, 11
    whole = [data.batch_at(corpus.train, s, batch, seq, seed) for s in range(3)]
    again = [x for _, x in zip(range(3), data.batches(corpus.train, batch, seq, seed))]
    for (x1, y1), (x2, y2) in zip(whole, again):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)
        assert x1.shape == (batch, seq) and x1.dtype == torch.int64
        assert torch.equal(x1[:, 1:], y1[:, :-1])  # y is x shifted by one byte
    for world in (2, 4):
        for s in range(3):
            parts = [data.batch_at(corpus.train, s, batch, seq, seed, r, world)
                     for r in range(world)]
            assert torch.equal(torch.cat([p[0] for p in parts]), whole[s][0])
            assert torch.equal(torch.cat([p[1] for p in parts]), whole[s][1])
    # resuming at a step gives that step; other seeds and steps differ
    resumed = next(data.batches(corpus.train, batch, seq, seed, start=2))
    assert torch.equal(resumed[0], whole[2][0])
    assert not torch.equal(whole[0][0], whole[1][0])
    assert not torch.equal(data.batch_at(corpus.train, 0, batch, seq, seed + 1)[0], whole[0][0])
    with pytest.raises(ValueError, match="multiple of world"):
        data.batch_at(corpus.train, 0, 6, seq, seed, 0, 4)
    with pytest.raises(ValueError, match="rank"):
        data.batch_at(corpus.train, 0, 8, seq, seed, 4, 4)


def test_windows_are_slices_of_the_split(corpus):
    x, y = data.batch_at(corpus.train, 5, 4, 16, 0)
    hay = bytes(corpus.train.numpy())
    for row in x:
        assert bytes(row.to(torch.uint8).numpy()) in hay


def test_val_positions_fixed_and_non_overlapping(corpus):
    seq, n = 128, 64
    pos = data.val_positions(corpus.val.numel(), seq, n)
    assert len(pos) == n and pos[0] == 0 and pos[-1] == corpus.val.numel() - seq - 1
    assert (pos[1:] - pos[:-1] >= seq + 1).all()
    assert (pos == data.val_positions(corpus.val.numel(), seq, n)).all()


def test_data_path_directory_and_file(tmp_path):
    gen = torch.Generator().manual_seed(0)
    names = [f"d{i % 3}/f{i}.txt" for i in range(30)]
    for name in names:
        p = tmp_path / name
        p.parent.mkdir(exist_ok=True)
        body = bytes((torch.randint(97, 123, (200,), generator=gen)).tolist())
        p.write_bytes(body + b"\n")
    (tmp_path / "blob.bin").write_bytes(b"\x00\x01\x02" * 10)  # not text: skipped
    (tmp_path / ".hidden").mkdir()
    (tmp_path / ".hidden" / "x.txt").write_text("hidden")     # hidden: skipped
    c = data.load_corpus(str(tmp_path))
    assert c.split_rule == "path-hash"
    assert sorted(c.train_files + c.val_files) == sorted(names)
    assert set(c.train_files).isdisjoint(c.val_files)
    assert c.train.numel() + c.val.numel() == 30 * 201
    assert c.val_files == tuple(n for n in sorted(names) if data.is_validation(n, 0.1))

    single = tmp_path / "d0" / "f0.txt"
    s = data.load_corpus(str(single))
    assert s.split_rule == "tail"
    body = single.read_bytes()
    assert bytes(torch.cat([s.train, s.val]).numpy()) == body
    assert s.val.numel() == round(len(body) * 0.1)
    with pytest.raises(ValueError, match="--data"):
        data.load_corpus(str(tmp_path / "missing"))


def test_eval_loss_matches_direct_computation(corpus):
    model = gpt.GPT(gpt.get_config("tiny"), seed=0)
    model.train()
    seq, n = 32, 10
    got = data.eval_loss(model, corpus.val, seq, n_seqs=n, batch=3)
    assert model.training
    starts = data.val_positions(corpus.val.numel(), seq, n)
    losses = nan_empty(n)
    with torch.no_grad():
        for i, s in enumerate(starts):
            w = corpus.val[s:s + seq + 1].long()
            losses[i] = model.loss(w[None, :-1], w[None, 1:])
    assert torch.isfinite(losses).all()
    assert got == pytest.approx(losses.mean().item(), rel=1e-5)


def test_tiny_model_learns(corpus):
    torch.manual_seed(0)
    model = gpt.GPT(gpt.get_config("tiny"), seed=0)
    opt = torch.optim.AdamW(gpt.param_groups(model, 0.1), lr=3e-3, betas=(0.9, 0.95))
    stream = data.batches(corpus.train, 16, 64, seed=0)
    before = data.eval_loss(model, corpus.val, 64, n_seqs=16)
    for _, (x, y) in zip(range(30), stream):
        loss = model.loss(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    after = data.eval_loss(model, corpus.val, 64, n_seqs=16)
    assert before > 5.0  # ~log(256) = 5.55 at init
    assert after < before - 1.0
