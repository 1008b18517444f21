"""Triton, or a stand-in where it is not installed.

Triton is only needed for CUDA tensors (it ships with PyTorch's CUDA wheels and with the
``gpu`` extra); on a CPU-only install the kernels run their torch implementations. Without
Triton the ``@triton.jit`` kernels are still defined (so every module imports) but cannot be
launched: :func:`scape.kernels._checks.use_triton` routes every call to the torch path, and a
launch that is forced anyway raises ``RuntimeError`` saying what to install.
"""

from __future__ import annotations

from typing import Any

MISSING = ("triton is not installed: the Triton kernels cannot run (CPU tensors use the torch "
           "implementations). Install it with the gpu extra: pip install \"scape-optim[gpu]\"")


class _Unavailable:
    """A kernel (or any Triton name) that raises when used."""

    def __init__(self, name: str) -> None:
        self.__name__ = name

    def __getitem__(self, grid: Any) -> Any:
        raise RuntimeError(f"{self.__name__}: {MISSING}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{self.__name__}: {MISSING}")


class _MissingModule:
    """Stands in for ``triton`` and ``triton.language``: ``jit`` keeps the kernels defined,
    ``constexpr`` annotates them, anything else raises when called."""

    constexpr = object

    @staticmethod
    def jit(fn: Any = None, **kwargs: Any) -> Any:
        if fn is None:
            return lambda f: _Unavailable(f.__name__)
        return _Unavailable(fn.__name__)

    def __getattr__(self, name: str) -> Any:
        return _Unavailable(f"triton.{name}")


try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:
    triton = _MissingModule()  # type: ignore[assignment]
    tl = _MissingModule()  # type: ignore[assignment]
    HAVE_TRITON = False

__all__ = ["HAVE_TRITON", "MISSING", "tl", "triton"]
