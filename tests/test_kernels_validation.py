"""Bad arguments raise ValueError/TypeError naming the argument, the expected and the actual
value; dispatch follows the device and the backend (``scape.kernels.set_backend``, initially
``SCAPE_KERNELS``)."""

from __future__ import annotations

import pytest
import torch

from scape import kernels
from scape.kernels import (
    _checks,
    catchup,
    moments,
    reference,
    sparse,
    stats,
    stats_torch,
    topk,
    topk_torch,
)

B = 256
N = 2 * B
HP = dict(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0)


def _idx(k: int = 4, rows: int = 2, dtype=torch.int16) -> torch.Tensor:
    return torch.arange(k, dtype=dtype).repeat(rows, 1)


def _f(n: int = N, dtype=torch.float32) -> torch.Tensor:
    return torch.zeros(n, dtype=dtype)


def _age(n: int = N, dtype=torch.int32) -> torch.Tensor:
    return torch.zeros(n, dtype=dtype)


META = torch.zeros(N, device="meta")
BAD = [
    # (id, call, exception, words that must all appear in the message)
    ("topk-score-dtype", lambda: kernels.blockwise_topk(_f(dtype=torch.float64), 4, B),
     TypeError, ["score", "float32", "float64"]),
    ("topk-score-2d", lambda: kernels.blockwise_topk(_f().view(2, B), 4, B),
     ValueError, ["score", "1-D", "(2, 256)"]),
    ("topk-score-noncontiguous", lambda: kernels.blockwise_topk(_f(2 * N)[::2], 4, B),
     ValueError, ["score", "contiguous"]),
    ("topk-block-size-not-pow2", lambda: kernels.blockwise_topk(_f(3 * 384), 4, 384),
     ValueError, ["block_size", "power of two", "384"]),
    ("topk-block-size-too-small", lambda: kernels.blockwise_topk(_f(), 4, 128),
     ValueError, ["block_size", "[256, 32768]", "128"]),
    ("topk-block-size-too-large", lambda: kernels.blockwise_topk(_f(65536), 4, 65536),
     ValueError, ["block_size", "65536"]),
    ("topk-block-size-type", lambda: kernels.blockwise_topk(_f(), 4, 256.0),
     TypeError, ["block_size", "int", "float"]),
    ("topk-numel-not-multiple", lambda: kernels.blockwise_topk(_f(N + 1), 4, B),
     ValueError, ["score", "multiple", "256", str(N + 1)]),
    ("topk-k-above-block", lambda: kernels.blockwise_topk(_f(), B + 1, B),
     ValueError, ["k", "[1, 256]", "257"]),
    ("topk-k-zero", lambda: kernels.blockwise_topk(_f(), 0, B),
     ValueError, ["k", "0"]),
    ("topk-k-explore-above-k", lambda: kernels.blockwise_topk(_f(), 4, B, age=_age(),
                                                              k_explore=5),
     ValueError, ["k_explore", "[0, 4]", "5"]),
    ("topk-k-explore-without-age", lambda: kernels.blockwise_topk(_f(), 4, B, k_explore=2),
     ValueError, ["k_explore", "age", "None"]),
    ("topk-age-dtype", lambda: kernels.blockwise_topk(_f(), 4, B, age=_age(dtype=torch.int64),
                                                      k_explore=1),
     TypeError, ["age", "int32", "int64"]),
    ("topk-age-length", lambda: kernels.blockwise_topk(_f(), 4, B, age=_age(B), k_explore=1),
     ValueError, ["age", str(N), str(B)]),
    ("topk-mixed-devices", lambda: kernels.blockwise_topk(_f(), 4, B,
                                                          age=_age().to("meta"), k_explore=1),
     ValueError, ["age", "device", "meta", "cpu"]),
    ("take-idx-dtype", lambda: kernels.take_(_f(), _idx(dtype=torch.int32), B),
     TypeError, ["idx", "int16", "int32"]),
    ("take-idx-1d", lambda: kernels.take_(_f(), _idx().view(-1), B),
     ValueError, ["idx", "2-D", "(8,)"]),
    ("take-idx-rows", lambda: kernels.take_(_f(), _idx(rows=3), B),
     ValueError, ["idx", "2 rows", "3"]),
    ("take-idx-too-wide", lambda: kernels.take_(_f(), _idx(k=B + 1), B),
     ValueError, ["idx", "256", "257"]),
    ("take-idx-noncontiguous", lambda: kernels.take_(_f(), _idx(k=8)[:, ::2], B),
     ValueError, ["idx", "contiguous"]),
    ("take-out-size", lambda: kernels.take_(_f(), _idx(), B, out=_f(7)),
     ValueError, ["out", "8", "7"]),
    ("take-out-dtype-conflict", lambda: kernels.take_(_f(), _idx(), B, out=_f(8),
                                                      out_dtype=torch.bfloat16),
     TypeError, ["out", "float32", "bfloat16"]),
    ("take-out-dtype-int", lambda: kernels.take_(_f(), _idx(), B, out_dtype=torch.int32),
     TypeError, ["out_dtype", "int32"]),
    ("take-mixed-devices", lambda: kernels.take_(META, _idx(), B),
     ValueError, ["idx", "device", "meta", "cpu"]),
    ("gather-residual-length", lambda: kernels.gather(_f(), _idx(), B, residual=_f(B)),
     ValueError, ["residual", str(N), str(B)]),
    ("gather-residual-dtype", lambda: kernels.gather(_f(), _idx(), B,
                                                     residual=_f(dtype=torch.float64)),
     TypeError, ["residual", "float64"]),
    ("scatter-values-length", lambda: kernels.scatter_(_f(), _idx(), B, _f(9)),
     ValueError, ["values", "8", "9"]),
    ("scatter-dst-dtype", lambda: kernels.scatter_(_age(), _idx(), B, _f(8)),
     TypeError, ["dst", "int32"]),
    ("adams-p-dtype", lambda: kernels.adams_dense_(_f(dtype=torch.bfloat16), _f(), _f(), **HP),
     TypeError, ["p", "float32", "bfloat16"]),
    ("adams-m-length", lambda: kernels.adams_dense_(_f(), _f(B), _f(), **HP),
     ValueError, ["m", str(N), str(B)]),
    ("adams-g-noncontiguous", lambda: kernels.adams_dense_(_f(), _f(), _f(2 * N)[::2], **HP),
     ValueError, ["g", "contiguous"]),
    ("adams-model-out-length", lambda: kernels.adams_dense_(_f(), _f(), _f(),
                                                            model_out=_f(B), **HP),
     ValueError, ["model_out", str(N), str(B)]),
    ("adams-lr-negative", lambda: kernels.adams_dense_(_f(), _f(), _f(), **{**HP, "lr": -1.0}),
     ValueError, ["lr", "-1.0"]),
    ("adams-beta2-one", lambda: kernels.adams_dense_(_f(), _f(), _f(), **{**HP, "beta2": 1.0}),
     ValueError, ["beta2", "1.0"]),
    ("adams-lr-type", lambda: kernels.adams_dense_(_f(), _f(), _f(), **{**HP, "lr": "0.1"}),
     TypeError, ["lr", "str"]),
    ("adams-mixed-devices", lambda: kernels.adams_dense_(_f(), _f(), META, **HP),
     ValueError, ["g", "device", "meta"]),
    ("sparse-age-dtype", lambda: kernels.adams_sparse_(_f(), _f(), _f(), _f(8), _idx(), B,
                                                       **HP),
     TypeError, ["age", "int32", "float32"]),
    ("sparse-g-length", lambda: kernels.adams_sparse_(_f(), _f(), _age(), _f(N), _idx(), B,
                                                      **HP),
     ValueError, ["g", "8", str(N)]),
    ("sparse-idx-rows", lambda: kernels.adams_sparse_(_f(), _f(), _age(), _f(4), _idx(rows=1),
                                                      B, **HP),
     ValueError, ["idx", "2 rows", "1"]),
    ("sparse-model-out-length", lambda: kernels.adams_sparse_(_f(), _f(), _age(), _f(8),
                                                              _idx(), B, model_out=_f(N),
                                                              **HP),
     ValueError, ["model_out", "8", str(N)]),
    ("adamw-step-zero", lambda: kernels.adamw_dense_(_f(), _f(), _f(), _f(), step=0, **HP),
     ValueError, ["step", "0"]),
    ("adamw-step-float", lambda: kernels.adamw_dense_(_f(), _f(), _f(), _f(), step=1.0, **HP),
     TypeError, ["step", "int", "float"]),
    ("adamw-v-dtype", lambda: kernels.adamw_dense_(_f(), _f(), _f(dtype=torch.float16), _f(),
                                                   step=1, **HP),
     TypeError, ["v", "float32", "float16"]),
    ("stats-dtype", lambda: kernels.grad_stats(_age()),
     TypeError, ["x", "int32"]),
    ("stats-2d", lambda: kernels.grad_stats(_f().view(2, B)),
     ValueError, ["x", "1-D"]),
    ("stats-not-a-tensor", lambda: kernels.grad_stats([1.0, 2.0]),
     TypeError, ["x", "Tensor", "list"]),
    ("stats-limit-zero", lambda: kernels.grad_stats(_f(), limit=0.0),
     ValueError, ["limit", "0.0"]),
    ("stats-limit-inf", lambda: kernels.grad_stats(_f(), limit=float("inf")),
     ValueError, ["limit", "inf"]),
    ("stats-limit-bool", lambda: kernels.grad_stats(_f(), limit=True),
     ValueError, ["limit", "True"]),
    ("noise-s2-length", lambda: kernels.noise_ema_(_f(), _f(), _age(), _f(B), _f(),
                                                   beta=0.9, error_feedback=True),
     ValueError, ["s2", str(B), str(N)]),
    ("noise-age-dtype", lambda: kernels.noise_ema_(_f(), _f(), _f(), _f(), _f(), beta=0.9,
                                                   error_feedback=True),
     TypeError, ["age", "int32", "float32"]),
    ("noise-buf-bf16", lambda: kernels.noise_ema_(_f(dtype=torch.bfloat16), _f(), _age(), _f(),
                                                  _f(), beta=0.9, error_feedback=True),
     TypeError, ["buf", "float32", "bfloat16"]),
    ("noise-beta-one", lambda: kernels.noise_ema_(_f(), _f(), _age(), _f(), _f(), beta=1.0,
                                                  error_feedback=True),
     ValueError, ["beta", "1.0"]),
    ("gain-s2-length", lambda: kernels.gain_score(_f(), _f(B), _f(), _age(), beta=0.95,
                                                  beta1=0.9, world=2),
     ValueError, ["s2", str(B), str(N)]),
    ("gain-age-dtype", lambda: kernels.gain_score(_f(), _f(), _f(), _f(), beta=0.95,
                                                  beta1=0.9, world=2),
     TypeError, ["age", "int32", "float32"]),
    ("gain-mu-bf16", lambda: kernels.gain_score(_f(dtype=torch.bfloat16), _f(), _f(), _age(),
                                                beta=0.95, beta1=0.9, world=2),
     TypeError, ["mu", "float32", "bfloat16"]),
    ("gain-beta1-one", lambda: kernels.gain_score(_f(), _f(), _f(), _age(), beta=0.95,
                                                  beta1=1.0, world=2),
     ValueError, ["beta1", "1.0"]),
    ("gain-prev-length", lambda: kernels.gain_score(_f(), _f(), _f(), _age(), beta=0.95,
                                                    beta1=0.9, world=2, prev=_f(B)),
     ValueError, ["prev", str(B), str(N)]),
    ("gain-world-zero", lambda: kernels.gain_score(_f(), _f(), _f(), _age(), beta=0.95,
                                                   beta1=0.9, world=0),
     ValueError, ["world", "0"]),
    ("noise-mu-length", lambda: kernels.noise_ema_(_f(), _f(), _age(), _f(), _f(), beta=0.9,
                                                   error_feedback=True, mu=_f(B)),
     ValueError, ["mu", str(B), str(N)]),
    ("noise-mu-bf16", lambda: kernels.noise_ema_(_f(), _f(), _age(), _f(), _f(), beta=0.9,
                                                 error_feedback=True,
                                                 mu=_f(dtype=torch.bfloat16)),
     TypeError, ["mu", "float32", "bfloat16"]),
]


