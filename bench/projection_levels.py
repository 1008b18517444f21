"""Two-level projection: one data-parallel step on R nodes of G GPUs (W = R*G), per method.

A model, not a measurement. It extends the alpha-beta model of ``bench.projection`` (whose
constants, ring cost and compute time it imports) to a cluster with two levels: NVLink
inside a node, one NIC per node across nodes.

Methods, payload bytes per rank per step (ring factors dropped, as in DESIGN §1; b_g = b_p = 2,
bf16 on the wire; K and N_pad of DESIGN §1 at W ranks, ``bench.projection.mask_size``):

    dense HSDP      intra N*(b_g+b_p) (dense RS + AG inside)   inter 2*(N/G)*b (RS + AG of the
                    slice among the R ranks holding it, i.e. an all-reduce of the slice)
    ZeRO++          as dense HSDP with the paper's per-collective factors: gradients in int4
                    (x0.25 of fp16, qgZ), weight all-gather in int8 (x0.5, qwZ), on both levels
    flat SCAPE      inter K*(b_g+b_p+2) + 8 per rank: every rank's compact buffers cross the NIC
    hier. SCAPE     intra N_pad*b_g + K*(b_p+2) + 8 (dense RS of the whole gradient buffer, the
                    node halves of the parameter and mask all-gathers, the scalar all-reduce);
                    inter (K/G)*(b_g+b_p+2) + 8 (the rank's slice only)

so the node's NIC carries K*(b_g+b_p+2) per hierarchical step and G*K*(b_g+b_p+2) per flat
one. That 1/G holds where every rank's bytes cross the NIC (a transport that is not
topology-aware). NCCL's own rings are: they cross each node's NIC once per ring, so a flat
SCAPE step puts about K*(b_g+b_p+2) on it too. A second flat row, "topology-aware ring",
models that case; there the two levels save ring latency only, and pay the dense NVLink
reduce-scatter.

Step time: compute (6N FLOPs/token at MFU*peak) plus every collective in sequence, each an
NCCL ring (``bench.projection.ring_time``: baseLat + (n-1)*hwLat + bytes*(n-1)/n / busBw)
on its level; SCAPE's mask all-gather (2K bytes) hides behind the next step's compute on the
slow level (flat: all of it; hierarchical: the inter-node half, the node half is waited).

A second table models a model too big for one GPU, sharded by FSDP2 inside the node (its
forward and backward weight all-gathers and gradient reduce-scatter, ``N*(2*b_p + b_g)`` per
rank inside), across nodes either FSDP2's HSDP (an all-reduce of the rank's slice, ``2*(N/G)*b_g``)
or SCAPE over ``dp_replicate`` on the local shard (``K_loc*(b_g+b_p+2) + 8``, ``K_loc`` of the
shard ``N/G`` on R ranks): Llama-1.8B and an 8B Llama (``FSDP2_MODELS``).

Every assumption is in ``ASSUMPTIONS`` (printed by ``--assumptions``, kept in the JSON).

    python -m bench.projection_levels [--out bench/results/projection_levels.json]
                                      [--plot bench/results/projection_levels.png] [--smoke]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path
from typing import Any, TextIO

from bench import projection as pj

MODEL = "Llama-1.8B"
PER_NODE = 8
NIC_LINKS = ("100G", "400G")
WORLDS = (16, 32, 64, 128, 256, 512, 1024)
TABLE_WORLDS = (64, 256, 1024)
TOKENS_PER_GPU = 2048
GRAD_BYTES = PARAM_BYTES = 2
MASK_BYTES = 2
"""int16 offsets of the mask inside its block (DESIGN §1)."""
SCALAR_BYTES = 8
"""The sparse step's one scalar all-reduce (sum of squares, non-finite count)."""

ZEROPP_SOURCE = "ZeRO++, Wang et al., arXiv 2306.10209"
ZEROPP: dict[str, float] = {
    "paper_cross_node_volume_zero3_M": 3.0,
    "paper_cross_node_volume_zeropp_M": 0.75,
    "paper_weight_allgather_factor_qwZ_int8": 0.5,
    "paper_backward_allgather_cross_node_factor_hpZ": 0.0,
    "paper_gradient_factor_qgZ_int4": 0.25,
}
"""From the paper: ZeRO-3's cross-node volume 3M per step (forward weight all-gather M,
backward weight all-gather M, gradient reduce-scatter M; M = the model in fp16) becomes 0.75M
with ZeRO++ (qwZ int8 weights: 0.5M; hpZ secondary shard inside the node: backward all-gather
0 across nodes; qgZ int4 gradients by all-to-all: 0.25M). Applied here per collective: the
dense step modelled has no backward weight all-gather (parameters are replicated), so hpZ
removes nothing and ZeRO++ moves 0.25*N*b_g + 0.5*N*b_p across a node's NIC = 0.75M, against
dense HSDP's 2M (ratio 0.375, not the paper's 0.25 against ZeRO-3)."""

