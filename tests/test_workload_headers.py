"""The third workload (:mod:`bench.workloads.headers`): the split, the BPE tokenizer, the cache
and the int16 tokens through the data path and the ``small-bpe`` model. Built on a small tree
of generated headers (the real one takes ~40 s to tokenize)."""

from __future__ import annotations

import math
import random
import threading

import numpy as np
import pytest
import torch

from bench.workloads import headers
from bench.workloads.data import batch_at, eval_loss, is_validation
from bench.workloads.gpt import GPT, get_config
from bench.workloads.prose import load

WORDS = ("tensor", "int64_t", "const", "return", "namespace", "at", "c10", "template",
         "typename", "std::vector", "inline", "void", "size", "dim", "scalar_type", "device")


def _tree(tmp_path, n_files: int = 60, seed: int = 0):
    rng = random.Random(seed)
    root = tmp_path / "include"
    for i in range(n_files):
        d = root / f"lib{i % 4}" / ("detail" if i % 3 else "")
        d.mkdir(parents=True, exist_ok=True)
        lines = [f"// file {i}", "#pragma once"] + [
            " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))) + ";"
            for _ in range(rng.randint(20, 60))]
        (d / f"h{i:03d}.h").write_text("\n".join(lines) + "\n")
    (root / "lib0" / "notes.txt").write_text("not a header\n")
    (root / "lib0" / "bad.h").write_bytes(b"\xff\xfe not utf-8")
    return root


def test_source_texts_reads_headers_only(tmp_path):
    root = _tree(tmp_path)
    texts = headers.source_texts(root)
    assert len(texts) == 60 and all(k.endswith(".h") for k in texts)
    assert "lib0/notes.txt" not in texts and "lib0/bad.h" not in texts
    with pytest.raises(ValueError, match="no .h"):
        headers.source_texts(tmp_path / "empty")


def test_build_splits_by_path_and_tokenizes_deterministically(tmp_path):
    texts = headers.source_texts(_tree(tmp_path))
    a, tok_a = headers.build(texts, vocab_size=300, source="x")
    b, tok_b = headers.build(dict(reversed(list(texts.items()))), vocab_size=300, source="x")
    assert headers.tokenizer_sha256(tok_a) == headers.tokenizer_sha256(tok_b)
    assert torch.equal(a.train, b.train) and torch.equal(a.val, b.val)
    assert a.train.dtype == torch.int16 and a.val.dtype == torch.int16
    assert set(a.val_files) == {n for n in texts if is_validation(n, 0.1)}
    assert not set(a.val_files) & set(a.train_files)
    assert int(a.train.min()) >= 0 and int(a.train.max()) < 300
    # Decoding gives back the validation files, each followed by a newline, in path order.
    decoded = tok_a.decode(a.val.tolist())
    assert decoded == "".join(texts[n] + "\n" for n in sorted(a.val_files))
    # Fewer tokens than bytes: the merges were learned.
    assert a.train.numel() < 0.9 * sum(len(texts[n]) for n in a.train_files)


def test_build_refuses_bad_settings(tmp_path):
    texts = headers.source_texts(_tree(tmp_path))
    with pytest.raises(ValueError, match="vocab_size"):
        headers.build(texts, vocab_size=256)
    with pytest.raises(ValueError, match="val_fraction"):
        headers.build(texts, val_fraction=1.0)
    with pytest.raises(ValueError, match="left a side empty"):
        headers.build({"a.h": "x y z"}, vocab_size=300)


def test_cache_is_built_once_by_concurrent_loaders(tmp_path, monkeypatch):
    root = _tree(tmp_path)
    monkeypatch.setattr(headers, "include_root", lambda: root)
    monkeypatch.setenv("SCAPE_BENCH_CACHE", str(tmp_path / "cache"))
    builds = []
    real_build = headers.build
    monkeypatch.setattr(headers, "build", lambda *a, **k: builds.append(1) or real_build(*a, **k))
    headers.load_headers.cache_clear()
    results: list = [None] * 3
    errors: list = []

    def worker(i: int) -> None:
        try:  # the lru_cache is per process: call the undecorated loader, as ranks would
            results[i] = headers.load_headers.__wrapped__(300)
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and all(not t.is_alive() for t in threads)
    assert len(builds) == 1  # the others read the file the first one wrote
    direct, _ = real_build(headers.source_texts(root), 300, 0.1, str(root))
    for r in results:
        assert torch.equal(r.train, direct.train) and torch.equal(r.val, direct.val)
    assert len(list((tmp_path / "cache").glob("*.pt"))) == 1
    # A changed input is another cache file, not a stale read.
    (root / "lib1" / "new.h").write_text("template <typename T> void f();\n")
    again = headers.load_headers.__wrapped__(300)
    assert len(list((tmp_path / "cache").glob("*.pt"))) == 2
    assert again.train.numel() + again.val.numel() > direct.train.numel() + direct.val.numel()
    headers.load_headers.cache_clear()


def test_run_config_data_name_selects_it(tmp_path, monkeypatch):
    root = _tree(tmp_path)
    monkeypatch.setattr(headers, "include_root", lambda: root)
    monkeypatch.setenv("SCAPE_BENCH_CACHE", str(tmp_path / "cache"))
    headers.load_headers.cache_clear()
    try:
        corpus = load(headers.NAME)
        assert corpus.train.dtype == torch.int16 and corpus.split_rule == "path-hash"
    finally:
        headers.load_headers.cache_clear()


def test_int16_tokens_train_the_small_bpe_model(tmp_path):
    torch.manual_seed(0)
    cfg = get_config("small-bpe")
    assert cfg.vocab_size == headers.VOCAB and not cfg.tie_head
    tokens = torch.randint(0, cfg.vocab_size, (5000,), dtype=torch.int16)
    x, y = batch_at(tokens, step=3, batch=4, seq=32, seed=1, rank=1, world=2)
    assert x.dtype == torch.int64 and x.shape == (2, 32)
    assert torch.equal(x[:, 1:], y[:, :-1])
    model = GPT(cfg, seed=0)
    loss = eval_loss(model, tokens, seq=32, n_seqs=4)
    # An untrained model is near the uniform guess over the vocabulary.
    assert math.isfinite(loss) and abs(loss - math.log(cfg.vocab_size)) < 0.5
    with pytest.raises(TypeError, match="int16"):
        batch_at(tokens.to(torch.int32), 0, 2, 8, 0)
    assert np.isfinite(float(model.loss(x, y).detach()))