@pytest.mark.parametrize("call,exc,words", [pytest.param(c, e, w, id=i) for i, c, e, w in BAD])
def test_bad_arguments_raise_with_a_clear_message(call, exc, words):
    with pytest.raises(exc) as info:
        call()
    msg = str(info.value)
    missing = [w for w in words if w not in msg]
    assert not missing, f"message {msg!r} lacks {missing}"


def test_bad_backend_name(kernel_backend):
    before = kernels.get_backend()
    with pytest.raises(ValueError, match="set_backend.*'cuda'"):
        kernel_backend("cuda")
    with pytest.raises(TypeError, match="set_backend.*NoneType"):
        kernel_backend(None)
    assert kernels.get_backend() == before  # a refused name changes nothing
    with pytest.raises(ValueError, match="SCAPE_KERNELS.*'cuda'"):
        _checks.backend_from_env({"SCAPE_KERNELS": "cuda"})


def test_backend_setting(kernel_backend):
    """Read from SCAPE_KERNELS once (unset or empty: auto); set_backend returns the previous
    one; ``backend`` sets it for a block."""
    assert _checks.backend_from_env({}) == "auto"
    assert _checks.backend_from_env({"SCAPE_KERNELS": " "}) == "auto"
    assert _checks.backend_from_env({"SCAPE_KERNELS": " Torch "}) == "torch"
    assert kernels.BACKENDS == ("auto", "torch", "triton", "compile")
    kernel_backend("torch")
    assert kernels.set_backend("auto") == "torch" and kernels.get_backend() == "auto"
    with kernels.backend("triton") as name:
        assert name == "triton" == kernels.get_backend()
    assert kernels.get_backend() == "auto"