METHODS = ("dense_hsdp", "zeropp", "flat_scape", "flat_scape_ring", "hier_scape")
LABELS = {"dense_hsdp": "dense sharded AdamS (HSDP)", "zeropp": "ZeRO++ (published volumes)",
          "flat_scape": "flat SCAPE-{s}", "flat_scape_ring": "flat SCAPE-{s}, topology-aware ring",
          "hier_scape": "hierarchical SCAPE-{s}"}
COLORS = {"dense_hsdp": "C0", "zeropp": "C1", "flat_scape": "C3", "flat_scape_ring": "C4",
          "hier_scape": "C2"}

FSDP2_METHODS = ("fsdp2_hsdp", "fsdp2_scape")
FSDP2_LABELS = {"fsdp2_hsdp": "FSDP2 HSDP (dense all-reduce across)",
                "fsdp2_scape": "FSDP2 inside, SCAPE-{s} across"}
FSDP2_MODELS = {
    "Llama-1.8B": pj.MODELS["Llama-1.8B"],
    "Llama-8B": pj.ModelConfig(
        "Llama-8B", 4096, 32, 32, 14336, 128256, 8192, gated_mlp=True, tied=False,
        learned_pos=False, bias=False,
        note="Llama-3-8B's shape counted without grouped KV heads (8.8B; the real model, "
             "with 8 KV heads, has 8.0B)"),
}

ASSUMPTIONS: dict[str, Any] = {
    "model": f"{MODEL} from bench.projection.MODELS (N counted from its config)",
    "cluster": f"R nodes of G={PER_NODE} GPUs; one NIC per node at 100 or 400 Gbit/s "
               "(per direction), NVLink inside at bench.projection.LINKS_GBPS['NVLink'] "
               f"= {pj.LINKS_GBPS['NVLink']:.0f} Gbit/s per GPU",
    "nic_sharing": "collectives that run on the G ranks of a node at once across nodes (the "
                   "G slice rings of HSDP, ZeRO++ and hierarchical SCAPE; flat SCAPE's W-rank "
                   "ring) share the node's NIC: NIC/G per GPU",
    "flat_scape": "every rank's K*(b_g+b_p+2) crosses the NIC (the library's per-rank payload "
                  "accounting; a transport that is not topology-aware); modelled as a ring "
                  "over all W ranks, every step an inter-node step (hwLat net), busBw = NIC/G "
                  "per GPU",
    "flat_scape_ring": "second flat row: NCCL's topology-aware ring over W ranks, which "
                       "crosses each node's NIC once per ring, so the NIC carries ~K*(b_g+b_p+2) "
                       "per node as in the hierarchical step; busBw = the whole NIC, latency "
                       "(R-1)*hwLat[net] + (W-R)*hwLat[NVLink] (NCCL tuning.cc's split; its "
                       "floor of 3x the network overhead on intra steps is not modelled)",
    "nic": "one NIC per node; a node with one NIC per GPU behaves here as one NIC G times "
           "faster",
    "ring": "NCCL ring alpha-beta (bench.projection.ring_time) per collective and level; "
            f"busBw = {pj.BUS_EFFICIENCY} x line rate; baseLat {pj.NCCL_BASE_LAT_S * 1e6:.1f} us; "
            f"hwLat net {pj.NCCL_HW_LAT_S['net'] * 1e6:.1f} us, NVLink "
            f"{pj.NCCL_HW_LAT_S['nvlink'] * 1e6:.1f} us per ring step",
    "all_reduce": "an all-reduce is a reduce-scatter plus an all-gather; the 8-byte scalar "
                  "all-reduce is counted in bytes but not in time (bench.projection leaves it "
                  "out too; NCCL would run it as a latency-bound tree)",
    "compute": f"6*N FLOPs per token, {TOKENS_PER_GPU} tokens per GPU per step, MFU "
               f"{pj.MFU} of {pj.PEAK_BF16_FLOPS / 1e12:.0f} TFLOP/s (bench.projection)",
    "overlap": "none, except SCAPE's mask all-gather on the slow level, which runs behind the "
               "next step's compute and adds only what outlasts it (as bench.projection)",
    "wire_dtypes": "bf16 gradients and parameters (b_g = b_p = 2), int16 mask offsets",
    "zeropp": "ZEROPP factors on both levels (int4 gradients, int8 weights); quantization "
              "kernels' time not modelled (favours ZeRO++); qgZ's all-to-all timed as a "
              "ring reduce-scatter of the same bytes",
    "steps": "steady-state sparse steps only (dense warm-up, dense_every, eval, checkpoints "
             "not modelled)",
    "G_equals_1": "nothing moves inside a node: intra bytes and time are 0",
    "fsdp2": "FSDP2 (reshard after forward) inside the node: weight all-gathers in forward and "
             "backward and a gradient reduce-scatter, N*(2*b_p + b_g) per rank, the same for "
             "both FSDP2 rows; across nodes HSDP all-reduces the rank's slice of the gradient "
             "(2*(N/G)*b_g), SCAPE sends K_loc*(b_g+b_p+2) + 8 per rank with K_loc the mask "
             "size of the local shard N/G on R ranks; SCAPE's mask all-gather hides behind "
             "compute as above; FSDP2's prefetch overlap not modelled (the same for both)",
    "zeropp_paper": {"source": ZEROPP_SOURCE, **ZEROPP},
    "zeropp_from_paper": "the paper's numbers: ZeRO-3 3M -> ZeRO++ 0.75M cross-node per step, "
                         "split as weights M -> 0.5M (qwZ), backward weights M -> 0 (hpZ), "
                         "gradients M -> 0.25M (qgZ). Ours: applying the two factors that fit "
                         "a step with replicated parameters (0.5, 0.25) to dense HSDP's bytes",
}


