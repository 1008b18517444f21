"""The main job's report: the two legs' tables, the byte formula each row is checked against,
the targets, the headline, the environment and the markdown (:mod:`bench.compare` runs it)."""

from __future__ import annotations

import os
import platform
import subprocess
from typing import Any

from bench.engine.local_sgd_opts import steady_bytes
from bench.engine.report import fmt, markdown_table
from scape.rules import block_budget
from scape.wire import fused_segment_bytes, mask_bytes, segment_bytes

SCHEMA = "scape.compare/2"
HEADLINE = "scape-0.99"
"""The row the headline speaks for."""

TARGETS = (
    ("scape-0.99 step time / compute_only", "<=", 1.15),
    ("adams step time / scape-0.99 step time", ">=", 3.0),
    ("scape-0.99 bytes / adams bytes", "<=", 1 / 50),
    ("scape-0.9 val loss / adams val loss", "<=", 1.01),
    ("scape-0.99 val loss / adams val loss", "<=", 1.03),
    ("scape-0.99 val loss / topk-0.99 val loss", "<", 1.0),
)
"""The project's targets, evaluated on the measured results (reported, never tuned for):
step times and bytes from the speed leg, losses from the quality leg."""


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


ENTRY_BYTES = 4 + 4
"""Wire bytes per mask coordinate of a SCAPE sparse step besides its offset: its gradient
value (fp32, the reduce-scatter) and its new parameter value (the all-gather)."""


