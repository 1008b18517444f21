"""pack_values / unpack_values: the Triton kernels (through the interpreter on CPU) against the
torch reference, bit for bit; the round trip against a float64 model of the codebook; odd
sizes, zero and NaN inputs, NaN-prefilled outputs; validation; sm_80/sm_90 compilation.

Run as a script (without TRITON_INTERPRET) this file compiles the kernels and prints JSON;
it therefore takes ``nan_out`` as a fixture instead of importing conftest, which sets the
interpreter variable."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zlib

import pytest
import torch

from scape import kernels
from scape.kernels import pack

CASES = [
    pytest.param(1, 1, id="n1-g1"),
    pytest.param(3, 3, id="n3-g3"),
    pytest.param(5, 1, id="n5-g1"),
    pytest.param(41, 41, id="n41-g41-odd"),
    pytest.param(1030, 103, id="n1030-g103-two-tiles"),
    pytest.param(4100, 41, id="n4100-g41-many-tiles"),
]
BITS = [pytest.param(b, id=f"{b}bit") for b in pack.PACK_BITS]


def _gen(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32("-".join(map(str, key)).encode()))


def _values(n: int, group: int, *key, dtype=torch.float32) -> torch.Tensor:
    """Random values with a different magnitude per group (scales span 1e-3 .. 1e2)."""
    g = _gen(*key)
    mag = torch.logspace(-3, 2, n // group).repeat_interleave(group)
    return (torch.randn(n, generator=g) * mag).to(dtype)


def _codes_f64(x: torch.Tensor, s: torch.Tensor, group: int, bits: int) -> torch.Tensor:
    """The codebook's nearest code, computed in float64 (independent of the fp32 paths)."""
    levels = (1 << bits) - 1
    x64, s64 = x.double().view(-1, group), s.double().view(-1, 1)
    t = torch.where(s64 == 0, 0.0, x64 / torch.where(s64 == 0, 1.0, s64))
    return torch.floor((t + 1) * levels / 2 + 0.5).clamp(0, levels).to(torch.int64).view(-1)