@dataclasses.dataclass(frozen=True)
class Cluster:
    nodes: int
    per_node: int
    nic_gbps: float
    nvlink_gbps: float = pj.LINKS_GBPS["NVLink"]

    @property
    def world(self) -> int:
        return self.nodes * self.per_node

    def intra(self) -> pj.Hardware:
        return pj.Hardware(self.nvlink_gbps, hw_lat_s=pj.NCCL_HW_LAT_S["nvlink"])

    def inter_shared(self) -> pj.Hardware:
        """A GPU's share of the NIC: NIC/G, every ring step across the network."""
        return pj.Hardware(self.nic_gbps / self.per_node, hw_lat_s=pj.NCCL_HW_LAT_S["net"])

    def topology_ring(self) -> pj.Hardware:
        """A W-rank ring crossing each NIC once: the mean per-step latency of NCCL's split."""
        w, r = self.world, self.nodes
        lat = ((r - 1) * pj.NCCL_HW_LAT_S["net"] + (w - r) * pj.NCCL_HW_LAT_S["nvlink"]) \
            / max(1, w - 1)
        return pj.Hardware(min(self.nic_gbps, self.nvlink_gbps), hw_lat_s=lat)


def padded(n: int, world: int, block_size: int = 4096) -> int:
    return math.ceil(n / (world * block_size)) * world * block_size


def level_bytes(method: str, n: int, nodes: int, per_node: int, sparsity: float = 0.99,
                block_size: int = 4096) -> dict[str, int]:
    """Payload bytes per step: per rank on each level, and across one node's NIC."""
    g, w = per_node, nodes * per_node
    b_g, b_p, c = GRAD_BYTES, PARAM_BYTES, GRAD_BYTES + PARAM_BYTES + MASK_BYTES
    if method == "dense_hsdp":
        intra, inter = n * (b_g + b_p), math.ceil(n / g) * (b_g + b_p)
    elif method == "zeropp":  # int4 gradients (b/4), int8 weights (b/2); b = 2 bytes (fp16)
        q = ZEROPP["paper_gradient_factor_qgZ_int4"] * b_g \
            + ZEROPP["paper_weight_allgather_factor_qwZ_int8"] * b_p
        intra, inter = round(n * q), round(math.ceil(n / g) * q)
    elif method in ("flat_scape", "flat_scape_ring"):
        k = pj.mask_size(n, w, sparsity, block_size)
        intra, inter = 0, k * c + SCALAR_BYTES
    elif method == "hier_scape":
        k = pj.mask_size(n, w, sparsity, block_size)
        intra = padded(n, w, block_size) * b_g + k * (b_p + MASK_BYTES) + SCALAR_BYTES
        inter = k // g * c + SCALAR_BYTES
    else:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if g == 1:
        intra = 0
    node = inter if method == "flat_scape_ring" else g * inter  # one ring edge leaves a node
    return {"intra_bytes_per_rank": intra, "inter_bytes_per_rank": inter,
            "inter_bytes_per_node": node}


