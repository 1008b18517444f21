"""``early_probe``: ``early`` bit for bit, recording per block what its catch-ups did.

A diagnostic for where a one-group run lags (docs/research.md, "What `early`'s catch-ups do
per matrix"); as it was measured, with one bucket per group (``early`` without ``attach``:
the embedding matrices are not set apart, :mod:`scape.embeddings`). Before each update it
reads, for every sent coordinate, the wait ``a + 1``, the steps the agreement catch-up asks
for (``(a + 1) * erf(...)``, :func:`scape.rules.catchup_agree`) and its bound (``max(sqrt(a +
1), c * rms_b / lr)``, ``c`` from :func:`scape.rules.trust_bound`), and sums per block of the
shard: coordinates sent, waits, steps asked, steps taken, sends the bound cut. Every
:data:`WINDOW` sparse steps the sums are written to ``$SCAPE_PROBE_DIR/rank<r>_b<bucket>.jsonl``
(one line per window) and restarted. The update itself is ``early``'s, so a run with the
probe trains the same parameters as one without (torch ops read the same state; nothing is
written back).

    SCAPE_PROBE_DIR=/tmp/probe python -m bench.lr_sweep --workloads gpt --steps 2000 \\
        --warmup-steps 1 --seeds 0 --optimizers adams scape-0.9-ramp0.5x20@early_probe \\
        --lrs 1e-3 --out /tmp/probe.json
    python -m bench.research.probe /tmp/probe --model small --world 4
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist

from scape import rules
from scape.buffers import flat_layout
from scape.rules import (
    RULES,
    Rule,
    ShardState,
    arrived_mean,
    mask_positions,
    sign_agreement,
    trust_reach,
)

WINDOW = 250
"""Sparse steps summed into one line of the probe's file."""
FIELDS = ("sent", "wait", "asked", "taken", "cut")


def _stats(shard: ShardState, g: torch.Tensor, idx: torch.Tensor, block_size: int,
           hp: dict) -> torch.Tensor:
    """``[len(FIELDS), n_blocks]``: this update's per-block sums (module docstring)."""
    flat = mask_positions(idx, block_size)
    waited = shard.age.index_select(0, flat) if shard.age_at_mask is None \
        else shard.age_at_mask
    a1 = waited.float().add_(1.0)
    m_sel = shard.m.index_select(0, flat)
    _, sigma2, mu2 = arrived_mean(shard, flat, m_sel, g.float() / a1, a1, hp)
    asked = torch.maximum(a1 * sign_agreement(sigma2, mu2, hp["beta1"]), torch.ones_like(a1))
    trust = rules.trust_bound(idx.shape[-1], block_size)
    bound = torch.maximum(a1.sqrt(), trust_reach(shard.master, block_size, idx.shape[1],
                                                 trust, hp["lr"]))
    taken = torch.minimum(asked, bound)
    per = torch.stack([torch.ones_like(a1), a1, asked, taken, (asked > bound).float()])
    return per.view(len(FIELDS), idx.shape[0], idx.shape[1]).sum(dim=2).double()


_STATE: dict[int, dict[str, Any]] = {}
"""Per shard (by ``id``): the window's sums, the sparse steps seen, the file's key."""


def probe_update(shard: ShardState, g: torch.Tensor, idx: torch.Tensor, block_size: int,
                 hp: dict, model_out: torch.Tensor) -> None:
    """Record (:func:`_stats`), then ``early``'s update."""
    if hp["lr"] > 0.0:
        st = _STATE.setdefault(id(shard), {"n": 0, "key": f"rank{_rank()}_b{len(_STATE)}"})
        acc = st.get("acc")
        if acc is None or acc.shape[1] != idx.shape[0]:
            acc = st["acc"] = torch.zeros(len(FIELDS), idx.shape[0], dtype=torch.float64)
        acc += _stats(shard, g, idx, block_size, hp)
        st["n"] += 1
        if st["n"] % WINDOW == 0:
            _write(st["key"], acc, st["n"], shard.master.numel())
            acc.zero_()
    RULES["agree"].update(shard, g, idx, block_size, hp, model_out)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _write(key: str, acc: torch.Tensor, n: int, numel: int) -> None:
    out = os.environ.get("SCAPE_PROBE_DIR")
    if not out:
        return
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"{key}.jsonl"), "a") as f:
        f.write(json.dumps({"rank": _rank(), "sparse_steps": n, "numel": numel,
                            **{k: acc[i].tolist() for i, k in enumerate(FIELDS)}}) + "\n")


