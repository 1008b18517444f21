"""Cross-rank agreement at construction: one all-gather of a fixed-size fingerprint.

Every rank packs (1) whether its own arguments were valid, with the error text, and (2) one
64-bit digest per configuration field (hyperparameters, parameter shapes, dtypes and order,
parameter contents). A single ``all_gather`` of that fixed-size record lets every rank raise
the *same* error when any rank's arguments are bad or when ranks disagree, naming the field.
Nothing else is enqueued before this check passes, so no collective is left half-issued.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

import torch

_MSG_BYTES = 512
_SHOWN_BYTES = 1024
_SHOWN_CHARS = 80
_ERROR_TYPES: dict[int, type[Exception]] = {1: ValueError, 2: TypeError}


def digest(value: Any) -> int:
    """A stable 63-bit digest of a value's repr (identical across processes and machines)."""
    h = hashlib.blake2b(repr(value).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & ((1 << 63) - 1)


def tensor_digest(tensors: Sequence[torch.Tensor]) -> int:
    """Content digest of tensors (bytes weighted by position): differs when any byte does."""
    total = 0
    for t in tensors:
        b = t.detach().contiguous().view(-1).view(torch.uint8).to(torch.int64)
        w = torch.arange(b.numel(), device=b.device, dtype=torch.int64) % 65521 + 1
        total = (total * 1_000_003 + int((b * w).sum()) + int(b.sum())) & ((1 << 63) - 1)
    return total


def agree(comm: Any, fields: dict[str, int], error: BaseException | None,
          what: str = "optimizer", shown: dict[str, Any] | None = None) -> None:
    """Exchange ``fields`` and ``error`` with every rank; raise the same error on all of them.

    ``fields`` must have the same keys in the same order on every rank (values may differ).
    ``shown``: the plain values behind some fields (hyperparameters), whose reprs the error
    of a disagreement lists rank by rank (each cut to 80 characters, 1 KiB in all).
    """
    names = list(fields)
    record = torch.zeros(8 * len(names) + 1 + _MSG_BYTES + _SHOWN_BYTES, dtype=torch.uint8)
    words = torch.tensor([fields[n] for n in names], dtype=torch.int64)
    record[: 8 * len(names)] = words.view(torch.uint8)
    if error is not None:
        code = 2 if isinstance(error, TypeError) else 1
        record[8 * len(names)] = code
        msg = str(error).encode()[:_MSG_BYTES]
        record[8 * len(names) + 1: 8 * len(names) + 1 + len(msg)] = torch.frombuffer(
            bytearray(msg), dtype=torch.uint8)
    text = _pack_shown(shown or {})
    if text:
        at = 8 * len(names) + 1 + _MSG_BYTES
        record[at:at + len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    device = getattr(comm, "device", torch.device("cpu"))
    inp = record.to(device)
    out = torch.empty(comm.world_size * inp.numel(), dtype=torch.uint8, device=device)
    comm.all_gather(out, inp).wait()
    rows = out.cpu().view(comm.world_size, -1)
    for r in range(comm.world_size):
        code = int(rows[r, 8 * len(names)])
        if code:
            raw = bytes(rows[r, 8 * len(names) + 1:8 * len(names) + 1 + _MSG_BYTES].tolist())
            raw = raw.rstrip(b"\0")
            if r == comm.rank and error is not None:
                raise error
            raise _ERROR_TYPES[code](f"rank {r}: {raw.decode(errors='replace')}")
    table = rows[:, : 8 * len(names)].contiguous().view(-1).view(torch.int64)
    table = table.view(comm.world_size, -1)
    differ = [n for i, n in enumerate(names) if bool((table[:, i] != table[0, i]).any())]
    if differ:
        at = 8 * len(names) + 1 + _MSG_BYTES
        values = [_unpack_shown(bytes(rows[r, at:].tolist())) for r in range(comm.world_size)]
        lines = []
        for n in differ:
            if all(n in v for v in values):
                lines.append(f"  {n}: " + ", ".join(f"rank {r} {v[n]}"
                                                   for r, v in enumerate(values)))
        hint = ""
        if "param_values" in differ:
            hint = (" Parameter values differ: call scape.broadcast_parameters(model) on every "
                    "rank before building the optimizer (it copies rank 0's values to all), or "
                    "build the model from the same seed on every rank.")
        shown_text = ("\n" + "\n".join(lines)) if lines else ""
        raise ValueError(f"{what} configuration differs across ranks in: "
                         f"{', '.join(differ)}.{hint}{shown_text}")


def _pack_shown(shown: dict[str, Any]) -> bytes:
    """``shown`` as JSON of short reprs, cut to fit the record (whole entries only)."""
    out: dict[str, str] = {}
    for k, v in shown.items():
        r = repr(v)
        out[k] = r if len(r) <= _SHOWN_CHARS else r[:_SHOWN_CHARS - 3] + "..."
        if len(json.dumps(out).encode()) > _SHOWN_BYTES:
            del out[k]
            break
    return json.dumps(out).encode() if out else b""


def _unpack_shown(raw: bytes) -> dict[str, str]:
    try:
        value = json.loads(raw.rstrip(b"\0").decode() or "{}")
    except (UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return value if isinstance(value, dict) else {}