def _unpacked_codes(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Codes read back from the stream as one Python integer (little-endian: code ``i`` at
    bits ``[i * bits, (i + 1) * bits)``)."""
    stream = int.from_bytes(bytes(packed.tolist()), "little")
    return torch.tensor([(stream >> (i * bits)) & ((1 << bits) - 1) for i in range(n)])


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("n,group", CASES)
def test_triton_pack_matches_reference(n, group, bits):
    x = _values(n, group, "pack", n, bits)
    s = pack.absmax_scales(x, group)
    want = pack.pack_ref(x, s, group, bits)
    # uint8 has no NaN: pre-fill with a pattern that a forgotten byte would keep
    out = torch.full((pack.packed_nbytes(n, bits),), 0xA5, dtype=torch.uint8)
    got = pack.pack_triton(x, s, group, bits, out)
    assert got.data_ptr() == out.data_ptr()
    assert torch.equal(got, want)
    # the codes in the bytes are the codebook's nearest codes (a float64 model), and the
    # unused high bits of the last byte are zero
    codes = _unpacked_codes(want, bits, n)
    f64 = _codes_f64(x, s, group, bits)
    assert (codes - f64).abs().max() <= 1  # fp32 vs float64 can differ only at exact halves
    assert (codes != f64).float().mean() < 0.01
    spare = pack.packed_nbytes(n, bits) * 8 - n * bits
    if spare:
        assert int(want[-1]) >> (8 - spare) == 0


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("n,group", CASES)
def test_triton_unpack_matches_reference_and_round_trips(n, group, bits, nan_out):
    x = _values(n, group, "unpack", n, bits)
    s = pack.absmax_scales(x, group)
    packed = pack.pack_ref(x, s, group, bits)
    want = pack.unpack_ref(packed, s, group, bits, n)
    got = pack.unpack_triton(packed, s, group, bits, nan_out(n))
    assert torch.equal(got, want)
    # round trip: error at most half a codebook step (s / (L-1)), up to fp32 rounding
    levels = (1 << bits) - 1
    bound = s.repeat_interleave(group).double() / levels * (1 + 1e-5)
    assert ((want.double() - x.double()).abs() <= bound).all()
    # every decoded value lies on the codebook: s * (2q - L + 1) / L-1 for the stored code
    codes = _unpacked_codes(packed, bits, n)
    on_book = s.repeat_interleave(group).double() * (2 * codes - levels) / levels
    torch.testing.assert_close(want.double(), on_book, rtol=1e-6, atol=0)
    # the extreme of every group (its absmax) decodes to +-s, within one rounding of s*L/L
    for gi in range(n // group):
        j = int(x.view(-1, group)[gi].abs().argmax())
        torch.testing.assert_close(want.view(-1, group)[gi, j].abs(), s[gi], rtol=1.2e-7,
                                   atol=0)


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_public_api_low_precision_inputs(backend, dtype, kernel_backend, nan_out):
    kernel_backend(backend)
    x = _values(300, 30, "lp", dtype, dtype=dtype)
    s = pack.absmax_scales(x, 30)
    packed = kernels.pack_values(x, s, 30, 4)
    assert torch.equal(packed, pack.pack_ref(x.float(), s, 30, 4))
    out = nan_out(300)
    got = kernels.unpack_values(packed, s, 30, 4, 300, out=out)
    assert got is out and torch.equal(out, pack.unpack_ref(packed, s, 30, 4, 300))


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_zero_groups_nan_and_out_of_range(backend, kernel_backend, nan_out):
    """A zero scale decodes to zeros; NaN maps to code 0; values beyond the scale clamp."""
    kernel_backend(backend)
    x = torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0, float("nan"), -3.0, 0.25])
    s = torch.tensor([0.0, 1.0])
    packed = kernels.pack_values(x, s, 4, 2)
    codes = _unpacked_codes(packed, 2, 8).tolist()
    assert codes[4:] == [3, 0, 0, 2]
    got = kernels.unpack_values(packed, s, 4, 2, 8, out=nan_out(8))
    assert torch.equal(got[:4], torch.zeros(4))
    assert got[4:].tolist() == pytest.approx([1.0, -1.0, -1.0, 1 / 3])


def test_validation_messages():
    x, s = torch.randn(8), torch.ones(2)
    with pytest.raises(ValueError, match=r"bits must be one of \(2, 4, 6, 8\); got 3"):
        kernels.pack_values(x, s, 4, 3)
    with pytest.raises(TypeError, match="bits must be an int; got float"):
        kernels.pack_values(x, s, 4, 2.0)
    with pytest.raises(ValueError, match="group must be a positive divisor of the value "
                                         "count 8; got 3"):
        kernels.pack_values(x, s, 3, 2)
    with pytest.raises(ValueError, match=r"scales must have 4 elements .*; got 2"):
        kernels.pack_values(x, s, 2, 2)
    with pytest.raises(TypeError, match="scales must have dtype torch.float32; got "
                                        "torch.float64"):
        kernels.pack_values(x, s.double(), 4, 2)
    with pytest.raises(TypeError, match="values must have dtype"):
        kernels.pack_values(x.to(torch.int32), s, 4, 2)
    with pytest.raises(ValueError, match=r"out must have 2 elements"):
        kernels.pack_values(x, s, 4, 2, out=torch.empty(3, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"packed must have 4 elements"):
        kernels.unpack_values(torch.zeros(3, dtype=torch.uint8), s, 4, 4, 8)
    with pytest.raises(ValueError, match="n must be a positive int"):
        kernels.unpack_values(torch.zeros(3, dtype=torch.uint8), s, 4, 4, 0)
    with pytest.raises(TypeError, match="out must have dtype torch.float32"):
        kernels.unpack_values(torch.zeros(2, dtype=torch.uint8), s, 4, 2, 8,
                              out=torch.empty(8, dtype=torch.float64))
    with pytest.raises(ValueError, match="values must not be empty"):
        kernels.pack_values(torch.empty(0), torch.empty(0), 1, 2)


# ------------------------------------------------------------------- GPU compilation
def _compile_rows() -> list[dict]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    rows = []
    for cc in (80, 90):
        for bits in pack.PACK_BITS:
            cfg = pack.pack_config(bits)
            codes, wbytes = pack.word_layout(bits)
            for label, fn, sig, consts in (
                ("pack", pack._pack_kernel,
                 {"p_values": "*fp32", "p_scales": "*fp32", "p_out": "*u8", "n": "i32",
                  "n_bytes": "i32", "group": "i32", "BITS": "constexpr",
                  "CODES": "constexpr", "WBYTES": "constexpr", "WORD_TILE": "constexpr"},
                 {"BITS": bits, "CODES": codes, "WBYTES": wbytes,
                  "WORD_TILE": cfg["WORD_TILE"]}),
                ("unpack", pack._unpack_kernel,
                 {"p_packed": "*u8", "p_scales": "*fp32", "p_out": "*fp32", "n": "i32",
                  "group": "i32", "BITS": "constexpr", "CODES": "constexpr",
                  "WBYTES": "constexpr", "TILE": "constexpr"},
                 {"BITS": bits, "CODES": codes, "WBYTES": wbytes, "TILE": cfg["TILE"]})):
                compiled = triton.compile(ASTSource(fn, sig, constexprs=consts),
                                          target=GPUTarget("cuda", cc, 32),
                                          options={"num_warps": cfg["num_warps"]})
                ptx = compiled.asm["ptx"]
                rows.append({"kernel": label, "bits": bits, "cc": cc,
                             "has_entry": ".entry" in ptx, "cubin": len(compiled.asm["cubin"])})
    return rows


def test_pack_kernels_compile_for_sm80_and_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, __file__], capture_output=True, text=True, env=env,
                          timeout=300, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert proc.returncode == 0, f"compilation failed:\n{proc.stderr[-4000:]}"
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(rows) == 2 * len(pack.PACK_BITS) * 2
    assert all(r["has_entry"] and r["cubin"] > 0 for r in rows), rows


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    print(json.dumps(_compile_rows()))
