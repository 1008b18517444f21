"""How well 8-bit codes carry a sparse step's gradient values: the uniform 8-bit code of the
library's wire (:func:`scape.kernels.take_pack8_`: absmax scale per mask row, 255 levels)
against fp8 e4m3 with the same per-row scale (absmax mapped to 448, e4m3's largest finite
value), and 4-bit codes with the same scale, on the values a mask takes from real gradients.

The values: the ``small`` GPT trained for ``--steps`` steps of dense AdamS at lr 3e-4 on the
stdlib corpus (one process, batch 16 x 128 bytes), then at each of the last ``--sample``
steps every 4096-block's top ``k`` entries by magnitude of the gradient (k = 41 and 410: 0.99
and 0.9). Reported per code: the relative error ``||x - decoded|| / ||x||`` over all taken
values, and the largest relative error of a row. Coding only: error feedback (which sends
what a code drops later) and training are not in it.

    python -m bench.research.wire_codes            # ~1 min on 2 cores, prints JSON
"""

from __future__ import annotations

import argparse
import json

import torch

from bench.research.update_codes import e4m3_code, e4m3_decode
from scape.kernels import pack_values, unpack_values


def codes(x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Decoded values of ``x`` (rows of k) under each code."""
    rows, k = x.shape
    s = x.abs().amax(dim=1)
    flat = x.reshape(-1)
    out = {}
    for bits in (8, 4):
        packed = pack_values(flat, s, k, bits)
        out[f"uniform{bits}"] = unpack_values(packed, s, k, bits, flat.numel()).view(rows, k)
    scales, q = e4m3_code(flat, k)
    out["e4m3"] = e4m3_decode(q, scales, k).view(rows, k)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--sample", type=int, default=5)
    args = ap.parse_args(argv)
    from bench.workloads import data, gpt

    model = gpt.GPT(gpt.get_config("small"), seed=0)
    tokens = data.load_corpus(None).train
    opt = torch.optim.Adam(model.parameters(), lr=3e-4, betas=(0.9, 0.95))
    errs: dict[tuple[int, str], list[torch.Tensor]] = {}
    for t in range(args.steps):
        x, y = data.batch_at(tokens, t, 16, 128, seed=0)
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        if t >= args.steps - args.sample:
            g = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
            g = g[: g.numel() // 4096 * 4096].view(-1, 4096)
            for k in (41, 410):
                top = g.gather(1, g.abs().topk(k, dim=1).indices)
                for name, dec in codes(top).items():
                    errs.setdefault((k, name), []).append(
                        torch.stack([(top - dec).square().sum(), top.square().sum(),
                                     ((top - dec).norm(dim=1) / top.norm(dim=1)).max()]))
        opt.step()
    rows = []
    for (k, name), e in sorted(errs.items()):
        e = torch.stack(e)
        rows.append({"k": k, "code": name, "bytes_per_value": 0.5 if name == "uniform4" else 1,
                     "relative_error": float((e[:, 0].sum() / e[:, 1].sum()).sqrt()),
                     "worst_row": float(e[:, 2].max())})
    print(json.dumps({"steps": args.steps, "sample": args.sample, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
