"""bench/projection.py: the alpha-beta cluster model against DESIGN's byte count, its
invariants, the paper's published figures, and the JSON it writes."""

from __future__ import annotations

import itertools
import json

import pytest

from bench import projection as pj

B = 4096


def test_param_counts_from_configs():
    n = {k: m.n_params() for k, m in pj.MODELS.items()}
    assert 0.33e9 < n["GPT-345M"] < 0.37e9
    assert 0.45e9 < n["Llama-500M"] < 0.55e9
    assert 1.7e9 < n["Llama-1.8B"] < 1.9e9
    # GPT-345M by hand from Megatron's shapes: per layer 12 d^2 + 13 d, embeddings, final LN
    d, L = 1024, 24
    assert n["GPT-345M"] == L * (12 * d * d + 13 * d) + 50304 * d + 1024 * d + 2 * d


@pytest.mark.parametrize("n, world", [
    pytest.param(1_000_003, 4, id="odd-N"),
    pytest.param(355_000_000, 32, id="345M-W32"),
    pytest.param(1_775_372_288, 256, id="1.8B-W256"),
])
@pytest.mark.parametrize("sparsity", [0.9, 0.99])
def test_bytes_match_design(n, world, sparsity):
    dense = pj.bytes_per_step(n, world, 0.0)
    assert dense == n * (2 + 2)
    assert pj.bytes_per_step(n, world, 0.0, grad_bytes=4) == n * 6
    n_pad = -(-n // (world * B)) * world * B
    assert n_pad % (world * B) == 0 and 0 <= n_pad - n < world * B
    k = pj.mask_size(n, world, sparsity)
    assert k == (n_pad // B) * max(1, round((1 - sparsity) * B))
    assert k % world == 0  # every shard contributes the same k_s
    assert pj.bytes_per_step(n, world, sparsity) == k * (2 + 2 + 2)
    # "At 99% sparsity with bf16 that is 1/67 of dense" (padding aside)
    if sparsity == 0.99 and n > 10**8:
        assert dense / pj.bytes_per_step(n, world, sparsity) == pytest.approx(
            4 / (6 * round(0.01 * B) / B), rel=0.01)


def test_validation_errors():
    with pytest.raises(ValueError, match="sparsity"):
        pj.mask_size(100, 2, 1.0)
    with pytest.raises(ValueError, match="link"):
        pj.hardware("10G")


def test_ring_time_is_nccl_alpha_beta():
    hw = pj.hardware("400G")
    n, w = 1e9, 32
    expected = 8.4e-6 + (w - 1) * 9.6e-6 + n * (w - 1) / w / (400e9 / 8 * pj.BUS_EFFICIENCY)
    assert pj.ring_time(n, w, hw) == pytest.approx(expected, rel=1e-12)
    assert pj.ring_time(n, 1, hw) == 0.0


LINKS = list(pj.LINKS_GBPS)
WORLDS = [8, 32, 256, 1024]


@pytest.mark.parametrize("model", list(pj.MODELS))
def test_more_bandwidth_never_slower(model):
    n = pj.MODELS[model].n_params()
    for w, s in itertools.product(WORLDS, [0.9, 0.99]):
        rows = [pj.step_times(n, w, s, 2048, pj.Hardware(gbps))
                for gbps in (50, 100, 200, 400, 3600)]
        for a, b in zip(rows, rows[1:]):
            assert b["dense_step_s"] <= a["dense_step_s"]
            assert b["scape_step_s"] <= a["scape_step_s"]
        for link in LINKS:
            r = pj.step_times(n, w, s, 2048, pj.hardware(link))
            assert r["compute_s"] < r["scape_step_s"] <= r["dense_step_s"]


@pytest.mark.parametrize("model", list(pj.MODELS))
def test_more_sparsity_never_more_bytes_or_time(model):
    n = pj.MODELS[model].n_params()
    levels = [0.0, 0.5, 0.9, 0.95, 0.99, 0.999]
    for w in WORLDS:
        by = [pj.bytes_per_step(n, w, s) for s in levels]
        assert all(b <= a for a, b in zip(by[1:], by[2:]))  # among sparse levels
        assert by[2] < by[0] and by[4] < by[0] / 50
        times = [pj.step_times(n, w, s, 2048, pj.hardware("400G"))["scape_step_s"]
                 for s in levels[1:]]
        assert all(b <= a for a, b in zip(times, times[1:]))


@pytest.fixture(scope="module")
def checks():
    return {c["model"]: c for c in pj.paper_checks()}


def test_paper_llama_1p8b_per_step_speedup(checks):
    """3.26x per step at 99% sparsity (Llama-1.8B, 32 GH200, 400G): within 15%."""
    c = checks["Llama-1.8B"]
    assert c["target"] == 3.26
    assert abs(c["projected"] / 3.26 - 1) <= 0.15, c


@pytest.mark.xfail(strict=True, reason=(
    "the model projects SCAPE at ~34% of dense time for Llama-500M, not the published 56.7%: "
    "with the same GPU and link assumptions that reproduce the 1.8B per-step speedup, the "
    "500M end-to-end figure implies ~3x lower compute throughput (MFU ~0.11 vs ~0.34); the "
    "gap is not closed by fitting (see bench/README.md, Projection)"))
def test_paper_llama_500m_end_to_end(checks):
    """-43.3% end-to-end wall-clock (SCAPE at 56.7% of dense), Llama-500M at 99%."""
    c = checks["Llama-500M"]
    assert c["target"] == 0.567
    assert abs(c["projected"] / 0.567 - 1) <= 0.15, c


def test_no_single_mfu_matches_both_paper_figures():
    """The finding behind the xfail above, checked on a grid: at the stated link assumptions
    no one MFU puts both published figures within 15%."""
    both = []
    for m in [x / 100 for x in range(5, 101)]:
        r5 = pj.paper_setting("Llama-500M", 0.99, mfu=m)["time_ratio"]
        r18 = pj.paper_setting("Llama-1.8B", 0.99, mfu=m)["speedup"]
        if abs(r5 / 0.567 - 1) <= 0.15 and abs(r18 / 3.26 - 1) <= 0.15:
            both.append(m)
    assert both == []


def test_json_schema(tmp_path):
    out = tmp_path / "p.json"
    pj.main(["--smoke", "--out", str(out)])
    rep = json.loads(out.read_text())
    assert rep["schema"] == "scape.projection/1"
    assert {"assumptions", "models", "paper_checks", "sensitivity", "projection"} <= set(rep)
    a = rep["assumptions"]
    for key in ("peak_bf16_flops", "mfu", "bus_efficiency", "nccl_base_lat_s",
                "nccl_hw_lat_s", "links_gbps", "paper_setting", "baseline"):
        assert key in a, key
    for name, m in rep["models"].items():
        assert m["n_params"] == pj.MODELS[name].n_params() and m["note"]
    assert len(rep["paper_checks"]) == 2
    for c in rep["paper_checks"]:
        assert {"name", "model", "target", "projected", "rel_error", "within_tolerance",
                "implied_mfu"} <= set(c)
        assert c["within_tolerance"] == (abs(c["rel_error"]) <= 0.15)
    assert rep["sensitivity"][0]["variant"] == "baseline"
    rows = rep["projection"]
    assert rows and {r["world"] for r in rows} == {8, 32}
    keys = {"model", "link", "link_gbps", "world", "sparsity", "compute_s", "dense_step_s",
            "scape_step_s", "speedup", "dense_tokens_per_s_per_gpu",
            "scape_tokens_per_s_per_gpu", "dense_bytes", "scape_bytes", "mask_size"}
    for r in rows:
        assert keys <= set(r)
        assert r["speedup"] == pytest.approx(r["dense_step_s"] / r["scape_step_s"])
        assert r["dense_tokens_per_s_per_gpu"] == pytest.approx(2048 / r["dense_step_s"])


@pytest.mark.parametrize("block_size, half", [(1024, 2.5), (4096, 40.5), (256, 0.5)])
def test_mask_size_takes_the_librarys_row_size_at_a_half(block_size, half):
    """The projection counts a mask row as the optimizer does (``scape.rules.block_budget``,
    halves rounded up), also where ``(1 - sparsity) * B`` is exactly ``x.5``, which
    Python's ``round`` would send to the even side."""
    from scape.rules import block_budget

    sparsity = 1.0 - half / block_size
    assert (1.0 - sparsity) * block_size == half  # exact in binary: a real half
    world = 4
    k_b = block_budget(sparsity, block_size, 0.0)[0]
    assert k_b == int(half + 0.5)
    assert pj.mask_size(world * block_size, world, sparsity, block_size) == world * k_b
