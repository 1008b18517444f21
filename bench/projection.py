"""GPU-cluster projection: an alpha-beta model of one data-parallel training step.

What it models. One step of sharded (ZeRO-1) data-parallel training on W GPUs:

    dense sharded AdamS:  t = t_compute + t_RS(N*b_g) + t_AG(N*b_p)          (no overlap)
    SCAPE:                t = t_compute + t_RS(K*b_g) + t_AG(K*b_p)
                          (+ the mask all-gather of 2K bytes, overlapped with the next
                           forward/backward: it adds time only where it outlasts compute)

with ``K`` the mask size of DESIGN §1 (every block of B=4096 coordinates keeps
``max(1, round((1-sparsity)*B))``, over the flat buffer padded to a multiple of W*B).
Bytes per rank per step, ring factor (W-1)/W dropped as in DESIGN: dense ``N*(b_g+b_p)``,
SCAPE ``K*(b_g+b_p+2)``.

Collectives follow NCCL's own cost model for ring all-gather / reduce-scatter (NVIDIA/nccl
``src/graph/tuning.cc``, ``ncclTopoTuneModel`` and ``ncclTopoGetAlgoTime``)::

    t(n) = baseLat + (W-1) * hwLat + n * (W-1)/W / busBw
         = (W-1) * (alpha + n/W / busBw) + baseLat,      n = bytes of the full buffer

Compute: ``6 * N * tokens`` FLOPs per GPU per step (forward 2N, backward 4N per token;
attention's extra FLOPs left out, as in the paper-style "6N" count) at ``MFU * peak``.

Every constant is below with its source, printed beside each result (``--assumptions``).
Two numbers are judgement calls and get sensitivity lines: the achieved fraction of the link
(bus bandwidth efficiency) and the MFU at ~2k tokens per GPU per step.

    python -m bench.projection [--out bench/results/projection.json] [--smoke]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path

# ------------------------------------------------------------------------------ constants

PEAK_BF16_FLOPS = 989e12
"""Dense BF16 tensor-core peak of the Hopper GPU in a GH200 (the same figure as H100 SXM5:
989.4 TFLOP/s without sparsity; NVIDIA H100 / GH200 datasheets)."""

MFU = 0.30
"""Model FLOPs utilisation assumed at ~2k tokens per GPU per step. Public reference: MosaicML
llm-foundry's H100 BF16 table (scripts/train/benchmarking/README.md) measures 35-42% MFU for
760M-1.3B models at sequence length 2048 -- but with 14-24 sequences per GPU per step. The
paper's setting has about one 2048-token sequence per GPU, where fixed per-kernel costs weigh
more, so a lower value is taken. Sensitivity 0.2-0.4 is printed."""

BUS_EFFICIENCY = 0.90
"""Achieved NCCL bus bandwidth as a fraction of the link's line rate for large messages.
nccl-tests on 400 Gb/s NDR InfiniBand typically report 45-48 GB/s bus bandwidth per NIC
(0.90-0.96 of 50 GB/s); 0.90 is the lower end. Sensitivity 0.8-1.0 is printed."""

NCCL_BASE_LAT_S = 8.4e-6
"""NCCL ``baseLat[Ring][Simple]`` = 8.4 us (src/graph/tuning.cc, Simple protocol, which
NCCL picks for the large messages of a gradient/parameter collective)."""

NCCL_HW_LAT_S = {"net": 9.6e-6, "nvlink": 3.4e-6}
"""NCCL ``hwLat[NET|NVLINK][Ring][Simple]`` per ring step: 9.6 us over the network, 3.4 us over
NVLink (same file). With one GPU per node every ring step is an inter-node step."""

LINKS_GBPS = {"100G": 100.0, "200G": 200.0, "400G": 400.0, "NVLink": 3600.0}
"""Per-GPU line rates in Gbit/s, one direction. 100/200/400G are HDR/NDR-class NICs, one per
GPU. NVLink: GH200 NVL32 / DGX GH200 give each GPU 900 GB/s bidirectional NVLink (NVIDIA
GH200 datasheet), i.e. 450 GB/s = 3600 Gbit/s per direction."""

PAPER = {
    "gpus": 32,
    "link": "400G",
    "tokens_per_gpu": 2048,
    "grad_bytes": 2,
    "param_bytes": 2,
    "block_size": 4096,
}
"""The paper's setting (arXiv 2607.01678): 32 GH200 on TACC Vista, one GPU and one 400 Gb/s
NDR link per node, about 2k tokens per GPU per step; bf16 gradients and parameters on the
wire (DESIGN §1's byte count)."""

PAPER_TARGETS = [
    # (name, model, sparsity, metric, published value)
    ("Llama-500M end-to-end wall-clock, SCAPE/dense", "Llama-500M", 0.99, "time_ratio", 0.567),
    ("Llama-1.8B per-step speedup, dense/SCAPE", "Llama-1.8B", 0.99, "speedup", 3.26),
]
"""-43.3% end-to-end wall-clock means SCAPE's time is 56.7% of dense. This model compares with
dense sharded AdamS (AdamW moves the same bytes) and equates end-to-end with steady-state
steps (warm-up, evaluation and checkpoints are not modelled)."""

TOLERANCE = 0.15


# --------------------------------------------------------------------------------- models

@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A transformer's shape, enough to count its parameters exactly."""

    name: str
    d_model: int
    n_layers: int
    n_heads: int
    ffn: int
    """MLP hidden width."""
    vocab: int
    seq_len: int
    gated_mlp: bool
    """SwiGLU (3 matrices, Llama) or GELU (2 matrices, GPT)."""
    tied: bool
    """Output head shares the token embedding."""
    learned_pos: bool
    """Learned position table (GPT) or rotary (Llama, no parameters)."""
    bias: bool
    """Biases in linear layers and LayerNorm (GPT-2/Megatron GPT) or none (Llama)."""
    note: str = ""

    def n_params(self) -> int:
        d, f = self.d_model, self.ffn
        attn = 4 * d * d + (4 * d if self.bias else 0)
        mlp = (3 if self.gated_mlp else 2) * d * f + ((f + d) if self.bias else 0)
        norms = 2 * (2 * d if self.bias else d)
        layer = attn + mlp + norms
        emb = self.vocab * d * (1 if self.tied else 2)
        pos = self.seq_len * d if self.learned_pos else 0
        final_norm = 2 * d if self.bias else d
        return self.n_layers * layer + emb + pos + final_norm


MODELS = {
    m.name: m for m in [
        ModelConfig("GPT-345M", 1024, 24, 16, 4096, 50304, 1024, gated_mlp=False, tied=True,
                    learned_pos=True, bias=True,
                    note="Megatron-LM GPT-345M: 24 layers, hidden 1024, 16 heads, GPT-2 vocab "
                         "50257 padded to 50304, seq 1024, tied head"),
        ModelConfig("Llama-500M", 1280, 20, 20, 3584, 32000, 2048, gated_mlp=True, tied=False,
                    learned_pos=False, bias=False,
                    note="assumed: hidden 1280, 20 layers, 20 heads, SwiGLU 3584 (8/3*d "
                         "rounded up to 256), Llama-2 vocab 32000, untied head"),
        ModelConfig("Llama-1.8B", 2048, 32, 16, 5632, 32000, 2048, gated_mlp=True, tied=False,
                    learned_pos=False, bias=False,
                    note="assumed: hidden 2048, 32 layers, 16 heads, SwiGLU 5632 (TinyLlama's "
                         "width), Llama-2 vocab 32000, untied head"),
    ]
}


# ------------------------------------------------------------------------------ the model

@dataclasses.dataclass(frozen=True)
class Hardware:
    link_gbps: float
    bus_efficiency: float = BUS_EFFICIENCY
    hw_lat_s: float = NCCL_HW_LAT_S["net"]
    base_lat_s: float = NCCL_BASE_LAT_S
    mfu: float = MFU
    peak_flops: float = PEAK_BF16_FLOPS

    @property
    def bus_bytes_per_s(self) -> float:
        return self.link_gbps * 1e9 / 8 * self.bus_efficiency


def hardware(link: str, **overrides: float) -> Hardware:
    if link not in LINKS_GBPS:
        raise ValueError(f"link must be one of {sorted(LINKS_GBPS)}, got {link!r}")
    params = {"hw_lat_s": NCCL_HW_LAT_S["nvlink" if link == "NVLink" else "net"], **overrides}
    return Hardware(LINKS_GBPS[link], **params)


def mask_size(n: int, world: int, sparsity: float, block_size: int = 4096) -> int:
    """K of DESIGN §1: coordinates synchronized by a sparse step (padding included)."""
    if not 0.0 <= sparsity < 1.0:
        raise ValueError(f"sparsity must be in [0, 1), got {sparsity!r}")
    if n < 1 or world < 1 or block_size < 1:
        raise ValueError(f"need n, world, block_size >= 1, got {n}, {world}, {block_size}")
    n_pad = math.ceil(n / (world * block_size)) * world * block_size
    return n_pad // block_size * _row_size(sparsity, block_size)


def _row_size(sparsity: float, block_size: int) -> int:
    """``k_b``: the coordinates one block's mask row takes, as ``scape.rules.block_budget``
    counts them (halves rounded up, where Python's ``round`` goes to even), without torch."""
    return max(1, math.floor((1.0 - sparsity) * block_size + 0.5))


def bytes_per_step(n: int, world: int, sparsity: float, grad_bytes: int = 2,
                   param_bytes: float = 2, block_size: int = 4096,
                   offset_bits: int | None = 16) -> int:
    """Bytes on the wire per rank per step (DESIGN §1, ring factor dropped).

    ``sparsity == 0``: dense sharded AdamS, ``N*(b_g + b_p)``. Otherwise SCAPE,
    ``K*(b_g + b_p) + ceil(K * offset_bits / 8)`` (compact gradients, compact parameters, the
    mask offsets). The projection's model keeps the paper's int16 offsets (``offset_bits=16``);
    ``offset_bits=None`` counts the library's coding instead, every rank's mask rows in
    Elias-Fano code (:func:`scape.wire.mask_bytes`: 1.07 bytes an offset at 0.99).
    ``param_bytes`` may be a fraction (6- and 4-bit updates: 0.75, 0.5): values round up."""
    if sparsity == 0.0:
        return math.ceil(n * (grad_bytes + param_bytes))
    k = mask_size(n, world, sparsity, block_size)
    values = math.ceil(k * (grad_bytes + param_bytes))
    if offset_bits is None:
        from scape.wire import mask_bytes  # torch only for this count
        k_b = _row_size(sparsity, block_size)
        return values + world * mask_bytes(k // k_b // world, k_b, block_size)
    return values + -(-(k * offset_bits) // 8)


def ring_time(nbytes: float, world: int, hw: Hardware) -> float:
    """Seconds for a ring all-gather or reduce-scatter whose full buffer is ``nbytes``."""
    if world == 1:
        return 0.0
    return (hw.base_lat_s + (world - 1) * hw.hw_lat_s
            + nbytes * (world - 1) / world / hw.bus_bytes_per_s)


def compute_time(n: int, tokens_per_gpu: int, hw: Hardware) -> float:
    return 6.0 * n * tokens_per_gpu / (hw.peak_flops * hw.mfu)


def step_times(n: int, world: int, sparsity: float, tokens_per_gpu: int, hw: Hardware,
               grad_bytes: int = 2, param_bytes: int = 2, block_size: int = 4096,
               ) -> dict[str, float]:
    """Compute, dense and SCAPE step times (seconds) and bytes per rank for one setting."""
    t_c = compute_time(n, tokens_per_gpu, hw)
    dense_comm = ring_time(n * grad_bytes, world, hw) + ring_time(n * param_bytes, world, hw)
    k = mask_size(n, world, sparsity, block_size)
    sparse_comm = ring_time(k * grad_bytes, world, hw) + ring_time(k * param_bytes, world, hw)
    mask_comm = ring_time(k * 2, world, hw)
    scape = t_c + sparse_comm + max(0.0, mask_comm - t_c)  # the mask sync hides behind compute
    dense = t_c + dense_comm
    return {
        "compute_s": t_c, "dense_step_s": dense, "scape_step_s": scape,
        "dense_comm_s": dense_comm, "scape_comm_s": sparse_comm, "mask_comm_s": mask_comm,
        "speedup": dense / scape, "time_ratio": scape / dense,
        "dense_tokens_per_s_per_gpu": tokens_per_gpu / dense,
        "scape_tokens_per_s_per_gpu": tokens_per_gpu / scape,
        "dense_bytes": bytes_per_step(n, world, 0.0, grad_bytes, param_bytes),
        "scape_bytes": bytes_per_step(n, world, sparsity, grad_bytes, param_bytes, block_size),
        "mask_size": k,
    }


def paper_setting(model: str, sparsity: float, **hw_overrides: float) -> dict[str, float]:
    tokens = int(hw_overrides.pop("tokens_per_gpu", PAPER["tokens_per_gpu"]))
    hw = hardware(str(PAPER["link"]), **hw_overrides)
    return step_times(MODELS[model].n_params(), int(PAPER["gpus"]), sparsity, tokens, hw,
                      int(PAPER["grad_bytes"]), int(PAPER["param_bytes"]),
                      int(PAPER["block_size"]))


def paper_checks() -> list[dict[str, object]]:
    rows = []
    for name, model, sparsity, metric, target in PAPER_TARGETS:
        got = paper_setting(model, sparsity)[metric]
        rel = got / target - 1.0
        # the compute rate at which this model would hit the published value exactly
        implied = _implied_mfu(model, sparsity, metric, target)
        rows.append({"name": name, "model": model, "sparsity": sparsity, "metric": metric,
                     "target": target, "projected": got, "rel_error": rel,
                     "within_tolerance": abs(rel) <= TOLERANCE, "implied_mfu": implied})
    return rows


def _implied_mfu(model: str, sparsity: float, metric: str, target: float) -> float | None:
    """Bisection on MFU in [0.01, 1]; time_ratio rises and speedup falls with compute time."""
    lo, hi = 0.01, 1.0

    def f(m: float) -> float:
        v = paper_setting(model, sparsity, mfu=m)[metric]
        return (target - v) if metric == "time_ratio" else (v - target)

    if f(lo) * f(hi) > 0:
        return None
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        if f(lo) * f(mid) <= 0:
            hi = mid
        else:
            lo = mid
    return 0.5 * (lo + hi)


def sensitivity() -> list[dict[str, object]]:
    """Each paper check with one assumption moved at a time."""
    variants: list[tuple[str, dict[str, float]]] = [
        ("baseline", {}),
        ("mfu=0.20", {"mfu": 0.20}), ("mfu=0.40", {"mfu": 0.40}),
        ("bus_efficiency=0.80", {"bus_efficiency": 0.80}),
        ("bus_efficiency=1.00", {"bus_efficiency": 1.00}),
        ("hw_lat=14us", {"hw_lat_s": 14e-6}),
        ("tokens_per_gpu=1024", {"tokens_per_gpu": 1024}),
        ("tokens_per_gpu=4096", {"tokens_per_gpu": 4096}),
    ]
    rows = []
    for label, over in variants:
        row: dict[str, object] = {"variant": label}
        for _name, model, sparsity, metric, _target in PAPER_TARGETS:
            row[f"{model}:{metric}"] = paper_setting(model, sparsity, **dict(over))[metric]
        rows.append(row)
    return rows


def projection(worlds: list[int], links: list[str], sparsities: list[float],
               models: list[str], tokens_per_gpu: int = 2048) -> list[dict[str, object]]:
    rows = []
    for model in models:
        n = MODELS[model].n_params()
        for link in links:
            hw = hardware(link)
            for world in worlds:
                for s in sparsities:
                    r = step_times(n, world, s, tokens_per_gpu, hw)
                    rows.append({"model": model, "link": link, "link_gbps": LINKS_GBPS[link],
                                 "world": world, "sparsity": s, **r})
    return rows


def assumptions() -> dict[str, object]:
    return {
        "peak_bf16_flops": PEAK_BF16_FLOPS, "mfu": MFU, "bus_efficiency": BUS_EFFICIENCY,
        "nccl_base_lat_s": NCCL_BASE_LAT_S, "nccl_hw_lat_s": NCCL_HW_LAT_S,
        "links_gbps": LINKS_GBPS, "paper_setting": PAPER, "flops_per_token": "6*N",
        "overlap": "dense: none; SCAPE: mask all-gather hidden behind compute",
        "baseline": "dense sharded AdamS (reduce-scatter bf16 grads + all-gather bf16 params)",
        "end_to_end": "equated with steady-state step time (warm-up, eval, checkpoints "
                      "not modelled)",
        "tolerance": TOLERANCE,
    }


# ---------------------------------------------------------------------------------- output

def _fmt_s(t: float) -> str:
    return f"{t * 1e3:8.1f}"


def report(smoke: bool = False) -> dict[str, object]:
    worlds = [8, 32] if smoke else [8, 16, 32, 64, 128, 256, 512, 1024]
    links = ["400G"] if smoke else list(LINKS_GBPS)
    return {
        "schema": "scape.projection/1",
        "assumptions": assumptions(),
        "models": {k: {**dataclasses.asdict(m), "n_params": m.n_params()}
                   for k, m in MODELS.items()},
        "paper_checks": paper_checks(),
        "sensitivity": sensitivity(),
        "projection": projection(worlds, links, [0.9, 0.99], list(MODELS)),
    }


def print_report(rep: dict[str, object], file=sys.stdout) -> None:
    p = lambda *a: print(*a, file=file)  # noqa: E731
    a = rep["assumptions"]
    assert isinstance(a, dict)
    p("Assumptions")
    p(f"  compute: 6*N FLOPs/token at MFU {a['mfu']:.2f} of {a['peak_bf16_flops'] / 1e12:.0f} "
      "TFLOP/s (GH200 dense BF16)")
    p(f"  network: ring RS/AG, busBw = {a['bus_efficiency']:.2f} x line rate; alpha = NCCL "
      f"baseLat {NCCL_BASE_LAT_S * 1e6:.1f} us + (W-1) x hwLat "
      f"(net {NCCL_HW_LAT_S['net'] * 1e6:.1f} us, NVLink {NCCL_HW_LAT_S['nvlink'] * 1e6:.1f} us)")
    p(f"  paper setting: {PAPER['gpus']} GPUs, {PAPER['link']} per GPU, "
      f"{PAPER['tokens_per_gpu']} tokens/GPU/step, bf16 grads+params, block {PAPER['block_size']}")
    p(f"  baseline: {a['baseline']}; overlap: {a['overlap']}")
    p(f"  end-to-end: {a['end_to_end']}")
    p("Models (parameter counts from the configs)")
    models = rep["models"]
    assert isinstance(models, dict)
    for name, m in models.items():
        p(f"  {name:11} N = {m['n_params'] / 1e6:8.1f}M  ({m['note']})")
    p("Paper checks (tolerance +-15%)")
    for c in rep["paper_checks"]:  # type: ignore[attr-defined]
        implied = "n/a" if c["implied_mfu"] is None else f"{c['implied_mfu']:.3f}"
        p(f"  {c['name']:48} published {c['target']:6.3f}  model {c['projected']:6.3f}  "
          f"({c['rel_error']:+.1%}) {'OK' if c['within_tolerance'] else 'MISS'}  "
          f"[MFU that would match: {implied}]")
    p("Sensitivity (one assumption moved at a time)")
    for r in rep["sensitivity"]:  # type: ignore[attr-defined]
        vals = "  ".join(f"{k} {v:6.3f}" for k, v in r.items() if k != "variant")
        p(f"  {r['variant']:22} {vals}")
    p("Projection: step time (ms) and tokens/s per GPU, 2048 tokens/GPU/step")
    p(f"  {'model':11} {'link':6} {'W':>5} {'sparsity':>8} {'compute':>8} {'dense':>8} "
      f"{'SCAPE':>8} {'speedup':>7} {'dense tok/s':>11} {'SCAPE tok/s':>11} {'bytes ratio':>11}")
    for r in rep["projection"]:  # type: ignore[attr-defined]
        p(f"  {r['model']:11} {r['link']:6} {r['world']:>5} {r['sparsity']:>8} "
          f"{_fmt_s(r['compute_s'])} {_fmt_s(r['dense_step_s'])} {_fmt_s(r['scape_step_s'])} "
          f"{r['speedup']:>7.2f} {r['dense_tokens_per_s_per_gpu']:>11.0f} "
          f"{r['scape_tokens_per_s_per_gpu']:>11.0f} "
          f"{r['dense_bytes'] / r['scape_bytes']:>10.1f}x")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Project SCAPE vs dense step time onto clusters.")
    ap.add_argument("--out", default="bench/results/projection.json")
    ap.add_argument("--smoke", action="store_true", help="a small grid (CI)")
    args = ap.parse_args(argv)
    rep = report(smoke=args.smoke)
    print_report(rep)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rep, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
