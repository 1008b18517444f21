"""Micro-benchmarks of every kernel op (block 4096, sparsity 0.9 and 0.99) at n = 2^24 on
the CPU and n = 2^26 on a GPU (so that the inputs do not fit in its L2 cache), and of a whole
``opt.step()``: dense sharded AdamS against the default rule at 0.99 (group "optimizer step").

On CPU tensors this times the torch path; on a GPU (``SCAPE_BENCH_DEVICE=cuda``) the Triton
kernels. Each benchmark stores in ``extra_info``: the bytes the op must move (as counted in
the op's docstring), the achieved GB/s, the GB/s of a plain memory copy of the same number of
bytes timed in the same test, their ratio, and elements/s for the sparse ops.
``blockwise_topk`` is timed beside ``torch.topk`` over the ``[n_blocks, block_size]`` view.

Timing on a GPU: pytest-benchmark's rounds end with ``torch.cuda.synchronize()`` (a launch
returns before the kernel has run), so its table holds launch + kernel + sync; the
bandwidth columns come from ``triton.testing.do_bench`` (CUDA events, L2 flushed before each
call, fastest of its repetitions), the kernel's own device time.

    pytest bench/bench_kernels.py --benchmark-only                       # run, print table
    pytest bench/bench_kernels.py --benchmark-only \\
        --benchmark-storage=bench/baseline --benchmark-save=cpu          # store a baseline
    pytest bench/bench_kernels.py --benchmark-only \\
        --benchmark-storage=bench/baseline --benchmark-compare           # compare with it
    SCAPE_BENCH_SMOKE=1 pytest bench/bench_kernels.py --benchmark-disable  # n = 2^16, quick
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import pytest
import torch

from scape import kernels

SMOKE = os.environ.get("SCAPE_BENCH_SMOKE", "0") == "1"
DEVICE = os.environ.get("SCAPE_BENCH_DEVICE", "cpu")
N = 1 << (16 if SMOKE else 26 if DEVICE == "cuda" else 24)
BLOCK = 4096
ROUNDS = 2 if SMOKE else 10
SPARSITIES = [pytest.param(0.9, id="s0.9"), pytest.param(0.99, id="s0.99")]


def _k(sparsity: float) -> int:
    """Entries per block: max(1, round(density * block_size)) (DESIGN §1)."""
    return max(1, round((1.0 - sparsity) * BLOCK))


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _best_time(fn: Callable[[], object], rounds: int) -> float:
    """Fastest of ``rounds`` timed calls after one warm-up call (seconds)."""
    fn()
    _sync()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        _sync()
        best = min(best, time.perf_counter() - t0)
    return best


def _op_seconds(fn: Callable[[], object], rounds: int) -> float:
    """The op's own time: CUDA events through ``do_bench`` on a GPU, else ``_best_time``."""
    if DEVICE == "cuda":
        from triton.testing import do_bench

        return do_bench(fn, warmup=5, rep=50, return_mode="min") / 1e3
    return _best_time(fn, rounds)


