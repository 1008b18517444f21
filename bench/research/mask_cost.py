"""What the next mask's wire costs on this machine: :func:`scape.kernels.pack_mask` (the
owner's Elias-Fano rows) and :func:`scape.kernels.unpack_mask` (every rank's rows read back)
against the ``log2(B)``-bit packing (:func:`scape.kernels.pack_offsets`, ``unpack_offsets``),
on the tensors' device with the kernel backend in force (CPU: the torch implementations), one
thread, the median of repeats; beside the bytes each sends.

Shapes: the bundled model's (52 mask rows a rank at W=4) and a 1B-parameter model's share (4096
rows a rank at W=8), at k = 41 and 410 (sparsity 0.99 and 0.9, B = 4096); random ascending rows.

    python -m bench.research.mask_cost                  # ~1 minute on 2 cores, JSON lines
    python -m bench.research.mask_cost --quick          # the small shapes only
    python -m bench.research.mask_cost --device cuda    # the Triton kernels (.ci/gpu runs it)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from scape import kernels

BLOCK = 4096
SHAPES = ((52, 4, 41), (52, 4, 410), (4096, 8, 41), (4096, 8, 410))
"""(rows a rank, ranks, offsets a row)."""


def _rows(n: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(BLOCK, generator=g)[:k].sort().values
                        for _ in range(n)]).to(torch.int16)


def _median_ms(fn: Callable[[], object], reps: int, device: torch.device) -> float:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()  # compiles the kernels on a GPU
    times = []
    for _ in range(reps):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def measure(n: int, world: int, k: int, reps: int,
            device: torch.device | None = None) -> dict[str, float | int]:
    device = device or torch.device("cpu")
    idx = _rows(n, k, 0).to(device)
    coded = kernels.pack_mask(idx, BLOCK)
    packed = kernels.pack_offsets(idx.view(-1), BLOCK)
    all_coded, all_packed = coded.repeat(world), packed.repeat(world)
    out = torch.empty(world * n, k, dtype=torch.int16, device=device)
    kernels.unpack_mask(all_coded, n, BLOCK, out=out)
    assert torch.equal(out, idx.repeat(world, 1)), "the rows must read back"
    return {"rows": n, "world": world, "k": k,
            "bytes_elias_fano": coded.numel(), "bytes_packed": packed.numel(),
            "pack_elias_fano_ms": _median_ms(lambda: kernels.pack_mask(idx, BLOCK), reps, device),
            "pack_packed_ms": _median_ms(lambda: kernels.pack_offsets(idx.view(-1), BLOCK), reps,
                                         device),
            "unpack_elias_fano_ms": _median_ms(
                lambda: kernels.unpack_mask(all_coded, n, BLOCK, out=out), reps, device),
            "unpack_packed_ms": _median_ms(
                lambda: kernels.unpack_offsets(all_packed, n * k, BLOCK, out=out.view(-1)), reps,
                device)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the bundled model's shapes only")
    ap.add_argument("--device", default="cpu", help="where the tensors live (cuda: the kernels)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    device = torch.device(args.device)
    for n, world, k in SHAPES:
        if args.quick and n > 100:
            continue
        row = measure(n, world, k, reps=5 if args.quick else (200 if n < 1000 else 15),
                      device=device)
        print(json.dumps({"device": str(device),
                          **{a: round(b, 3) if isinstance(b, float) else b
                             for a, b in row.items()}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
