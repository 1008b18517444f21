"""blockwise_topk: the Triton kernel (through the interpreter on CPU) against the torch
implementation and a brute-force reference, bitwise; property tests with hypothesis."""

from __future__ import annotations

import zlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kernel_cases import brute_topk, make_scores

from scape import kernels
from scape.kernels import reference as ref
from scape.kernels import topk as topk_mod


@pytest.fixture
def triton_path(monkeypatch, kernel_backend):
    """Public API forced onto the Triton kernel; counts launches so a silent fallback fails."""
    kernel_backend("triton")
    calls = []
    launch = topk_mod.blockwise_topk_triton

    def counted(*a, **kw):
        calls.append(1)
        return launch(*a, **kw)

    monkeypatch.setattr(topk_mod, "blockwise_topk_triton", counted)
    return calls


def _case(block_size, n_blocks, k, k_explore, dtype, kind, id_):
    return pytest.param(block_size, n_blocks, k, k_explore, dtype, kind, id=id_)


F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
CASES = [
    _case(256, 1, 1, 0, F32, "randn", "b256-nb1-k1-f32"),
    _case(256, 5, 26, 0, F32, "randn", "b256-nb5-k26-f32"),
    _case(256, 5, 26, 3, BF16, "randn", "b256-nb5-k26-kx3-bf16"),
    _case(256, 3, 26, 26, F16, "randn", "b256-nb3-k26-kx26-f16"),
    _case(256, 3, 256, 0, F32, "randn", "b256-nb3-kB-f32"),
    _case(256, 2, 256, 17, BF16, "randn", "b256-nb2-kB-kx17-bf16"),
    _case(256, 4, 26, 3, F32, "small_ints", "b256-ties-small-ints-f32"),
    _case(256, 4, 40, 0, F16, "small_ints", "b256-ties-small-ints-f16"),
    _case(256, 2, 26, 3, F32, "zeros", "b256-all-zeros-signed-f32"),
    _case(256, 2, 1, 0, BF16, "zeros", "b256-all-zeros-k1-bf16"),
    _case(256, 4, 60, 5, F32, "nan_inf", "b256-nan-inf-f32"),
    _case(256, 2, 250, 0, F32, "nan_inf", "b256-nan-inf-k250-f32"),
    _case(256, 2, 26, 0, F16, "nan_inf", "b256-nan-inf-f16"),
    _case(4096, 2, 410, 41, F32, "randn", "b4096-nb2-k410-kx41-f32"),
    _case(4096, 1, 1, 0, BF16, "small_ints", "b4096-nb1-k1-ties-bf16"),
    _case(4096, 1, 41, 41, F16, "randn", "b4096-nb1-k41-kx41-f16"),
    _case(8192, 1, 820, 82, F32, "small_ints", "b8192-ties-kx82-f32"),
    # above topk.RESIDENT_MAX: the chunked form of the kernel
    _case(16384, 1, 164, 16, F32, "small_ints", "b16384-chunked-ties-kx16-f32"),
    _case(16384, 1, 82, 8, BF16, "nan_inf", "b16384-chunked-nan-inf-kx8-bf16"),
]