def step_time(method: str, n: int, cl: Cluster, sparsity: float = 0.99,
              tokens_per_gpu: int = TOKENS_PER_GPU, block_size: int = 4096) -> dict[str, float]:
    """Seconds of one step, split into compute, the intra and inter collectives, the part of
    the mask all-gather that compute does not hide."""
    g, r, w = cl.per_node, cl.nodes, cl.world
    lo, hi = cl.intra(), cl.inter_shared()
    t_c = pj.compute_time(n, tokens_per_gpu, lo)
    ring = pj.ring_time
    exposed = 0.0
    if method in ("dense_hsdp", "zeropp"):
        if method == "dense_hsdp":
            bg, bp = float(GRAD_BYTES), float(PARAM_BYTES)
        else:
            bg = ZEROPP["paper_gradient_factor_qgZ_int4"] * GRAD_BYTES
            bp = ZEROPP["paper_weight_allgather_factor_qwZ_int8"] * PARAM_BYTES
        intra = ring(n * bg, g, lo) + ring(n * bp, g, lo)
        inter = ring(n / g * bg, r, hi) + ring(n / g * bp, r, hi)
    elif method in ("flat_scape", "flat_scape_ring"):
        k = pj.mask_size(n, w, sparsity, block_size)
        hw = hi if method == "flat_scape" else cl.topology_ring()
        intra = 0.0
        inter = ring(k * GRAD_BYTES, w, hw) + ring(k * PARAM_BYTES, w, hw)
        exposed = max(0.0, ring(k * MASK_BYTES, w, hw) - t_c)
    elif method == "hier_scape":
        k = pj.mask_size(n, w, sparsity, block_size)
        intra = (ring(padded(n, w, block_size) * GRAD_BYTES, g, lo)
                 + ring(k * PARAM_BYTES, g, lo) + ring(k * MASK_BYTES, g, lo))
        inter = ring(k / g * GRAD_BYTES, r, hi) + ring(k / g * PARAM_BYTES, r, hi)
        exposed = max(0.0, ring(k / g * MASK_BYTES, r, hi) - t_c)
    else:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    return {"compute_s": t_c, "intra_s": intra, "inter_s": inter, "mask_exposed_s": exposed,
            "step_s": t_c + intra + inter + exposed}


def fsdp2_step(method: str, n: int, cl: Cluster, sparsity: float = 0.99,
               tokens_per_gpu: int = TOKENS_PER_GPU, block_size: int = 4096) -> dict[str, float]:
    """Bytes (per rank inside and across, per node across) and seconds of one step of a model
    sharded by FSDP2 inside each node, with HSDP or SCAPE across (module docstring)."""
    g, r = cl.per_node, cl.nodes
    lo, hi = cl.intra(), cl.inter_shared()
    b_g, b_p = GRAD_BYTES, PARAM_BYTES
    ring = pj.ring_time
    t_c = pj.compute_time(n, tokens_per_gpu, lo)
    shard = math.ceil(n / g)
    intra_b = n * (2 * b_p + b_g) if g > 1 else 0
    intra = 2 * ring(n * b_p, g, lo) + ring(n * b_g, g, lo)
    exposed = 0.0
    if method == "fsdp2_hsdp":
        inter_b = 2 * shard * b_g
        inter = 2 * ring(shard * b_g, r, hi)
    elif method == "fsdp2_scape":
        k = pj.mask_size(shard, r, sparsity, block_size)
        inter_b = k * (b_g + b_p + MASK_BYTES) + SCALAR_BYTES
        inter = ring(k * b_g, r, hi) + ring(k * b_p, r, hi)
        exposed = max(0.0, ring(k * MASK_BYTES, r, hi) - t_c)
    else:
        raise ValueError(f"method must be one of {FSDP2_METHODS}, got {method!r}")
    return {"compute_s": t_c, "intra_s": intra, "inter_s": inter, "mask_exposed_s": exposed,
            "step_s": t_c + intra + inter + exposed, "intra_bytes_per_rank": intra_b,
            "inter_bytes_per_rank": inter_b, "inter_bytes_per_node": g * inter_b}