def mask_coords(n_pad: int, sparsity: float, block: int = 4096, explore: float = 0.1) -> int:
    """``K = (N_pad / B) * k_b``: the coordinates one step's masks take over ``n_pad``."""
    return (n_pad // block) * block_budget(sparsity, block, explore)[0]


def formula_bytes(run: dict[str, Any], world: int) -> int | None:
    """Payload bytes per steady step per rank that DESIGN §1 predicts for ``run`` (an fp32
    model, the ``comm.stats`` convention), from its layout: ``N`` parameters, ``N_pad``
    padded coordinates (``run["n_pad"]``), ``K`` mask coordinates (``W`` times each rank's
    mask rows, ``run["mask_rows"]``, or ``(N_pad / B) * k_b``).

    DDP all-reduce ``2 * 4 * N``; dense sharded AdamS and DistributedAdamW ``N_pad * (4 + 4)
    + 8``; a SCAPE sparse step ``K * (4 + 4)``, each rank's next mask (Elias-Fano rows,
    :func:`scape.wire.mask_bytes`) and each rank's count and sum of squares (``W * 8``,
    riding in the step's two collectives); with the 8-bit wires (``grad_comm_dtype`` or
    ``param_comm_dtype`` ``int8``) that leg's values are every owner's segment of codes and
    row scales instead (:func:`scape.wire.fused_segment_bytes`, the gradients' with the
    count ahead); top-k ``W * K * (2 + 4)``. None where the row has no single per-step
    formula (local-step rows, the compute-only floor, a per-group split, a 16-bit wire,
    clipping)."""
    cfg, n_pad = run["config"], run.get("n_pad")
    opt = cfg["optimizer"]
    if opt == "adamw_ddp":
        return 2 * 4 * int(run["params"])
    if n_pad is None:
        return None
    if opt in ("adams", "dist_adamw"):
        return 8 * n_pad + 8
    kw = cfg.get("optimizer_kwargs") or {}
    wire8 = {key: _is_int8(kw[key]) for key in ("grad_comm_dtype", "param_comm_dtype")
             if kw.get(key) is not None}
    if opt not in ("scape", "topk") or cfg.get("group_sparsity") or "max_grad_norm" in kw \
            or not all(wire8.values()):
        return None
    settings = run.get("optimizer_settings", {})
    block = int(settings.get("block_size", 4096))
    explore = float(settings.get("explore", 0.0)) if opt == "scape" else 0.0
    if opt == "scape":
        k_b = block_budget(cfg["sparsity"], block, explore)[0]
        # each bucket's rows per rank and k (the embeddings' bucket has its own k; a record
        # without them: one bucket), every rank's mask rows coded apart
        rows = [(int(n), int(k)) for n, k in
                run.get("mask_rows") or [[n_pad // block // world, k_b]]]
        coords = world * sum(n * k for n, k in rows)
        grads = (world * fused_segment_bytes(rows, 1) if "grad_comm_dtype" in wire8
                 else (coords + world) * 4)
        values = (world * sum(segment_bytes(n, k) for n, k in rows)
                  if "param_comm_dtype" in wire8 else coords * 4)
        return grads + values + world * 4 \
            + sum(world * mask_bytes(n, k, block) for n, k in rows)
    return world * mask_coords(n_pad, cfg["sparsity"], block, explore) * 6


def _is_int8(dtype: Any) -> bool:
    return str(dtype).removeprefix("torch.") == "int8"


def quality_table(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per quality-leg run: final validation loss and its ratio to dense AdamS."""
    dense = next((r for r in runs if r["name"] == "adams"), {})
    return [{"name": r["name"], "optimizer": r["config"]["optimizer"],
             "sparsity": r["config"]["sparsity"], "final_val_loss": r["final_val_loss"],
             "val_ratio_to_adams": ratio(r["final_val_loss"], dense.get("final_val_loss")),
             "val_curve": r["val_curve"]} for r in runs]


def speed_table(runs: list[dict[str, Any]], world: int) -> list[dict[str, Any]]:
    """Per speed-leg run: median step, its ratio to compute-only, the speed-up over dense
    sharded AdamS, and bytes per step per rank against the formula and against dense.

    ``bytes_per_step`` is :func:`bench.engine.local_sgd_opts.steady_bytes`: the per-step median for
    optimizers that communicate every step, the mean over all steps for the local-step ones
    (``bytes_basis`` says which)."""
    by = {r["name"]: r for r in runs}
    dense, floor = by.get("adams", {}), by.get("compute_only", {})
    dense_bytes = steady_bytes(dense)[0] if dense else None
    rows = []
    for r in runs:
        nbytes, basis = steady_bytes(r)
        formula = None if r["name"] == "compute_only" else formula_bytes(r, world)
        first, last = r.get("timing_window") or (1, 0)
        window = (r.get("step_s") or [])[first - 1:last]
        rows.append({
            "name": r["name"], "optimizer": r["config"]["optimizer"],
            "sparsity": r["config"]["sparsity"],
            "median_step_s": r["median_step_s"], "mean_step_s":
                sum(window) / len(window) if window else None,
            "median_wait_s": r["median_wait_s"], "median_compute_s": r["median_compute_s"],
            "step_ratio_to_compute_only": ratio(r["median_step_s"], floor.get("median_step_s")),
            "speedup_over_adams": ratio(dense.get("median_step_s"), r["median_step_s"]),
            "bytes_per_step": nbytes, "bytes_basis": basis,
            "bytes_formula": formula,
            "bytes_ratio_to_formula": ratio(nbytes, formula) if basis == "median" else None,
            "bytes_ratio_to_adams": ratio(nbytes, dense_bytes),
        })
    return rows


def evaluate_targets(quality: list[dict[str, Any]], speed: list[dict[str, Any]]
                     ) -> list[dict[str, Any]]:
    q = {r["name"]: r for r in quality}
    s = {r["name"]: r for r in speed}

    def get(rows: dict[str, Any], name: str, key: str) -> float | None:
        return rows[name][key] if name in rows else None

    values = [
        ratio(get(s, "scape-0.99", "median_step_s"), get(s, "compute_only", "median_step_s")),
        ratio(get(s, "adams", "median_step_s"), get(s, "scape-0.99", "median_step_s")),
        ratio(get(s, "scape-0.99", "bytes_per_step"), get(s, "adams", "bytes_per_step")),
        ratio(get(q, "scape-0.9", "final_val_loss"), get(q, "adams", "final_val_loss")),
        ratio(get(q, "scape-0.99", "final_val_loss"), get(q, "adams", "final_val_loss")),
        ratio(get(q, "scape-0.99", "final_val_loss"), get(q, "topk-0.99", "final_val_loss")),
    ]
    out = []
    for (what, op, threshold), v in zip(TARGETS, values):
        met = None if v is None else {"<=": v <= threshold, ">=": v >= threshold,
                                      "<": v < threshold}[op]
        out.append({"target": f"{what} {op} {threshold:.4g}", "value": v, "met": met})
    return out


def headline(report: dict[str, Any]) -> dict[str, Any]:
    """SCAPE-0.99's three numbers (None where its leg or dense AdamS did not run) and the
    one line that says them."""
    q = {r["name"]: r for r in report["quality"]["table"]} if report.get("quality") else {}
    s = {r["name"]: r for r in report["speed"]["table"]} if report.get("speed") else {}
    loss = q.get(HEADLINE, {}).get("val_ratio_to_adams")
    nbytes = s.get(HEADLINE, {}).get("bytes_ratio_to_adams")
    speedup = s.get(HEADLINE, {}).get("speedup_over_adams")
    steps = report["quality"]["workload"]["steps"] if report.get("quality") else None
    link = None
    if report.get("speed"):
        rate = report["speed"]["link"]["requested"]
        link = f"a {rate} link" if rate else "the unshaped loopback"
    parts = []
    if loss is not None:
        parts.append(f"val loss {loss:.3f}x dense AdamS after {steps} steps")
    if nbytes:
        parts.append(f"bytes 1/{1 / nbytes:.1f} of dense")
    if speedup is not None:
        parts.append(f"step {speedup:.1f}x faster than dense sharded AdamS on {link}")
    text = (f"SCAPE-0.99 (update=\"{report.get('update', 'agree')}\"): " + ", ".join(parts)
            if parts else "SCAPE-0.99: no headline (scape-0.99 or adams did not run)")
    return {"loss_ratio": loss, "bytes_ratio": nbytes, "speedup": speedup, "text": text}


def environment(device: str, device_name: str | None) -> dict[str, Any]:
    """Where the job ran: cores, versions, the git revision of this checkout, the device."""
    import torch

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def git(*args: str) -> str | None:
        try:
            r = subprocess.run(["git", "-C", root, *args], capture_output=True, text=True,
                               timeout=20)
        except (OSError, subprocess.SubprocessError):
            return None
        return r.stdout.strip() if r.returncode == 0 else None

    status = git("status", "--porcelain", "--untracked-files=no")
    return {"platform": platform.platform(), "python": platform.python_version(),
            "cpus": os.cpu_count(), "cpus_usable": len(os.sched_getaffinity(0))
            if hasattr(os, "sched_getaffinity") else os.cpu_count(),
            "torch": torch.__version__, "git_revision": git("rev-parse", "HEAD"),
            "git_dirty": None if status is None else bool(status),
            "device": device, "device_name": device_name or "cpu"}


def verify_link(rate: str | None, seconds: float = 1.0) -> dict[str, Any]:
    """The speed leg's link: the requested tc rate and the rate one TCP stream is delivered
    at through a fresh namespace shaped the same way (:func:`bench.engine.netns.measure_tcp_rate`);
    unshaped: the loopback's own rate is not measured (it is not the bottleneck)."""
    if rate is None:
        return {"requested": None, "requested_bps": None, "delivered_bps": None,
                "label": "unshaped loopback"}
    from bench.engine.netns import format_rate, measure_tcp_rate, parse_rate, shaped_namespace

    bits = parse_rate(rate)
    with shaped_namespace(bits) as ns:
        got = measure_tcp_rate(ns.prefix, max(1 << 20, int(bits / 8 * seconds)))
    return {"requested": rate, "requested_bps": bits, "delivered_bps": got,
            "label": f"{format_rate(bits)} link (delivered {format_rate(got)})"}


def _ms(v: float | None) -> str:
    return fmt(None if v is None else v * 1e3, ".0f")


def _bytes_cell(n: float | None, basis: str | None) -> str:
    return "-" if n is None or n == 0 else fmt(int(n)) + (" *" if basis == "mean_all_steps"
                                                          else "")


def _vs(r: float | None) -> str:
    return "-" if not r else ("1" if abs(r - 1) < 1e-12 else f"1/{1 / r:.1f}")


def render_markdown(report: dict[str, Any]) -> str:
    """The headline, the side-by-side table, each leg's detail, the targets."""
    q = {r["name"]: r for r in report["quality"]["table"]} if report.get("quality") else {}
    s = {r["name"]: r for r in report["speed"]["table"]} if report.get("speed") else {}
    names = list(dict.fromkeys([*q, *s]))
    link = (report["speed"]["link"]["requested"] or "unshaped") if s else "-"
    steps = report["quality"]["workload"]["steps"] if q else "-"
    floor = {"bytes_per_step": None}  # compute-only's counters: what SCAPE-0.99 would send
    rows = [[n, fmt(q.get(n, {}).get("final_val_loss")),
             fmt(q.get(n, {}).get("val_ratio_to_adams"), ".3f"),
             _bytes_cell((floor if n == "compute_only" else s.get(n, {})).get("bytes_per_step"),
                         s.get(n, {}).get("bytes_basis")),
             _vs(None if n == "compute_only" else s.get(n, {}).get("bytes_ratio_to_adams")),
             _ms(s.get(n, {}).get("median_step_s")),
             fmt(s.get(n, {}).get("speedup_over_adams"), ".2f")] for n in names]
    main = markdown_table(["optimizer", f"val loss ({steps} steps)", "vs dense AdamS",
                           "bytes/step/rank", "vs dense", f"step ms, {link}",
                           "speed-up vs dense AdamS"], rows)
    parts = [f"# bench.compare\n\n**{report['headline']['text']}**\n",
             f"`{report['command']}`, {report['date']}, {_where(report)}. "
             f"Wall time {report['wall_s']:.0f} s.\n", main]
    if s:
        detail = [[r["name"], _ms(r["median_step_s"]), _ms(r["median_wait_s"]),
                   fmt(r["step_ratio_to_compute_only"], ".2f"),
                   _bytes_cell(r["bytes_per_step"], r["bytes_basis"]),
                   "-" if r["bytes_formula"] is None else fmt(r["bytes_formula"]),
                   fmt(r["bytes_ratio_to_formula"], ".4f")] for r in report["speed"]["table"]]
        w = report["speed"]["workload"]
        parts.append(f"\n## Speed leg\n\n{report['speed']['link']['label']}; {w['steps']} steps, "
                     f"SCAPE/top-k dense warm-up {w['warmup_steps']}, medians over steps "
                     f"{report['speed']['timing_window'][0]}-"
                     f"{report['speed']['timing_window'][1]} of rank 0.\n\n" + markdown_table(
                         ["optimizer", "median step ms", "wait ms", "vs compute-only",
                          "bytes/step/rank", "formula", "measured / formula"], detail))
    if any(r.get("bytes_basis") == "mean_all_steps" for r in s.values()):
        parts.append("\n\\* local-step method: communicates only every H steps, so its bytes "
                     "are the mean over all steps (`bytes_per_step_mean_all_steps`: a sync's "
                     "bytes / H, averaged over the sync periods), not the per-step median (0); "
                     "its median step is a step without a sync (`mean_step_s` in report.json "
                     "includes the syncs).")
    for text in report.get("warnings", []):
        parts.append(f"\n{text}")
    targets = markdown_table(["target", "measured", "met"],
                             [[t["target"], fmt(t["value"], ".4g"),
                               {True: "yes", False: "**no**", None: "-"}[t["met"]]]
                              for t in report["targets"]])
    if report.get("quick"):
        targets = ("None judged: `--quick` is a smoke that shows every leg runs (a tiny model, "
                   "a few steps).")
    parts.append(f"\n## Targets\n\n{targets}\n")
    return "\n".join(parts)


def _where(report: dict[str, Any]) -> str:
    env = report["environment"]
    parts = [f"{env['cpus_usable']} CPU cores", f"torch {env['torch']}",
             f"device {env['device_name']}"]
    if report.get("quality"):
        w = report["quality"]["workload"]
        parts.append(f"W={w['world']}, model {w['model']} ({report['params']:,} parameters), "
                     f"{w['batch']}x{w['seq']} bytes per rank and step, lr {w['lr']:g} "
                     f"({report['quality']['lr_source']}), quality leg on the unshaped "
                     "loopback")
    rev = env.get("git_revision")
    if rev:
        parts.append(f"revision {rev[:10]}{' (modified)' if env.get('git_dirty') else ''}")
    return ", ".join(parts)
