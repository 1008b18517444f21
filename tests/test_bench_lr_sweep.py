"""The learning-rate sweep's pieces: the prose corpus, the Llama-style model, the choice of
each optimizer's best lr, and the CLI's smoke."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

import bench.research  # noqa: F401 (registers the research rules and rows named below)
from bench.engine.rows import resolve
from bench.engine.runner import RunConfig
from bench.lr_sweep import COMMON, WORKLOADS, make_config
from bench.lr_sweep_report import curves, markdown, select_best
from bench.workloads.llama import (
    PRESETS,
    Llama,
    LlamaConfig,
    apply_rotary,
    make_model,
    rotary_tables,
)
from bench.workloads.prose import NAME, chunks, load, load_prose, paragraphs, split

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def row(name: str, **fields) -> str:
    """A row as ``--optimizers`` takes it when it is not in the table: JSON."""
    return json.dumps({"name": name, **fields})


# --------------------------------------------------------------------------- the corpus
def test_prose_corpus_is_deterministic_and_non_empty():
    from pydoc_data.topics import topics

    a = load_prose()
    b = split(dict(topics))  # built again, not the cached object
    assert a.split_rule == "chunk-hash" and load(NAME) is a
    assert torch.equal(a.train, b.train) and torch.equal(a.val, b.val)
    assert a.train_files == b.train_files and a.val_files == b.val_files
    assert a.train.numel() > 200_000 and a.val.numel() > 128 * 129  # the eval windows fit
    assert 0.05 < a.val.numel() / (a.train.numel() + a.val.numel()) < 0.2
    assert list(a.train_files) == sorted(a.train_files)
    text = bytes(a.train[:2000].tolist()).decode("utf-8", errors="replace")
    assert sum(c.isalpha() for c in text) > 0.6 * len(text)  # prose, mostly letters
    assert load(None).split_rule == "path-hash"  # anything else is bench.workloads.data's


def test_prose_splits_are_disjoint():
    from pydoc_data.topics import topics

    corpus = load_prose()
    assert not set(corpus.train_files) & set(corpus.val_files)
    parts = chunks(dict(topics))
    assert set(parts) == set(corpus.train_files) | set(corpus.val_files)
    train = {p for n in corpus.train_files for p in parts[n].split("\n\n")}
    val = {p for n in corpus.val_files for p in parts[n].split("\n\n")}
    assert not {p for p in train & val if len(p) > 40}  # no paragraph on both sides


def test_prose_drops_quoted_paragraphs_and_keeps_order():
    topics = {"b": "one\n\ntwo\n\nthree", "a": "two\n\nfour", "c": "\n\n"}
    assert paragraphs(topics) == [("a", ["two", "four"]), ("b", ["one", "three"]), ("c", [])]
    parts = chunks({"t": "x" * 10 + "\n\n" + "y" * 10 + "\n\n" + "z"}, chunk_bytes=13)
    assert parts == {"t/0000": "x" * 10 + "\n\n" + "y" * 10, "t/0001": "z"}


# --------------------------------------------------------------------------- the model
def _tiny(seed: int = 0) -> Llama:
    return Llama(PRESETS["llama-tiny"], seed=seed)


def test_llama_shapes_backward_and_determinism():
    model = _tiny()
    x = torch.randint(0, 256, (3, 40), generator=torch.Generator().manual_seed(0))
    assert model(x).shape == (3, 40, 256)
    loss = model.loss(x, x)
    assert abs(float(loss.detach()) - math.log(256)) < 0.2  # near uniform at initialisation
    loss.backward()
    assert all(p.grad is not None and p.grad.shape == p.shape for p in model.parameters())
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), _tiny().parameters()))
    assert not torch.equal(model.head.weight, _tiny(seed=1).head.weight)
    assert not any(n.endswith("bias") for n, _ in model.named_parameters())
    with pytest.raises(ValueError, match="seq_len"):
        model(torch.zeros(1, 65, dtype=torch.long))


def test_llama_small_size_and_the_model_registry():
    from bench.engine.run_config import RunConfig
    from bench.workloads.gpt import GPT, num_params

    assert num_params(make_model("llama-small")) == 1_252_992
    assert isinstance(make_model("tiny"), GPT)
    assert RunConfig(model="llama-small").seq_len == 128
    with pytest.raises(ValueError, match="even"):
        LlamaConfig(d_model=12, n_heads=4)


def test_the_head_is_untied():
    model = _tiny()
    assert model.head.weight.data_ptr() != model.tok_emb.weight.data_ptr()
    names = dict(model.named_parameters())
    assert "head.weight" in names and "tok_emb.weight" in names
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    model.loss(x, x).backward()
    before = model.tok_emb.weight.detach().clone()
    with torch.no_grad():
        model.head.weight.add_(1.0)
    assert torch.equal(model.tok_emb.weight, before)  # changing one leaves the other


def test_rmsnorm_invariants():
    block = _tiny().blocks[0]
    x = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(2))
    y = block.attn_norm(x)
    assert torch.allclose(y.pow(2).mean(-1), torch.ones(2, 5), atol=1e-4)  # unit rms
    assert torch.allclose(block.attn_norm(7.5 * x), y, atol=1e-5)  # scale invariant
    assert [n for n, _ in block.attn_norm.named_parameters()] == ["weight"]  # no shift


def test_rotary_preserves_norms_and_sees_only_relative_positions():
    cos, sin = rotary_tables(32, 16)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 32, 16, generator=gen)
    rx = apply_rotary(x, cos, sin)
    assert torch.allclose(rx.norm(dim=-1), x.norm(dim=-1), atol=1e-5)
    assert torch.allclose(rx[..., 0, :], x[..., 0, :])  # position 0: no turn
    q, k = torch.randn(16, generator=gen), torch.randn(16, generator=gen)

    def score(i: int, j: int) -> float:
        rq = apply_rotary(q.expand(32, 16), cos, sin)[i]
        rk = apply_rotary(k.expand(32, 16), cos, sin)[j]
        return float(rq @ rk)

    for i, j, shift in ((5, 2, 7), (9, 9, 20), (3, 0, 11)):
        assert score(i, j) == pytest.approx(score(i + shift, j + shift), abs=1e-4)
    assert abs(score(5, 2) - score(5, 4)) > 1e-3  # the offset does matter


def test_attention_is_shift_equivariant_through_rotary_only():
    """A window of a sequence sees the same attention output whatever its absolute start,
    once the causal context is the same: the model has no absolute position anywhere."""
    model = _tiny().eval()
    x = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert torch.allclose(model(x), model(x.clone()), atol=0)
        # one block applied to the same 8 inputs, rotated as positions 0..7 or 0..7 again
        h = model.tok_emb(x[:, :8])
        out_a = model.blocks[0](h, model.rope_cos, model.rope_sin)
        out_b = model.blocks[0](h, model.rope_cos[5:], model.rope_sin[5:])
    assert torch.allclose(out_a, out_b, atol=1e-5)  # every position moved by 5: no change


# --------------------------------------------------------------------------- the choice
def _run(workload, optimizer, lr, loss, seed=0, steps=600):
    return {"workload": workload, "optimizer": optimizer, "steps": steps, "lr": lr,
            "seed": seed, "final_val_loss": loss}


def test_each_optimizer_gets_its_own_argmin():
    runs = [_run("w", "adams", 3e-4, 2.2), _run("w", "adams", 1e-3, 2.0),
            _run("w", "adams", 3e-3, 2.5),
            _run("w", "scape-0.99", 3e-4, 2.3), _run("w", "scape-0.99", 1e-3, 2.4),
            _run("w", "scape-0.99", 3e-3, float("nan")),
            _run("w", "topk-0.99", 3e-4, None), _run("w", "topk-0.99", 1e-3, None),
            _run("w", "topk-0.99", 3e-3, 3.0)]
    rows = {r["optimizer"]: r for r in select_best(runs)}
    assert rows["adams"]["best_lr"] == 1e-3 and rows["adams"]["best_loss"] == 2.0
    assert not rows["adams"]["at_edge"]
    assert rows["scape-0.99"]["best_lr"] == 3e-4 and rows["scape-0.99"]["at_edge"]
    assert rows["scape-0.99"]["loss_by_lr"]["0.003"] is None  # diverged, never the best
    assert rows["scape-0.99"]["ratio_of_bests"] == pytest.approx(2.3 / 2.0)
    assert rows["scape-0.99"]["ratio_at_ref_lr"] == pytest.approx(2.4 / 2.0)
    assert rows["topk-0.99"]["best_lr"] == 3e-3 and rows["topk-0.99"]["ratio_at_ref_lr"] is None
    assert rows["adams"]["ratio_of_bests"] == 1.0
    md = markdown(list(rows.values()))
    assert "**2.3000**" in md and "diverged" in md and "| 0.0003* |" in md


def test_seeds_are_averaged_and_ratios_pair_workload_and_length():
    runs = [_run("w", "adams", 1e-3, 2.0, seed=0), _run("w", "adams", 1e-3, 2.2, seed=1),
            _run("w", "adams", 3e-3, 2.05, seed=0), _run("w", "adams", 3e-3, 2.25, seed=1),
            _run("w", "scape-0.9", 1e-3, 2.1, seed=0), _run("w", "scape-0.9", 1e-3, 2.3, seed=1),
            _run("w", "adams", 1e-3, 1.5, steps=2000), _run("w", "scape-0.9", 1e-3, 1.6,
                                                                steps=2000),
            _run("v", "adams", 1e-3, 1.0), _run("v", "scape-0.9", 1e-3, 1.2)]
    rows = select_best(runs)
    w600 = {r["optimizer"]: r for r in rows if r["workload"] == "w" and r["steps"] == 600}
    assert w600["adams"]["best_lr"] == 1e-3  # mean 2.1 against 2.15
    assert w600["adams"]["best_loss"] == pytest.approx(2.1)
    assert w600["adams"]["spread"] == pytest.approx(0.2) and w600["adams"]["seeds"] == 2
    assert w600["scape-0.9"]["ratio_of_bests"] == pytest.approx(2.2 / 2.1)
    assert curves(rows) == {("w", "scape-0.9"): [(600, pytest.approx(2.2 / 2.1)),
                                                 (2000, pytest.approx(1.6 / 1.5))],
                            ("v", "scape-0.9"): [(600, pytest.approx(1.2))]}


# --------------------------------------------------------------------------- the CLI
@pytest.mark.timeout(300)
def test_smoke_cli_writes_the_report_and_resumes(tmp_path):
    out = tmp_path / "sweep.json"
    cmd = [sys.executable, "-m", "bench.lr_sweep", "--smoke", "--workloads", "llama",
           "--out", str(out)]
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, timeout=280, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "ETA" in proc.stdout
    report = json.loads(out.read_text())
    assert report["schema"] == "scape.lr_sweep/1" and report["complete"]
    assert report["environment"]["torch"] == torch.__version__
    assert len(report["runs"]) == 4 and (tmp_path / "sweep.png").exists()
    for r in report["runs"]:
        assert r["ranks_agree"] and 0 < r["final_val_loss"] < 7
        assert r["val_curve"][-1] == [6, r["final_val_loss"]]
        assert r["params"] == 133_440
    best = {b["optimizer"]: b for b in report["best"]}
    assert set(best) == {"adams", "scape-0.99"}
    for b in best.values():
        losses = [r["final_val_loss"] for r in report["runs"] if r["optimizer"] == b["optimizer"]]
        assert b["best_loss"] == min(losses)
    assert report["table_md"] in proc.stdout
    again = subprocess.run(cmd + ["--resume"], cwd=ROOT, env=env, timeout=120,
                           capture_output=True, text=True)
    assert again.returncode == 0 and "4 runs (4 kept" in again.stdout, again.stdout[-2000:]
    assert json.loads(out.read_text())["best"] == report["best"]


def test_warmup_steps_reach_the_sparse_rows_only():
    common = dict(COMMON, warmup_steps=4)
    wl = WORKLOADS["gpt"]
    assert make_config(wl, common, "scape-0.99", 600, 3e-4, 0, "x", 60.0) \
        .optimizer_kwargs == {"warmup_steps": 4}
    assert make_config(wl, common, "adams", 600, 3e-4, 0, "x", 60.0).optimizer_kwargs == {}
    assert make_config(wl, COMMON, "scape-0.99", 600, 3e-4, 0, "x", 60.0) \
        .optimizer_kwargs == {}
    proc = subprocess.run([sys.executable, "-m", "bench.lr_sweep", "--smoke", "--out", "x.json",
                           "--warmup-steps", "0"], cwd=ROOT, timeout=60, capture_output=True,
                          text=True, env=dict(os.environ, PYTHONPATH=ROOT))
    assert proc.returncode == 2 and "--warmup-steps must be >= 1" in proc.stderr


def test_a_rule_reaches_scape_rows_and_bad_ones_are_refused():
    wl = WORKLOADS["llama"]
    early = row("scape-0.9-early", optimizer="scape", sparsity=0.9,
                optimizer_kwargs={"update": "early"})
    cfg = make_config(wl, dict(COMMON, warmup_steps=2), early, 600, 3e-4, 0, "x", 60.0)
    assert (cfg.optimizer, cfg.sparsity) == ("scape", 0.9)
    assert cfg.optimizer_kwargs == {"warmup_steps": 2, "update": "early"}
    cfg = make_config(wl, COMMON, "scape-0.99@robust", 600, 3e-4, 0, "x", 60.0)
    assert (cfg.sparsity, cfg.optimizer_kwargs) == (0.99, {"update": "robust",
                                                          "warmup_steps": 20})
    nope = row("scape-0.99-nope", optimizer="scape", sparsity=0.99,
               optimizer_kwargs={"update": "nope"})
    with pytest.raises(ValueError, match="unknown rule 'nope'.*auto"):
        resolve(nope)
    proc = subprocess.run([sys.executable, "-m", "bench.lr_sweep", "--smoke", "--out", "x.json",
                           "--optimizers", "adams", nope], cwd=ROOT, timeout=60,
                          capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=ROOT))
    assert proc.returncode == 2 and "unknown rule 'nope'" in proc.stderr


def test_group_rows_split_the_one_group_and_keep_their_decay():
    from bench.engine.run_rank import make_groups

    split = row("split", optimizer="scape", sparsity=0.99,
                group_sparsity={"embed": 0.9, "head": 0.97})
    cfg = make_config(WORKLOADS["llama"], COMMON, split, 600, 3e-4, 0, "x", 60.0)
    assert cfg.group_sparsity == {"embed": 0.9, "head": 0.97} and cfg.one_group
    model = make_model("llama-tiny", seed=3)
    groups = make_groups(model, cfg)
    ids = [id(p) for g in groups for p in g["params"]]
    assert sorted(ids) == sorted(id(p) for p in model.parameters())  # each once, none lost
    assert all(g["weight_decay"] == COMMON["weight_decay"] for g in groups)
    by_sparsity = {g.get("sparsity"): g["params"] for g in groups}
    assert [p is model.tok_emb.weight for p in by_sparsity[0.9]] == [True]
    assert [p is model.head.weight for p in by_sparsity[0.97]] == [True]
    one = make_groups(model, make_config(WORKLOADS["llama"], COMMON, "scape-0.99", 600, 3e-4, 0,
                                         "x", 60.0))
    assert len(one) == 1 and "sparsity" not in one[0]
    for fields, match in [
            ({"optimizer": "adams", "group_sparsity": {"embed": 0.9}}, "group_sparsity applies"),
            ({"optimizer": "scape", "group_sparsity": {"embed": 1.5}}, "embed"),
            ({"optimizer": "topk", "group_sparsity": {"head": 0.9}}, "group_sparsity applies"),
            ({"optimizer": "scape", "sparsity_ramp": [1.5, 20]}, "Invalid sparsity: 1.5"),
            ({"optimizer": "topk", "sparsity_ramp": [0.5, 2]}, "applies to scape rows")]:
        with pytest.raises(ValueError, match=match):
            make_config(WORKLOADS["llama"], COMMON, row("bad", sparsity=0.99, **fields), 600,
                        3e-4, 0, "x", 60.0)


@pytest.fixture(scope="module")
def smoke_rows(tmp_path_factory) -> dict:
    """One smoke sweep of the plain row beside its ramp, follow and drift rows (JSON rows),
    by row name (the last two are the research's hooks: the sweep runs under ``python -m
    bench.research``)."""
    out = tmp_path_factory.mktemp("rows") / "s.json"
    plain = {"optimizer": "scape", "sparsity": 0.9}
    proc = subprocess.run([sys.executable, "-m", "bench.research", "bench.lr_sweep", "--smoke",
                           "--out", str(out),
                           "--workloads", "gpt", "--optimizers", "adams", "scape-0.9",
                           row("scape-0.9-ramp0.5x2", **plain, sparsity_ramp=[0.5, 2]),
                           row("scape-0.9-follow1", **plain,
                               hooks={"bench.research.follow:Hook": {"q": 1.0}}),
                           row("scape-0.9-drift", **plain,
                               hooks={"bench.research.drift:hook": {}}),
                           "--lrs", "1e-3"],
                          cwd=ROOT, timeout=300, capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=ROOT))
    assert proc.returncode == 0, proc.stderr[-2000:]
    return {r["optimizer"]: r for r in json.loads(out.read_text())["runs"]}


def test_a_ramp_row_writes_the_sparsity_before_each_sparse_step(smoke_rows):
    """A row's ``sparsity_ramp`` reaches ``RunConfig.sparsity_ramp``; a run of it sends more
    bytes on its first sparse steps than later, and the same as the plain row once the ramp is
    over."""
    cfg = make_config(WORKLOADS["gpt"], dict(COMMON, warmup_steps=2),
                      row("r", optimizer="scape", sparsity=0.99, sparsity_ramp=[0.5, 3],
                          optimizer_kwargs={"update": "robust"}), 600, 3e-4, 0, "x", 60.0)
    assert cfg.sparsity_ramp == (0.5, 3) and cfg.optimizer_kwargs["update"] == "robust"
    plain, ramp = smoke_rows["scape-0.9"], smoke_rows["scape-0.9-ramp0.5x2"]
    assert ramp["dense_steps"] == plain["dense_steps"] == 2
    assert ramp["bytes_per_step"] == plain["bytes_per_step"]  # after the ramp: the same
    assert ramp["bytes_per_step_mean_all_steps"] > plain["bytes_per_step_mean_all_steps"]
    assert ramp["final_val_loss"] != plain["final_val_loss"]


@pytest.mark.parametrize("q", [0.5, 1.0, 2.0])
def test_a_follow_row_spends_the_same_bytes_while_the_lr_is_high(q):
    """A follow row (the research's hook, :mod:`bench.research.follow`) reaches
    ``RunConfig.hooks``; the density after the ramp follows ``(lr / peak)^q`` (largest at the
    peak, falling with the cosine) and its mean over those steps is the row's own."""
    from bench.engine.run_config import lr_at
    from bench.research.follow import follow_density, follow_mean  # registers the research

    hooks = {"bench.research.follow:Hook": {"q": q}}
    follow = row(f"scape-0.99-ramp0.5x20-follow{q:g}@early", optimizer="scape", sparsity=0.99,
                 optimizer_kwargs={"update": "early"}, sparsity_ramp=[0.5, 20], hooks=hooks)
    cfg = make_config(WORKLOADS["gpt"], dict(COMMON, warmup_steps=1), follow, 2000, 7e-4, 0,
                      "x", 60.0)
    assert cfg.hooks == hooks and cfg.sparsity_ramp == (0.5, 20)
    mean = follow_mean(cfg, q)
    first = cfg.warmup_steps + 20  # the first step the schedule sends: masks made one before
    dens = [1.0 - follow_density(t - 1, cfg, 0.99, mean, q) for t in range(first, cfg.steps)]
    assert sum(dens) / len(dens) == pytest.approx(0.01, rel=1e-9)
    lrs = [lr_at(t, cfg) for t in range(first, cfg.steps)]
    peak = lrs.index(max(lrs))
    assert max(dens) == dens[peak] > 0.01 > dens[-1] > 0.0
    assert all(a >= b for a, b in zip(dens[peak:], dens[peak + 1:]))  # the cosine: falling
    with pytest.raises(ValueError, match="density"):
        follow_density(first + peak - 1, cfg, 0.1, mean, q)  # more than every coordinate
    with pytest.raises(ValueError, match="follow applies to scape rows"):
        RunConfig(optimizer="adams", hooks=hooks)
    with pytest.raises(ValueError, match=r"power in \(0, 4\]"):
        RunConfig(hooks={"bench.research.follow:Hook": {"q": 0.0}})
    with pytest.raises(ValueError, match="turn dense at the peak lr"):
        RunConfig(sparsity=0.3, hooks=hooks, steps=200,
                  optimizer_kwargs={"warmup_steps": 20})  # a borderline case at 20 dense steps
    # with the research loaded its rows (by name) and rules pass too
    assert resolve("scape-0.99-ramp0.5x20-follow1@early")[1]["hooks"] == {
        "bench.research.follow:Hook": {"q": 1.0}}
    assert resolve("scape-0.9@catchup_agree_trust2_accum")[1]["optimizer_kwargs"] == {
        "update": "catchup_agree_trust2_accum"}


def test_a_follow_row_reaches_the_ranks(smoke_rows):
    """A run of ``-follow1`` writes the schedule into the groups: it trains differently from
    the plain row, its median step sends other bytes, and about the same on the mean."""
    plain, follow = smoke_rows["scape-0.9"], smoke_rows["scape-0.9-follow1"]
    assert follow["dense_steps"] == plain["dense_steps"]
    assert follow["final_val_loss"] != plain["final_val_loss"]
    assert follow["bytes_per_step"] != plain["bytes_per_step"]
    ratio = follow["bytes_per_step_mean_all_steps"] / plain["bytes_per_step_mean_all_steps"]
    assert 0.9 < ratio < 1.1, ratio


def test_a_drift_row_reaches_the_ranks(smoke_rows):
    """``-drift`` (:mod:`bench.research.drift`): the same bytes as the plain row, another
    model, the same on every rank."""
    plain, drift = smoke_rows["scape-0.9"], smoke_rows["scape-0.9-drift"]
    assert drift["bytes_per_step_mean_all_steps"] == plain["bytes_per_step_mean_all_steps"]
    assert drift["final_val_loss"] != plain["final_val_loss"]
    assert drift["ranks_agree"] and plain["ranks_agree"]
    with pytest.raises(ValueError, match="drift applies to scape rows"):
        RunConfig(optimizer="adams", hooks={"bench.research.drift:hook": {}})
