"""Argument validation and backend dispatch shared by every public op.

Validation raises ``TypeError`` (wrong kind of object or dtype) or ``ValueError`` (wrong
value, shape, layout or device) naming the argument, what was expected and what was got.
It never reads tensor contents, so it never synchronises with a GPU.

Which implementation an op runs is one module-level setting (:func:`set_backend`), read from
``SCAPE_KERNELS`` once, when the package is imported; an op's dispatch compares it, and
``TRITON_INTERPRET`` as read at the same import, and parses nothing.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator, Mapping

import torch

from ._triton import HAVE_TRITON, MISSING

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MIN_BLOCK_SIZE = 256
MAX_BLOCK_SIZE = 32768

BACKENDS = ("auto", "torch", "triton", "compile")
"""The kernel backends :func:`set_backend` takes."""
ENV = "SCAPE_KERNELS"
"""The environment variable that gives the backend at import (unset or empty: ``auto``)."""


def _backend_name(name: object, where: str) -> str:
    if not isinstance(name, str):
        raise TypeError(f"{where} must be a str, one of {BACKENDS}; got {type(name).__name__}")
    mode = name.strip().lower()
    if mode not in BACKENDS:
        raise ValueError(f"{where} must be 'auto', 'triton', 'torch' or 'compile'; got "
                         f"{name!r}")
    return mode


def backend_from_env(environ: Mapping[str, str]) -> str:
    """The backend ``SCAPE_KERNELS`` names in ``environ`` (unset or empty: ``auto``);
    ``ValueError`` naming the variable and its value for anything else."""
    return _backend_name(environ.get(ENV, "").strip() or "auto", ENV)


_backend = backend_from_env(os.environ)
_interpret_env = os.environ.get("TRITON_INTERPRET")
INTERPRETED = _interpret_env == "1"
"""Whether Triton runs its kernels in the interpreter (``TRITON_INTERPRET=1`` when imported:
Triton reads it then too), which is what lets it run on CPU tensors."""


def get_backend() -> str:
    """The kernel backend in force: ``auto``, ``torch``, ``triton`` or ``compile``."""
    return _backend


def set_backend(name: str) -> str:
    """Choose the implementation every op runs, from the next call on, in this process;
    return the previous choice (to restore it).

    ``auto`` (the default): Triton for CUDA tensors, torch for CPU tensors (and for CUDA
    tensors where Triton is not installed). ``torch`` or ``triton`` forces one: Triton on CPU
    tensors works only through the interpreter (``TRITON_INTERPRET=1`` set before triton is
    imported), and an op raises ``RuntimeError`` saying so, or what to install, when it cannot
    run. ``compile`` dispatches as ``auto`` and runs the ops that have a ``torch.compile``
    form on CPU tensors through it (:func:`use_compiled`). The initial value comes from
    ``SCAPE_KERNELS``. Raises ``ValueError`` for another name, ``TypeError`` for a non-str.
    """
    global _backend
    mode = _backend_name(name, "set_backend(name)")
    previous, _backend = _backend, mode
    return previous


@contextlib.contextmanager
def backend(name: str) -> Iterator[str]:
    """:func:`set_backend` for the ``with`` block, then the previous backend again."""
    previous = set_backend(name)
    try:
        yield get_backend()
    finally:
        set_backend(previous)


def use_triton(t: torch.Tensor) -> bool:
    """Whether an op on ``t`` runs its Triton kernel under the backend in force
    (:func:`set_backend`); ``RuntimeError`` when it is forced to and cannot."""
    mode = _backend
    if mode == "auto" or mode == "compile":
        return t.is_cuda and HAVE_TRITON
    if mode == "torch":
        return False
    if not HAVE_TRITON:
        raise RuntimeError(f"kernel backend 'triton' (set_backend or {ENV}): {MISSING}")
    if not t.is_cuda and not INTERPRETED:
        raise RuntimeError(
            f"kernel backend 'triton' (set_backend or {ENV}) with CPU tensors needs "
            "TRITON_INTERPRET=1 set before triton is imported; got TRITON_INTERPRET="
            f"{_interpret_env!r}")
    return True


def use_compiled(t: torch.Tensor) -> bool:
    """Whether an op with a ``torch.compile`` form runs it: on CPU tensors, and only with the
    ``compile`` backend (the first call compiles, seconds; the compiled code is not bitwise
    the eager twin, so it is never the default)."""
    return _backend == "compile" and t.device.type == "cpu"


def check_tensor(name: str, t: object, *, dtypes: tuple[torch.dtype, ...] | None = None,
                 ndim: int | None = None) -> torch.Tensor:
    """``t`` is a contiguous tensor of one of ``dtypes`` with ``ndim`` dimensions."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
    if dtypes is not None and t.dtype not in dtypes:
        want = " or ".join(str(d) for d in dtypes)
        raise TypeError(f"{name} must have dtype {want}; got {t.dtype}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D; got shape {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(
            f"{name} must be contiguous; got strides {t.stride()} for shape {tuple(t.shape)} "
            "(call .contiguous())")
    return t


