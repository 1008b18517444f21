"""A third benchmark workload, kept apart from the rules' tuning: C++ source under a learned
BPE vocabulary, for data that no default of the library was chosen on.

The two bundled workloads are byte-level models of Python text (:mod:`bench.workloads.data`,
the standard library; :mod:`bench.workloads.prose`, ``pydoc_data``'s help text). This one
differs in the three ways a user's run would:

- **another language**: the C++ headers the installed ``torch`` wheel ships
  (``torch/include/**/*.h``, ``.hpp``, ``.cuh``: ATen, c10, the CUDA and XPU interfaces and
  their vendored libraries; ~9,400 files, ~39 MB for torch 2.13), present wherever the
  project installs and pinned by the torch version. No English prose of that size is
  available offline here (the interpreter's help text is the second workload already);
- **a learned tokenization**: a byte-level BPE of :data:`VOCAB` tokens trained with the
  ``tokenizers`` library on the training split only, so the token embedding has rows that
  most batches do not touch (a byte vocabulary touches nearly all 256 every step);
- **an untied output head** (the ``small-bpe`` preset of :mod:`bench.workloads.gpt`).

Split: each file is validation when :func:`bench.workloads.data.is_validation` (sha256 of
its path under ``torch/include``) says so, at ``val_fraction`` 0.1; each split is its files
in path order, each file's tokens followed by one newline token. Tokens are ``int16``.

Tokenizing takes about 35 s on 2 cores, so the result is kept in a cache file
(``$SCAPE_BENCH_CACHE`` or ``~/.cache/scape-bench``) named by a sha256 of everything it
depends on (the files' paths and bytes, :data:`VOCAB`, the split fraction, the
``tokenizers`` version); concurrent ranks wait on a file lock while the first one builds
it. :meth:`~bench.workloads.data.Corpus.record` gives each split's sha256, and
:func:`tokenizer_sha256` the vocabulary's, to compare machines.

    python -m bench.workloads.headers        # sizes, digests, a decoded sample
"""

from __future__ import annotations

import argparse
import fcntl
import functools
import hashlib
import os
from pathlib import Path
from typing import Any

import torch

from bench.workloads.data import Corpus, is_validation

NAME = "torch-headers-bpe"
"""The value of ``RunConfig.data`` (and ``--data``) that selects this corpus."""
VOCAB = 2048
"""Tokens in the BPE vocabulary (256 byte tokens and 1,792 merges); the ``small-bpe`` preset's
``vocab_size``."""
SUFFIXES = (".h", ".hpp", ".cuh")
"""The files read under ``torch/include``."""
CACHE_VERSION = 1
"""Bumped when the cache file's layout or the tokenization's recipe changes."""


def include_root() -> Path:
    """``torch/include`` of the installed torch."""
    return Path(torch.__file__).parent / "include"


def source_texts(root: Path | None = None) -> dict[str, str]:
    """``{path relative to root: text}`` of every :data:`SUFFIXES` file under ``root``
    (default :func:`include_root`) that is UTF-8 without NUL bytes; ValueError when none."""
    root = include_root() if root is None else Path(root)
    texts: dict[str, str] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            if not name.endswith(SUFFIXES):
                continue
            path = Path(dirpath, name)
            try:
                data = path.read_bytes()
                text = data.decode("utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            if text and b"\x00" not in data:
                texts[path.relative_to(root).as_posix()] = text
    if not texts:
        raise ValueError(f"no {'/'.join(SUFFIXES)} UTF-8 files under {str(root)!r}")
    return texts


def train_tokenizer(texts: list[str], vocab_size: int = VOCAB) -> Any:
    """A byte-level BPE (``tokenizers``) of ``vocab_size`` tokens trained on ``texts``: the 256
    byte tokens first, so any text encodes; deterministic for the same texts and version."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 257 or vocab_size > 32767:
        raise ValueError(f"vocab_size must be in [257, 32767] (int16 token ids), "
                         f"got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=[])
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def tokenizer_sha256(tok: Any) -> str:
    """sha256 of the tokenizer's JSON form (its vocabulary and merges)."""
    return hashlib.sha256(tok.to_str().encode("utf-8")).hexdigest()


def encode(tok: Any, texts: list[str]) -> torch.Tensor:
    """The texts' token ids, in order, each text followed by the newline's token, as one
    ``int16`` tensor."""
    newline = tok.encode("\n").ids
    ids: list[int] = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)
        ids.extend(newline)
    return torch.tensor(ids, dtype=torch.int16)


