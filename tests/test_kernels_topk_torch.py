"""The two-level torch path of blockwise_topk (kernels/topk_torch.py) against the brute-force
selection and the single-level reference, bitwise: ties, NaN, signed zeros, ages at the int32
extremes (the explore fallback), every float dtype; and the dispatch on CPU tensors."""

from __future__ import annotations

import zlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kernel_cases import brute_topk, make_scores

from scape import kernels
from scape.kernels import reference as ref
from scape.kernels import topk_torch

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


def make_ages(kind: str, n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if kind == "ties":  # every mask ages alike: few distinct values
        return torch.randint(0, 4, (n,), generator=gen, dtype=torch.int32)
    if kind == "spread":
        return torch.randint(0, 5000, (n,), generator=gen, dtype=torch.int32)
    if kind == "signed":
        return torch.randint(-6, 3, (n,), generator=gen, dtype=torch.int32)
    if kind == "extremes":  # the lowest int32 takes the explore fallback
        age = torch.randint(-2, 2, (n,), generator=gen, dtype=torch.int32)
        u = torch.rand(n, generator=gen)
        age[u < 0.6] = INT32_MIN
        age[u > 0.97] = INT32_MAX
        return age
    raise ValueError(kind)


CASES = [  # block_size, n_blocks, k, k_explore, dtype, score kind, age kind
    (256, 3, 1, 0, F32, "randn", "ties"),
    (256, 3, 4, 1, BF16, "small_ints", "ties"),
    (256, 2, 4, 4, F16, "randn", "signed"),
    (256, 2, 3, 1, F32, "zeros", "extremes"),
    (1024, 3, 16, 2, F32, "nan_inf", "ties"),
    (1024, 2, 9, 0, F16, "nan_inf", "spread"),
    (4096, 2, 41, 4, F32, "randn", "spread"),
    (4096, 2, 41, 4, F32, "small_ints", "ties"),
    (4096, 2, 64, 16, BF16, "zeros", "signed"),
    (4096, 1, 20, 6, F32, "randn", "extremes"),
    (32768, 1, 328, 33, F32, "randn", "spread"),
]


@pytest.mark.parametrize("block_size,n_blocks,k,k_explore,dtype,score_kind,age_kind", CASES,
                         ids=[f"b{c[0]}-k{c[2]}-kx{c[3]}-{c[5]}-{c[6]}" for c in CASES])
def test_two_level_matches_brute_force_and_reference(block_size, n_blocks, k, k_explore, dtype,
                                                     score_kind, age_kind):
    assert topk_torch.group_count(k, block_size) > 0  # the case runs the two-level path
    n = n_blocks * block_size
    seed = zlib.crc32(f"{block_size}-{k}-{k_explore}-{score_kind}-{age_kind}".encode())
    score = make_scores(score_kind, n, dtype, seed)
    age = make_ages(age_kind, n, seed + 1)
    score_before, age_before = score.clone(), age.clone()

    got = topk_torch.blockwise_topk(score, k, block_size, age=age, k_explore=k_explore)
    expected = brute_topk(score, k, block_size, age, k_explore)
    assert got.dtype == torch.int16 and got.shape == (n_blocks, k)
    assert torch.equal(got, expected)
    assert torch.equal(ref.blockwise_topk(score, k, block_size, age=age, k_explore=k_explore),
                       expected)
    cols = got.long()  # int16 cannot hold block_size 32768
    assert (cols[:, 1:] > cols[:, :-1]).all() and (cols >= 0).all() and (cols < block_size).all()
    assert torch.equal(score.view(torch.uint8), score_before.view(torch.uint8))
    assert torch.equal(age, age_before)


def test_explore_fallback_is_taken_and_exact(monkeypatch):
    """Ages at the int32 minimum: a kept group's maximum is a taken entry, so the explore part
    keeps k groups over all entries instead (a third group selection) and stays exact."""
    calls = []
    keep = topk_torch._keep_groups
    monkeypatch.setattr(topk_torch, "_keep_groups", lambda g, m: calls.append(m) or keep(g, m))
    b = 256
    score = torch.zeros(b)
    score[[0, 1]] = torch.tensor([3.0, 2.0])  # the score part takes offsets 0 and 1
    age = torch.full((b,), INT32_MIN, dtype=torch.int32)  # every group ties at the minimum
    age[200] = 5
    got = topk_torch.blockwise_topk(score, 4, b, age=age, k_explore=2)
    assert calls == [2, 2, 4]  # score part, explore fast try, explore fallback
    assert got.tolist() == [[0, 1, 2, 200]]  # 200 is oldest; then the lowest untaken offset
    assert torch.equal(got, brute_topk(score, 4, b, age, 2))


def test_group_count_thresholds():
    assert topk_torch.group_count(41, 4096) == 512  # 8 entries per group
    assert topk_torch.group_count(64, 4096) == 512
    assert topk_torch.group_count(65, 4096) == 0  # groups of 4: single level
    assert topk_torch.group_count(410, 4096) == 0  # sparsity 0.9
    assert topk_torch.group_count(4, 256) == 32
    assert topk_torch.group_count(5, 256) == 0


@pytest.mark.parametrize("k,two_level", [(41, True), (410, False)])
def test_cpu_dispatch(monkeypatch, kernel_backend, k, two_level):
    """CPU tensors run topk_torch; it runs two levels exactly when group_count says so."""
    kernel_backend("auto")
    calls = []
    single = topk_torch._single_level

    def counted(*a, **kw):
        calls.append(1)
        return single(*a, **kw)

    monkeypatch.setattr(topk_torch, "_single_level", counted)
    gen = torch.Generator().manual_seed(k)
    score = torch.randn(2 * 4096, generator=gen)
    age = torch.randint(0, 50, (2 * 4096,), generator=gen, dtype=torch.int32)
    got = kernels.blockwise_topk(score, k, 4096, age=age, k_explore=k // 10)
    assert bool(calls) != two_level
    assert torch.equal(got, ref.blockwise_topk(score, k, 4096, age=age, k_explore=k // 10))


_VALUES = st.sampled_from([0.0, -0.0, 1.0, -1.0, 2.0, 1e-30, 3e38,
                           float("nan"), float("inf"), -float("inf")])


@st.composite
def _inputs(draw):
    n_blocks = draw(st.integers(1, 3))
    n = n_blocks * 256
    vals = draw(st.lists(_VALUES | st.floats(-4, 4, width=32), min_size=n, max_size=n))
    ages = draw(st.lists(st.sampled_from([INT32_MIN, -1, 0, 1, 2, INT32_MAX]),
                         min_size=n, max_size=n))
    k = draw(st.integers(1, 12))  # 1-4: two levels; above: the single-level path
    return (torch.tensor(vals, dtype=torch.float32).to(draw(st.sampled_from([F32, BF16, F16]))),
            torch.tensor(ages, dtype=torch.int32), k, draw(st.integers(0, k)))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_inputs())
def test_property_two_level_matches_brute_force(inputs):
    score, age, k, k_explore = inputs
    got = topk_torch.blockwise_topk(score, k, 256, age=age, k_explore=k_explore)
    assert torch.equal(got, brute_topk(score, k, 256, age, k_explore))
    assert torch.equal(ref.blockwise_topk(score, k, 256, age=age, k_explore=k_explore), got)
