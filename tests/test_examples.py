"""The scripts under examples/ run as documented, under torchrun on gloo, with a tiny config.

Each is launched as ``python -m torch.distributed.run --standalone --nproc-per-node=N`` (a free
port is picked by the standalone rendezvous), bounded by a deadline after which torchrun and
every worker are stopped, so a hang is a failure. From the JSON a script writes,
the test asserts that the loss fell, that a sparse step sent exactly the bytes of README
"Cost" (recomputed here from each param group's parameter count, not from the optimizer's
layout), and for the 2-D layout that the replicas of a DP group hold identical parameters
while the TP positions differ.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from dist import descendants

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
DEADLINE_S = 240
SCALAR_BYTES, CLIP_BYTES = 8, 12
"""README "Cost": every step's one scalar all-reduce, the ``+ 8`` (gradient norm and
non-finite count, two fp32 values), 12 bytes more with ``max_grad_norm`` (``+ 20``)."""
TEARDOWN_ABORT = "terminate called without an active exception"
"""What a gloo worker has, rarely, printed when it aborted at interpreter exit after its work
was done (tests/test_reliability_torchrun.py); such a run is launched once more, with a
warning."""


def _needs(*modules: str) -> None:
    for m in modules:
        if importlib.util.find_spec(m) is None:
            pytest.skip(f"{m} is not installed (pip install -e '.[test]')")


def _launch(cmd: list[str], cwd: Path, env: dict, log_path: Path) -> int:
    """Run ``cmd`` to its exit code, or stop it and every process under it at the deadline."""
    with open(log_path, "w") as log:  # a file, not a pipe: a stray worker cannot block us
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            return proc.wait(timeout=DEADLINE_S)
        except subprocess.TimeoutExpired:
            workers = descendants(proc.pid)  # torchrun starts each worker in a session of its own
            proc.terminate()  # torchrun stops its workers on SIGTERM
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            for pid in workers:  # whatever is left of the processes this test started
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            pytest.fail(f"{' '.join(cmd[3:])} did not finish within {DEADLINE_S} s:\n"
                        f"{log_path.read_text()[-4000:]}")


def _torchrun(script: str, nproc: int, tmp_path: Path, *args: str) -> dict:
    out, log_path = tmp_path / "out.json", tmp_path / "torchrun.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC", "SCAPE_"))}
    env.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")  # gloo on the CPU
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", str(EXAMPLES / script), *args, "--out", str(out)]
    for attempt in range(2):
        rc = _launch(cmd, tmp_path, env, log_path)
        log = log_path.read_text()
        if rc == 0 or attempt or TEARDOWN_ABORT not in log:
            break
        warnings.warn(f"{script}: a worker aborted in torch's teardown, once more:\n"
                      f"{log[-2000:]}", stacklevel=2)
    assert rc == 0, log[-6000:]
    return json.loads(out.read_text())


def _k_b(sparsity: float, block: int) -> int:
    return max(1, int((1.0 - sparsity) * block + 0.5))  # README "Cost" (ties round up)


def _check_bytes(r: dict) -> None:
    """A sparse step's bytes, by collective, against README "Cost", bucket by bucket: one
    bucket per group (fp32), or, where ``attach`` set a group's embedding matrices apart, two
    whose budgets split the group's (``scape.embeddings.split_budget``)."""
    from scape.embeddings import split_budget

    w, b, s = r["world"], r["block_size"], r["sparsity"]
    unit = w * b
    n_pad = [-(-n // unit) * unit for n in r["group_numels"]]
    got, groups, apart = r["bucket_n_pad"], r["bucket_group"], r["bucket_apart"]
    k = offsets = 0  # K, and the next mask's packed offsets: log2(B) bits, per rank
    bits = b.bit_length() - 1

    def packed(n: int) -> int:
        return w * -(-(n * bits) // 8)

    for g, want in enumerate(n_pad):
        mine = [(n, a) for n, gg, a in zip(got, groups, apart) if gg == g]
        assert all(n % unit == 0 for n, _ in mine), mine
        if len(mine) == 1:  # one bucket: the group padded as a whole
            assert mine[0][0] == want and not mine[0][1], (want, mine)
            k += w * (want // w // b) * _k_b(s, b)
            offsets += packed((want // w // b) * _k_b(s, b))
            continue
        assert sorted(a for _, a in mine) == [False, True] and sum(n for n, _ in mine) >= want
        share = sum(n for n, a in mine if a) / sum(n for n, _ in mine)
        k_e, k_r = split_budget(_k_b(s, b), b, share)
        k += sum(w * (n // w // b) * (k_e if a else k_r) for n, a in mine)
        offsets += sum(packed((n // w // b) * (k_e if a else k_r)) for n, a in mine)
    b_g, b_p = r["grad_bytes"], r["param_bytes"]
    scalar = SCALAR_BYTES + (CLIP_BYTES if r["max_grad_norm"] is not None else 0)
    sparse = r["sparse_step"]
    assert sparse is not None and sparse["dense"] is False
    if r["max_grad_norm"] is None:  # (flat, every group sparse, no shard mesh in these
        # examples): the scalars ride, every rank's count with the gradients, its sum of
        # squares with the values, and no all-reduce
        want = {"reduce_scatter": k * b_g + w * b_g, "all_gather": k * b_p + offsets + w * 4}
    else:
        want = {"reduce_scatter": k * b_g, "all_gather": k * b_p + offsets, "all_reduce": scalar}
    assert sparse["bytes"] == want, sparse["bytes"]
    dense = r.get("dense_step")
    if dense is not None and dense["step"] == 1:  # the first step: no mask in flight yet
        want = sum(got) * (b_g + b_p) + scalar
        assert sum(dense["bytes"].values()) == want, dense["bytes"]


def _check_loss_falls(r: dict, by: float) -> None:
    losses = r["losses"]
    tail = sum(losses[-5:]) / 5
    assert r["last_loss"] == losses[-1] and r["first_loss"] == losses[0]
    assert tail < losses[0] - by, f"loss did not fall: {losses[0]:.3f} -> last 5 {tail:.3f}"


def test_hf_causal_lm(tmp_path):
    _needs("transformers")
    r = _torchrun("hf_causal_lm.py", 2, tmp_path, "--steps", "24", "--warmup-steps", "8",
                  "--ckpt", str(tmp_path / "ckpt"))
    assert r["world"] == 2 and len(r["losses"]) == 24 and len(r["group_numels"]) == 2
    assert r["max_grad_norm"] == 1.0
    _check_loss_falls(r, by=1.0)
    _check_bytes(r)
    manifest = json.loads(next((tmp_path / "ckpt").glob("step-*/manifest.json")).read_text())
    assert (manifest["world_size"], manifest["step"]) == (2, 24)


def test_hf_trainer(tmp_path):
    _needs("transformers", "accelerate")
    r = _torchrun("hf_trainer.py", 2, tmp_path, "--steps", "24", "--warmup-steps", "8",
                  "--accum", "2", "--batch", "4", "--ckpt", str(tmp_path / "ckpt"))
    assert r["ddp_wrapped"] is True  # the Trainer wrapped it; skip_ddp_allreduce made it safe
    assert r["trainer_steps"] == 24 and len(r["losses"]) == 24 and r["max_grad_norm"] == 1.0
    _check_loss_falls(r, by=1.0)
    _check_bytes(r)
    steps = sorted(json.loads(m.read_text())["step"]
                   for m in (tmp_path / "ckpt").glob("step-*/manifest.json"))
    assert steps == [12, 24]  # SCAPE stepped once per optimizer step, not per micro-batch


def test_tp_dp(tmp_path):
    r = _torchrun("tp_dp.py", 4, tmp_path, "--steps", "24", "--warmup-steps", "8")
    assert (r["dp"], r["tp"], r["world"]) == (2, 2, 2)  # SCAPE's world: the DP group
    assert r["max_grad_norm"] is None
    _check_loss_falls(r, by=1.0)
    _check_bytes(r)
    ranks = r["ranks"]
    assert sorted((x["dp"], x["tp"]) for x in ranks) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for x in ranks:
        for y in ranks:
            same_dp_group = x["tp"] == y["tp"]  # the DP group: the ranks at one TP position
            assert (x["sharded"] == y["sharded"]) == same_dp_group, (x, y)
            assert x["replicated"] == y["replicated"], (x, y)


def test_fsdp2(tmp_path):
    """2 x 2 gloo ranks: the loss falls, every rank's full parameters are identical, a sparse
    step sends the bytes of the formula on rank 0's local shard, and a run resumed from a DCP
    checkpoint goes on with the uninterrupted run's losses."""
    ck = str(tmp_path / "ckpt")
    r = _torchrun("fsdp2.py", 4, tmp_path, "--steps", "24", "--warmup-steps", "8",
                  "--ckpt", ck, "--save-at", "12")
    assert (r["replicate"], r["shard"], r["world"]) == (2, 2, 2)  # SCAPE's world: replicas
    _check_loss_falls(r, by=1.0)
    _check_bytes(r)
    assert len(set(r["digests"])) == 1, "the ranks' full parameters differ"
    again = tmp_path / "again"
    again.mkdir()
    resumed = _torchrun("fsdp2.py", 4, again, "--steps", "24", "--warmup-steps", "8",
                        "--ckpt", ck, "--resume")
    assert resumed["start"] == 12
    assert resumed["losses"] == r["losses"][12:]
    assert resumed["digests"] == r["digests"]
