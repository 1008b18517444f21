"""Cross-rank agreement at construction: one all-gather of a fixed-size fingerprint.

Every rank packs (1) whether its own arguments were valid, with the error text, and (2) one
64-bit digest per configuration field (hyperparameters, parameter shapes, dtypes and order,
parameter contents). A single ``all_gather`` of that fixed-size record lets every rank raise
the *same* error when any rank's arguments are bad or when ranks disagree, naming the field.
Nothing else is enqueued before this check passes, so no collective is left half-issued.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import torch

_MSG_BYTES = 512
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
          what: str = "optimizer") -> None:
    """Exchange ``fields`` and ``error`` with every rank; raise the same error on all of them.

    ``fields`` must have the same keys in the same order on every rank (values may differ).
    """
    names = list(fields)
    record = torch.zeros(8 * len(names) + 1 + _MSG_BYTES, dtype=torch.uint8)
    words = torch.tensor([fields[n] for n in names], dtype=torch.int64)
    record[: 8 * len(names)] = words.view(torch.uint8)
    if error is not None:
        code = 2 if isinstance(error, TypeError) else 1
        record[8 * len(names)] = code
        msg = str(error).encode()[:_MSG_BYTES]
        record[8 * len(names) + 1: 8 * len(names) + 1 + len(msg)] = torch.frombuffer(
            bytearray(msg), dtype=torch.uint8)
    device = getattr(comm, "device", torch.device("cpu"))
    inp = record.to(device)
    out = torch.empty(comm.world_size * inp.numel(), dtype=torch.uint8, device=device)
    comm.all_gather(out, inp).wait()
    rows = out.cpu().view(comm.world_size, -1)
    for r in range(comm.world_size):
        code = int(rows[r, 8 * len(names)])
        if code:
            raw = bytes(rows[r, 8 * len(names) + 1:].tolist()).rstrip(b"\0")
            if r == comm.rank and error is not None:
                raise error
            raise _ERROR_TYPES[code](f"rank {r}: {raw.decode(errors='replace')}")
    table = rows[:, : 8 * len(names)].contiguous().view(-1).view(torch.int64)
    table = table.view(comm.world_size, -1)
    differ = [n for i, n in enumerate(names) if bool((table[:, i] != table[0, i]).any())]
    if differ:
        hint = ""
        if "param_values" in differ:
            hint = (" Parameter values differ: start every rank from the same seed or "
                    "broadcast rank 0's parameters (torch.distributed.broadcast) before "
                    "building the optimizer.")
        raise ValueError(f"{what} configuration differs across ranks in: "
                         f"{', '.join(differ)}.{hint}")
