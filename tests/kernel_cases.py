"""Independent references for the kernel tests: brute force in Python (selection) and float64
formulas written straight from DESIGN §1 (arithmetic). They share no code with
``scape.kernels.reference``, so a mistake there cannot hide behind the same mistake here."""

from __future__ import annotations

import math
import os
import zlib

import torch

# Per-dtype tolerances for arithmetic against the float64 reference: (rtol, atol).
TOL = {
    torch.float32: (2e-6, 1e-6),
    torch.bfloat16: (1.6e-2, 1e-5),
    torch.float16: (2e-3, 1e-6),
}


def brute_topk(score: torch.Tensor, k: int, block_size: int, age: torch.Tensor | None = None,
               k_explore: int = 0) -> torch.Tensor:
    """Per block: sort offsets by (|score| descending with NaN lowest, offset ascending) and
    take ``k - k_explore``; then sort the rest by (age descending, offset) and take
    ``k_explore``; return the union sorted. Plain Python, for small inputs."""
    s = score.double().tolist()
    a = age.tolist() if age is not None else None
    n_blocks = len(s) // block_size
    rows = []
    for b in range(n_blocks):
        base = b * block_size

        mag = [-1.0 if math.isnan(v) else abs(v) for v in s[base:base + block_size]]
        order = sorted(range(block_size), key=lambda j: (-mag[j], j))
        top = order[: k - k_explore]
        if k_explore:
            assert a is not None
            taken = set(top)
            rest = sorted((j for j in range(block_size) if j not in taken),
                          key=lambda j: (-a[base + j], j))
            top = top + rest[:k_explore]
        rows.append(sorted(top))
    return torch.tensor(rows, dtype=torch.int16).view(n_blocks, k)


def flat_positions(idx: torch.Tensor, block_size: int) -> torch.Tensor:
    """int64 flat positions ``b * block_size + idx[b, j]``, block-major."""
    rows = torch.arange(idx.shape[0], dtype=torch.int64)[:, None] * block_size
    return (rows + idx.long()).view(-1)


def adams_f64(p, m, g, lr, b1, b2, eps, wd, age=None, catchup=None):
    """AdamS in float64 (DESIGN §1), lazy decay over ``age + 1`` steps when age is given.

    ``catchup=c``: the ``age + 1`` missed steps replayed from the mean gradient ``g/(age+1)``
    (moment decayed by ``b1^(age+1)``, ``(age + 1)^c`` normalized steps)."""
    p, m, g = p.double(), m.double(), g.double()
    steps = 1.0 if age is None else age.double() + 1.0
    if catchup is not None:
        g = g / steps
    v = b2 * m * m + (1 - b2) * g * g
    keep = b1 ** steps if catchup is not None else b1
    m_new = keep * m + (1 - keep) * g
    moved = steps ** catchup if catchup is not None else 1.0
    p_new = p * (1 - lr * wd) ** steps - lr * moved * m_new / (v.sqrt() + eps)
    return p_new, m_new


def adamw_f64(p, m, v, g, lr, b1, b2, eps, wd, step):
    """AdamW (torch.optim.AdamW's documented algorithm) in float64."""
    p, m, v, g = p.double(), m.double(), v.double(), g.double()
    p = p * (1 - lr * wd)
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    m_hat = m / (1 - b1 ** step)
    v_hat = v / (1 - b2 ** step)
    return p - lr * m_hat / (v_hat.sqrt() + eps), m, v


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype,
                 what: str) -> None:
    """``actual`` within the tolerance of ``dtype`` of the float64 ``expected``; no NaN."""
    rtol, atol = TOL[dtype]
    assert not torch.isnan(actual).any(), f"{what}: NaN in output (element not written?)"
    torch.testing.assert_close(actual.double(), expected.double(), rtol=rtol, atol=atol,
                               msg=lambda m: f"{what} ({dtype}): {m}")


