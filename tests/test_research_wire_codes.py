"""bench.research.wire_codes, the coding-only comparison of 8-bit and 4-bit codes on a mask's
values: each code keeps the rows' shape, decodes a row of zeros to zeros and a row's absmax
entry exactly (uniform) or within e4m3's rounding, and errs within its code's resolution;
the module runs end to end on a 2-step model."""

from __future__ import annotations

import json

import pytest
import torch

from bench.research import wire_codes

K = 41


def _rows() -> torch.Tensor:
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(96, K, generator=gen) * torch.exp(2 * torch.randn(96, 1, generator=gen))
    x[7] = 0.0
    return x


def test_codes_keep_shape_zero_rows_and_err_within_their_resolution() -> None:
    x = _rows()
    s = x.abs().amax(dim=1, keepdim=True)
    out = wire_codes.codes(x)
    assert set(out) == {"uniform8", "uniform4", "e4m3"}
    # one uniform level is 2s/(2^bits - 1); rounding to nearest errs by at most half of it
    half_level = {"uniform8": 1 / 255, "uniform4": 1 / 15}
    for name, dec in out.items():
        assert dec.shape == x.shape and dec.dtype == torch.float32 and dec.isfinite().all()
        assert (dec[7] == 0).all(), name
        err = (dec - x).abs()
        if name in half_level:
            assert (err <= s * half_level[name] * (1 + 1e-5)).all(), name
        else:  # e4m3 keeps 3 mantissa bits: relative error 2^-4 above its normal range
            normal = x.abs() >= s * 2.0 ** -6 / 448.0
            assert (err[normal] <= x.abs()[normal] * 2.0 ** -4 * (1 + 1e-5)).all()
    # at this many levels, the 8-bit codes beat the 4-bit one over the whole sample
    total = {n: float((d - x).norm()) for n, d in out.items()}
    assert total["uniform8"] < total["uniform4"] and total["e4m3"] < total["uniform4"]


@pytest.mark.timeout(300)
def test_module_runs_end_to_end(capsys: pytest.CaptureFixture[str]) -> None:
    wire_codes.main(["--steps", "2", "--sample", "1"])
    got = json.loads(capsys.readouterr().out)
    assert {(r["k"], r["code"]) for r in got["rows"]} == \
        {(k, c) for k in (41, 410) for c in ("uniform8", "uniform4", "e4m3")}
    for r in got["rows"]:
        assert 0 < r["relative_error"] <= r["worst_row"] < 1, r