def check_numel(name: str, t: torch.Tensor, numel: int, what: str) -> None:
    if t.numel() != numel:
        raise ValueError(f"{name} must have {numel} elements ({what}); got {t.numel()}")


def check_same_device(**tensors: torch.Tensor | None) -> None:
    named = [(n, t) for n, t in tensors.items() if t is not None]
    first_name, first = named[0]
    for n, t in named[1:]:
        if t.device != first.device:
            raise ValueError(
                f"{n} must be on the same device as {first_name} ({first.device}); "
                f"got {t.device}")


def check_block_size(block_size: object) -> int:
    if isinstance(block_size, bool) or not isinstance(block_size, int):
        raise TypeError(f"block_size must be an int; got {type(block_size).__name__}")
    if not (MIN_BLOCK_SIZE <= block_size <= MAX_BLOCK_SIZE) or block_size & (block_size - 1):
        raise ValueError(
            f"block_size must be a power of two in [{MIN_BLOCK_SIZE}, {MAX_BLOCK_SIZE}]; "
            f"got {block_size}")
    return block_size


def check_blocked(name: str, t: torch.Tensor, block_size: int) -> int:
    """1-D data tensor whose length is a multiple of ``block_size``; returns n_blocks."""
    n = t.numel()
    if n == 0 or n % block_size:
        raise ValueError(
            f"{name} must have a positive multiple of block_size={block_size} elements; "
            f"got {n}")
    return n // block_size


def check_idx(idx: object, n_blocks: int, block_size: int,
              name: str = "idx") -> tuple[int, int]:
    """int16 ``[n_blocks, k]`` block-local offsets; returns (n_blocks, k)."""
    t = check_tensor(name, idx, dtypes=(torch.int16,), ndim=2)
    rows, k = t.shape
    if rows != n_blocks:
        raise ValueError(
            f"{name} must have one row per block: expected {n_blocks} rows; got {rows}")
    if not (1 <= k <= block_size):
        raise ValueError(f"{name} must have 1..block_size={block_size} columns; got {k}")
    return rows, k


def check_int(name: str, v: object, lo: int, hi: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name} must be an int; got {type(v).__name__}")
    if not lo <= v <= hi:
        raise ValueError(f"{name} must be in [{lo}, {hi}]; got {v}")
    return v


def check_hparams(*, lr: object, beta1: object, beta2: object, eps: object,
                  weight_decay: object) -> tuple[float, float, float, float, float]:
    """Optimizer hyperparameters as floats (torch.optim's ranges)."""
    out = []
    for name, v, lo, hi_open in (("lr", lr, 0.0, math.inf), ("beta1", beta1, 0.0, 1.0),
                                 ("beta2", beta2, 0.0, 1.0), ("eps", eps, 0.0, math.inf),
                                 ("weight_decay", weight_decay, 0.0, math.inf)):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise TypeError(f"{name} must be a Python float; got {type(v).__name__}")
        f = float(v)
        if not (lo <= f < hi_open) or math.isnan(f):
            raise ValueError(f"Invalid {name}: {v} (expected {lo} <= {name} < {hi_open})")
        out.append(f)
    return out[0], out[1], out[2], out[3], out[4]


def check_out(name: str, out: torch.Tensor | None, numel: int, what: str, like_name: str,
              like: torch.Tensor, out_dtype: torch.dtype | None = None) -> None:
    """Optional output: floating dtype, 1-D, contiguous, ``numel`` elements, ``like``'s device."""
    if out_dtype is not None and out_dtype not in FLOAT_DTYPES:
        raise TypeError(f"out_dtype must be one of {FLOAT_DTYPES}; got {out_dtype}")
    if out is None:
        return
    check_tensor(name, out, dtypes=FLOAT_DTYPES, ndim=1)
    check_numel(name, out, numel, what)
    check_same_device(**{like_name: like, name: out})
    if out_dtype is not None and out.dtype != out_dtype:
        raise TypeError(f"{name} has dtype {out.dtype} but out_dtype={out_dtype}; "
                        "they must agree (pass only one)")
