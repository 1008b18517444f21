"""Promises 8 and 9 (issue 6): corrupt and malicious checkpoints, atomic saves.

8. A truncated file, a flipped byte, a missing shard, a missing or broken manifest, a bad
   ``latest`` pointer or a checkpoint of another configuration: a clear error on every rank, no
   hang, and the live model and optimizer bitwise unchanged. A rank killed in the middle of a
   save (fault ``1:6:save:die`` installed) leaves the previous checkpoint complete and still the
   one ``load_checkpoint(opt, root)`` finds.
9. A shard file whose pickle would write a file through ``__reduce__`` (with a manifest whose
   checksums match it) is refused by ``torch.load(weights_only=True)``; the file is never
   written. The same bytes loaded with ``weights_only=False`` do write it (the payload is live).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import torch
import torch.distributed as dist
from dist import run_ranks, run_ranks_outcomes
from reliability_common import differing, make_model, make_opt, snapshot, state_hash, train_step

import scape
from scape import faults, io


class _WritesAFile:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (exec, (f"open({self.path!r}, 'w').write('pwned')",))


def _corrupt(good: str, bad: str, case: str, pwned: str) -> None:
    """Copy checkpoint directory ``good`` to ``bad`` and damage it as ``case`` says."""
    shutil.copytree(good, bad)
    f0, f1 = (os.path.join(bad, io.rank_file(r, 2)) for r in (0, 1))
    manifest_path = os.path.join(bad, io.MANIFEST)
    if case == "truncated":
        data = open(f1, "rb").read()
        open(f1, "wb").write(data[: len(data) // 2])
    elif case == "flipped_byte":
        data = bytearray(open(f0, "rb").read())
        data[len(data) // 2] ^= 0x40
        open(f0, "wb").write(bytes(data))
    elif case == "missing_shard":
        os.remove(f1)
    elif case == "no_manifest":
        os.remove(manifest_path)
    elif case == "broken_manifest":
        data = open(manifest_path, "rb").read()
        open(manifest_path, "wb").write(data[:40])
    elif case == "bad_latest":
        os.makedirs(os.path.join(bad, "root"))
        open(os.path.join(bad, "root", io.LATEST), "w").write("../../etc\n")
    elif case == "malicious":
        torch.save({"format": "scape.sharded/1", "x": _WritesAFile(pwned)}, f0)
        manifest = json.load(open(manifest_path))
        data = open(f0, "rb").read()
        manifest["files"][0].update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
        open(manifest_path, "w").write(json.dumps(manifest))
    else:
        raise ValueError(case)


CASES = {  # case -> words every rank's error must contain (from the rank that found it)
    "truncated": "the manifest says", "flipped_byte": "SHA-256",
    "missing_shard": "missing or unreadable", "no_manifest": "no checkpoint",
    "broken_manifest": "unreadable manifest", "bad_latest": "expected a directory name",
    "malicious": "weights_only=True",
}


def _corrupt_body(rank, world, root, crashed_root):
    model = make_model()
    opt = make_opt(model)
    for t in range(1, 5):
        train_step(model, opt, t, rank)
    good = scape.save_checkpoint(opt, f"{root}/good")
    saved = snapshot(opt)
    for t in range(5, 7):
        train_step(model, opt, t, rank)
    live = snapshot(opt)
    assert differing(saved, live)
    pwned = f"{root}/pwned"
    errors = {}
    for case in CASES:
        bad = f"{root}/{case}"
        if rank == 0:
            _corrupt(str(good), bad, case, pwned)
        dist.barrier()
        target = f"{bad}/root" if case == "bad_latest" else bad
        try:
            scape.load_checkpoint(opt, target)
        except ValueError as e:
            errors[case] = (type(e).__name__, str(e))
        else:
            raise AssertionError(f"{case}: the checkpoint was accepted")
        assert not differing(live, snapshot(opt)), f"{case}: live state changed"
        assert not os.path.exists(pwned), "the malicious pickle ran"
    # another configuration (this group dense, the saved one sparse): refused before
    # anything changes (another sparsity > 0 loads: the saved value is restored, like lr)
    other = make_opt(make_model(), sparsity=0.0)
    other_before = snapshot(other)
    try:
        scape.load_checkpoint(other, good)
    except ValueError as e:
        errors["other_sparsity"] = (type(e).__name__, str(e))
    assert not differing(other_before, snapshot(other))
    # the good checkpoint still loads, and gives back exactly the saved state
    assert scape.load_checkpoint(opt, f"{root}/good") == 4
    assert not differing(saved, snapshot(opt))
    # after a crash in the middle of a save, `latest` still names the last complete one
    assert scape.load_checkpoint(opt, crashed_root) == 4
    expected = open(f"{crashed_root}/hash-rank{rank}").read()
    return errors, state_hash(snapshot(opt)) == expected


def _crash_in_save_body(rank, world, root):
    model = make_model()
    opt = make_opt(model)
    for t in range(1, 5):
        train_step(model, opt, t, rank)
    scape.save_checkpoint(opt, root)
    with open(f"{root}/hash-rank{rank}", "w") as f:
        f.write(state_hash(snapshot(opt)))
    model = make_model()
    opt = make_opt(model)
    faults.install(opt, "1:6:save:die")
    for t in range(1, 7):
        train_step(model, opt, t, rank)
    scape.save_checkpoint(opt, root)  # rank 1 dies after writing its file, before the manifest


def test_corrupt_and_malicious_checkpoints_and_crash_during_save(tmp_path):
    crashed = tmp_path / "crashed"
    outcomes = run_ranks_outcomes(_crash_in_save_body, 2, str(crashed), timeout=120,
                                  pg_timeout=10)
    assert outcomes[1].exitcode == faults.DIE_EXIT_CODE
    assert outcomes[0].exc_type == "CommError", outcomes[0].error
    partial = [d for d in os.listdir(crashed) if d.startswith("step-00000006")]
    assert len(partial) == 1 and not os.path.exists(crashed / partial[0] / io.MANIFEST)
    assert os.listdir(crashed / partial[0])  # the crash left files behind: a real half save
    assert open(crashed / io.LATEST).read().startswith("step-00000004")

    results = run_ranks(_corrupt_body, 2, str(tmp_path), str(crashed), timeout=200)
    for rank, (errors, resumed_equal) in enumerate(results):
        assert resumed_equal, f"rank {rank}: the checkpoint before the crash did not load back"
        for case, words in CASES.items():
            kind, text = errors[case]
            assert words in text, (rank, case, text)
        assert "sparsity" in errors["other_sparsity"][1]
    # a damaged shard of rank 1 is reported on rank 0 too, naming the rank that found it
    assert results[0][0]["truncated"][1].startswith("rank 1: ")
    assert results[1][0]["truncated"][0] == "CheckpointError"
    # negative control: the refused payload is live — unrestricted unpickling runs it
    pwned = tmp_path / "pwned"
    assert not pwned.exists()
    torch.load(tmp_path / "malicious" / io.rank_file(0, 2), weights_only=False)
    assert pwned.read_text() == "pwned"
