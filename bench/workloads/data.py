"""The benchmark corpus: real text with no download, and a deterministic sampler.

Default source: the ``.py`` files of the running interpreter's standard library
(``sysconfig.get_paths()["stdlib"]``), leaving out ``site-packages`` (third-party code that
differs between machines) and test directories (``test``, ``tests``, ``idle_test``: large,
repetitive fixture code that would dominate the corpus). ``load_corpus(path)`` takes a text
file or a directory instead (every UTF-8 text file under it, hidden entries skipped).

Split: a file goes to validation when the first 8 bytes of ``sha256(relative posix path)``,
read as an integer, fall below ``val_fraction * 2**64``. The rule depends only on the path
relative to the corpus root, so it is the same on every run and machine (Python's ``hash()``
is salted per process and would not be). Within a split, files are concatenated in sorted
path order and byte-tokenised into one ``uint8`` tensor. A single file (or a directory whose
hash split would leave a side empty) is split by position instead: the last ``val_fraction``
of its bytes is validation. ``Corpus.split_rule`` records which rule was used.

``load_packages(names)`` reads the ``.py`` files of installed packages instead (``torch``,
``transformers``, ...; a dotted name takes a subpackage), found at run time through
``importlib`` without importing them; paths are relative to the directory holding the
top-level package (``torch/nn/modules/linear.py``), so the split is the same wherever the
packages are installed, and ``Corpus.record()`` says which files and bytes a run read.

Nothing is cached on disk: reading the ~12 MB stdlib corpus takes well under a second, so a
cache would only add invalidation problems. Within a process, :func:`load_corpus` memoises.

Sampling (:func:`batches`): step ``s`` of a run with seed ``seed`` draws ``batch`` start
offsets uniformly from the train split with ``numpy.random.default_rng((seed, s))``, the
same for every optimizer and every world size. Rank ``r`` of ``world`` takes rows
``[r*batch/world, (r+1)*batch/world)``: disjoint micro-batches whose union is the global
batch. Validation (:func:`val_positions`, :func:`eval_loss`) uses fixed, evenly spaced,
non-overlapping windows of the validation split -- no randomness at all.

    python -m bench.workloads.data [--data PATH]      # corpus sizes
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test",
                           "__pycache__"})
"""Directory names skipped when walking the standard library."""


@dataclasses.dataclass(frozen=True)
class Corpus:
    """Byte-tokenised train and validation splits of one source."""

    train: torch.Tensor
    """Tokens of the training split: uint8 bytes, or int16 ids of a learned vocabulary."""
    val: torch.Tensor
    """Tokens of the validation split (the training split's dtype)."""
    source: str
    """Root the files were read from."""
    train_files: tuple[str, ...]
    """Relative posix paths in the training split (sorted)."""
    val_files: tuple[str, ...]
    """Relative posix paths in the validation split (sorted); same as train for a tail split."""
    split_rule: str
    """``"path-hash"`` or ``"tail"``."""

    def record(self) -> dict[str, object]:
        """:meth:`summary` with the sha256 of each split's bytes (a validation split is the
        same exactly when its digest is)."""
        return {**self.summary(),
                "train_sha256": hashlib.sha256(self.train.numpy().tobytes()).hexdigest(),
                "val_sha256": hashlib.sha256(self.val.numpy().tobytes()).hexdigest()}

    def summary(self) -> dict[str, object]:
        return {"source": self.source, "split_rule": self.split_rule,
                "train_files": len(self.train_files), "val_files": len(self.val_files),
                "train_bytes": int(self.train.numel()), "val_bytes": int(self.val.numel())}


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_validation(rel_path: str, val_fraction: float) -> bool:
    """The stable split rule: sha256 of the relative posix path against the fraction."""
    digest = hashlib.sha256(rel_path.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") < int(val_fraction * 2**64)


def _stdlib_files(root: Path) -> list[Path]:
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in EXCLUDED_DIRS)
        files.extend(Path(dirpath, f) for f in filenames if f.endswith(".py"))
    return files


def _text_files(root: Path) -> list[Path]:
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d != "__pycache__")
        files.extend(Path(dirpath, f) for f in filenames if not f.startswith("."))
    return files


