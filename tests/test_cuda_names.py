"""The names ``tests/test_cuda.py`` passes still exist, checked where there is no GPU.

That module runs only on a CUDA machine, so a rename elsewhere (an ``update=`` rule, a Triton
kernel) leaves it stale without any CPU run noticing: the ``sqrt`` rule's old name did, until a
GPU run failed on it. Here every ``update`` value it is parametrized with builds a
:class:`scape.SCAPE` and steps it on the CPU, and every kernel name it expects to see launched
is a ``@triton.jit`` function of ``kernels/``.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

import pytest
import test_cuda
import torch

import scape

KERNELS = Path(__file__).resolve().parents[1] / "kernels"


def _params(argname: str) -> list[Any]:
    """Every value ``argname`` takes in a ``parametrize`` of ``test_cuda``."""
    out = []
    for obj in vars(test_cuda).values():
        for mark in getattr(obj, "pytestmark", []):
            if mark.name != "parametrize":
                continue
            names = [n.strip() for n in mark.args[0].split(",")]
            if argname in names:
                col = names.index(argname)
                out += [v[col] if len(names) > 1 else v for v in mark.args[1]]
    return out


def _jit_functions() -> set[str]:
    """Names of the functions under ``kernels/`` decorated with ``triton.jit``."""
    found = set()
    for path in KERNELS.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and any(
                    "jit" in ast.unparse(d) for d in node.decorator_list):
                found.add(node.name)
    return found


def test_the_scan_sees_the_parametrizations():
    """A scan that found nothing would pass the checks below vacuously."""
    assert len(_params("update")) >= 2
    assert len(_params("launched")) >= 2
    assert len(_kernel_names()) >= 3
    assert len(_jit_functions()) >= 5


@pytest.mark.parametrize("update", [u for u in _params("update") if u is not None])
def test_update_names_are_registered(update):
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(1024))
    opt = scape.SCAPE([p], lr=1e-3, sparsity=0.9, block_size=256, warmup_steps=1,
                      update=update)
    for _ in range(3):  # the dense warm-up step, then sparse steps through the rule
        p.grad = torch.randn_like(p)
        opt.step()
    opt.finish_param_sync()
    assert torch.isfinite(p).all()


def _kernel_names() -> set[str]:
    """Every string constant of ``test_cuda`` that names a kernel (``_..._kernel``)."""
    tree = ast.parse(Path(test_cuda.__file__).read_text())
    return {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)
            and isinstance(n.value, str) and re.fullmatch(r"_\w+_kernel", n.value)}


def test_expected_kernels_exist():
    jit = _jit_functions()
    expected = _kernel_names()
    assert {k for names in _params("launched") for k in names} <= expected
    assert expected <= jit, f"not a @triton.jit function of kernels/: {sorted(expected - jit)}"
