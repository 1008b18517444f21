"""Smokes of the convergence ablation and the step-compute benchmark (schemas checked), and
the null communicator they time with."""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import sys

import pytest
import torch

from bench.engine.comm_timing import timed_communicator
from bench.engine.nullcomm import NullCommunicator

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(module: str, out: str, *extra: str) -> dict:
    env = dict(os.environ, PYTHONPATH=ROOT)
    job = module.split()  # "bench.research bench.step_compute": a job run with the research
    proc = subprocess.run([sys.executable, "-m", *job, "--smoke", "--out", out, *extra],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with open(out) as f:
        return json.load(f)


def test_convergence_smoke(tmp_path):
    rep = _run("bench.research.convergence", str(tmp_path / "c.json"), "--check-world", "2")
    assert rep["schema"] == "scape.convergence/1"
    # where it ran: the Python (whose stdlib is the corpus), torch, cores, the revision
    env = rep["environment"]
    assert env["python"] == platform.python_version() and env["torch"] == torch.__version__
    assert env["cpus"] >= 1 and env["device"] == "cpu"
    names = [r["variant"]["name"] for r in rep["results"]]
    assert names[0].startswith("dense-adams") and any(n.startswith("lazy@") for n in names)
    for r in rep["results"]:
        assert r["final_val_loss"] > 0 and r["ratio_to_dense"] > 0
        assert [s for s, _ in r["val_curve"]][-1] == rep["workload"]["steps"]
    sparse = [r for r in rep["results"] if r["variant"].get("sparsity", 0) > 0]
    assert sparse and all(sum(r["bytes_last_step"].values()) > 0 for r in sparse)
    # the single-process ablation equals the same run on 2 gloo ranks (the module's premise)
    check = rep["world_check"]
    assert check["world"] == 2 and abs(check["relative_difference"]) < 1e-3, check


def test_convergence_group_sparsity_rows(tmp_path):
    """Per-group sparsity rows (--smoke runs at 0.9) run; keeping the embeddings dense sends
    their fp32 gradient and parameters beside the sparse rest; and the split ablation still
    equals the same run on 2 gloo ranks."""
    from bench.workloads.gpt import GPT, get_config

    names = ["catchup_sqrt_accum-embed0", "catchup_sqrt_accum-vec0"]
    rep = _run("bench.research.convergence", str(tmp_path / "g.json"), "--lr", "0.003",
               "--no-dense", "--check-world", "2", "--variants", *names)
    sent = {r["variant"]["name"].split("@")[0]: sum(r["bytes_last_step"].values())
            for r in rep["results"]}
    assert set(sent) == set(names)
    emb = sum(m.weight.numel() for m in GPT(get_config(rep["workload"]["model"])).modules()
              if isinstance(m, torch.nn.Embedding))
    dense_emb, sparse_emb = sent["catchup_sqrt_accum-embed0"], sent["catchup_sqrt_accum-vec0"]
    # the dense embeddings move their fp32 gradient and parameters; the rest stays sparse
    # (per-group block padding moves the sparse part a little, so no finer bound here)
    assert 8 * emb < dense_emb and dense_emb - 8 * emb <= sparse_emb < dense_emb
    check = rep["world_check"]
    assert check["variant"].split("@")[0] in names  # a split row ran on the ranks
    assert check["world"] == 2 and abs(check["relative_difference"]) < 1e-3, check


def test_convergence_transform_rows(tmp_path):
    """A transform-domain row is SCAPE on the rotated matrices (an engine hook): the same
    bytes as the plain row, a different trajectory; the world check runs on the first sparse
    row."""
    names = ["catchup_sqrt_accum", "catchup_sqrt_accum-dct64"]
    rep = _run("bench.research.convergence", str(tmp_path / "t.json"), "--lr", "0.003",
               "--no-dense", "--check-world", "2", "--variants", *names)
    rows = {r["variant"]["name"].split("@")[0]: r for r in rep["results"]}
    assert set(rows) == set(names)
    plain, dct = rows["catchup_sqrt_accum"], rows["catchup_sqrt_accum-dct64"]
    assert plain["bytes_last_step"] == dct["bytes_last_step"]
    assert math.isfinite(dct["final_val_loss"])
    assert dct["final_val_loss"] != plain["final_val_loss"]
    assert rep["world_check"]["variant"].startswith("catchup_sqrt_accum@")


def test_convergence_rows_on_ranks(tmp_path):
    """--ranks 2 trains each row on 2 gloo ranks: a rule without local statistics ends where
    one process fed the global batch does (the ablation's premise); the gain masks, which
    read each rank's own gradient, run there too and send the same bytes."""
    names = ["catchup_sqrt_accum", "catchup_agree_trust2_gain"]
    args = ("--lr", "0.003", "--no-dense", "--variants", *names)
    ranks = _run("bench.research.convergence", str(tmp_path / "r.json"), "--ranks", "2", *args)
    one = _run("bench.research.convergence", str(tmp_path / "o.json"), *args)
    by = {r["variant"]["name"]: r for r in one["results"]}
    for r in ranks["results"]:
        assert r["world"] == 2 and math.isfinite(r["final_val_loss"])
        assert [s for s, _ in r["val_curve"]][-1] == ranks["workload"]["steps"]
        assert 0 < r["bytes_per_sparse_step"] < r["bytes_per_step"]  # the dense warm-up
    sqrt = ranks["results"][0]
    assert sqrt["variant"]["name"].startswith("catchup_sqrt_accum@")
    ref = by[sqrt["variant"]["name"]]["final_val_loss"]
    assert abs(sqrt["final_val_loss"] / ref - 1.0) < 1e-3


def test_convergence_no_dense_leaves_ratios_to_the_table(tmp_path):
    """--no-dense (a dense run going on in parallel): no dense row, no ratio recorded; the
    table refuses the file without --dense-loss and fills the ratios in with it, or with the
    dense row of the same workload from another file; the gap plot is written."""
    from bench.research.convergence import plot_gap, table

    out = str(tmp_path / "c.json")
    rep = _run("bench.research.convergence", out, "--lr", "0.003", "--no-dense", "--variants",
               "lazy")
    assert [r["variant"]["name"] for r in rep["results"]] == ["lazy@0.9"]
    assert rep["dense_val_loss"] is None and rep["results"][0]["ratio_to_dense"] is None
    with pytest.raises(ValueError, match="--no-dense"):
        table([out])
    loss = rep["results"][0]["final_val_loss"]
    assert f"| {loss:.4f} | {loss / 2.5:.3f} |" in table([out], 2.5)
    # or from the dense row of the same workload in another file (a parallel dense run)
    dense_out = str(tmp_path / "d.json")
    dense = _run("bench.research.convergence", dense_out, "--variants", "none")["results"][0]
    assert dense["variant"]["name"].startswith("dense-adams")
    ratio = loss / dense["final_val_loss"]
    assert f"| {loss:.4f} | {ratio:.3f} |" in table([out, dense_out])
    assert not plot_gap([out, dense_out], str(tmp_path / "gap.png"))  # one length only
    # a dense run of another seed is another workload: no ratio from it
    seed1 = str(tmp_path / "s1.json")
    assert _run("bench.research.convergence", seed1, "--lr", "0.003", "--no-dense", "--variants",
                "lazy", "--seed", "1")["workload"]["seed"] == 1
    with pytest.raises(ValueError, match="--no-dense"):
        table([seed1, dense_out])


def test_gap_plot_needs_two_lengths(tmp_path):
    """A rule measured at 400 and 2,000 steps is a series of the gap plot; a rule measured at
    one length is not (ratios from the dense row of the same workload)."""
    from bench.research.convergence import SCHEMA, gap_series, plot_gap

    def report(steps, rows):
        path = tmp_path / f"r{steps}.json"
        results = [{"variant": {"name": n, "sparsity": sp}, "final_val_loss": loss,
                    "ratio_to_dense": None} for n, sp, loss in rows]
        path.write_text(json.dumps({"schema": SCHEMA, "results": results, "workload":
                                    {"steps": steps, "accum": 1, "model": "small"}}))
        return str(path)

    files = [report(400, [("dense-adams-lr0.0003", 0.0, 2.0), ("a@0.99", 0.99, 3.0),
                          ("b@0.99", 0.99, 2.5)]),
             report(2000, [("dense-adams-lr0.0003", 0.0, 1.5), ("a@0.99", 0.99, 2.0)])]
    series = gap_series(files)
    assert list(series) == ["a @ 0.99"]
    (x0, r0), (x1, r1) = series["a @ 0.99"]
    assert (x0, x1) == pytest.approx((4.0, 20.0)) and (r0, r1) == pytest.approx((1.5, 2.0 / 1.5))
    png = tmp_path / "gap.png"
    assert plot_gap(files, str(png)) and png.stat().st_size > 0
    assert gap_series(files[:1]) == {} and not plot_gap(files[:1], str(tmp_path / "one.png"))


@pytest.mark.timeout(200)
def test_convergence_local_step_row_smoke(tmp_path):
    """One SparseLoCo row on 2 gloo ranks beside the single-process dense row; its bytes per
    step are README's formula (record bytes * W / H) and the dense reference is what a real
    dense sharded AdamS step of this model counts at W=2."""
    from bench.research.convergence import table
    from bench.workloads.gpt import GPT, get_config, param_groups

    rep = _run("bench.research.convergence", str(tmp_path / "c.json"), "--variants", "none",
               "--local", json.dumps({"name": "sparseloco-h3-d0.03", "optimizer": "sparseloco",
                                      "optimizer_kwargs": {"sync_every": 3, "density": 0.03,
                                                           "value_bits": 2}}),
               "--adamw-reference")
    assert rep["schema"] == "scape.convergence/1" and rep["warnings"] == []
    dense, adamw, local = rep["results"]
    assert adamw["variant"] == {"name": f"dense-adamw-lr{rep['dense_lr']:g}",
                                "optimizer": "adamw", "lr": rep["dense_lr"]}
    assert adamw["world"] == 1 and adamw["final_val_loss"] != dense["final_val_loss"]
    steps = rep["workload"]["steps"]
    assert dense["variant"]["name"].startswith("dense-adams") and dense["world"] == 1
    assert local["variant"] == {"name": "sparseloco-h3-d0.03", "optimizer": "sparseloco",
                                "lr": rep["dense_lr"], "sync_every": 3, "density": 0.03,
                                "value_bits": 2}
    assert local["world"] == 2 and local["outer_settings"]["ef_decay"] > 0
    # evaluated at the syncs (steps 3, 6) on the same windows; the last step is a sync
    assert [s for s, _ in local["val_curve"]] == [3, 6] and steps == 6
    assert local["last_sync_step"] == 6 and local["last_sync_val_loss"] == local["final_val_loss"]
    assert local["ratio_to_dense"] == pytest.approx(local["final_val_loss"]
                                                    / dense["final_val_loss"])
    n_blocks = -(-local["params"] // 4096)
    k = n_blocks * round(0.03 * 4096)
    record = 4 * n_blocks + 2 * k + -(-k * 2 // 8)
    assert local["bytes_per_step"] == pytest.approx(2 * record / 3, rel=1e-12)
    assert local["bytes_per_sync"] == pytest.approx(2 * record, rel=1e-12)
    # the dense reference: a real dense step of the same model as rank 0 of 2, counted
    model = GPT(get_config("tiny"), seed=0)
    groups = param_groups(model, 0.1)
    for g in groups:
        g.pop("name")
    opt = __import__("scape").SCAPE(groups, lr=1e-3, sparsity=0.0,
                                    comm=NullCommunicator(2, 0))
    x = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    model.loss(x, x).backward()
    opt.step()
    assert rep["dense_adams_bytes_per_step"]["world"] == 2
    assert rep["dense_adams_bytes_per_step"]["bytes"] == sum(opt.last_step.bytes.values())
    # --table: the bytes column, "-" for a file written before bytes were recorded
    old = {k: v for k, v in rep.items() if k not in ("dense_adams_bytes_per_step", "warnings")}
    old["results"] = [{k: v for k, v in dense.items() if k not in ("bytes_per_step", "world")}]
    (tmp_path / "old.json").write_text(json.dumps(old))
    lines = table([str(tmp_path / "old.json")]).splitlines()
    assert "| bytes/step/rank |" in lines[0] and len(lines) == 3
    assert lines[2].split(" | ")[6] == "–"
    lines = table([str(tmp_path / "c.json")]).splitlines()
    reference = rep["dense_adams_bytes_per_step"]["bytes"]
    assert lines[2].split(" | ")[6] == \
        f"{dense['bytes_per_step']:,.0f} (1/{reference / dense['bytes_per_step']:.0f})"
    assert "sparseloco-h3-d0.03 (W=2)" in lines[4]
    assert lines[4].split(" | ")[6] == \
        f"{local['bytes_per_step']:,.0f} (1/{reference / local['bytes_per_step']:.0f})"
    assert lines[-1].startswith("Dense sharded AdamS on this model at W=2: ")


def test_step_compute_smoke(tmp_path):
    rep = _run("bench.step_compute", str(tmp_path / "s.json"))
    assert rep["schema"] == "scape.step_compute/1"
    rows = {r["optimizer"]: r for r in rep["rows"]}
    assert set(rows) == {"dense_adams", "scape_0.9", "scape_0.99", "dist_adamw"}
    assert rows["dense_adams"]["dense_step"] and not rows["scape_0.99"]["dense_step"]
    assert rows["scape_0.99"]["bytes"] < rows["scape_0.9"]["bytes"] < rows["dense_adams"]["bytes"]
    assert all(r["median_s"] > 0 for r in rows.values())
    # the library's default rule, recorded by every SCAPE row
    assert rep["update"] == "agree" and rows["scape_0.99"]["update"] == rep["update"]
    assert rows["dist_adamw"]["update"] is None
    # where it ran: a timing is read against the machine, versions and revision that made it
    env = rep["environment"]
    assert env["device"] == "cpu" and env["device_name"] == "cpu"
    assert env["torch"] == torch.__version__ and env["cpus"] >= 1
    assert "git_revision" in env and "python" in env


def test_step_compute_groups(tmp_path):
    """``--groups``: decay and no_decay groups, each at the row's sparsity."""
    rep = _run("bench.step_compute", str(tmp_path / "s.json"), "--groups")
    assert rep["groups"] is True and rep["update"] == "agree"
    rows = {r["optimizer"]: r for r in rep["rows"]}
    assert rows["scape_0.99"]["bytes"] < rows["scape_0.9"]["bytes"] < rows["dense_adams"]["bytes"]


def test_step_compute_update_option(tmp_path):
    """``--update`` takes a built-in rule by name, and a research rule's under ``python -m
    bench.research`` (which registers them in the benchmark's process)."""
    rep = _run("bench.step_compute", str(tmp_path / "s.json"), "--update", "lazy")
    assert rep["update"] == "lazy" and not rep["rows"][2]["dense_step"]
    research = _run("bench.research bench.step_compute", str(tmp_path / "r.json"), "--update",
                    "catchup_agree_accum")
    assert research["update"] == "catchup_agree_accum"
    # the rule changes the owner's update, not what is sent
    assert research["rows"][2]["bytes"] == rep["rows"][2]["bytes"]


def test_step_compute_profile_and_device(tmp_path):
    prof = tmp_path / "p.txt"
    rep = _run("bench.step_compute", str(tmp_path / "s.json"), "--profile", str(prof))
    assert rep["device"] == "cpu"
    sections = prof.read_text().split("== ")[1:]
    assert [s.split(":")[0] for s in sections] == [r["optimizer"] for r in rep["rows"]]
    assert "scape/take" in sections[2] and "scape/take" not in sections[0]  # 0.99 vs dense
    if not torch.cuda.is_available():
        r = subprocess.run([sys.executable, "-m", "bench.step_compute", "--smoke", "--device",
                            "cuda", "--out", str(tmp_path / "x.json")], capture_output=True,
                           text=True, timeout=120, cwd=ROOT)
        assert r.returncode == 2 and "torch.cuda.is_available() is False" in r.stderr
        assert not (tmp_path / "x.json").exists()


@pytest.mark.parametrize("world,rank", [(1, 0), (4, 2)])
def test_null_communicator(world, rank):
    c = NullCommunicator(world, rank)
    x = torch.randn(6, generator=torch.Generator().manual_seed(world))
    out = torch.full((6 * world,), float("nan"))
    c.all_gather(out, x).wait()
    assert torch.equal(out.view(world, 6), x.expand(world, 6))
    rs = torch.full((6 // world if world < 6 else 1,), float("nan"))
    inp = torch.randn(rs.numel() * world)
    c.reduce_scatter(rs, inp).wait()
    assert torch.equal(rs, inp.view(world, -1)[rank])
    a2a_in = torch.randn(3 * world, generator=torch.Generator().manual_seed(10 + world))
    a2a = torch.full((3 * world,), float("nan"))
    c.all_to_all(a2a, a2a_in).wait()  # as if every rank sent this rank's segments
    assert torch.equal(a2a.view(world, 3), a2a_in.view(world, 3)[rank].expand(world, 3))
    assert c.stats["all_gather"] == {"calls": 1, "bytes": out.nbytes}
    assert c.stats["reduce_scatter"] == {"calls": 1, "bytes": inp.nbytes}
    assert c.stats["all_to_all"] == {"calls": 1, "bytes": a2a_in.nbytes}
    with pytest.raises(ValueError):
        c.all_gather(torch.empty(5), x)
    with pytest.raises(ValueError, match="all_to_all"):
        c.all_to_all(torch.empty(3 * world), torch.empty(3 * world + 1))
    timed = timed_communicator(c)  # the runner's wrapper passes it through, and times wait()
    timed.all_to_all(a2a, a2a_in).wait()
    assert timed.stats["all_to_all"] == {"calls": 2, "bytes": 2 * a2a_in.nbytes}
    assert timed.wait_s >= 0.0


def test_lr_stability_table(capsys):
    """One lr, one rule and the dense column: a markdown row per sparsity, losses finite and
    the dense cell the same in both rows (sparsity does not apply to it)."""
    from bench.research.lr_stability import main

    assert main(["--lrs", "0.003", "--rules", "lazy", "--dense"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0] == "| lr | sparsity | lazy | dense AdamS |"
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]
    assert [r[:2] for r in rows] == [["0.003", "0.9"], ["0.003", "0.99"]]
    for r in rows:
        for cell in r[2:]:
            first, last = (float(v) for v in cell.split(" -> "))
            assert math.isfinite(first) and math.isfinite(last) and first > 0
    assert rows[0][3] == rows[1][3]


def test_convergence_ramp_rows():
    """A ``-ramp`` row changes every sparse group's sparsity per step: it sends more bytes per
    sparse step than the same row without it, the same once the ramp is over; on ranks it is
    the runner's ramp over the same share of the run."""
    from bench.research.convergence import Workload, run_config, train
    from bench.research.rows import variants

    names = [v["name"] for v in variants([0.99], ["catchup_agree_trust2_accum-ramp0.9x0.2"])]
    assert names == ["catchup_agree_trust2_accum-ramp0.9x0.2@0.99"]
    w = Workload(model="tiny", steps=12, batch=4, seq=64, eval_every=12, eval_seqs=4, threads=1)
    base = dict(name="r", sparsity=0.99, warmup_steps=2, lr=3e-3, update="catchup_sqrt_accum")
    plain = train(base, w, log=False)
    ramp = train(dict(base, ramp=(0.5, 0.5)), w, log=False)
    assert ramp["bytes_per_sparse_step"] > 2 * plain["bytes_per_sparse_step"]
    assert ramp["bytes_last_step"] == plain["bytes_last_step"]
    assert plain["bytes_per_step"] > plain["bytes_per_sparse_step"]  # dense warm-up steps
    assert run_config(dict(base, ramp=(0.5, 0.5)), w, 2).sparsity_ramp == (0.5, 6)
    assert run_config(base, w, 2).sparsity_ramp == (0.5, 0)  # as measured: no ramp
    (early,) = variants([0.99], ["early-ramp0.5x0.01"])
    assert (early["update"], early["ramp"]) == ("early", (0.5, 0.01))
    (head,) = variants([0.99], ["catchup_agree_trust2_accum-head0.9"])
    assert head["group_sparsity"] == {"head": 0.9}
    (both,) = variants([0.99], ["catchup_agree_trust2_accum-tokhead0.9"])
    assert both["group_sparsity"] == {"embed": 0.9, "pos": 0.99, "head": 0.9}
    # a ramp on the embedding split: the embeddings ramp down to their own 0.9, the rest to 0.99
    (row,) = variants([0.99], ["catchup_agree_trust2_accum-embed0.9-ramp0.5x0.02"])
    assert row["group_sparsity"] == {"embed": 0.9} and row["ramp"] == (0.5, 0.02)
    split = train(dict(base, group_sparsity={"embed": 0.9}), w, log=False)
    both = train(dict(base, group_sparsity={"embed": 0.9}, ramp=(0.5, 0.5)), w, log=False)
    assert both["bytes_last_step"] == split["bytes_last_step"]
    assert both["bytes_per_sparse_step"] > split["bytes_per_sparse_step"]
    assert split["bytes_per_sparse_step"] > plain["bytes_per_sparse_step"]


def test_convergence_auto_rows():
    """An ``-auto`` row splits the row's sparsity over the groups by agreement (by gain on
    ``-autog``): every group measured at the first sparse step and every ``every`` after, the
    groups that read higher denser, the coordinates per step those of every group at the row's
    sparsity, a floor kept where set; on ranks it is the same engine hook."""
    from bench.research.convergence import Workload, run_config, train
    from bench.research.rows import variants

    (row,) = variants([0.99], ["catchup_agree_trust2_accum-auto2"])
    assert row["allot"] == (2.0, 100, "m") and row["group_sparsity"] == {"embed": 0.99, "pos": 0.99}
    (ramped,) = variants([0.99], ["catchup_agree_trust4_accum-auto1-ramp0.5x0.02"])
    assert ramped["allot"] == (1.0, 100, "m") and ramped["ramp"] == (0.5, 0.02)
    (fresh,) = variants([0.99], ["catchup_agree_trust2_accum-autof3"])
    assert fresh["allot"] == (3.0, 100, "fresh")
    (gain,) = variants([0.99], ["catchup_agree_trust2_accum-autog1.5"])
    assert gain["allot"] == (1.5, 100, "gain")
    (floored,) = variants([0.99], ["catchup_agree_trust2_accum-autog1-floor0.5-ramp0.5x0.02"])
    assert floored["allot"] == (1.0, 100, "gain") and floored["allot_floor"] == 0.5
    assert floored["ramp"] == (0.5, 0.02)
    w = Workload(model="tiny", steps=14, batch=4, seq=64, eval_every=14, eval_seqs=4, threads=1)
    base = dict(name="a", sparsity=0.9, warmup_steps=2, lr=3e-3,
                update="catchup_agree_trust2_accum",
                group_sparsity={"embed": 0.9, "pos": 0.9})
    auto = train(dict(base, allot=(2.0, 5, "m")), w, log=False)
    fresh = train(dict(base, allot=(2.0, 5, "fresh")), w, log=False)
    gain = train(dict(base, allot=(2.0, 5, "gain")), w, log=False)
    for run in (auto, fresh, gain):
        assert [h[0] for h in run["allot_history"]] == [0, 5, 10]
    for _, signal, split in auto["allot_history"] + fresh["allot_history"] \
            + gain["allot_history"]:
        assert set(signal) == set(split) and len(split) == 4
        assert all(0.0 <= a <= 1.0 for a in signal.values())  # agreement; gain is far below 1
        most = max(signal, key=signal.__getitem__)
        least = min(signal, key=signal.__getitem__)
        assert split[most] < 0.9 < split[least]
    # gain carries the gradient's scale: a reading of its own, not the agreement's
    assert gain["allot_history"][-1][1] != fresh["allot_history"][-1][1]
    floored = train(dict(base, allot=(4.0, 5, "gain"), allot_floor=0.5), w, log=False)
    for _, _, split in floored["allot_history"]:
        assert all(s <= 1.0 - 0.5 * 0.1 + 1e-12 for s in split.values())  # the floor holds
        assert max(split.values()) > 0.9  # and the split still moves below it
    hooks = run_config(dict(base, allot=(2.0, 5, "gain", 0.99), allot_floor=0.5), w, 2).hooks
    assert hooks["bench.research.rows:Allotment"] == {"power": 2.0, "every": 5, "source": "gain",
                                                      "beta": 0.99, "floor": 0.5}


def test_convergence_rows_use_the_lean_optimizer():
    """No row passes a keyword the optimizer does not take: an ``explore`` or error-feedback
    change names a rule made by ``with_options``, and the optimizer's own split rows became
    ``-autog1`` rows, split from outside (gain, power 1, every 100 sparse steps)."""
    from bench.research.rows import variants
    from scape import rules

    rows = variants([0.99], None)
    assert rows and not any({"explore", "error_feedback", "split", "split_every"} & set(r)
                            for r in rows)
    assert not any("-split" in r["name"] for r in rows)
    names = {r["name"].split("@")[0]: r for r in rows}
    assert names["lazy-explore0.2"]["update"] == "lazy-explore0.2"
    assert rules.RULES["lazy-explore0.2"].explore == 0.2
    assert rules.RULES[names["catchup_accum-no_ef"]["update"]].error_feedback is False
    assert rules.RULES[names["catchup_agree_trust2_gain-explore1"]["update"]].explore == 1.0
    for name in ("catchup_agree_trust2_gain-autog1", "catchup_agree_trustlr_accum-autog1",
                 "catchup_agree_trust2_accum-autog1"):
        assert names[name]["allot"] == (1.0, 100, "gain")
        assert names[name]["group_sparsity"] == {"embed": 0.99, "pos": 0.99}
    assert names["catchup_agree_trust2_accum-autog1-trustlr"]["trust_lr"] == (0.5, 0.25)
    # every rule has a plain row; the research names of the built-ins only when asked for
    assert {"auto", "robust", "sqrt", "lazy", "catchup_agree_trust2_accum"} <= set(names)
    assert "catchup_sqrt_accum" not in names and "catchup_agree_trust2_gainr" in names
    (alias,) = variants([0.99], ["catchup_sqrt_accum"])
    assert alias["update"] == "catchup_sqrt_accum"


def test_convergence_trust_lr_row_with_the_gain_split():
    """``-autog1-trustlr``: the bound follows the lr from c = 1/2 at the peak towards 1/4 while
    the Allotment splits by gain; it moves the run (engine hooks, in the order the row lists
    them)."""
    from bench.research.convergence import Workload, run_config, train

    w = Workload(model="tiny", steps=14, batch=4, seq=64, eval_every=14, eval_seqs=4, threads=1)
    base = dict(name="a", sparsity=0.9, warmup_steps=2, lr=3e-3,
                update="catchup_agree_trust2_accum",
                group_sparsity={"embed": 0.9, "pos": 0.9}, allot=(1.0, 5, "gain"))
    split = train(base, w, log=False)
    scheduled = train(dict(base, trust_lr=(0.5, 0.25)), w, log=False)
    assert [h[0] for h in scheduled["allot_history"]] == [0, 5, 10]
    assert math.isfinite(scheduled["final_val_loss"])
    assert scheduled["final_val_loss"] != split["final_val_loss"]  # the bound moved
    assert list(run_config(dict(base, trust_lr=(0.5, 0.25)), w, 2).hooks) == [
        "bench.research.rows:Allotment", "bench.research.rows:TrustLr",
        "bench.research.rows:Diagnostics"]