def fsdp2_rows(worlds: tuple[int, ...], links: tuple[str, ...], sparsity: float = 0.99,
               per_node: int = PER_NODE) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for model, cfg in FSDP2_MODELS.items():
        n = cfg.n_params()
        for link in links:
            for w in worlds:
                cl = Cluster(w // per_node, per_node, pj.LINKS_GBPS[link])
                base = fsdp2_step("fsdp2_hsdp", n, cl)["step_s"]
                for method in FSDP2_METHODS:
                    s = sparsity if method == "fsdp2_scape" else 0.0
                    t = fsdp2_step(method, n, cl, s)
                    out.append({"model": model, "n_params": n, "method": method,
                                "label": FSDP2_LABELS[method].format(s=s), "sparsity": s,
                                "link": link, "world": w, "nodes": cl.nodes, **t,
                                "speedup_vs_hsdp": base / t["step_s"]})
    return out


def rows(worlds: tuple[int, ...], links: tuple[str, ...], sparsities: tuple[float, ...],
         per_node: int = PER_NODE, model: str = MODEL) -> list[dict[str, Any]]:
    n = pj.MODELS[model].n_params()
    out: list[dict[str, Any]] = []
    for link in links:
        for w in worlds:
            cl = Cluster(w // per_node, per_node, pj.LINKS_GBPS[link])
            base = step_time("dense_hsdp", n, cl)["step_s"]
            for method in METHODS:
                for s in (sparsities if "scape" in method else (0.0,)):
                    t = step_time(method, n, cl, s)
                    by = level_bytes(method, n, cl.nodes, per_node, s)
                    out.append({"model": model, "method": method,
                                "label": LABELS[method].format(s=s), "sparsity": s,
                                "link": link, "nic_gbps": cl.nic_gbps, "world": w,
                                "nodes": cl.nodes, "per_node": per_node, **t, **by,
                                "speedup_vs_hsdp": base / t["step_s"],
                                "tokens_per_s_per_gpu": TOKENS_PER_GPU / t["step_s"]})
    return out


def report(smoke: bool = False) -> dict[str, Any]:
    worlds, links = ((16, 64), ("400G",)) if smoke else (WORLDS, NIC_LINKS)
    m = pj.MODELS[MODEL]
    return {"schema": "scape.projection_levels/1", "assumptions": ASSUMPTIONS,
            "model": {**dataclasses.asdict(m), "n_params": m.n_params()},
            "per_node": PER_NODE, "table_worlds": list(TABLE_WORLDS),
            "rows": rows(worlds, links, (0.9, 0.99)),
            "fsdp2_rows": fsdp2_rows(tuple(w for w in TABLE_WORLDS if w in worlds) or worlds,
                                     links)}


def _name(r: dict[str, Any]) -> str:
    return str(r["label"])


def print_report(rep: dict[str, Any], file: TextIO | None = None) -> None:
    p = lambda *a: print(*a, file=file or sys.stdout)  # noqa: E731
    p(f"{MODEL} (N = {rep['model']['n_params'] / 1e6:.1f}M), {PER_NODE} GPUs per node, "
      f"{TOKENS_PER_GPU} tokens/GPU/step. A model, not a measurement (--assumptions).")
    p(f"  {'method':46} {'link':5} {'W':>5} {'step ms':>8} {'vs HSDP':>7} "
      f"{'NIC MB/node':>11} {'intra ms':>8} {'inter ms':>8}")
    for r in rep["rows"]:
        p(f"  {_name(r):46} {r['link']:5} {r['world']:>5} {r['step_s'] * 1e3:8.1f} "
          f"{r['speedup_vs_hsdp']:6.2f}x {r['inter_bytes_per_node'] / 1e6:11.1f} "
          f"{r['intra_s'] * 1e3:8.1f} {r['inter_s'] * 1e3:8.1f}")
    p("\nNIC bytes per node per step, then step time (speed-up over dense HSDP):\n")
    p(markdown(rep))
    p("\nFSDP2 inside the node; step time (speed-up over FSDP2 HSDP), NIC bytes per node:\n")
    p(markdown_fsdp2(rep))


def markdown(rep: dict[str, Any]) -> str:
    """The two tables of docs/benchmarks.md ("Two levels: projection"), from the JSON."""
    worlds = [w for w in rep["table_worlds"] if any(r["world"] == w for r in rep["rows"])]
    links = sorted({r["link"] for r in rep["rows"]}, key=lambda s: pj.LINKS_GBPS[s])
    cell = {(_name(r), r["link"], r["world"]): r for r in rep["rows"]}
    names = list(dict.fromkeys(_name(r) for r in rep["rows"]))
    head = " | ".join(f"W={w:,}" for w in worlds)
    rule = "|---" * (len(worlds) + 1) + "|"
    out = [f"| method | {head} |", rule]
    for name in names:  # bytes do not depend on the link
        by = [cell[name, links[0], w]["inter_bytes_per_node"] / 1e6 for w in worlds]
        out.append(f"| {name} | " + " | ".join(f"{b:,.1f} MB" for b in by) + " |")
    out += ["", f"| method | link | {head} |", rule + "---|"]
    for link in links:
        for name in names:
            rs = [cell[name, link, w] for w in worlds]
            out.append(f"| {name} | {link} | " + " | ".join(
                f"{r['step_s'] * 1e3:.1f} ms ({r['speedup_vs_hsdp']:.2f}×)" for r in rs) + " |")
    return "\n".join(out)


def markdown_fsdp2(rep: dict[str, Any]) -> str:
    """The FSDP2 table of docs/benchmarks.md, from the JSON."""
    fr = rep.get("fsdp2_rows", [])
    worlds = sorted({r["world"] for r in fr})
    head = " | ".join(f"W={w:,}" for w in worlds)
    out = [f"| model | link | method | {head} |", "|---|---|---" + "|---" * len(worlds) + "|"]
    keys = list(dict.fromkeys((r["model"], r["link"], r["label"]) for r in fr))
    cell = {(r["model"], r["link"], r["label"], r["world"]): r for r in fr}
    for model, link, label in keys:
        rs = [cell[model, link, label, w] for w in worlds]
        out.append(f"| {model} | {link} | {label} | " + " | ".join(
            f"{r['step_s'] * 1e3:.0f} ms ({r['speedup_vs_hsdp']:.2f}×), "
            f"{r['inter_bytes_per_node'] / 1e6:,.0f} MB" for r in rs) + " |")
    return "\n".join(out)


def print_assumptions(file: TextIO | None = None) -> None:
    for key, val in ASSUMPTIONS.items():
        if isinstance(val, dict):
            val = "; ".join(f"{k} = {v}" for k, v in val.items())
        print(f"{key}: {val}", file=file or sys.stdout)


def plot(rep: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    links = sorted({r["link"] for r in rep["rows"]}, key=lambda s: pj.LINKS_GBPS[s])
    fig, axes = plt.subplots(1, len(links), figsize=(6 * len(links), 5.2), squeeze=False,
                             sharey=True)
    for ax, link in zip(axes[0], links):
        sel = [r for r in rep["rows"] if r["link"] == link]
        for method, sp in dict.fromkeys((r["method"], r["sparsity"]) for r in sel):
            mine = [r for r in sel if r["method"] == method and r["sparsity"] == sp]
            pts = sorted((r["world"], r["step_s"] * 1e3) for r in mine)
            ax.plot(*zip(*pts), marker="o", ms=3, label=_name(mine[0]), color=COLORS[method],
                    ls="--" if 0.0 < sp < 0.99 else "-")
        floor = sorted((r["world"], r["compute_s"] * 1e3) for r in sel
                       if r["method"] == "dense_hsdp")
        ax.plot(*zip(*floor), color="black", lw=0.8, ls=":", label="compute alone")
        ax.set(xscale="log", yscale="log", xlabel="GPUs", title=f"{MODEL}, NIC {link} per node")
        ax.grid(alpha=0.3, which="both")
    axes[0][0].set_ylabel("step time, ms (model)")
    handles, names = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, names, loc="lower center", ncol=5, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Two-level projection of dense, ZeRO++ and SCAPE.")
    ap.add_argument("--out", default="bench/results/projection_levels.json")
    ap.add_argument("--plot", default=None, help="write the step-time plot here (PNG)")
    ap.add_argument("--smoke", action="store_true", help="a small grid (CI)")
    ap.add_argument("--assumptions", action="store_true", help="print the assumptions and exit")
    args = ap.parse_args(argv)
    if args.assumptions:
        print_assumptions()
        return
    rep = report(smoke=args.smoke)
    print_report(rep)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rep, indent=1))
    print(f"wrote {out}")
    if args.plot:
        plot(rep, Path(args.plot))
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
