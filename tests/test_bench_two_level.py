"""bench.engine.netns_nodes and bench.two_level: two emulated nodes (a shaped link between two
network namespaces, the unshaped loopback inside each), and the job's quick form end to end."""

from __future__ import annotations

import json
import subprocess

import pytest

from bench.engine import netns, netns_nodes
from bench.engine.run_config import RunConfig
from bench.two_level import PER_NODE, formula
from scape.rules import block_budget
from tests.test_bench_smoke import _run
from tests.test_netns import _OK, needs_netns


@needs_netns
@pytest.mark.timeout(90)
def test_link_delivers_its_rate_and_the_node_inside_is_not_shaped():
    rate = netns.parse_rate("50mbit")
    with netns_nodes.node_namespaces("50mbit") as names:
        assert set(names) <= set(netns.namespaces())
        got = netns_nodes.measure(names, 6_250_000)  # ~1 s at 50 Mbit/s
    assert not set(names) & set(netns.namespaces())  # removed, the veth pair with them
    assert 0.75 * rate <= got["link_bps"] <= 1.25 * rate, got
    assert got["inside_bps"] > 10 * rate, got  # the loopback inside a node is not shaped
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert "sv" not in " ".join(line.split(":")[1] for line in links.splitlines())


@needs_netns
@pytest.mark.timeout(60)
def test_namespaces_removed_on_exception():
    with pytest.raises(RuntimeError, match="boom"):
        with netns_nodes.node_namespaces("100mbit") as names:
            raise RuntimeError("boom")
    assert not set(names) & set(netns.namespaces())


def test_run_config_checks_the_node_layout():
    with pytest.raises(ValueError, match="divisor of world"):
        RunConfig(world=4, nodes=3)
    with pytest.raises(ValueError, match="one namespace per node"):
        RunConfig(world=4, nodes=2, node_netns=["a"])


def test_run_config_checks_fsdp2():
    with pytest.raises(ValueError, match="fsdp2 takes the optimizers"):
        RunConfig(world=4, nodes=2, fsdp2=True, two_level=True)
    with pytest.raises(ValueError, match="fsdp2 takes the optimizers"):
        RunConfig(world=4, nodes=2, fsdp2=True, optimizer="topk")
    with pytest.raises(ValueError, match="set fsdp2=True"):
        RunConfig(world=4, nodes=2, optimizer="hsdp_adamw")


def test_formula_levels():
    n_pad = 4 * 4096 * 10
    k = (n_pad // 4096) * block_budget(0.99, 4096, 0.1)[0]
    two, flat = formula("two_level", n_pad), formula("flat", n_pad)
    assert two is not None and flat is not None
    offsets = n_pad // 4096 // 4 * 44  # one rank's 10 mask rows, 44 bytes each (Elias-Fano)
    # across nodes a rank sends its slice's share: 1/G of a flat rank's, up to the scalars
    # (flat: the 4 ranks' counts and sums of squares ride; two levels: the all-reduce)
    assert (two["inter"] - 8) * PER_NODE == flat["flat"] - 4 * 8 == k * 8 + 4 * offsets
    assert two["intra"] == n_pad * 4 + k * 4 + 4 * offsets + 8  # dense reduce-scatter inside


def test_two_level_quick(tmp_path):
    out = tmp_path / "tl"
    text = _run(["bench.two_level", "--quick", "--out", str(out)], timeout=900)
    rep = json.loads((out / "report.json").read_text())
    assert rep["schema"] == "scape.two_level/1"
    q = rep["quality"]
    assert q["runs"]["flat"]["param_sha256_ranks_agree"]
    assert q["runs"]["two_level"]["param_sha256_ranks_agree"]
    assert abs(q["two_level_over_flat"] - 1) < 0.05  # 40 steps: the same plateau
    if not _OK:
        assert "speed_skipped" in rep
        return
    (leg,) = rep["speed"]
    rows = {r["name"]: r for r in leg["rows"]}
    assert set(rows) == {"compute_only", "dense_hsdp", "flat", "two_level"}
    for name in ("dense_hsdp", "two_level"):  # the library's counters equal the formula
        lv, f = rows[name]["bytes_per_step_by_level"], rows[name]["formula"]
        assert lv["inter"] == f["inter"] and lv["intra"] == f["intra"]
    assert rows["flat"]["bytes_per_step_by_level"]["flat"] == rows["flat"]["formula"]["flat"]
    # on the wire: both sparse rows put far less on the link than dense (at --quick's size a
    # collective's framing outweighs the payload, so flat's two a step and two levels'
    # per-bucket ones are not ordered by their payloads here)
    wire = {n: sum(r["link_bytes_per_node_per_step"]) for n, r in rows.items()}
    assert max(wire["two_level"], wire["flat"]) < wire["dense_hsdp"] / 4, wire
    assert leg["link"]["inside_bps"] > leg["link"]["link_bps"]
    assert "| 100mbit | two_level |" in text


def test_two_level_fsdp2_quick(tmp_path):
    """FSDP2 inside each node, HSDP or SCAPE-0.99 across: both train with every rank's
    parameters identical; SCAPE's counted bytes across are the formula on the local shard and
    the link carries less than HSDP's all-reduce puts on it."""
    out = tmp_path / "tl"
    text = _run(["bench.two_level", "--quick", "--fsdp2", "--out", str(out)], timeout=900)
    rep = json.loads((out / "report.json").read_text())
    q = rep["quality"]
    assert q["pair"] == ["fsdp2_hsdp", "fsdp2_scape"]
    for run in q["runs"].values():
        assert run["param_sha256_ranks_agree"] and run["max_rss_mb"] > 0
    assert abs(q["scape_over_hsdp"] - 1) < 0.1  # 40 steps: both near the unigram plateau
    if not _OK:
        assert "speed_skipped" in rep
        return
    (leg,) = rep["speed"]
    rows = {r["name"]: r for r in leg["rows"]}
    assert set(rows) == {"fsdp2_hsdp", "fsdp2_scape"}
    scape = rows["fsdp2_scape"]
    assert scape["bytes_per_step_by_level"]["flat"] == scape["formula"]["flat"]
    wire = {n: sum(r["link_bytes_per_node_per_step"]) for n, r in rows.items()}
    assert wire["fsdp2_scape"] < wire["fsdp2_hsdp"]
    assert "| 100mbit | fsdp2_scape |" in text
