"""GPU readiness without a GPU: every Triton kernel compiles through ``triton.compile`` for
sm_80 and sm_90 (fp32 and bf16 specialisations, the launchers' own settings), and ptxas
reports zero register spills. The table (registers, shared memory, spills, widest global
load) is printed (``pytest -s`` / ``-rA``) and attached to the report as a property.

Compilation cannot run under ``TRITON_INTERPRET=1``, which the test session sets, so the
work happens in a child process: this file run as a script (``python tests/test_compile.py``
prints the rows as JSON).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor

import pytest

TARGETS = (80, 90)
DTYPES = ("fp32", "bf16")


def _specs(dt: str) -> list[tuple[str, object, dict, dict, int]]:
    """(label, kernel, signature, constexprs, num_warps) as the launchers configure them."""
    from scape.kernels import catchup, moments, select, sparse, stats, topk
    from scape.rules import reads_wait

    specs = []
    for block in (4096, 8192, 32768):
        cfg = topk.topk_config(block)
        specs.append((f"topk B={block}", topk._blockwise_topk_kernel,
                      {"p_score": f"*{dt}", "p_age": "*i32", "p_idx": "*i16", "k": "i32",
                       "k_explore": "i32", "BLOCK_SIZE": "constexpr", "CHUNK": "constexpr",
                       "HAS_EXPLORE": "constexpr"},
                      {"BLOCK_SIZE": block, "CHUNK": cfg["CHUNK"], "HAS_EXPLORE": True},
                      cfg["num_warps"]))
    scfg = sparse.sparse_config(410)  # block 4096 at sparsity 0.9
    common = {"k": "i32", "BLOCK_SIZE": "constexpr", "K_TILE": "constexpr"}
    kc = {"BLOCK_SIZE": 4096, "K_TILE": scfg["K_TILE"]}
    specs += [
        *[(name, sparse._take_kernel,
           {"p_src": "*fp32", "p_idx": "*i16", "p_out": f"*{dt}", **common,
            "KEEP_ERROR": "constexpr"}, {**kc, "KEEP_ERROR": keep}, scfg["num_warps"])
          for name, keep in (("take_", False), ("take_ keep_error", True))],
        ("gather", sparse._gather_kernel,
         {"p_src": "*fp32", "p_residual": "*fp32", "p_idx": "*i16", "p_out": f"*{dt}",
          **common, "HAS_RESIDUAL": "constexpr"}, {**kc, "HAS_RESIDUAL": True},
         scfg["num_warps"]),
        ("scatter_", sparse._scatter_kernel,
         {"p_dst": f"*{dt}", "p_idx": "*i16", "p_values": f"*{dt}", **common}, kc,
         scfg["num_warps"]),
    ]
    from scape.kernels import pack
    for k in (41, 410, 2048):  # block 4096 at sparsity 0.99, 0.9, 0.5
        pcfg = pack.take_pack8_config(k)
        specs.append((f"take_pack8_ k={k}", pack._take_pack8_kernel,
                      {"p_src": "*fp32", "p_idx": "*i16", "p_codes": "*u8", "p_scales": "*fp32",
                       **common}, {"BLOCK_SIZE": 4096, "K_TILE": pcfg["K_TILE"]},
                      pcfg["num_warps"]))
    for block in (4096, 32768):
        bits = pack.offset_bits(block)
        specs.append((f"pack_offsets B={block}", pack._pack_offsets_kernel,
                      {"p_idx": "*i16", "p_out": "*u8", "n": "i32", "n_bytes": "i32",
                       "BITS": "constexpr", "TILE": "constexpr"},
                      {"BITS": bits, "TILE": pack.OFFSET_TILE}, 4))
        specs.append((f"unpack_offsets B={block}", pack._unpack_offsets_kernel,
                      {"p_packed": "*u8", "p_out": "*i16", "n_seg": "i32", "seg_bytes": "i32",
                       "n": "i32", "BITS": "constexpr", "TILE": "constexpr"},
                      {"BITS": bits, "TILE": pack.OFFSET_TILE}, 4))
    from scape.kernels import mask_code
    for k in (41, 410, 2048):  # block 4096 at sparsity 0.99, 0.9, 0.5
        low = mask_code.ef_low_bits(k, 4096)
        chunk = min(mask_code.MAX_CHUNK, 1 << (k + (4095 >> low) - 1).bit_length())
        specs.append((f"unpack_mask k={k}", mask_code._unpack_rows_kernel,
                      {"p_packed": "*u8", "p_out": "*i16", "k": "i32", "low_bits": "i32",
                       "row_bytes": "i32", "high_bits": "i32", "CHUNK": "constexpr"},
                      {"CHUNK": chunk}, 4))
        row_bytes = mask_code.ef_row_bytes(k, 4096)
        specs.append((f"pack_mask k={k}", mask_code._pack_rows_kernel,
                      {"p_idx": "*i16", "p_out": "*u8", "k": "i32", "low_bits": "i32",
                       "row_bytes": "i32", "SEARCH": "constexpr", "BYTE_TILE": "constexpr"},
                      {"SEARCH": k.bit_length(),
                       "BYTE_TILE": min(mask_code.ENCODE_TILE, 1 << (row_bytes - 1).bit_length())},
                      4))
    f32s = {n: "fp32" for n in ("lr", "beta1", "beta2", "eps")}
    dense = {"TILE": moments.DENSE_TILE, "HAS_OUT": True}
    sparse_sig = {"p_p": "*fp32", "p_m": "*fp32", "p_age": "*i32", "p_g": f"*{dt}",
                  "p_idx": "*i16", "p_out": f"*{dt}", "k": "i32", **f32s, "log_decay": "fp32",
                  "log_beta1": "fp32", "power": "fp32", "BLOCK_SIZE": "constexpr",
                  "K_TILE": "constexpr", "HAS_DECAY": "constexpr", "HAS_OUT": "constexpr",
                  "CATCHUP": "constexpr"}
    specs += [
        ("adams_dense_", moments._adams_dense_kernel,
         {"p_p": "*fp32", "p_m": "*fp32", "p_g": f"*{dt}", "p_out": f"*{dt}", "n": "i32",
          **f32s, "decay": "fp32", "TILE": "constexpr", "HAS_OUT": "constexpr"}, dense,
         moments.DENSE_WARPS),
        ("adamw_dense_", moments._adamw_dense_kernel,
         {"p_p": "*fp32", "p_m": "*fp32", "p_v": "*fp32", "p_g": f"*{dt}", "p_out": f"*{dt}",
          "n": "i32", "beta1": "fp32", "beta2": "fp32", "eps": "fp32", "decay": "fp32",
          "step_size": "fp32", "bias2_sqrt": "fp32", "TILE": "constexpr",
          "HAS_OUT": "constexpr"}, dense, moments.DENSE_WARPS),
        *[(name, moments._adams_sparse_kernel, sparse_sig,
           {**kc, "HAS_DECAY": True, "HAS_OUT": True, "CATCHUP": catchup}, 4)
          for name, catchup in (("adams_sparse_", False), ("adams_sparse_ catchup", True))],
        ("age (+1)", moments._age_kernel, {"p_age": "*i32", "n": "i32", "TILE": "constexpr"},
         {"TILE": moments.DENSE_TILE}, moments.DENSE_WARPS),
        ("grad_stats", stats._grad_stats_kernel,
         {"p_x": f"*{dt}", "p_sumsq": "*fp32", "p_count": "*i32", "n": "i32",
          "limit": "fp32", "TILE": "constexpr"}, {"TILE": stats.STATS_TILE}, stats.STATS_WARPS),
        ("grad_stats finish", stats._grad_stats_finish_kernel,
         {"p_sumsq": "*fp32", "p_count": "*i32", "p_out": "*fp32", "n_parts": "i32",
          "PART_TILE": "constexpr"}, {"PART_TILE": stats.PART_TILE}, 4),
    ]
    specs += [(f"noise_ema_{' (+mu)' if has_mu else ''}", stats._noise_ema_kernel,
               {"p_buf": "*fp32", "p_prev": "*fp32", "p_age": "*i32", "p_s2": "*fp32",
                "p_s2w": "*fp32", "p_mu": "*fp32", "n": "i32", "beta": "fp32",
                "ERROR_FEEDBACK": "constexpr", "HAS_MU": "constexpr", "TILE": "constexpr"},
               {"ERROR_FEEDBACK": True, "HAS_MU": has_mu, "TILE": stats.NOISE_TILE}, 8)
              for has_mu in (False, True)]
    specs += [(f"gain_score{' (+wait)' if has_prev else ''}", stats._gain_score_kernel,
               {"p_mu": "*fp32", "p_s2": "*fp32", "p_s2w": "*fp32", "p_age": "*i32",
                "p_prev": "*fp32", "p_out": "*fp32", "n": "i32", "span": "fp32",
                "var_m_scale": "fp32", "HAS_PREV": "constexpr", "TILE": "constexpr"},
               {"HAS_PREV": has_prev, "TILE": stats.GAIN_TILE}, 8) for has_prev in (False, True)]
    catchup_sig = {"p_p": "*fp32", "p_m": "*fp32", "p_age": "*i32", "p_s2": "*fp32",
                   "p_s2w": "*fp32", "p_g": f"*{dt}", "p_idx": "*i16", "p_out": f"*{dt}",
                   "p_waited": "*i32", "k": "i32",
                   **{n: "fp32" for n in ("lr", "beta2", "eps", "world",
                                                       "var_m_ratio", "log_beta1",
                                                       "log_decay", "reach_scale")},
                   **{n: "constexpr" for n in ("BLOCK_SIZE", "CHUNK", "K_TILE", "HAS_TRUST",
                                               "HAS_DECAY", "HAS_OUT", "AGED")}}
    for block, k, aged in ((4096, 41, False), (4096, 41, True), (32768, 3277, False)):
        ccfg = catchup.catchup_config(block, k)
        specs.append((f"catchup_agree_ B={block}{' (aged)' if aged else ''}",
                      catchup._catchup_agree_kernel, catchup_sig,
                      {"BLOCK_SIZE": block, "CHUNK": ccfg["CHUNK"], "K_TILE": ccfg["K_TILE"],
                       "HAS_TRUST": True, "HAS_DECAY": True, "HAS_OUT": True, "AGED": aged},
                      ccfg["num_warps"]))
    for block in (4096, 8192):
        specs.append((f"gain_topk B={block}", select._gain_topk_kernel,
                      {"p_mu": "*fp32", "p_s2": "*fp32", "p_s2w": "*fp32", "p_age": "*i32",
                       "p_prev": "*fp32", "p_idx": "*i16", "k": "i32", "k_explore": "i32",
                       "span": "fp32", "var_m_scale": "fp32", "BLOCK_SIZE": "constexpr",
                       "HAS_PREV": "constexpr", "HAS_EXPLORE": "constexpr"},
                      {"BLOCK_SIZE": block, "HAS_PREV": True, "HAS_EXPLORE": True},
                      select.gain_topk_warps(block)))
    for block, k_cur in ((1024, 11), (4096, 41), (4096, 410)):  # up to select.FUSED_MAX
        specs.append((f"noise_gain_topk_ B={block} k={k_cur}", select._noise_gain_topk_kernel,
                      {**{f"p_{n}": "*fp32" for n in ("buf", "prev")}, "p_age": "*i32",
                       **{f"p_{n}": "*fp32" for n in ("s2", "s2w", "mu")}, "p_cur": "*i16",
                       "p_waited": "*i32", "p_idx": "*i16", "k_cur": "i32", "k": "i32",
                       "k_explore": "i32", "beta": "fp32", "span": "fp32",
                       "var_m_scale": "fp32", "BLOCK_SIZE": "constexpr", "K_TILE": "constexpr",
                       "ERROR_FEEDBACK": "constexpr", "HAS_EXPLORE": "constexpr",
                       "RESIDUAL": "constexpr"},
                      {"BLOCK_SIZE": block, "K_TILE": select.cur_tile(k_cur),
                       "ERROR_FEEDBACK": True, "HAS_EXPLORE": True,
                       "RESIDUAL": reads_wait(k_cur, block)},
                      select.gain_topk_warps(block)))
    return specs


def _compile_one(job: tuple[str, int, int]) -> dict:
    """Compile spec ``i`` of dtype ``dt`` for ``sm_<cc>`` and read ptxas's resource report."""
    dt, i, cc = job
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.compiler import ASTSource

    label, fn, sig, consts, warps = _specs(dt)[i]
    # Pointers are 16-byte aligned (torch's allocations) and shard lengths `n` are multiples
    # of 16: Triton's launcher specialises both the same way at run time.
    attrs = {(j,): [["tt.divisibility", 16]] for j, (name, t) in enumerate(sig.items())
             if t.startswith("*") or name == "n"}
    src = ASTSource(fn, sig, constexprs=consts, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", cc, 32),
                              options={"num_warps": warps, "enable_fp_fusion": True})
    ptx = compiled.asm["ptx"]
    arch = re.search(r"\.target\s+(sm_\w+)", ptx).group(1)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        log = subprocess.run([get_ptxas(cc).path, "-v", f"--gpu-name={arch}", path, "-o",
                              os.path.join(tmp, "k.cubin")], capture_output=True, text=True,
                             check=True).stderr
    num = lambda pat: int(m.group(1)) if (m := re.search(pat, log)) else 0  # noqa: E731
    widths = [int(w) for w in re.findall(r"ld\.global(?:\.\w+)*?\.v(\d)\.", ptx)]
    return {"kernel": label, "dtype": dt, "target": f"sm_{cc}", "warps": warps,
            "registers": num(r"Used (\d+) registers"), "smem": num(r"(\d+) bytes smem"),
            "dyn_smem": compiled.metadata.shared, "stack": num(r"(\d+) bytes stack frame"),
            "spill_stores": num(r"(\d+) bytes spill stores"),
            "spill_loads": num(r"(\d+) bytes spill loads"),
            "vector": max(widths, default=1)}


