"""Communication benchmark: TorchCommunicator (gloo) on loopback, W processes on this machine.

Measures, for each world size W and payload size:

- all_gather and reduce_scatter (op="sum") time, median over repetitions (every repetition
  starts after a barrier; the time is rank 0's, from the call to the end of ``wait()``);
  achieved payload bandwidth ``algbw = payload / time`` with the payload as ``comm.stats``
  counts it (``out.nbytes`` for all_gather, ``inp.nbytes`` for reduce_scatter), and the ring
  bus bandwidth ``busbw = algbw * (W-1)/W`` (the bytes each rank's link carries per second).
- the fraction of a collective's time hidden behind compute: rank 0 starts the collective
  async and runs a matmul loop calibrated to about 3x the collective's time (the other ranks
  only wait), then ``hidden = (t_comm + t_compute - t_both) / t_comm``: 1 when the collective
  is entirely hidden, 0 when it costs as much as run alone, negative when running both at once
  is slower than one after the other (CPU contention: gloo moves bytes with CPU threads).

    python -m bench.comm_bench                       # W = 2 and 4, 1 KB .. 64 MB
    python -m bench.comm_bench --world 2 --sizes 1K,1M --out /tmp/c.json
    python -m bench.comm_bench --smoke               # seconds; what the test suite runs

Writes JSON (default bench/results/comm_bench.json) and prints progress and a table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time

from bench.engine.launch import Ranks, launch, progress

DEFAULT_SIZES = "1K,4K,16K,64K,256K,1M,4M,16M,64M"
OVERLAP_SIZES = "1M,4M,16M"
SMOKE = {"world": "2", "sizes": "1K,64K", "overlap_sizes": "64K", "time_per_point": 0.05}
OPS = ("all_gather", "reduce_scatter")


def parse_size(text: str) -> int:
    """``"64K"`` -> 65536, ``"4M"`` -> 4194304, ``"100"`` -> 100 (bytes)."""
    text = text.strip().upper().removesuffix("B")
    scale = {"K": 1024, "M": 1024**2, "G": 1024**3}.get(text[-1:], 1)
    number = text[:-1] if scale > 1 else text
    try:
        value = int(number) * scale
    except ValueError:
        raise ValueError(f"size must look like 1024, 64K or 4M, got {text!r}") from None
    if value < 4:
        raise ValueError(f"size must be at least 4 bytes, got {text!r}")
    return value


def _tensors(op: str, nbytes: int, world: int):
    """(out, inp) whose payload (as stats counts it) is ``nbytes`` rounded to whole float32
    elements divisible among the ranks."""
    import torch

    per_rank = max(1, nbytes // 4 // world)
    if op == "all_gather":
        return torch.empty(world * per_rank), torch.randn(per_rank)
    return torch.empty(per_rank), torch.randn(world * per_rank)


def _run(comm, op: str, out, inp):
    if op == "all_gather":
        return comm.all_gather(out, inp)
    return comm.reduce_scatter(out, inp, op="sum")


def _rank_body(rank: int, world: int, cfg: dict) -> tuple[list, list]:
    """One rank of :func:`run_world` (its process group joined): the timed collectives and
    the overlap rows; rank 0 sends each row to the driver as it is measured."""
    import torch

    from scape.comm import TorchCommunicator

    comm = TorchCommunicator(timeout=120.0)
    rows, overlap = [], []
    for nbytes in cfg["sizes"]:
        for op in OPS:
            out, inp = _tensors(op, nbytes, world)
            comm.barrier()
            t0 = time.perf_counter()
            _run(comm, op, out, inp).wait()  # warm-up, also sizes the repetitions
            first = torch.tensor([time.perf_counter() - t0])
            comm.all_reduce(first, op="max").wait()
            reps = int(min(200, max(3, cfg["time_per_point"] / max(float(first), 1e-6))))
            times = []
            comm.reset_stats()
            for _ in range(reps):
                comm.barrier()
                t0 = time.perf_counter()
                _run(comm, op, out, inp).wait()
                times.append(time.perf_counter() - t0)
            payload = comm.stats[op]["bytes"] // reps
            med = statistics.median(times)
            row = {"world": world, "op": op, "bytes": payload, "reps": reps,
                   "seconds_median": med, "seconds_min": min(times),
                   "algbw_Bps": payload / med, "busbw_Bps": payload / med * (world - 1)
                   / world}
            rows.append(row)
            if rank == 0:
                progress(row)
    a = torch.randn(192, 192)
    for nbytes in cfg["overlap_sizes"]:
        for op in OPS:
            overlap.append(_overlap(comm, rank, op, nbytes, world, a))
            if rank == 0:
                progress(overlap[-1])
    comm.barrier()
    return rows, overlap


def _overlap(comm, rank: int, op: str, nbytes: int, world: int, a) -> dict:
    """Median over 5 attempts of collective alone, compute alone (rank 0) and both at once."""
    import torch

    out, inp = _tensors(op, nbytes, world)

    def compute(iters: int, work=None) -> int | None:
        done_at = None
        for i in range(iters if rank == 0 else 0):
            torch.mm(a, a)
            if work is not None and done_at is None and work.is_completed():
                done_at = i
        return done_at

    comm.barrier()
    t0 = time.perf_counter()
    _run(comm, op, out, inp).wait()
    t_cal = time.perf_counter() - t0
    t0 = time.perf_counter()
    compute(20)
    t_iter = (time.perf_counter() - t0) / 20 if rank == 0 else 1.0
    iters_t = torch.tensor([max(1, math.ceil(3 * t_cal / t_iter))])
    comm.all_reduce(iters_t, op="max").wait()
    iters = int(iters_t)
    samples = []
    for _ in range(5):
        comm.barrier()
        t0 = time.perf_counter()
        _run(comm, op, out, inp).wait()
        t_comm = time.perf_counter() - t0
        comm.barrier()
        t0 = time.perf_counter()
        compute(iters)
        t_compute = time.perf_counter() - t0
        comm.barrier()
        t0 = time.perf_counter()
        work = _run(comm, op, out, inp)
        done_at = compute(iters, work)
        work.wait()
        t_both = time.perf_counter() - t0
        samples.append((t_comm, t_compute, t_both, done_at))
    t_comm = statistics.median(s[0] for s in samples)
    t_compute = statistics.median(s[1] for s in samples)
    t_both = statistics.median(s[2] for s in samples)
    done_early = sum(s[3] is not None and s[3] < iters - 1 for s in samples)
    return {"world": world, "op": op, "bytes": out.nbytes if op == "all_gather" else inp.nbytes,
            "t_comm": t_comm, "t_compute": t_compute, "t_both": t_both,
            "hidden_fraction": (t_comm + t_compute - t_both) / t_comm,
            "completed_during_compute": f"{done_early}/5", "compute_iters": iters}


def run_world(world: int, cfg: dict, timeout: float) -> tuple[list, list]:
    """Rank 0's rows and overlap rows on ``world`` ranks (:mod:`bench.engine.launch`)."""
    spec = Ranks(world=world, timeout_s=timeout, pg_timeout_s=120.0, threads=1,
                 env={"OMP_NUM_THREADS": "1"}, fail_fast=True, label=f"W={world}",
                 on_progress=lambda rank, row: print(_fmt(row), file=sys.stderr, flush=True))
    outcomes = launch(_rank_body, spec, cfg)
    bad = [o for o in outcomes if not o.ok]
    if bad:
        raise RuntimeError(f"W={world} rank {bad[0].rank}: {bad[0].error}")
    return outcomes[0].result