def _read_text(path: Path) -> bytes | None:
    """The file's bytes if it is UTF-8 text without NUL bytes, else None."""
    try:
        data = path.read_bytes()
        data.decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    return None if b"\x00" in data else data


def _to_tensor(chunks: list[bytes]) -> torch.Tensor:
    joined = b"".join(chunks)
    return torch.frombuffer(bytearray(joined), dtype=torch.uint8) if joined else \
        torch.empty(0, dtype=torch.uint8)


@functools.lru_cache(maxsize=4)
def load_corpus(path: str | None = None, val_fraction: float = 0.1) -> Corpus:
    """Read and split the corpus (``path=None``: the standard library's own sources)."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction!r}")
    if path is None:
        root = stdlib_root()
        files = _stdlib_files(root)
    else:
        root = Path(path)
        if root.is_file():
            files = [root]
            root = root.parent
        elif root.is_dir():
            files = _text_files(root)
        else:
            raise ValueError(f"--data must be an existing text file or directory, got {path!r}")
    texts: dict[str, bytes] = {}
    for f in files:
        data = _read_text(f)
        if data:
            texts[f.relative_to(root).as_posix()] = data
    if not texts:
        raise ValueError(f"no UTF-8 text files found under {str(root)!r}")
    names = sorted(texts)
    split = _path_hash_split(texts, val_fraction, str(root))
    if split is not None:
        return split
    tokens = _to_tensor([texts[n] for n in names])
    cut = int(round(tokens.numel() * (1.0 - val_fraction)))
    return Corpus(tokens[:cut].clone(), tokens[cut:].clone(), str(root), tuple(names),
                  tuple(names), "tail")


def package_root(name: str) -> tuple[Path, Path] | None:
    """``(package directory, the directory its paths are relative to)`` of the installed
    package ``name`` (dotted: a subpackage), found without importing it; None when absent."""
    import importlib.util

    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    pkg = Path(next(iter(spec.submodule_search_locations)))
    return pkg, pkg.parents[name.count(".")]


@functools.lru_cache(maxsize=4)
def load_packages(names: tuple[str, ...], val_fraction: float = 0.1) -> Corpus:
    """The ``.py`` files of the installed packages ``names`` (those absent are skipped; none
    found is a ``ValueError``), test directories left out as for the standard library, split by
    :func:`is_validation` of the path relative to the package's parent (``torch/...``)."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction!r}")
    texts: dict[str, bytes] = {}
    roots = []
    for name in names:
        found = package_root(name)
        if found is None:
            continue
        pkg, base = found
        roots.append(str(pkg))
        for f in _stdlib_files(pkg):
            data = _read_text(f)
            if data:
                texts[f.relative_to(base).as_posix()] = data
    if not texts:
        raise ValueError(f"none of the packages {list(names)} is installed with .py sources")
    split = _path_hash_split(texts, val_fraction, " ".join(roots))
    if split is None:
        raise ValueError(f"packages {list(names)}: {len(texts)} files leave a split empty")
    return split


def _path_hash_split(texts: dict[str, bytes], val_fraction: float, source: str
                     ) -> Corpus | None:
    """``texts`` (relative path -> bytes) split by :func:`is_validation` of the path, in path
    order; None when one side would be empty."""
    names = sorted(texts)
    val_names = [n for n in names if is_validation(n, val_fraction)]
    train_names = [n for n in names if not is_validation(n, val_fraction)]
    if not val_names or not train_names:
        return None
    return Corpus(_to_tensor([texts[n] for n in train_names]),
                  _to_tensor([texts[n] for n in val_names]), source,
                  tuple(train_names), tuple(val_names), "path-hash")


TOKEN_DTYPES = (torch.uint8, torch.int16)
"""Token dtypes of a :class:`Corpus`: bytes, or the ids of a learned vocabulary
(:mod:`bench.workloads.headers`)."""