@pytest.mark.parametrize("block_size,n_blocks,k,k_explore,dtype,kind", CASES)
def test_triton_matches_torch_and_brute_force(triton_path, block_size, n_blocks, k, k_explore,
                                              dtype, kind):
    n = n_blocks * block_size
    seed = zlib.crc32(f"{block_size}-{n_blocks}-{k}-{k_explore}-{dtype}-{kind}".encode())
    score = make_scores(kind, n, dtype, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    age = torch.randint(0, 6, (n,), generator=gen, dtype=torch.int32)  # ties in age too
    score_before, age_before = score.clone(), age.clone()

    got = kernels.blockwise_topk(score, k, block_size, age=age, k_explore=k_explore)
    assert triton_path, "the Triton kernel was not launched"
    expected = brute_topk(score, k, block_size, age, k_explore)
    assert got.dtype == torch.int16 and got.shape == (n_blocks, k)
    assert torch.equal(got, expected)
    assert torch.equal(ref.blockwise_topk(score, k, block_size, age=age, k_explore=k_explore),
                       expected)
    # invariants: in range, strictly ascending per row, inputs untouched
    assert (got >= 0).all() and (got < block_size).all()
    assert (got[:, 1:] > got[:, :-1]).all()
    assert torch.equal(score.view(torch.uint8), score_before.view(torch.uint8))
    assert torch.equal(age, age_before)


def test_nan_never_beats_a_number(triton_path):
    n = 256
    score = torch.full((n,), float("nan"))
    score[[5, 200]] = torch.tensor([0.0, -1e-30])
    got = kernels.blockwise_topk(score, 3, n)
    assert got.tolist() == [[0, 5, 200]]  # the two numbers, then the lowest-offset NaN


def test_negative_and_extreme_ages(triton_path):
    """Age order is plain signed int32 order, extremes included."""
    n = 256
    gen = torch.Generator().manual_seed(7)
    score = torch.randn(n, generator=gen)
    age = torch.randint(-5, 5, (n,), generator=gen, dtype=torch.int32)
    age[[3, 9, 100]] = torch.tensor([2**31 - 1, -2**31, 2**31 - 1], dtype=torch.int32)
    got = kernels.blockwise_topk(score, 12, n, age=age, k_explore=10)
    assert torch.equal(got, brute_topk(score, 12, n, age, 10))


@pytest.mark.parametrize("kind", ["last-is-largest", "last-ties-first"])
def test_offset_32767_at_block_size_32768(triton_path, kind):
    """The largest offset survives the int16 store (and its flat position is right)."""
    b = 32768
    gen = torch.Generator().manual_seed(11)
    score = torch.rand(b, generator=gen)
    if kind == "last-is-largest":
        score[b - 1] = 10.0
        expected = [[b - 1]]
        got = kernels.blockwise_topk(score, 1, b)
    else:  # offset 0 and 32767 tie: the lower offset wins, the next pick is 32767
        score[0] = score[b - 1] = 10.0
        expected = [[0, b - 1]]
        got = kernels.blockwise_topk(score, 2, b)
    assert got.tolist() == expected
    assert torch.equal(got, ref.blockwise_topk(score, got.shape[1], b))


_VALUES = st.sampled_from([0.0, -0.0, 1.0, -1.0, 2.0, 0.5, -0.5, 1e-30, 3e38,
                           float("nan"), float("inf"), -float("inf")])


@st.composite
def _topk_inputs(draw, max_blocks: int):
    n_blocks = draw(st.integers(1, max_blocks))
    n = n_blocks * 256
    vals = draw(st.lists(_VALUES | st.floats(-4, 4, width=32), min_size=n, max_size=n))
    ages = draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))
    k = draw(st.sampled_from([1, 2, 7, 64, 255, 256]) | st.integers(1, 256))
    k_explore = draw(st.integers(0, k))
    dtype = draw(st.sampled_from([F32, BF16, F16]))
    score = torch.tensor(vals, dtype=torch.float32).to(dtype)
    return score, torch.tensor(ages, dtype=torch.int32), k, k_explore


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_topk_inputs(max_blocks=3))
def test_property_torch_matches_brute_force(inputs):
    score, age, k, k_explore = inputs
    got = ref.blockwise_topk(score, k, 256, age=age, k_explore=k_explore)
    assert torch.equal(got, brute_topk(score, k, 256, age, k_explore))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.data_too_large])
@given(_topk_inputs(max_blocks=2))
def test_property_triton_matches_brute_force(inputs):
    score, age, k, k_explore = inputs
    got = topk_mod.blockwise_topk_triton(score, k, 256, age=age, k_explore=k_explore)
    assert torch.equal(got, brute_topk(score, k, 256, age, k_explore))
