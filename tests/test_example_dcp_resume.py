"""``examples/dcp_resume.py`` under torchrun: save through DCP on 2 ranks, resume on 3.

The resumed run starts at the saved step, the loss keeps falling, and the last (sparse)
step's bytes equal README's formula, recomputed here from the parameter counts.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from test_examples import _launch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "dcp_resume.py"
NUMEL = (32 * 128 + 128) + (128 * 128 + 128) + (128 * 8 + 8)  # the example's model


def _torchrun(world: int, log: Path, *args: str) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={world}", str(SCRIPT), *args]
    rc = _launch(cmd, ROOT, env, log)  # stops torchrun and its workers at the deadline
    assert rc == 0, log.read_text()[-4000:]


def _formula(world: int, block: int = 256, sparsity: float = 0.99) -> int:
    n_pad = -(-NUMEL // (world * block)) * world * block
    k = (n_pad // block) * max(1, round((1 - sparsity) * block))
    return k * (4 + 4 + 1) + world * (4 + 4)  # offsets of 8 bits at block 256; the scalars


def test_dcp_save_on_two_ranks_resume_on_three(tmp_path):
    ckpt, first, second = tmp_path / "ckpt", tmp_path / "a.json", tmp_path / "b.json"
    _torchrun(2, tmp_path / "a.log", "--ckpt", str(ckpt), "--stop-at", "30", "--out", str(first))
    _torchrun(3, tmp_path / "b.log", "--ckpt", str(ckpt), "--resume", "--out", str(second))
    a, b = json.loads(first.read_text()), json.loads(second.read_text())
    assert (a["world"], b["world"], b["start"]) == (2, 3, 30)
    assert len(a["losses"]) == 30 and len(b["losses"]) == 30
    head, tail = sum(a["losses"][:5]) / 5, sum(b["losses"][-5:]) / 5
    assert tail < 0.6 * head, (head, tail)
    assert sum(b["losses"][:5]) / 5 < 1.2 * sum(a["losses"][-5:]) / 5  # resumed, not reset
    for r in (a, b):
        assert not r["last_step_dense"]
        assert r["last_step_bytes"] == r["expected_sparse_bytes"] == _formula(r["world"])