def _fmt(row: dict) -> str:
    if "algbw_Bps" in row:
        return (f"W={row['world']} {row['op']:<14} {_size(row['bytes']):>7}  "
                f"{row['seconds_median'] * 1e3:9.3f} ms  {row['algbw_Bps'] / 1e9:7.3f} GB/s")
    return (f"W={row['world']} {row['op']:<14} {_size(row['bytes']):>7}  overlap: alone "
            f"{row['t_comm'] * 1e3:.2f} ms + compute {row['t_compute'] * 1e3:.2f} ms, both "
            f"{row['t_both'] * 1e3:.2f} ms -> hidden {row['hidden_fraction']:.2f}")


def _mbps(bytes_per_s: float) -> str:
    v = bytes_per_s / 1e6
    return f"{v:.0f}" if v >= 100 else f"{v:.3g}"


def _size(n: int) -> str:
    for unit, scale in (("MB", 1024**2), ("KB", 1024)):
        if n >= scale:
            return f"{n / scale:g} {unit}"
    return f"{n} B"


def markdown(results: list[dict], overlap: list[dict]) -> str:
    """The bandwidth table (MB/s of payload, 1 MB = 1e6 B) and the overlap table (markdown)."""
    worlds = sorted({r["world"] for r in results})
    sizes = sorted({r["bytes"] for r in results if r["world"] == worlds[0]})
    head = "| payload | " + " | ".join(f"{op} W={w} (MB/s)" for w in worlds for op in OPS) + " |"
    lines = [head, "|" + "---|" * (1 + len(worlds) * len(OPS))]
    for i, _ in enumerate(sizes):
        cells = []
        for w in worlds:
            for op in OPS:
                rows = sorted((r for r in results if r["world"] == w and r["op"] == op),
                              key=lambda r: r["bytes"])
                cells.append(_mbps(rows[i]["algbw_Bps"]) if i < len(rows) else "")
        lines.append(f"| {_size(sizes[i])} | " + " | ".join(cells) + " |")
    lines += ["", "| W | op | payload | alone ms | compute ms | both ms | hidden | done early |",
              "|---|---|---|---|---|---|---|---|"]
    for r in overlap:
        lines.append(f"| {r['world']} | {r['op']} | {_size(r['bytes'])} | "
                     f"{r['t_comm'] * 1e3:.2f} | {r['t_compute'] * 1e3:.2f} | "
                     f"{r['t_both'] * 1e3:.2f} | {r['hidden_fraction']:.2f} | "
                     f"{r['completed_during_compute']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", default="2,4", help="comma-separated world sizes (default 2,4)")
    ap.add_argument("--sizes", default=DEFAULT_SIZES, help=f"payloads (default {DEFAULT_SIZES})")
    ap.add_argument("--overlap-sizes", default=OVERLAP_SIZES,
                    help=f"payloads for the overlap measurement (default {OVERLAP_SIZES})")
    ap.add_argument("--time-per-point", type=float, default=0.5,
                    help="seconds of repetitions per (op, size) point (default 0.5)")
    ap.add_argument("--out", default=os.path.join("bench", "results", "comm_bench.json"))
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, W=2 (seconds)")
    ap.add_argument("--timeout", type=float, default=1800.0, help="per world size (s)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.world, args.sizes = SMOKE["world"], SMOKE["sizes"]
        args.overlap_sizes, args.time_per_point = SMOKE["overlap_sizes"], SMOKE["time_per_point"]
    worlds = [int(w) for w in args.world.split(",")]
    if any(w < 2 for w in worlds):
        raise ValueError(f"--world sizes must be >= 2, got {args.world}")
    cfg = {"sizes": [parse_size(s) for s in args.sizes.split(",")],
           "overlap_sizes": [parse_size(s) for s in args.overlap_sizes.split(",") if s],
           "time_per_point": args.time_per_point}
    import torch

    results: list[dict] = []
    overlap: list[dict] = []
    for w in worlds:
        rows, ov = run_world(w, cfg, args.timeout)
        results += rows
        overlap += ov
    report = {
        "benchmark": "comm_bench", "backend": "gloo", "transport": "loopback",
        "command": " ".join(["python -m bench.comm_bench"] + (argv if argv is not None
                                                                 else sys.argv[1:])),
        "host": {"cpus": os.cpu_count(), "platform": platform.platform(),
                 "torch": torch.__version__, "python": platform.python_version()},
        "smoke": args.smoke, "results": results, "overlap": overlap,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(markdown(results, overlap))
    print(f"wrote {args.out}", file=sys.stderr)
    return report


if __name__ == "__main__":
    main()
