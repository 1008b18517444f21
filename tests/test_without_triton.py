"""A CPU-only install without Triton: every module imports, SCAPE trains on the torch
implementations, and forcing the Triton path says what to install."""

from __future__ import annotations

import json
import subprocess
import sys

SCRIPT = r'''
import importlib.abc, json, sys

class NoTriton(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ImportError("No module named 'triton' (blocked)")
        return None

sys.meta_path.insert(0, NoTriton())
import torch
import scape
from scape import kernels
from scape.kernels._triton import HAVE_TRITON

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
opt = scape.SCAPE(model.parameters(), lr=1e-2, sparsity=0.9, block_size=256, warmup_steps=2)
x = torch.randn(16, 32)
losses = []
for _ in range(8):
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    losses.append(float(loss))
kernels.set_backend("triton")
try:
    kernels.grad_stats(torch.ones(8))
    forced = ""
except RuntimeError as e:
    forced = str(e)
print(json.dumps({"have": HAVE_TRITON, "losses": losses, "sparse": not opt.last_step.dense,
                  "forced": forced, "loaded": "triton" in sys.modules}))
'''


def test_scape_trains_without_triton():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          timeout=300, env={"PATH": "/usr/bin:/bin", "TRITON_INTERPRET": "0"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["have"] is False and out["loaded"] is False
    assert out["sparse"] and out["losses"][-1] < out["losses"][0]
    assert "pip install" in out["forced"] and "gpu" in out["forced"]