def _bf16_truncated(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16 by dropping the low 16 bits (round toward zero)."""
    bits = x.float().contiguous().view(torch.int32) & -65536
    return bits.view(torch.float32).bfloat16()


def assert_cast_equal(actual: torch.Tensor, source: torch.Tensor, what: str) -> None:
    """``actual`` is ``source`` cast to ``actual.dtype``, bitwise.

    One allowance: Triton's interpreter converts fp32 -> bf16 by truncation (its cast has no
    rounding mode), while torch and the GPU (``cvt.rn.bf16.f32``) round to nearest even. So
    for a bf16 output written from wider values under the interpreter, each element must be
    one of those two roundings, and nothing else.
    """
    expected = source.to(actual.dtype)
    if torch.equal(actual, expected):
        return
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if actual.dtype == torch.bfloat16 and source.dtype != torch.bfloat16 and interpreted:
        ok = (actual == expected) | (actual == _bf16_truncated(source)) | (
            torch.isnan(actual) & torch.isnan(expected))
        assert ok.all(), f"{what}: {int((~ok).sum())} elements are neither RNE nor truncation"
        return
    bad = (actual != expected) & ~(torch.isnan(actual) & torch.isnan(expected))
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {actual.numel()} elements differ "
                           f"from the cast, e.g. {actual[bad][:4].tolist()} vs "
                           f"{expected[bad][:4].tolist()}")


def make_scores(kind: str, n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Selection scores of one ``kind``: ``randn``, ``small_ints`` (many exact ties), ``zeros``
    (all ties, half of them -0.0) or ``nan_inf`` (NaN of both signs and infinities mixed in)."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "randn":
        x = torch.randn(n, generator=gen)
    elif kind == "small_ints":  # many exact ties
        x = torch.randint(-3, 4, (n,), generator=gen).float()
    elif kind == "zeros":  # all ties, half of them -0.0
        x = torch.zeros(n)
        x[torch.rand(n, generator=gen) < 0.5] = -0.0
    elif kind == "nan_inf":
        x = torch.randn(n, generator=gen)
        u = torch.rand(n, generator=gen)
        x[u < 0.15] = float("nan")
        x[(u >= 0.15) & (u < 0.2)] = float("inf")
        x[(u >= 0.2) & (u < 0.25)] = -float("inf")
        x[(u >= 0.25) & (u < 0.3)] = -float("nan")
    else:
        raise ValueError(kind)
    return x.to(dtype)


def seeded(*key) -> torch.Generator:
    """A CPU generator seeded by a stable hash of ``key`` (fresh inputs per test case)."""
    return torch.Generator().manual_seed(zlib.crc32("-".join(map(str, key)).encode()))


def random_mask(n_blocks: int, block_size: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """Random sorted distinct offsets per block (CPU int16), always including the block's last
    offset when k > 1 (the int16 / int64 edge)."""
    keys = torch.rand(n_blocks, block_size, generator=gen)
    if k > 1:
        keys[:, -1] = 2.0
    return keys.topk(k, dim=1).indices.sort(dim=1).values.to(torch.int16).contiguous()


def check_adams_sparse(before, after, g, idx, block_size, hp, weight_decay, catchup) -> None:
    """``adams_sparse_`` took ``before = (p0, m0, age0)`` to ``after = (p, m, age, model_out)``
    (all CPU): float64 values at the mask, the cast into ``model_out``, nothing else moved,
    ages reset at the mask and advanced elsewhere."""
    (p0, m0, age0), (p, m, age, out) = before, after
    flat = flat_positions(idx, block_size)
    outside = torch.ones(p0.numel(), dtype=torch.bool)
    outside[flat] = False
    ep, em = adams_f64(p0[flat], m0[flat], g, hp["lr"], hp["beta1"], hp["beta2"], hp["eps"],
                       weight_decay, age=age0[flat], catchup=catchup)
    assert_close(p[flat], ep, torch.float32, "p at the mask")
    assert_close(m[flat], em, torch.float32, "m at the mask")
    assert_cast_equal(out, p[flat], "model_out")
    assert torch.equal(p[outside], p0[outside]) and torch.equal(m[outside], m0[outside])
    assert (age[flat] == 0).all()
    assert torch.equal(age[outside], age0[outside] + 1)


def noise_ema_f64(buf, prev0, age, s2_0, s2w_0, beta, error_feedback, mu0=None):
    """``noise_ema_``'s ``(s2, s2w)`` in float64 from the inputs (all finite), and ``mu``
    after them if ``mu0`` is given."""
    local = buf.double() - (torch.where(age == 0, 0.0, prev0.double()) if error_feedback
                            else 0.0)
    out = (beta * s2_0.double() + (1 - beta) * local ** 2, beta * s2w_0.double() + (1 - beta))
    return out if mu0 is None else out + (beta * mu0.double() + (1 - beta) * local,)


def _gain_terms(mu, s2, s2w, age, beta, prev):
    """``(mean, var, cover, scale)`` of ``gain_score`` in float64; ``scale`` is the size of
    the terms that ``mean^2 - var / cover`` subtracts, before they cancel."""
    w = s2w.double().clamp(min=1e-12)
    mean = mu.double() / w
    sq = s2.double() / w
    var = (sq - mean ** 2).clamp(min=0.0)
    span = (1 + beta) / (1 - beta)
    cover = torch.full_like(mean, span)
    big = mean.abs()
    if prev is not None:
        cover = cover + age.double()
        waited = torch.where(age > 0, prev.double(), 0.0)
        big = (span * mean.abs() + waited.abs()) / cover
        mean = (span * mean + waited) / cover
    return mean, var, cover, big ** 2 + (sq + mean ** 2) / cover


def _gain_of(mean, var, cover, age, beta1, world):
    """The score from :func:`_gain_terms`'s first three."""
    sig = (mean ** 2 - var / cover).clamp(min=0.0).sqrt()
    sigma_m = (2 * var * (1 - beta1) / (1 + beta1) / world + 1e-30).sqrt()
    return sig * (torch.special.erf(sig / sigma_m) * (age.double() + 1)).clamp(min=1.0)


