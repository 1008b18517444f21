"""bench/projection_levels.py: the two-level model's bytes against DESIGN §1's formula, its
invariants (1/G across nodes, G=1 is flat, more bandwidth is never slower) and its JSON."""

from __future__ import annotations

import json
import math

import pytest

from bench import projection as pj
from bench import projection_levels as pl

B = 4096
N_18B = pj.MODELS["Llama-1.8B"].n_params()
SIZES = [1_000_003, 355_000_000, N_18B]


def _design_k(n: int, world: int, sparsity: float) -> tuple[int, int]:
    """N_pad and K of DESIGN §1, from scratch: pad to a multiple of W*B; every block keeps
    k_b = max(1, round(d*B)) coordinates, halves rounding up."""
    n_pad = -(-n // (world * B)) * world * B
    k_b = max(1, math.floor((1.0 - sparsity) * B + 0.5))
    return n_pad, n_pad // B * k_b


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("nodes, per_node", [(4, 2), (8, 8), (32, 8), (16, 4), (3, 16)])
@pytest.mark.parametrize("sparsity", [0.9, 0.99])
def test_bytes_match_design(n, nodes, per_node, sparsity):
    w, g = nodes * per_node, per_node
    n_pad, k = _design_k(n, w, sparsity)
    hier = pl.level_bytes("hier_scape", n, nodes, per_node, sparsity)
    flat = pl.level_bytes("flat_scape", n, nodes, per_node, sparsity)
    # inside the node: the dense gradient buffer, the K new values and K int16 offsets, 8 bytes
    assert hier["intra_bytes_per_rank"] == n_pad * 2 + k * (2 + 2) + 8
    # across nodes: the slice's K/G compact values (gradient, parameter, offset), 8 bytes
    assert hier["inter_bytes_per_rank"] == k // g * (2 + 2 + 2) + 8
    assert flat["inter_bytes_per_rank"] == k * (2 + 2 + 2) + 8
    assert flat["inter_bytes_per_rank"] == pj.bytes_per_step(n, w, sparsity) + 8
    dense = pl.level_bytes("dense_hsdp", n, nodes, per_node)
    assert dense["intra_bytes_per_rank"] == n * (2 + 2)
    assert dense["inter_bytes_per_node"] == pytest.approx(2 * n * 2, abs=4 * g)  # N/G rounded up
    zpp = pl.level_bytes("zeropp", n, nodes, per_node)  # 0.75M with M = 2N bytes (fp16)
    assert zpp["inter_bytes_per_node"] == pytest.approx(0.75 * 2 * n, abs=2 * g)


@pytest.mark.parametrize("per_node", [2, 4, 8, 16])
@pytest.mark.parametrize("sparsity", [0.5, 0.9, 0.99])
def test_hierarchical_nic_bytes_are_one_gth_of_flat(per_node, sparsity):
    for n in SIZES:
        for nodes in (2, 8, 64):
            hier = pl.level_bytes("hier_scape", n, nodes, per_node, sparsity)
            flat = pl.level_bytes("flat_scape", n, nodes, per_node, sparsity)
            scalars = 8 * per_node  # every rank's 8-byte all-reduce
            assert (hier["inter_bytes_per_node"] - scalars) * per_node \
                == flat["inter_bytes_per_node"] - scalars
            ring = pl.level_bytes("flat_scape_ring", n, nodes, per_node, sparsity)
            assert ring["inter_bytes_per_node"] - 8 == hier["inter_bytes_per_node"] - scalars


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("world", [4, 32, 256])
def test_one_gpu_per_node_is_flat(n, world):
    for link in pl.NIC_LINKS:
        cl = pl.Cluster(world, 1, pj.LINKS_GBPS[link])
        for s in (0.9, 0.99):
            hier = pl.step_time("hier_scape", n, cl, s)
            flat = pl.step_time("flat_scape", n, cl, s)
            assert hier["intra_s"] == 0.0
            assert hier["step_s"] == pytest.approx(flat["step_s"], rel=1e-12)
            assert pl.level_bytes("hier_scape", n, world, 1, s) \
                == pl.level_bytes("flat_scape", n, world, 1, s)
        # with G=1 HSDP is flat sharded AdamS: bench.projection's dense step, same link
        dense = pl.step_time("dense_hsdp", n, cl)["step_s"]
        assert dense == pytest.approx(
            pj.step_times(n, world, 0.99, pl.TOKENS_PER_GPU, pj.hardware(link))["dense_step_s"],
            rel=1e-9)


@pytest.mark.parametrize("method", pl.METHODS)
def test_more_bandwidth_never_slower(method):
    for world in (16, 64, 1024):
        for s in (0.9, 0.99):
            times = [pl.step_time(method, N_18B, pl.Cluster(world // 8, 8, gbps), s)["step_s"]
                     for gbps in (25, 50, 100, 200, 400, 800, 3600)]
            assert all(b <= a for a, b in zip(times, times[1:])), times
            fast_nvlink = pl.step_time(method, N_18B, pl.Cluster(world // 8, 8, 400, 7200), s)
            assert fast_nvlink["step_s"] <= times[4]


def test_every_step_is_at_least_its_compute():
    for r in pl.rows((16, 1024), pl.NIC_LINKS, (0.99,)):
        assert r["step_s"] >= r["compute_s"] > 0
        assert r["step_s"] == pytest.approx(
            r["compute_s"] + r["intra_s"] + r["inter_s"] + r["mask_exposed_s"])


def test_unknown_method():
    with pytest.raises(ValueError, match="method"):
        pl.level_bytes("allreduce", 10, 2, 2)
    with pytest.raises(ValueError, match="method"):
        pl.step_time("allreduce", 10, pl.Cluster(2, 2, 100))


def test_smoke_cli_writes_the_json_the_docs_use(tmp_path, capsys):
    out, png = tmp_path / "p.json", tmp_path / "p.png"
    pl.main(["--smoke", "--out", str(out), "--plot", str(png)])
    rep = json.loads(out.read_text())
    assert png.stat().st_size > 0
    assert rep["schema"] == "scape.projection_levels/1"
    assert rep["model"]["n_params"] == N_18B and rep["per_node"] == 8
    for key in ("cluster", "nic_sharing", "flat_scape", "flat_scape_ring", "ring", "compute",
                "overlap", "zeropp_paper", "zeropp_from_paper"):
        assert key in rep["assumptions"], key
    rows = rep["rows"]
    assert {r["method"] for r in rows} == set(pl.METHODS)
    for r in rows:  # the fields of the docs' tables
        for key in ("method", "label", "sparsity", "link", "world", "step_s",
                    "speedup_vs_hsdp", "inter_bytes_per_node", "intra_bytes_per_rank",
                    "inter_bytes_per_rank", "compute_s"):
            assert key in r, key
        base = next(x for x in rows if x["method"] == "dense_hsdp"
                    and x["link"] == r["link"] and x["world"] == r["world"])
        assert r["speedup_vs_hsdp"] == pytest.approx(base["step_s"] / r["step_s"])
    assert "| method |" in pl.markdown(rep)
    assert "hierarchical SCAPE-0.99" in capsys.readouterr().out
    pl.main(["--assumptions"])
    assert "zeropp_from_paper" in capsys.readouterr().out


@pytest.mark.parametrize("model", sorted(pl.FSDP2_MODELS))
@pytest.mark.parametrize("nodes, per_node", [(8, 8), (32, 8), (3, 4)])
def test_fsdp2_rows_bytes_match_the_formula_on_the_local_shard(model, nodes, per_node):
    """FSDP2 inside (both rows move the same bytes there); across, HSDP all-reduces the
    rank's slice and SCAPE sends the flat formula on the local shard N/G over R ranks."""
    n = pl.FSDP2_MODELS[model].n_params()
    cl = pl.Cluster(nodes, per_node, pj.LINKS_GBPS["100G"])
    hsdp = pl.fsdp2_step("fsdp2_hsdp", n, cl)
    scape = pl.fsdp2_step("fsdp2_scape", n, cl, 0.99)
    assert hsdp["intra_bytes_per_rank"] == scape["intra_bytes_per_rank"] == n * (2 + 2 + 2)
    shard = -(-n // per_node)
    assert hsdp["inter_bytes_per_rank"] == 2 * shard * 2
    _, k = _design_k(shard, nodes, 0.99)
    assert scape["inter_bytes_per_rank"] == k * (2 + 2 + 2) + 8
    assert scape["inter_bytes_per_node"] == per_node * scape["inter_bytes_per_rank"]
    # bf16 on the wire: about 1/66.7 of HSDP's bytes across at 0.99 (padding adds a little)
    ratio = hsdp["inter_bytes_per_node"] / scape["inter_bytes_per_node"]
    assert 60 < ratio < 4 / (0.01 * 6) + 1e-9
    for t in (hsdp, scape):
        parts = t["compute_s"] + t["intra_s"] + t["inter_s"] + t["mask_exposed_s"]
        assert t["step_s"] == pytest.approx(parts)
    assert scape["step_s"] < hsdp["step_s"]


def test_fsdp2_rows_in_the_report():
    rep = pl.report()
    fr = rep["fsdp2_rows"]
    assert {r["model"] for r in fr} == set(pl.FSDP2_MODELS)
    assert {r["world"] for r in fr} == set(pl.TABLE_WORLDS)
    assert {r["link"] for r in fr} == set(pl.NIC_LINKS)
    for r in fr:
        if r["method"] == "fsdp2_hsdp":
            assert r["speedup_vs_hsdp"] == 1.0
    table = pl.markdown_fsdp2(rep)
    assert table.count("\n") == 1 + len(pl.FSDP2_MODELS) * len(pl.NIC_LINKS) * 2