def _copy_seconds(n_bytes: int) -> float:
    """A memory copy moving ``n_bytes`` (half read, half written), best of a few rounds."""
    src = torch.ones(max(1, n_bytes // 2), dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    return _op_seconds(lambda: dst.copy_(src), 3 * ROUNDS)


def _run(benchmark, fn: Callable[[], object], n_bytes: int, elements: int | None = None,
         beside: dict[str, Callable[[], object]] | None = None) -> None:
    """Time ``fn`` with pytest-benchmark and record bytes, GB/s and the copy ratio."""

    def synced() -> None:
        fn()
        _sync()

    benchmark.pedantic(synced, rounds=ROUNDS, iterations=1, warmup_rounds=1,
                       setup=_sync if DEVICE == "cuda" else None)
    info = benchmark.extra_info
    info.update(n=N, block_size=BLOCK, device=DEVICE, bytes=n_bytes)
    stats = getattr(benchmark, "stats", None)
    if stats is None:  # --benchmark-disable: ran once, nothing timed
        return
    t = stats.stats.min if DEVICE != "cuda" else _op_seconds(fn, ROUNDS)
    copy_t = _copy_seconds(n_bytes)
    info["GB/s"] = round(n_bytes / t / 1e9, 2)
    info["copy GB/s"] = round(n_bytes / copy_t / 1e9, 2)
    info["vs copy"] = round(copy_t / t, 3)
    if elements is not None:
        info["Melem/s"] = round(elements / t / 1e6, 1)
    for name, other in (beside or {}).items():
        other_t = _op_seconds(other, max(3, ROUNDS // 2))
        info[f"{name} s"] = round(other_t, 5)
        info[f"vs {name}"] = round(other_t / t, 3)


@pytest.fixture(scope="module")
def data() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    t = {
        "score": torch.randn(N, generator=gen),
        "age": torch.randint(0, 100, (N,), generator=gen, dtype=torch.int32),
        "p": torch.randn(N, generator=gen),
        "m": torch.randn(N, generator=gen) * 1e-2,
        "v": torch.rand(N, generator=gen) * 1e-4,
        "g": torch.randn(N, generator=gen),
    }
    return {name: x.to(DEVICE) for name, x in t.items()}


def _mask(data, sparsity: float) -> torch.Tensor:
    return kernels.blockwise_topk(data["score"], _k(sparsity), BLOCK)


@pytest.mark.parametrize("sparsity", SPARSITIES)
def test_blockwise_topk(benchmark, data, sparsity):
    benchmark.group = "blockwise_topk"
    k = _k(sparsity)
    k_explore = round(0.1 * k)
    score, age = data["score"], data["age"]
    view = score.view(-1, BLOCK)
    idx = kernels.blockwise_topk(score, k, BLOCK, age=age, k_explore=k_explore)
    assert idx.shape == (N // BLOCK, k)
    # reads score and age, writes the int16 mask
    _run(benchmark, lambda: kernels.blockwise_topk(score, k, BLOCK, age=age,
                                                   k_explore=k_explore),
         N * 8 + idx.numel() * 2, elements=N,
         beside={"torch.topk": lambda: torch.topk(view.abs(), k, dim=1, sorted=False)})


@pytest.mark.parametrize("sparsity", SPARSITIES)
def test_torch_topk_view(benchmark, data, sparsity):
    """Reference point: torch.topk of |score| over the [n_blocks, block_size] view (no
    explore part, no tie rule, unsorted indices)."""
    benchmark.group = "blockwise_topk"
    view = data["score"].view(-1, BLOCK)
    k = _k(sparsity)
    _run(benchmark, lambda: torch.topk(view.abs(), k, dim=1, sorted=False), N * 4,
         elements=N)


@pytest.mark.parametrize("sparsity", SPARSITIES)
def test_take_(benchmark, data, sparsity):
    benchmark.group = "sparse copies"
    idx = _mask(data, sparsity)
    buf = data["g"].clone()
    out = torch.empty(idx.numel(), device=DEVICE)
    n_k = idx.numel()
    _run(benchmark, lambda: kernels.take_(buf, idx, BLOCK, out=out), n_k * (2 + 4 + 4 + 4),
         elements=n_k)


@pytest.mark.parametrize("sparsity", SPARSITIES)
def test_gather_with_residual(benchmark, data, sparsity):
    benchmark.group = "sparse copies"
    idx = _mask(data, sparsity)
    out = torch.empty(idx.numel(), dtype=torch.bfloat16, device=DEVICE)
    n_k = idx.numel()
    _run(benchmark, lambda: kernels.gather(data["g"], idx, BLOCK, residual=data["v"], out=out),
         n_k * (2 + 4 + 4 + 2), elements=n_k)


@pytest.mark.parametrize("sparsity", SPARSITIES)
def test_scatter_(benchmark, data, sparsity):
    benchmark.group = "sparse copies"
    idx = _mask(data, sparsity)
    dst = data["p"].to(torch.bfloat16)
    values = torch.randn(idx.numel(), device=DEVICE).to(torch.bfloat16)
    n_k = idx.numel()
    _run(benchmark, lambda: kernels.scatter_(dst, idx, BLOCK, values), n_k * (2 + 2 + 2),
         elements=n_k)


HP = dict(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)


@pytest.mark.parametrize("sparsity", SPARSITIES)
def test_adams_sparse_(benchmark, data, sparsity):
    benchmark.group = "optimizer updates"
    idx = _mask(data, sparsity)
    p, m, age = data["p"].clone(), data["m"].clone(), data["age"].clone()
    n_k = idx.numel()
    g = torch.randn(n_k, device=DEVICE)
    out = torch.empty(n_k, dtype=torch.bfloat16, device=DEVICE)
    # masked: idx, g, p/m/age read and written, model_out; dense: age += 1
    _run(benchmark, lambda: kernels.adams_sparse_(p, m, age, g, idx, BLOCK, model_out=out,
                                                  **HP),
         n_k * (2 + 4 + 12 + 12 + 2) + N * 8, elements=n_k)


def test_adams_dense_(benchmark, data):
    benchmark.group = "optimizer updates"
    p, m = data["p"].clone(), data["m"].clone()
    _run(benchmark, lambda: kernels.adams_dense_(p, m, data["g"], **HP), N * 20)


def test_adamw_dense_(benchmark, data):
    benchmark.group = "optimizer updates"
    p, m, v = data["p"].clone(), data["m"].clone(), data["v"].clone()
    _run(benchmark, lambda: kernels.adamw_dense_(p, m, v, data["g"], step=10, **HP), N * 28)


def test_grad_stats(benchmark, data):
    benchmark.group = "grad_stats"
    _run(benchmark, lambda: kernels.grad_stats(data["g"]), N * 4)


def test_noise_ema_(benchmark, data):
    """The default rule's observation of its own gradient (error feedback on, with ``mu``):
    reads buf, prev, age, s2, s2w, mu; writes prev, s2, s2w, mu."""
    benchmark.group = "default rule, per shard"
    buf, age = data["g"], data["age"]
    prev, s2, s2w, mu = (data[x].clone() for x in ("score", "v", "v", "m"))
    _run(benchmark, lambda: kernels.noise_ema_(buf, prev, age, s2, s2w, beta=0.95,
                                               error_feedback=True, mu=mu), N * 40)


def test_gain_score(benchmark, data):
    """The default rule's score (with the summed wait ``prev``): reads mu, s2, s2w, age,
    prev; writes the score into one reused buffer."""
    benchmark.group = "default rule, per shard"
    out = torch.empty(N, device=DEVICE)
    mu, s2, age, prev = data["m"], data["v"], data["age"], data["score"]
    s2w = torch.full((N,), 0.9, device=DEVICE)
    _run(benchmark, lambda: kernels.gain_score(mu, s2, s2w, age, beta=0.95, beta1=0.9,
                                               world=8, prev=prev, out=out), N * 24)


@pytest.mark.parametrize("sparsity", SPARSITIES)
def test_gain_topk(benchmark, data, sparsity):
    """The default rule's next mask, score and selection fused (explore 10%): reads mu, s2,
    s2w, age, prev once, writes the int16 mask. On the CPU it is gain_score (into a reused
    buffer, 24 bytes more) then blockwise_topk (8 more): the bytes counted are the fused
    kernel's on either device."""
    benchmark.group = "default rule, per shard"
    k = _k(sparsity)
    mu, s2, age, prev = data["m"], data["v"], data["age"], data["score"]
    s2w = torch.full((N,), 0.9, device=DEVICE)
    out = torch.empty(N, device=DEVICE)
    n_idx = (N // BLOCK) * k
    _run(benchmark, lambda: kernels.gain_topk(mu, s2, s2w, age, k, BLOCK, k_explore=round(0.1 * k),
                                              beta=0.95, beta1=0.9, world=8, prev=prev,
                                              out=out),
         N * 20 + n_idx * 2, elements=N)


@pytest.mark.parametrize("sparsity", SPARSITIES)
def test_noise_gain_topk_(benchmark, data, sparsity):
    """The default rule's whole pass over the shard before the take (explore 10%): reads buf,
    prev, age, s2, s2w, mu, writes prev, age, s2, s2w, mu (44 bytes per coordinate); per
    entry of this step's mask reads the offset and the old age, writes it out and zeroes the
    age; writes the next int16 mask. On the CPU it is noise_ema_, the ages, gain_score (into a
    reused buffer) and blockwise_topk: the bytes counted are the fused kernel's."""
    benchmark.group = "default rule, per shard"
    k = _k(sparsity)
    cur = _mask(data, sparsity)
    buf = data["g"]
    prev, age, s2, mu = (data[x].clone() for x in ("score", "age", "v", "m"))
    s2w = torch.full((N,), 0.9, device=DEVICE)
    out = torch.empty(N, device=DEVICE)
    n_idx = (N // BLOCK) * k
    _run(benchmark, lambda: kernels.noise_gain_topk_(
        buf, prev, age, s2, s2w, mu, cur, k, BLOCK, k_explore=round(0.1 * k), beta=0.95,
        beta1=0.9, world=8, out=out), N * 44 + n_idx * (14 + 2), elements=N)


@pytest.mark.parametrize("sparsity", SPARSITIES)
def test_catchup_agree_(benchmark, data, sparsity):
    """The default rule's catch-up: per mask entry idx, g, p/m/age/s2/s2w read, p/m/age and
    model_out written; per shard coordinate age += 1 and the trust RMS's read of p."""
    benchmark.group = "default rule, per shard"
    idx = _mask(data, sparsity)
    p, m, age = data["p"].clone(), data["m"].clone(), data["age"].clone()
    s2w = torch.full((N,), 0.9, device=DEVICE)
    s2 = data["v"] + m * m
    n_k = idx.numel()
    g = torch.randn(n_k, device=DEVICE) * 1e-2
    out = torch.empty(n_k, dtype=torch.bfloat16, device=DEVICE)
    _run(benchmark, lambda: kernels.catchup_agree_(p, m, age, s2, s2w, g, idx, BLOCK, **HP,
                                                   world=8, trust=0.5, model_out=out),
         n_k * (2 + 4 + 20 + 12 + 2) + N * 12, elements=n_k)


STEP_MODEL = "tiny" if SMOKE else "base"


@pytest.mark.parametrize("kind", [pytest.param("dense_adams", id="dense"),
                                  pytest.param("scape_0.99", id="default-0.99")])
def test_optimizer_step(benchmark, kind):
    """A whole ``opt.step()`` of rank 0 of 4 (network left out: bench.step_compute's null
    communicator) on the bundled model: dense sharded AdamS against the default rule at
    0.99, the pair of bench.step_compute; its bytes are the dense step's state traffic."""
    from bench.step_compute import build

    benchmark.group = "optimizer step"
    opt, _ = build(STEP_MODEL, 4, kind, device=DEVICE)
    gen = torch.Generator().manual_seed(0)
    grads = [(torch.randn(b.n_pad, generator=gen) * 1e-2).to(DEVICE) for b in opt.buckets]

    def step() -> None:
        for b, g in zip(opt.buckets, grads):
            b.write_grad_(g)
        opt.step()

    for _ in range(3):  # warm-up: the first step is dense, then the masks exist
        step()
    shard = sum(b.shard_size for b in opt.buckets)
    _run(benchmark, step, shard * 24)
