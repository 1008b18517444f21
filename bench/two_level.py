"""Two levels side by side: 2 emulated nodes x 2 ranks, a slow link between the nodes.

**Speed leg** (per ``--bandwidth``, 100 Mbit/s and 1 Gbit/s by default): each node is a
network namespace, the two joined by a veth pair shaped to the rate each way; the ranks of
one node talk over their namespace's loopback, not shaped (:mod:`bench.engine.netns_nodes`). The
link's delivered rate and the loopback's are measured first and stored. Then, the same
model and batch, a short run each of:

=================  ===========================================================================
``compute_only``   SCAPE-0.99's per-rank work with no collectives (the floor)
``dense_hsdp``     dense sharded AdamS on the ``(2, 2)`` mesh: dense reduce-scatter inside the
                   node, the slice's dense reduce-scatter + all-gather across, as FSDP2's HSDP
``flat``           SCAPE-0.99 on one flat group of the 4 ranks (every rank's sparse traffic
                   crosses the link)
``two_level``      SCAPE-0.99 on the mesh: dense inside the node, sparse across
=================  ===========================================================================

Reports the median step, the speed-up over ``dense_hsdp``, the ratio to compute-only, the
payload bytes per step per rank by level (the library's counters, ``comm.stats``) beside the
formula of docs/design.md §1 ("Two levels"), and the bytes each node's end of the link sent
per timed step (the interface's own counter, read by the ranks: what really went over the
wire, gloo's and TCP's overheads included).

**Quality leg** (unshaped loopback, ``--quality-steps``, 600 by default): ``flat`` and
``two_level`` trained long enough to leave the unigram plateau, at the compare job's tuned
learning rate; the final validation loss of each and their ratio.

**FSDP2** (``--fsdp2``): both legs run, instead, a model sharded by FSDP2 inside each node
(``fully_shard`` over the node's ranks) with

=================  ===========================================================================
``fsdp2_hsdp``     FSDP2's HSDP (the model sharded over the whole mesh: a dense all-reduce of
                   each rank's slice across nodes) and ``torch.optim.AdamW``
``fsdp2_scape``    FSDP2 over the node's ranks and SCAPE-0.99 across, ``comm=`` the ranks that
                   hold the same shard
=================  ===========================================================================

and report each rank's peak resident memory too; the quality leg compares the two.

    python -m bench.two_level [--out out/two_level] [--quick] [--leg speed|quality|both]
                              [--fsdp2]

``--quick`` (tiny model, 40 quality steps, one bandwidth) is the smoke the tests run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from bench.compare_report import ENTRY_BYTES, environment, mask_coords
from bench.engine import netns_nodes
from bench.engine.netns import available
from bench.engine.run_config import RunConfig
from bench.engine.runner import run
from scape.wire import mask_bytes

SCHEMA = "scape.two_level/1"
NODES, PER_NODE = 2, 2
ROWS = ("compute_only", "dense_hsdp", "flat", "two_level")
FSDP2_ROWS = ("fsdp2_hsdp", "fsdp2_scape")
TUNED_LR = 3e-4
"""The compare job's learning rate (dense sharded AdamS's best at 600 steps)."""


def row_config(row: str, *, model: str, steps: int, lr: float, netns: list[str] | None,
               warmup: int, eval_every: int) -> RunConfig:
    """The run of one row (module docstring)."""
    opt = {"compute_only": "compute_only", "dense_hsdp": "adams",
           "fsdp2_hsdp": "hsdp_adamw"}.get(row, "scape")
    kwargs = {} if opt in ("adams", "hsdp_adamw") else {"warmup_steps": warmup}
    return RunConfig(optimizer=opt, sparsity=0.99, model=model, world=NODES * PER_NODE,
                     steps=steps, lr=lr, nodes=NODES, two_level=row in ("dense_hsdp",
                                                                        "two_level"),
                     fsdp2=row in FSDP2_ROWS,
                     node_netns=netns, optimizer_kwargs=kwargs, threads=1, name=row,
                     eval_every=eval_every, log_every=0,
                     timing_skip=min(warmup + 2, steps - 1))


def formula(row: str, n_pad: int, block: int = 4096, explore: float = 0.1
            ) -> dict[str, int] | None:
    """Payload bytes per steady step per rank by level (fp32 wire, docs/design.md §1)."""
    k = mask_coords(n_pad, 0.99, block, explore)
    world = NODES * PER_NODE
    k_b = k // (n_pad // block)  # a mask row's offsets
    per_rank = mask_bytes(k // world // k_b, k_b, block)  # one rank's next mask on the wire
    if row == "two_level":
        return {"inter": k // PER_NODE * ENTRY_BYTES + NODES * per_rank + 8,
                "intra": n_pad * 4 + k * 4 + world * per_rank + 8}
    if row == "dense_hsdp":
        return {"inter": n_pad // PER_NODE * 8 + 8, "intra": n_pad * 8 + 8}
    if row == "flat":  # the scalars ride: each rank's count (fp32) and sum of squares
        return {"flat": k * ENTRY_BYTES + world * per_rank + world * (4 + 4)}
    if row == "fsdp2_scape":  # n_pad: the rank's local shard; SCAPE over the NODES replicas
        per_replica = mask_bytes(k // NODES // k_b, k_b, block)
        return {"flat": k * ENTRY_BYTES + NODES * per_replica + 8}
    return None


def _levels(by_op: dict[str, float]) -> dict[str, float]:
    out: dict[str, float] = {}
    for op, b in by_op.items():
        level = op.split("/")[0] if "/" in op else "flat"
        out[level] = out.get(level, 0.0) + b
    return out


def speed_leg(rate: str, model: str, steps: int, warmup: int,
              rows_run: tuple[str, ...] = ROWS) -> dict[str, Any]:
    with netns_nodes.node_namespaces(rate) as names:
        bits = netns_nodes.parse_rate(rate)
        link = netns_nodes.measure(names, max(1 << 20, int(bits / 8)))
        print(f"link {rate}: delivered {link['link_bps'] / 1e6:.1f} Mbit/s across, "
              f"{link['inside_bps'] / 1e9:.1f} Gbit/s inside a node (not shaped)", flush=True)
        rows = []
        for row in rows_run:
            t0 = time.perf_counter()
            res = run(row_config(row, model=model, steps=steps, lr=TUNED_LR, netns=names,
                                 warmup=warmup, eval_every=10**6))
            rows.append(_speed_row(row, res))
            print(f"  {row:<13} {res['median_step_s'] * 1e3:8.0f} ms/step "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
    by = {r["name"]: r["median_step_s"] for r in rows}
    hsdp = by.get("dense_hsdp", by.get("fsdp2_hsdp"))  # (the FSDP2 rows: FSDP2's HSDP)
    for r in rows:  # (None where the row it divides by was not run: --rows)
        r["speedup_vs_dense_hsdp"] = hsdp / r["median_step_s"] if hsdp else None
        r["ratio_to_compute_only"] = r["median_step_s"] / by["compute_only"] \
            if "compute_only" in by else None
    return {"rate": rate, "rate_bps": bits, "link": link, "rows": rows}


def _speed_row(row: str, res: dict[str, Any]) -> dict[str, Any]:
    levels = _levels(res["bytes_per_step"])
    inter = levels.get("flat" if row == "fsdp2_scape" else "inter", 0.0)  # (SCAPE's comm is
    return {"name": row, "median_step_s": res["median_step_s"],  # the replicas only)
            "median_compute_s": res["median_compute_s"],
            "bytes_per_step_by_level": levels,
            "inter_bytes_per_node": inter * PER_NODE,
            "max_rss_mb": max(res.get("max_rss_mb_by_rank") or [0.0]),
            "formula": formula(row, res["n_pad"]) if res.get("n_pad") else None,
            # what each node's end of the link sent per timed step (TCP and gloo included)
            "link_bytes_per_node_per_step": res["link_tx_per_step_by_node"],
            "dense_steps": res["dense_steps"], "n_pad": res.get("n_pad")}


def quality_leg(model: str, steps: int, lr: float, fsdp2: bool = False) -> dict[str, Any]:
    runs = {}
    pair = FSDP2_ROWS if fsdp2 else ("flat", "two_level")
    for row in pair:
        t0 = time.perf_counter()
        res = run(row_config(row, model=model, steps=steps, lr=lr, netns=None, warmup=20,
                             eval_every=max(1, steps // 6)))
        runs[row] = {"final_val_loss": res["final_val_loss"], "val_curve": res["val_curve"],
                     "param_sha256_ranks_agree": res["param_sha256_ranks_agree"],
                     "max_rss_mb": max(res.get("max_rss_mb_by_rank") or [0.0])}
        print(f"  {row:<10} val {res['final_val_loss']:.4f} after {steps} steps "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)
    ratio = runs[pair[1]]["final_val_loss"] / runs[pair[0]]["final_val_loss"]
    return {"steps": steps, "lr": lr, "runs": runs, "pair": list(pair),
            "two_level_over_flat" if not fsdp2 else "scape_over_hsdp": ratio}


def _x(v: float | None) -> str:
    return "–" if v is None else f"{v:.2f}"


def render(rep: dict[str, Any]) -> str:
    lines = ["| link | row | ms/step | × vs dense HSDP | / compute | inter B/step/node "
             "(formula) | intra B/step/rank (formula) | link B/step/node (measured) | peak RSS "
             "MB/rank |", "|---|---|---|---|---|---|---|---|---|"]
    for leg in rep.get("speed", []):
        for r in leg["rows"]:
            f = r["formula"] or {}
            lv = r["bytes_per_step_by_level"]
            inter = f"{r['inter_bytes_per_node']:,.0f} ({f['inter'] * PER_NODE:,})" \
                if "inter" in f else (f"{lv.get('flat', 0):,.0f}/rank ({f['flat']:,})"
                                      if "flat" in f else "–")
            rss = r.get("max_rss_mb")
            intra = f"{lv.get('intra', 0):,.0f} ({f['intra']:,})" if "intra" in f else "–"
            lines.append(f"| {leg['rate']} | {r['name']} | {r['median_step_s'] * 1e3:.0f} | "
                         f"{_x(r['speedup_vs_dense_hsdp'])} | {_x(r['ratio_to_compute_only'])} "
                         f"| {inter} | {intra} | "
                         f"{' / '.join(f'{b:,.0f}' for b in r['link_bytes_per_node_per_step'])} "
                         f"| {'–' if not rss else f'{rss:,.0f}'} |")
    q = rep.get("quality")
    if q:
        a, b = q.get("pair", ["flat", "two_level"])
        ratio = q.get("two_level_over_flat", q.get("scape_over_hsdp"))
        lines += ["", f"Quality after {q['steps']} steps (lr {q['lr']}): {a} "
                  f"{q['runs'][a]['final_val_loss']:.4f}, {b} "
                  f"{q['runs'][b]['final_val_loss']:.4f} (ratio {ratio:.4f})."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="out/two_level")
    ap.add_argument("--leg", choices=("speed", "quality", "both"), default="both")
    ap.add_argument("--bandwidth", nargs="+", default=["100mbit", "1gbit"])
    ap.add_argument("--steps", type=int, default=16, help="steps per speed-leg run")
    ap.add_argument("--quality-steps", type=int, default=600)
    ap.add_argument("--rows", nargs="+", choices=ROWS, default=list(ROWS),
                    help="speed-leg rows (default: all)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--fsdp2", action="store_true",
                    help="the FSDP2 rows instead (fsdp2_hsdp, fsdp2_scape: module docstring)")
    args = ap.parse_args(argv)
    rows = FSDP2_ROWS if args.fsdp2 else tuple(args.rows)
    model, warmup = ("tiny", 2) if args.quick else ("small", 2)
    if args.quick:
        args.bandwidth, args.steps, args.quality_steps = args.bandwidth[:1], 8, 40
    os.makedirs(args.out, exist_ok=True)
    rep: dict[str, Any] = {"schema": SCHEMA, "nodes": NODES, "per_node": PER_NODE,
                           "model": model, "environment": environment("cpu", None)}
    if args.leg in ("speed", "both"):
        ok, why = available()
        if ok:
            rep["speed"] = [speed_leg(r, model, args.steps, warmup, rows)
                            for r in args.bandwidth]
        else:
            print(f"speed leg skipped: {why}", file=sys.stderr)
            rep["speed_skipped"] = why
    if args.leg in ("quality", "both"):
        rep["quality"] = quality_leg(model, args.quality_steps, TUNED_LR, args.fsdp2)
    with open(os.path.join(args.out, "report.json"), "w") as f:
        json.dump(rep, f, indent=1)
    text = render(rep)
    with open(os.path.join(args.out, "report.md"), "w") as f:
        f.write(text)
    print(text, end="")
    print(f"wrote {args.out}/report.json and report.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