def _check_tokens(tokens: torch.Tensor, seq: int, name: str) -> None:
    if not isinstance(tokens, torch.Tensor) or tokens.dtype not in TOKEN_DTYPES \
            or tokens.ndim != 1:
        raise TypeError(f"{name} must be a 1-D uint8 (bytes) or int16 (token ids) tensor, got "
                        f"{getattr(tokens, 'dtype', type(tokens).__name__)}")
    if tokens.numel() < seq + 1:
        raise ValueError(f"{name} has {tokens.numel()} tokens, need at least seq+1={seq + 1}")


def _windows(tokens: torch.Tensor, starts: np.ndarray, seq: int) -> tuple[torch.Tensor, ...]:
    idx = torch.from_numpy(starts).long()[:, None] + torch.arange(seq + 1)
    rows = tokens[idx].long()
    return rows[:, :-1], rows[:, 1:]


def batch_at(tokens: torch.Tensor, step: int, batch: int, seq: int, seed: int, rank: int = 0,
             world: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s micro-batch ``(x, y)`` (int64 ``[batch/world, seq]``) of global step
    ``step``; ``y`` is ``x`` shifted by one byte."""
    _check_tokens(tokens, seq, "tokens")
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"need 0 <= rank < world, got rank={rank}, world={world}")
    if batch < 1 or batch % world:
        raise ValueError(f"global batch must be a positive multiple of world={world}, "
                         f"got {batch}")
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    rng = np.random.default_rng((int(seed), int(step)))
    starts = rng.integers(0, tokens.numel() - seq, size=batch)
    local = batch // world
    return _windows(tokens, starts[rank * local:(rank + 1) * local], seq)


def batches(tokens: torch.Tensor, batch: int, seq: int, seed: int, rank: int = 0,
            world: int = 1, start: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless stream of :func:`batch_at` for steps ``start, start+1, ...``."""
    step = start
    while True:
        yield batch_at(tokens, step, batch, seq, seed, rank, world)
        step += 1


def val_positions(n_tokens: int, seq: int, n_seqs: int) -> np.ndarray:
    """Start offsets of the fixed validation windows: ``n_seqs`` evenly spaced windows of
    ``seq+1`` bytes (non-overlapping whenever the split holds that many)."""
    if n_seqs < 1:
        raise ValueError(f"n_seqs must be >= 1, got {n_seqs}")
    last = n_tokens - seq - 1
    if last < 0:
        raise ValueError(f"validation split has {n_tokens} tokens, need at least {seq + 1}")
    return np.linspace(0, last, n_seqs).round().astype(np.int64)


@torch.no_grad()
def eval_loss(model: torch.nn.Module, tokens: torch.Tensor, seq: int, n_seqs: int = 64,
              batch: int = 16, device: str | torch.device = "cpu") -> float:
    """Mean next-byte cross-entropy (nats/byte) of ``model`` on the fixed validation windows.

    ``model`` must provide ``loss(x, y)`` (as :class:`bench.workloads.gpt.GPT` does). Every window
    has the same length, so the mean of per-batch means weighted by batch size is exact. The
    model's train/eval mode is restored afterwards; the windows are moved to ``device``.
    """
    _check_tokens(tokens, seq, "tokens")
    starts = val_positions(tokens.numel(), seq, n_seqs)
    was_training = model.training
    model.eval()
    total = 0.0
    try:
        for i in range(0, len(starts), batch):
            x, y = (t.to(device) for t in _windows(tokens, starts[i:i + batch], seq))
            total += float(model.loss(x, y)) * len(x)  # type: ignore[operator]
    finally:
        model.train(was_training)
    return total / len(starts)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Print the corpus sizes.")
    ap.add_argument("--data", default=None, help="text file or directory (default: stdlib)")
    args = ap.parse_args(argv)
    import time

    t0 = time.perf_counter()
    corpus = load_corpus(args.data)
    elapsed = time.perf_counter() - t0
    for key, value in corpus.summary().items():
        print(f"{key:12} {value:,}" if isinstance(value, int) else f"{key:12} {value}")
    print(f"{'load_time_s':12} {elapsed:.2f}")


if __name__ == "__main__":
    main()
