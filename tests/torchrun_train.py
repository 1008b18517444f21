"""A small training job for the torchrun restart test (promise 14 of issue 6).

    torchrun --standalone --nproc-per-node=2 --max-restarts=1 tests/torchrun_train.py \
        --steps 12 --every 3 --ckpt DIR --out DIR

Every attempt starts by loading the latest complete checkpoint in ``--ckpt`` (if any), trains
to ``--steps`` saving every ``--every`` steps, and writes per rank the step it started from and
the hash of its final state under ``--out``. A crash is injected with ``SCAPE_FAULT`` (a
:func:`scape.faults.parse` spec), which this script reads and installs with
:func:`scape.faults.install`; only in the first attempt (``TORCHELASTIC_RESTART_COUNT`` = 0),
so the second attempt runs clean.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from reliability_common import (  # noqa: E402
    env_faults,
    make_model,
    make_opt,
    snapshot,
    state_hash,
    train_step,
)

import scape  # noqa: E402
from scape import faults  # noqa: E402
from scape.comm import TorchCommunicator  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--every", type=int, required=True)
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    faulthandler.enable()  # a native abort prints the Python stack of every thread
    torch.set_num_threads(1)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    # a fresh file store per attempt: no key of a failed attempt can be read by the next one
    store = os.path.join(args.out, f"store-attempt{attempt}")
    dist.init_process_group("gloo", init_method=f"file://{store}",
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    rank = dist.get_rank()
    model = make_model()
    opt = make_opt(model, TorchCommunicator(timeout=10.0))
    faults.install(opt, env_faults(rank, os.environ))
    start = 0
    if os.path.exists(os.path.join(args.ckpt, scape.io.LATEST)):
        start = scape.load_checkpoint(opt, args.ckpt)
    with open(os.path.join(args.out, f"attempt{attempt}-rank{rank}.json"), "w") as f:
        json.dump({"start": start, "fault": opt._faults is not None}, f)
    for t in range(start + 1, args.steps + 1):
        train_step(model, opt, t, rank)
        if t % args.every == 0:
            scape.save_checkpoint(opt, args.ckpt)
    with open(os.path.join(args.out, f"final-rank{rank}.txt"), "w") as f:
        f.write(state_hash(snapshot(opt)))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # Leave without the interpreter's teardown: under load, torch's gloo teardown has aborted
    # a finished worker at exit ("terminate called without an active exception", no Python
    # frame on any thread) and torchrun then restarted a job whose work was complete. Every
    # file above is closed by now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
