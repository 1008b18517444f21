"""Communication volume: bytes per step per rank of dense sharded AdamS and SCAPE for
GPT-345M, Llama-500M and Llama-1.8B at W = 8, 32, 256, from the library's own code path.

Those models cannot be allocated here (1.8B parameters are 7 GB per fp32 buffer), so the
numbers come from the library in two pieces, neither of which re-types the byte formula:

1. **Bytes per synchronized coordinate, measured.** ``scape.SCAPE`` runs real steps on two
   small proxies (bf16 parameters, bf16 gradients on the wire -- the paper's setting) with a
   :class:`bench.engine.nullcomm.NullCommunicator` playing rank 0 of W (it counts bytes exactly as
   the real backends do). ``opt.last_step.bytes`` of a steady dense step and of a steady
   sparse step, against the optimizer's own ``N_pad`` and ``K`` (``bucket.n_pad``,
   ``mask.n_blocks * mask.k``), gives each collective's bytes per coordinate and its fixed
   part (a line through the two proxies: the scalars a step carries do not grow with the
   model). A third proxy checks the scaling: its measured bytes must equal the prediction.
2. **Sizes of the real models, from the library's layout code.** ``scape.buffers.Bucket``
   builds the flat buffers of a parameter of the model's size on the ``meta`` device (no
   memory), which gives ``N_pad`` (padding to a multiple of W*B); ``K = N_pad / B * k_b``
   with ``k_b`` from ``scape.rules.block_budget`` at the default rule's ``explore``.

Printed beside: the DESIGN formula (``bench.projection.bytes_per_step``: dense
``N*(b_g+b_p)``, SCAPE ``K*(b_g+b_p)`` plus every rank's mask rows in Elias-Fano code), which
leaves out the dense padding and the scalar all-reduce.

    python -m bench.comm_volume          # writes bench/results/comm_volume.json
    python -m bench.comm_volume --smoke  # W=8 only, GPT-345M only
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
from typing import Any

import torch

import scape
from bench.engine.nullcomm import NullCommunicator
from bench.projection import MODELS, bytes_per_step
from scape.buffers import Bucket
from scape.rules import RULES, block_budget
from scape.wire import PARAM_BITS

SCHEMA = "scape.comm_volume/1"
WORLDS = (8, 32, 256)
SPARSITIES = (0.0, 0.9, 0.99)
BLOCK_SIZE = 4096
UPDATE = "agree"
"""The rule of the measurement (the library's default)."""
EXPLORE = RULES[UPDATE].explore
"""Its fraction of each block's budget taken by age (part of the mask, so of ``K``)."""
WIRE_DTYPE = torch.bfloat16
"""Model and gradient-wire dtype of the measurement (b_g = b_p = 2, as in the paper)."""


def _proxy_params(n: int, seed: int) -> list[torch.nn.Parameter]:
    """Three bf16 tensors totalling ``n`` elements (uneven sizes, so padding is exercised)."""
    gen = torch.Generator().manual_seed(seed)
    sizes = [n // 2, n // 3, n - n // 2 - n // 3]
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(WIRE_DTYPE)) for s in sizes]


def measure_step_bytes(n: int, world: int, sparsity: float, steps: int = 3,
                       seed: int = 0, wire: torch.dtype = WIRE_DTYPE,
                       param_wire: torch.dtype | None = None) -> dict[str, Any]:
    """Run ``steps`` SCAPE steps (the first dense) as rank 0 of ``world`` on a proxy of ``n``
    parameters; return the last step's bytes by op and the optimizer's N_pad and K."""
    params = _proxy_params(n, seed)
    comm = NullCommunicator(world, 0)
    opt = scape.SCAPE(params, lr=1e-3, sparsity=sparsity, warmup_steps=1,
                      block_size=BLOCK_SIZE, update=UPDATE, grad_comm_dtype=wire,
                      param_comm_dtype=param_wire, comm=comm)
    opt.ramp_steps = 0  # a sparse step at ``sparsity``, not on the start's ramp
    gen = torch.Generator().manual_seed(seed + 1)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
        opt.step()
    (bucket,) = opt.buckets
    (mask,) = opt.masks
    info = opt.last_step
    return {"n": n, "n_pad": bucket.n_pad,
            "k": None if mask is None else mask.n_blocks * mask.k,
            "dense": info.dense, "bytes": dict(info.bytes)}


def _count(measured: dict[str, Any]) -> int:
    return measured["n_pad"] if measured["dense"] else measured["k"]


def per_coordinate(a: dict[str, Any], b: dict[str, Any]) -> dict[str, tuple[float, float]]:
    """Per collective, ``(bytes per synchronized coordinate, fixed bytes)`` through two
    measurements of different sizes (the scalars a step carries are the fixed part)."""
    ca, cb = _count(a), _count(b)
    out = {}
    for op in a["bytes"]:
        slope = (b["bytes"][op] - a["bytes"][op]) / (cb - ca)
        out[op] = (slope, a["bytes"][op] - slope * ca)
    return out


def predict(costs: dict[str, tuple[float, float]], count: int) -> dict[str, int]:
    return {op: int(round(slope * count + fixed)) for op, (slope, fixed) in costs.items()}


def layout(n: int, world: int, sparsity: float) -> tuple[int, int | None]:
    """``(N_pad, K)`` of one bucket of ``n`` parameters, from the library's Bucket on meta."""
    p = torch.nn.Parameter(torch.empty(n, device="meta", dtype=WIRE_DTYPE))
    bucket = Bucket([p], 0, world, 0, BLOCK_SIZE)
    if sparsity == 0.0:
        return bucket.n_pad, None
    k_b, _ = block_budget(sparsity, BLOCK_SIZE, EXPLORE)
    return bucket.n_pad, bucket.n_pad // BLOCK_SIZE * k_b