def compile_all(workers: int = 2) -> list[dict]:
    jobs = [(dt, i, cc) for dt in DTYPES for i in range(len(_specs(dt))) for cc in TARGETS]
    with ProcessPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(_compile_one, jobs))


def format_table(rows: list[dict]) -> str:
    head = ("kernel", "dtype", "target", "warps", "regs", "smem", "dyn smem", "stack",
            "spill st", "spill ld", "ld vec")
    keys = ("kernel", "dtype", "target", "warps", "registers", "smem", "dyn_smem", "stack",
            "spill_stores", "spill_loads", "vector")
    cells = [head] + [tuple(str(r[k]) for k in keys) for r in rows]
    w = [max(len(c[i]) for c in cells) for i in range(len(head))]
    lines = ["  ".join(c[i].ljust(w[i]) for i in range(len(head))) for c in cells]
    lines.insert(1, "  ".join("-" * x for x in w))
    return "\n".join(lines)


@pytest.fixture(scope="module")
def compile_rows() -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, __file__], capture_output=True, text=True, env=env,
                          timeout=600, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert proc.returncode == 0, f"compilation failed:\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_every_kernel_compiles_for_sm80_and_sm90(compile_rows, record_property):
    table = format_table(compile_rows)
    print("\n" + table)
    record_property("compile_table", table)
    got = {(r["kernel"], r["dtype"], r["target"]) for r in compile_rows}
    n_specs = len(_specs("fp32"))
    assert len(got) == n_specs * len(DTYPES) * len(TARGETS)
    assert all(r["registers"] > 0 for r in compile_rows), "ptxas report not parsed"


def test_zero_register_spills(compile_rows):
    spilled = [f"{r['kernel']} {r['dtype']} {r['target']}: {r['spill_stores']} B stored, "
               f"{r['spill_loads']} B loaded" for r in compile_rows
               if r["spill_stores"] or r["spill_loads"]]
    assert not spilled, "register spills:\n" + "\n".join(spilled)


def test_streaming_kernels_use_128_bit_loads(compile_rows):
    """The dense kernels read fp32 state with 16-byte vector loads (v4)."""
    for r in compile_rows:
        if r["kernel"] in ("adams_dense_", "adamw_dense_", "age (+1)"):
            assert r["vector"] == 4, r


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    print(json.dumps(compile_all()))