PROBE: Rule = dataclasses.replace(RULES["agree"], update=probe_update, embeddings_apart=False)
"""``early`` with the probe's update (its fused pass before the take kept)."""


def tensor_blocks(model: torch.nn.Module, world: int, block_size: int
                  ) -> tuple[int, list[tuple[str, int, int]]]:
    """``(shard_size, [(name, first, end)])``: each parameter's coordinates in one group's
    flat buffer (``model.parameters()`` order), laid out as :class:`scape.buffers.Bucket`
    lays them out (:func:`scape.buffers.flat_layout`)."""
    names, params = zip(*model.named_parameters())
    _, offsets, n_pad = flat_layout(params, world * block_size)
    return n_pad // world, list(zip(names, offsets[:-1], offsets[1:]))


def summarize(lines: list[dict[str, Any]], model: torch.nn.Module, world: int,
              block_size: int = 4096) -> dict[str, dict[str, list[float]]]:
    """Per window and parameter kind (``tok_emb``, ``pos_emb``, ``attn``, ``mlp``): mean wait,
    mean steps asked and taken per send, fraction of sends cut by the bound."""
    shard, spans = tensor_blocks(model, world, block_size)
    share: dict[int, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for name, lo, hi in spans:
        kind = name.split(".")[0] if not name.startswith("blocks") else name.split(".")[2]
        for b in range(lo // block_size, -(-hi // block_size)):
            share[b][kind] += min(hi, (b + 1) * block_size) - max(lo, b * block_size)
    # a block that kinds share goes to the kind with most of its coordinates
    kind_of = {b: max(kinds, key=kinds.__getitem__) for b, kinds in share.items()}
    out: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for window in sorted({ln["sparse_steps"] for ln in lines}):
        sums: dict[str, list[float]] = defaultdict(lambda: [0.0] * len(FIELDS))
        for ln in (x for x in lines if x["sparse_steps"] == window):
            first = ln["rank"] * shard // block_size
            for j in range(len(ln["sent"])):
                kind = kind_of.get(first + j)
                if kind is None:
                    continue
                for i, k in enumerate(FIELDS):
                    sums[kind][i] += ln[k][j]
        for kind, s in sums.items():
            sent = max(s[0], 1.0)
            row = out[kind]
            row["window_end"].append(window)
            row["wait"].append(s[1] / sent)
            row["asked"].append(s[2] / sent)
            row["taken"].append(s[3] / sent)
            row["cut"].append(s[4] / sent)
    return {k: dict(v) for k, v in out.items()}


def main(argv: list[str] | None = None) -> int:
    from bench.workloads.llama import make_model
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir")
    ap.add_argument("--model", default="small")
    ap.add_argument("--world", type=int, default=4)
    args = ap.parse_args(argv)
    lines = []
    for name in sorted(os.listdir(args.dir)):
        if name.endswith(".jsonl"):
            with open(os.path.join(args.dir, name)) as f:
                lines += [json.loads(x) for x in f if x.strip()]
    if not lines:
        print(f"no probe lines under {args.dir}")
        return 1
    table = summarize(lines, make_model(args.model), args.world)
    print("| kind | sparse steps to | wait | steps asked | steps taken | cut by the bound |")
    print("|---|---|---|---|---|---|")
    for kind, row in table.items():
        for i, end in enumerate(row["window_end"]):
            print(f"| {kind} | {end} | {row['wait'][i]:.1f} | {row['asked'][i]:.2f} | "
                  f"{row['taken'][i]:.2f} | {row['cut'][i]:.1%} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