def calibrate(world: int, sparsity: float, wire: torch.dtype = WIRE_DTYPE,
              param_wire: torch.dtype | None = None) -> dict[str, Any]:
    """Per-coordinate and fixed bytes from proxies of 2 and 6 blocks per rank, checked on one
    of 10 to within what byte padding leaves (each rank's mask rows up to 1 byte, each
    segment of the 8-bit wire up to 3: ``4 W`` bytes per collective). The three have the
    same padding (block counts alike mod 4), so the line through two is exact. The dense row
    is dense AdamS's, in ``WIRE_DTYPE`` whatever the wires are."""
    if sparsity == 0.0:
        wire, param_wire = WIRE_DTYPE, None
    unit = world * BLOCK_SIZE
    small = measure_step_bytes(unit + unit // 2 + 77, world, sparsity, wire=wire,
                               param_wire=param_wire)
    big = measure_step_bytes(5 * unit + unit // 3 + 11, world, sparsity, seed=2, wire=wire,
                             param_wire=param_wire)
    costs = per_coordinate(small, big)
    large = measure_step_bytes(9 * unit + unit // 5 + 5, world, sparsity, seed=1, wire=wire,
                               param_wire=param_wire)
    count = _count(large)
    predicted = predict(costs, count)
    return {"costs": costs, "proxy": small, "check": large, "check_predicted": predicted,
            "check_ok": predicted.keys() == large["bytes"].keys() and all(
                abs(predicted[op] - large["bytes"][op]) <= 4 * world for op in predicted)}


def report(models: list[str], worlds: list[int], wire: torch.dtype = WIRE_DTYPE,
           param_wire: torch.dtype | None = None) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    calibrations: list[dict[str, Any]] = []
    for world in worlds:
        for sp in SPARSITIES:
            cal = calibrate(world, sp, wire, param_wire)
            calibrations.append({"world": world, "sparsity": sp, **cal})
            for name in models:
                n = MODELS[name].n_params()
                n_pad, k = layout(n, world, sp)
                by_op = predict(cal["costs"], n_pad if k is None else k)
                total = sum(by_op.values())
                b_g = (wire if sp else WIRE_DTYPE).itemsize  # dense AdamS: WIRE_DTYPE
                b_p = PARAM_BITS[param_wire] / 8 if param_wire is not None and sp else 2
                formula = bytes_per_step(n, world, sp, grad_bytes=b_g, param_bytes=b_p,
                                         block_size=BLOCK_SIZE, offset_bits=None)
                rows.append({"model": name, "n_params": n, "world": world, "sparsity": sp,
                             "n_pad": n_pad, "k": k, "bytes_by_op": by_op,
                             "bytes_per_step": total, "design_formula": formula,
                             "vs_formula": total / formula})
    for r in rows:
        dense = next(d for d in rows if d["model"] == r["model"] and d["world"] == r["world"]
                     and d["sparsity"] == 0.0)
        r["ratio_to_dense"] = r["bytes_per_step"] / dense["bytes_per_step"]
    return {"schema": SCHEMA, "date": datetime.date.today().isoformat(),
            "wire": "bf16 parameters, " + ("bf16 gradients" if wire == WIRE_DTYPE else
                                           f"gradients {wire}") + (
                "" if param_wire is None else f", parameter updates {param_wire}"),
            "block_size": BLOCK_SIZE,
            "explore": EXPLORE, "rows": rows, "calibration": calibrations}


def _mb(b: float) -> str:
    return f"{b / 1e6:,.2f}"


def print_report(rep: dict[str, Any]) -> None:
    ok = all(c["check_ok"] for c in rep["calibration"])
    print(f"per-coordinate bytes measured on proxies; scaling check on a third proxy: "
          f"{'within byte padding for every (W, sparsity)' if ok else 'FAILED'}")
    print(f"{'model':11} {'W':>4} {'sparsity':>8} {'MB/step/rank':>13} {'DESIGN MB':>10} "
          f"{'vs DESIGN':>9} {'vs dense':>10}")
    for r in rep["rows"]:
        vs_dense = f"1/{1 / r['ratio_to_dense']:.1f}" if r["sparsity"] else "1"
        print(f"{r['model']:11} {r['world']:>4} {r['sparsity']:>8g} "
              f"{_mb(r['bytes_per_step']):>13} {_mb(r['design_formula']):>10} "
              f"{r['vs_formula']:>9.5f} {vs_dense:>10}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/results/comm_volume.json")
    ap.add_argument("--smoke", action="store_true", help="W=8 and GPT-345M only")
    ap.add_argument("--int8", action="store_true", help="the 8-bit gradient wire "
                    "(grad_comm_dtype=torch.int8; its formula column counts 1 byte per value, "
                    "without the row scales)")
    ap.add_argument("--wire8", action="store_true", help="the whole 8-bit wire: --int8 and "
                    "8-bit parameter updates (param_comm_dtype=torch.int8)")
    ap.add_argument("--updates", type=int, choices=(8, 6, 4), help="--int8 and BITS-bit "
                    "parameter updates (param_comm_dtype torch.int8, int6, int4; --wire8 is "
                    "--updates 8)")
    args = ap.parse_args(argv)
    models = ["GPT-345M"] if args.smoke else list(MODELS)
    worlds = [8] if args.smoke else list(WORLDS)
    torch.set_num_threads(1)
    updates = 8 if args.wire8 else args.updates
    param_wire = None if updates is None else next(d for d, b in PARAM_BITS.items()
                                                    if b == updates)
    rep = report(models, worlds, torch.int8 if args.int8 or updates else WIRE_DTYPE,
                 param_wire)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(rep, f, indent=1)
    print_report(rep)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
