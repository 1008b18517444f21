"""Launch settings of the blockwise top-k kernel on a GPU: time each form (registers-resident
or chunked) and warp count per block size, each result checked against the CPU selection.

    python -m bench.topk_variants                     # n = 2^26 fp32 scores, sparsity 0.99
    python -m bench.topk_variants --n-log2 24 --sparsity 0.9 --out results.json

Times are ``triton.testing.do_bench`` medians (CUDA events, L2 flushed before each call).
The row marked ``*`` is what :func:`scape.kernels.topk.topk_config` launches.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
from collections.abc import Iterator

import torch

from scape.kernels import topk as topk_mod
from scape.kernels import topk_torch


@contextlib.contextmanager
def launch_settings(chunk: int, warps: int) -> Iterator[None]:
    """Within the block, :func:`scape.kernels.topk.blockwise_topk_triton` launches with
    ``CHUNK=chunk`` and ``num_warps=warps`` in place of what
    :func:`scape.kernels.topk.topk_config` chooses (the launcher reads it at every call)."""
    chosen = topk_mod.topk_config
    topk_mod.topk_config = lambda block_size: {"CHUNK": chunk, "num_warps": warps}
    try:
        yield
    finally:
        topk_mod.topk_config = chosen


def run_variant(score: torch.Tensor, age: torch.Tensor, k: int, k_explore: int,
                block: int, chunk: int, warps: int) -> torch.Tensor:
    """The library's launcher of the selection kernel at one launch setting."""
    with launch_settings(chunk, warps):
        return topk_mod.blockwise_topk_triton(score, k, block, age=age, k_explore=k_explore)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n-log2", type=int, default=26)
    ap.add_argument("--sparsity", type=float, default=0.99)
    ap.add_argument("--explore", type=float, default=0.1)
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device")
    from triton.testing import do_bench

    n = 1 << args.n_log2
    gen = torch.Generator().manual_seed(0)
    score_cpu = torch.randn(n, generator=gen)
    age_cpu = torch.randint(0, 100, (n,), generator=gen, dtype=torch.int32)
    score, age = score_cpu.cuda(), age_cpu.cuda()
    copy_s = do_bench(lambda: score.clone(), return_mode="median") / 1e3
    rows = []
    print(f"n = 2^{args.n_log2}, sparsity {args.sparsity}, explore {args.explore}; "
          f"a copy of the scores takes {copy_s * 1e3:.3f} ms")
    print(f"{'block':>6} {'form':>9} {'warps':>5} {'ms':>8} {'Gelem/s':>8}  ok")
    for block in (1024, 4096, 8192, 32768):
        k = max(1, round((1 - args.sparsity) * block))
        kx = round(args.explore * k)
        want = topk_torch.blockwise_topk(score_cpu, k, block, age=age_cpu, k_explore=kx)
        launched = topk_mod.topk_config(block)
        chunks = [c for c in (block, 2048) if c <= block and
                  (c == 2048 or block <= 2 * topk_mod.RESIDENT_MAX)]
        for chunk in dict.fromkeys(chunks):
            for warps in (4, 8, 16):
                launch = functools.partial(run_variant, score, age, k, kx, block, chunk, warps)
                ok = torch.equal(launch().cpu(), want)
                ms = do_bench(launch, return_mode="median")
                mark = "*" if (chunk, warps) == (launched["CHUNK"], launched["num_warps"]) \
                    else " "
                form = "resident" if chunk == block else "chunked"
                print(f"{block:>6} {form:>9} {warps:>5} {ms:8.3f} {n / ms / 1e6:8.2f}  "
                      f"{'yes' if ok else 'NO'} {mark}", flush=True)
                rows.append(dict(block=block, form=form, chunk=chunk, warps=warps, k=k,
                                 k_explore=kx, ms=ms, ok=ok, launched=mark == "*"))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"n": n, "sparsity": args.sparsity, "copy_ms": copy_s * 1e3,
                       "rows": rows}, f, indent=1)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