def gain_score_f64(mu, s2, s2w, age, beta, beta1, world, prev=None):
    """``gain_score`` in float64, written out from its docstring."""
    mean, var, cover, _ = _gain_terms(mu, s2, s2w, age, beta, prev)
    return _gain_of(mean, var, cover, age, beta1, world)


def assert_gain_close(out, mu, s2, s2w, age, beta, beta1, world, prev=None, rtol=1e-4):
    """``out`` (an fp32 ``gain_score``) against the float64 formula, to within what fp32 can
    hold: the signal ``sqrt(mean^2 - var / cover)`` subtracts terms of size ``scale``, so
    its argument is known to ``ulps * eps * scale`` (E) and the root to
    ``sqrt(d + E) - sqrt(d - E)``, which near ``d = 0`` is far above a relative tolerance.
    The score is the signal times a factor up to ``age + 1`` (erf's slope adds at most half
    of that). Anywhere the terms do not cancel this is ``rtol``."""
    mean, var, cover, scale = _gain_terms(mu, s2, s2w, age, beta, prev)
    want = _gain_of(mean, var, cover, age, beta1, world)
    d = (mean ** 2 - var / cover).clamp(min=0.0)
    e = 16 * torch.finfo(torch.float32).eps * scale
    d_sig = (d + e).sqrt() - (d - e).clamp(min=0.0).sqrt()
    tol = 1.5 * (age.double() + 1) * d_sig + rtol * want.abs() + 1e-30
    err = (out.double() - want).abs()
    bad = ~(err <= tol)  # NaN fails
    if bool(bad.any()):
        i = int((err / tol).nan_to_num(float("inf")).argmax())
        raise AssertionError(f"gain_score: {int(bad.sum())} of {bad.numel()} entries off; "
                             f"worst at {i}: {float(out[i])!r} vs {float(want[i])!r} "
                             f"(allowed {float(tol[i]):.3g})")


def gain_inputs(gen, n):
    """EMA state as :func:`noise_ema_` leaves it: a weight in (0.5, 1], a mean of either
    sign, a variance from pure noise (mean 0) to none (a steady gradient), ages 0-299."""
    w = torch.rand(n, generator=gen) * 0.5 + 0.5
    mean = torch.randn(n, generator=gen) * 0.1
    mean[::7] = 0.0
    var = torch.rand(n, generator=gen) * 0.05
    var[3::11] = 0.0
    age = torch.randint(0, 300, (n,), generator=gen, dtype=torch.int32)
    return mean * w, (var + mean ** 2) * w, w, age
