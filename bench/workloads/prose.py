"""A second benchmark corpus: English prose that CPython itself ships, with no download.

Source: ``pydoc_data.topics.topics``, the help text that ``help("assert")`` or
``help("FORMATTING")`` prints -- about 80 chapters of the Python language reference and library
manual (statements, the data model, string formatting, ...), rendered as plain English text.
CPython installs it with every interpreter (``Lib/pydoc_data/topics.py``), so it exists
wherever this project installs, and it is the same on every machine with the same Python
version (466,117 bytes on CPython 3.11.7). Why this text and not the alternatives:

- the standard library's docstrings are the other workload's corpus (:mod:`bench.workloads.data`) in
  other clothes, interleaved with code;
- licence and README files inside ``site-packages`` differ from machine to machine (whatever
  happens to be installed) and are dozens of copies of the same few licences;
- numpy's or torch's shipped text is mostly code and docstrings again.

It is prose, not code: English sentences, reStructuredText-like headings, grammar rules and
short examples -- a different distribution from :mod:`bench.workloads.data`'s Python sources (whose
``pydoc_data/topics.py`` holds the same text as escaped string literals, 0.76 MB of its
~12 MB; the two workloads train separate models, so this does not leak across them).

Deterministic split, without verbatim overlap:

1. topics in sorted key order, each cut into paragraphs at blank lines;
2. a paragraph already seen (the exact text) is dropped: the topics quote each other (``numeric-
   types`` is a section of ``specialnames``), and a quoted section must not sit on both sides;
3. each topic's remaining paragraphs are grouped in order into chunks of at least
   :data:`CHUNK_BYTES` bytes, named ``"<topic>/<index>"``;
4. a chunk is validation when :func:`bench.workloads.data.is_validation` (sha256 of its name) says
   so, at ``val_fraction`` 0.1; each split is its chunks in sorted name order, joined by blank
   lines, UTF-8 encoded into one ``uint8`` tensor (:class:`bench.workloads.data.Corpus`, split rule
   ``"chunk-hash"``).

On CPython 3.11.7 that gives 339 chunks (36 for validation), 329,607 training and 44,467
validation bytes (``python -m bench.workloads.prose``); 0.8% of the validation split's 64-byte
windows occur verbatim in the training split. ``RunConfig(data="pydoc-topics")`` selects it
(:func:`load`).

    python -m bench.workloads.prose          # the split's sizes
"""

from __future__ import annotations

import argparse
import functools

import torch

from bench.workloads.data import Corpus, is_validation, load_corpus

NAME = "pydoc-topics"
"""The value of ``RunConfig.data`` (and ``--data``) that selects this corpus."""
CHUNK_BYTES = 1024
"""A chunk holds whole paragraphs of one topic, at least this many bytes (a topic's last
chunk may be shorter)."""


def paragraphs(topics: dict[str, str]) -> list[tuple[str, list[str]]]:
    """``[(topic, [paragraph, ...]), ...]`` in sorted topic order, every paragraph's exact text
    kept at its first occurrence only (steps 1 and 2 of the module docstring)."""
    seen: set[str] = set()
    out = []
    for key in sorted(topics):
        kept = []
        for para in topics[key].split("\n\n"):
            para = para.strip("\n")
            if para.strip() and para not in seen:
                seen.add(para)
                kept.append(para)
        out.append((key, kept))
    return out


def chunks(topics: dict[str, str], chunk_bytes: int = CHUNK_BYTES) -> dict[str, str]:
    """``{"<topic>/<index>": text}``: each topic's deduplicated paragraphs, grouped in order
    into chunks of at least ``chunk_bytes`` bytes (step 3)."""
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
    out: dict[str, str] = {}
    for key, paras in paragraphs(topics):
        groups: list[list[str]] = [[]]
        size = 0
        for para in paras:
            if size >= chunk_bytes:
                groups.append([])
                size = 0
            groups[-1].append(para)
            size += len(para.encode("utf-8")) + 2
        for i, group in enumerate(g for g in groups if g):
            out[f"{key}/{i:04d}"] = "\n\n".join(group)
    return out


def _tensor(texts: list[str]) -> torch.Tensor:
    data = "\n\n".join(texts).encode("utf-8")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else \
        torch.empty(0, dtype=torch.uint8)


def split(topics: dict[str, str], val_fraction: float = 0.1,
          chunk_bytes: int = CHUNK_BYTES) -> Corpus:
    """The corpus of ``topics`` (any ``{name: text}``), split as the module docstring says."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction!r}")
    parts = chunks(topics, chunk_bytes)
    names = sorted(parts)
    val = [n for n in names if is_validation(n, val_fraction)]
    train = [n for n in names if not is_validation(n, val_fraction)]
    if not val or not train:
        raise ValueError(f"the hash split of {len(names)} chunks left a side empty")
    return Corpus(_tensor([parts[n] for n in train]), _tensor([parts[n] for n in val]),
                  "pydoc_data.topics", tuple(train), tuple(val), "chunk-hash")


@functools.lru_cache(maxsize=2)
def load_prose(val_fraction: float = 0.1) -> Corpus:
    """The ``pydoc_data.topics`` corpus of the running interpreter."""
    from pydoc_data.topics import topics

    return split(dict(topics), val_fraction)


def load(data: str | None) -> Corpus:
    """``RunConfig.data``'s corpus: this one for :data:`NAME`, the torch headers under a BPE
    vocabulary for :data:`bench.workloads.headers.NAME`, else
    :func:`bench.workloads.data.load_corpus` (the standard library, or a path)."""
    from bench.workloads import headers

    if data == NAME:
        return load_prose()
    if data == headers.NAME:
        return headers.load_headers()
    return load_corpus(data)


def main(argv: list[str] | None = None) -> None:
    argparse.ArgumentParser(description="Print the prose corpus's sizes.").parse_args(argv)
    import sys

    corpus = load_prose()
    print(f"python       {sys.version.split()[0]}")
    for key, value in corpus.summary().items():
        print(f"{key:12} {value:,}" if isinstance(value, int) else f"{key:12} {value}")


if __name__ == "__main__":
    main()