def test_triton_on_cpu_needs_the_interpreter(monkeypatch, kernel_backend):
    kernel_backend("triton")
    monkeypatch.setattr(_checks, "INTERPRETED", False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        kernels.grad_stats(_f())


LAUNCHES = [
    (topk, "blockwise_topk_triton", topk_torch, "blockwise_topk",
     lambda: kernels.blockwise_topk(torch.randn(N), 4, B)),
    (sparse, "take_triton", reference, "take_", lambda: kernels.take_(_f(), _idx(), B)),
    (sparse, "gather_triton", reference, "gather", lambda: kernels.gather(_f(), _idx(), B)),
    (sparse, "scatter_triton", reference, "scatter_",
     lambda: kernels.scatter_(_f(), _idx(), B, _f(8))),
    (moments, "adams_dense_triton", reference, "adams_dense_",
     lambda: kernels.adams_dense_(_f(), _f(), _f(), **HP)),
    (moments, "adams_sparse_triton", reference, "adams_sparse_",
     lambda: kernels.adams_sparse_(_f(), _f(), _age(), _f(8), _idx(), B, **HP)),
    (moments, "adamw_dense_triton", reference, "adamw_dense_",
     lambda: kernels.adamw_dense_(_f(), _f(), _f(), _f(), step=1, **HP)),
    (stats, "grad_stats_triton", reference, "grad_stats", lambda: kernels.grad_stats(_f())),
    (stats, "noise_ema_triton", stats_torch, "noise_ema_",
     lambda: kernels.noise_ema_(_f(), _f(), _age(), _f(), _f(), beta=0.9, error_feedback=True)),
    (stats, "gain_score_triton", stats_torch, "gain_score",
     lambda: kernels.gain_score(_f(), _f(), _f(), _age(), beta=0.95, beta1=0.9, world=2)),
    (catchup, "catchup_agree_triton", reference, "catchup_agree_",
     lambda: kernels.catchup_agree_(_f(), _f(), _age(), _f(), _f(), _f(8), _idx(), B, **HP,
                                    world=2, trust=0.5)),
]


@pytest.mark.parametrize("mode,expect", [("auto", "torch"), ("torch", "torch"),
                                         ("triton", "triton")],
                         ids=["cpu-default", "forced-torch", "forced-triton"])
@pytest.mark.parametrize("mod,launcher,ref_mod,ref_name,call", [
    pytest.param(*case, id=case[1]) for case in LAUNCHES])
def test_dispatch(monkeypatch, kernel_backend, mode, expect, mod, launcher, ref_mod, ref_name,
                  call):
    kernel_backend(mode)
    used = []
    real_launch, real_ref = getattr(mod, launcher), getattr(ref_mod, ref_name)
    monkeypatch.setattr(mod, launcher, lambda *a, **k: (used.append("triton"),
                                                        real_launch(*a, **k))[1])
    monkeypatch.setattr(ref_mod, ref_name, lambda *a, **k: (used.append("torch"),
                                                            real_ref(*a, **k))[1])
    call()
    assert used == [expect]