def build(texts: dict[str, str], vocab_size: int = VOCAB, val_fraction: float = 0.1,
          source: str = "") -> tuple[Corpus, Any]:
    """``(corpus, tokenizer)`` of ``texts`` split as the module docstring says; the tokenizer
    sees the training split only."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction!r}")
    names = sorted(texts)
    val = [n for n in names if is_validation(n, val_fraction)]
    train = [n for n in names if not is_validation(n, val_fraction)]
    if not val or not train:
        raise ValueError(f"the path-hash split of {len(names)} files left a side empty")
    tok = train_tokenizer([texts[n] for n in train], vocab_size)
    return Corpus(encode(tok, [texts[n] for n in train]), encode(tok, [texts[n] for n in val]),
                  source, tuple(train), tuple(val), "path-hash"), tok


def _cache_dir() -> Path:
    return Path(os.environ.get("SCAPE_BENCH_CACHE") or Path.home() / ".cache" / "scape-bench")


def _key(texts: dict[str, str], vocab_size: int, val_fraction: float) -> str:
    import tokenizers

    h = hashlib.sha256(f"v{CACHE_VERSION};{vocab_size};{val_fraction!r};"
                       f"{tokenizers.__version__};".encode())
    for name in sorted(texts):
        data = texts[name].encode("utf-8")
        h.update(f"{name}:{len(data)};".encode())
        h.update(data)
    return h.hexdigest()


def _load_cached(vocab_size: int, val_fraction: float) -> tuple[dict[str, Any], Path]:
    """``(the cache file's contents, the root read)`` for the installed torch's headers: the
    file is built and written atomically, one process at a time, when it does not hold this
    exact input."""
    root = include_root()
    texts = source_texts(root)
    key = _key(texts, vocab_size, val_fraction)
    cache = _cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    path = cache / f"{NAME}-{key[:24]}.pt"
    with open(cache / f"{NAME}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the other ranks wait while the first builds it
        try:
            if not path.exists():
                corpus, tok = build(texts, vocab_size, val_fraction, str(root))
                tmp = path.with_suffix(f".tmp{os.getpid()}")
                torch.save({"key": key, "train": corpus.train, "val": corpus.val,
                            "train_files": list(corpus.train_files),
                            "val_files": list(corpus.val_files),
                            "tokenizer": tok.to_str()}, tmp)
                os.replace(tmp, path)
            saved = torch.load(path, weights_only=True)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    if saved.get("key") != key:
        raise ValueError(f"cache file {path} holds another input; delete it")
    return saved, root


def _corpus(saved: dict[str, Any], root: Path) -> Corpus:
    return Corpus(saved["train"], saved["val"], str(root), tuple(saved["train_files"]),
                  tuple(saved["val_files"]), "path-hash")


@functools.lru_cache(maxsize=2)
def load_headers(vocab_size: int = VOCAB, val_fraction: float = 0.1) -> Corpus:
    """The corpus of the installed torch's headers, from the cache file when it holds this
    exact input (built and written atomically otherwise, one process at a time)."""
    return _corpus(*_load_cached(vocab_size, val_fraction))


def load_tokenizer(vocab_size: int = VOCAB, val_fraction: float = 0.1) -> Any:
    """The tokenizer :func:`load_headers` used (from its cache file)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_str(_load_cached(vocab_size, val_fraction)[0]["tokenizer"])


def main(argv: list[str] | None = None) -> None:
    argparse.ArgumentParser(description="Print the header corpus's sizes and digests."
                            ).parse_args(argv)
    import time

    import tokenizers
    from tokenizers import Tokenizer

    t0 = time.perf_counter()
    saved, root = _load_cached(VOCAB, 0.1)
    elapsed = time.perf_counter() - t0
    corpus, tok = _corpus(saved, root), Tokenizer.from_str(saved["tokenizer"])
    print(f"torch        {torch.__version__}")
    print(f"tokenizers   {tokenizers.__version__}")
    for key, value in corpus.record().items():
        print(f"{key:12} {value:,}" if isinstance(value, int) else f"{key:12} {value}")
    text_bytes = sum(len(t.encode()) for t in source_texts(root).values())
    tokens = corpus.train.numel() + corpus.val.numel()
    print(f"{'bytes/token':12} {text_bytes / tokens:.2f}")
    print(f"{'vocab_sha256':12} {tokenizer_sha256(tok)}")
    print(f"{'load_time_s':12} {elapsed:.1f}")
    print("sample:", repr(tok.decode(corpus.val[:40].tolist())))


if __name__ == "__main__":
    main()
