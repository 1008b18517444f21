"""Gradient statistics: for clipping and the non-finite skip decision (DESIGN §1), and the
owner's running estimate of its own gradient noise (the agreement rules of scape.rules).

Triton: a deterministic two-stage reduction. Stage one, one program per ``TILE`` entries,
writes a partial fp32 sum of squares and an int32 non-finite count; stage two, one program,
adds the partials in a fixed order (sum in fp32, count in int64) and writes the fp32 pair.
Bytes: reads ``N * s`` (``s`` the element size) plus ``8`` per tile of partials, writes 8.
No atomics, so the result is bitwise reproducible run to run.

``noise_ema_``: one elementwise pass, one program per ``TILE`` entries. Bytes: reads
``buf`` (4), ``prev`` (4), ``age`` (4), ``s2`` (4), ``s2w`` (4), writes ``s2``, ``s2w``,
``prev`` (12): 32 per entry (24 without error feedback, which reads neither ``prev`` nor
``age``), where the same update as separate torch ops moves about 70. With the optional
first moment ``mu`` (the gain selection of scape.rules): 8 more (read and write ``mu``).

``gain_score``: one elementwise pass over ``mu``, ``s2``, ``s2w``, ``age`` (16 bytes per entry
read; 20 with the summed wait ``prev``) writing the score (4): 20 or 24 bytes, where the same
formula as torch ops moves about 100.
"""

from __future__ import annotations

import torch

from . import reference, stats_torch
from ._checks import (
    FLOAT_DTYPES,
    check_numel,
    check_same_device,
    check_tensor,
    use_compiled,
    use_triton,
)
from ._triton import tl, triton
from .reference import FLOAT32_MAX


@triton.jit
def _grad_stats_kernel(p_x, p_sumsq, p_count, n, limit, TILE: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * TILE + tl.arange(0, TILE)
    b_x = tl.load(p_x + offs, mask=offs < n, other=0.0).to(tl.float32)
    nonfinite = ~(tl.abs(b_x) <= limit)  # NaN compares false, so it counts
    tl.store(p_sumsq + pid, tl.sum(b_x * b_x, axis=0))
    tl.store(p_count + pid, tl.sum(nonfinite.to(tl.int32), axis=0))


@triton.jit
def _grad_stats_finish_kernel(p_sumsq, p_count, p_out, n_parts, PART_TILE: tl.constexpr):
    acc = tl.zeros((PART_TILE,), tl.float32)
    cnt = tl.zeros((PART_TILE,), tl.int64)
    for start in range(0, n_parts, PART_TILE):
        offs = start + tl.arange(0, PART_TILE)
        m_parts = offs < n_parts
        acc += tl.load(p_sumsq + offs, mask=m_parts, other=0.0)
        cnt += tl.load(p_count + offs, mask=m_parts, other=0).to(tl.int64)
    tl.store(p_out, tl.sum(acc, axis=0))
    tl.store(p_out + 1, tl.sum(cnt, axis=0).to(tl.float32))


STATS_TILE = 4096
STATS_WARPS = 8
PART_TILE = 1024


def grad_stats_triton(x: torch.Tensor, limit: float = FLOAT32_MAX) -> torch.Tensor:
    """Launch both stages (arguments already validated)."""
    n = x.numel()
    n_parts = triton.cdiv(n, STATS_TILE)
    sumsq = torch.empty(n_parts, dtype=torch.float32, device=x.device)
    count = torch.empty(n_parts, dtype=torch.int32, device=x.device)
    out = torch.empty(2, dtype=torch.float32, device=x.device)
    _grad_stats_kernel[(n_parts,)](x, sumsq, count, n, limit, TILE=STATS_TILE,
                                   num_warps=STATS_WARPS)
    _grad_stats_finish_kernel[(1,)](sumsq, count, out, n_parts, PART_TILE=PART_TILE,
                                    num_warps=4)
    return out


def grad_stats(x: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """fp32 tensor ``[sum of squares of all entries, count of non-finite entries]``.

    The sum covers every entry, so it is inf or NaN whenever a non-finite entry exists: the
    skip decision reads the count (exact up to 2^24), clipping reads the sum. ``limit`` (a
    positive float, at most the largest fp32), if given, also counts the finite entries with
    ``|x| > limit``: those a narrow wire cannot sum (``scape.sharded``'s ``wire_limit``).
    """
    check_tensor("x", x, dtypes=FLOAT_DTYPES, ndim=1)
    if x.numel() == 0:
        raise ValueError("x must have at least one element; got 0")
    if limit is None:
        limit = FLOAT32_MAX
    elif isinstance(limit, bool) or not isinstance(limit, (int, float)) \
            or not 0.0 < limit <= FLOAT32_MAX:
        raise ValueError(f"limit must be a float in (0, {FLOAT32_MAX:.7g}]; got {limit!r}")
    if use_triton(x):
        return grad_stats_triton(x, float(limit))
    return reference.grad_stats(x, float(limit))


@triton.jit
def _ema(b_buf, b_prev, b_age, b_s2, b_s2w, b_mu, beta, ERROR_FEEDBACK: tl.constexpr):
    """One step of the noise EMAs on loaded entries: the new ``(s2, s2w, mu)``. Shared by
    :func:`_noise_ema_kernel` and the fused mask (``scape.kernels.select``), so both keep the
    same fp32 values."""
    if ERROR_FEEDBACK:
        b_local = b_buf - tl.where(b_age == 0, 0.0, b_prev)
    else:
        b_local = b_buf
    m_ok = tl.abs(b_local) < float("inf")  # NaN compares false: not an observation
    return (tl.where(m_ok, b_s2 * beta + (1.0 - beta) * (b_local * b_local), b_s2),
            tl.where(m_ok, b_s2w * beta + (1.0 - beta), b_s2w),
            tl.where(m_ok, b_mu * beta + (1.0 - beta) * b_local, b_mu))


@triton.jit
def _noise_ema_kernel(p_buf, p_prev, p_age, p_s2, p_s2w, p_mu, n, beta,
                      ERROR_FEEDBACK: tl.constexpr, HAS_MU: tl.constexpr, TILE: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * TILE + tl.arange(0, TILE)
    m_n = offs < n
    b_buf = tl.load(p_buf + offs, mask=m_n, other=0.0)
    if ERROR_FEEDBACK:
        b_prev = tl.load(p_prev + offs, mask=m_n, other=0.0)
        b_age = tl.load(p_age + offs, mask=m_n, other=0)
    else:
        b_prev = b_buf
        b_age = tl.zeros((TILE,), tl.int32)
    b_s2 = tl.load(p_s2 + offs, mask=m_n, other=0.0)
    b_s2w = tl.load(p_s2w + offs, mask=m_n, other=0.0)
    if HAS_MU:
        b_mu = tl.load(p_mu + offs, mask=m_n, other=0.0)
    else:
        b_mu = b_s2w
    b_s2, b_s2w, b_mu = _ema(b_buf, b_prev, b_age, b_s2, b_s2w, b_mu, beta, ERROR_FEEDBACK)
    tl.store(p_s2 + offs, b_s2, mask=m_n)
    tl.store(p_s2w + offs, b_s2w, mask=m_n)
    if HAS_MU:
        tl.store(p_mu + offs, b_mu, mask=m_n)
    tl.store(p_prev + offs, b_buf, mask=m_n)


NOISE_TILE = 2048


def noise_ema_triton(buf: torch.Tensor, prev: torch.Tensor, age: torch.Tensor,
                     s2: torch.Tensor, s2w: torch.Tensor, beta: float,
                     error_feedback: bool, mu: torch.Tensor | None = None) -> None:
    """Launch :func:`_noise_ema_kernel` (arguments already validated)."""
    n = buf.numel()
    _noise_ema_kernel[(triton.cdiv(n, NOISE_TILE),)](
        buf, prev, age, s2, s2w, s2 if mu is None else mu, n, beta,
        ERROR_FEEDBACK=error_feedback, HAS_MU=mu is not None, TILE=NOISE_TILE, num_warps=8)


def noise_ema_(buf: torch.Tensor, prev: torch.Tensor, age: torch.Tensor, s2: torch.Tensor,
               s2w: torch.Tensor, *, beta: float, error_feedback: bool,
               mu: torch.Tensor | None = None) -> None:
    """EMA of the square of a rank's own per-step gradient, in place (fp32 1-D tensors of one
    length; ``age`` int32)::

        local = buf - where(age == 0, 0, prev)    (buf itself without error feedback)
        s2  = beta * s2  + (1 - beta) * local^2
        s2w = beta * s2w + (1 - beta)             (s2 / s2w is unbiased from the first step)
        mu  = beta * mu  + (1 - beta) * local     (only if mu is given; mu / s2w likewise)
        prev = buf

    ``buf`` is this step's gradient plus the residual the previous step left; ``prev`` the
    previous ``buf``, whose coordinates synced last step (``age == 0``) left no residual.
    Where ``local`` is not finite (a step that will be skipped) ``s2`` and ``s2w`` keep their
    values: one bad gradient must not poison the estimate for good.
    """
    check_tensor("buf", buf, dtypes=(torch.float32,), ndim=1)
    n = buf.numel()
    named = (("prev", prev), ("s2", s2), ("s2w", s2w)) + ((("mu", mu),) if mu is not None else ())
    for name, t in named:
        check_tensor(name, t, dtypes=(torch.float32,), ndim=1)
        check_numel(name, t, n, "same length as buf")
    check_tensor("age", age, dtypes=(torch.int32,), ndim=1)
    check_numel("age", age, n, "same length as buf")
    check_same_device(buf=buf, prev=prev, age=age, s2=s2, s2w=s2w,
                      **({"mu": mu} if mu is not None else {}))
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0.0 <= beta < 1.0:
        raise ValueError(f"beta must be a float in [0, 1), got {beta!r}")
    if n == 0:
        return
    if use_triton(buf):
        return noise_ema_triton(buf, prev, age, s2, s2w, float(beta), bool(error_feedback),
                                mu)
    if mu is not None and error_feedback and use_compiled(buf):
        return stats_torch.compiled_noise_ema_(buf, prev, age, s2, s2w, beta=float(beta), mu=mu)
    torch_path = stats_torch if buf.device.type == "cpu" else reference
    torch_path.noise_ema_(buf, prev, age, s2, s2w, beta=float(beta),
                          error_feedback=bool(error_feedback), mu=mu)


@triton.jit
def _gain_moments(b_mu, b_s2, b_s2w):
    """The mean and variance the gain score reads from loaded EMAs."""
    b_w = tl.maximum(b_s2w, 1e-12)
    b_ema = b_mu / b_w
    return b_ema, tl.maximum(b_s2 / b_w - b_ema * b_ema, 0.0)


@triton.jit
def _gain_of(b_ema, b_var, b_prev, b_age, span, var_m_scale, HAS_PREV: tl.constexpr):
    """The gain score of loaded entries from :func:`_gain_moments` (``b_age`` int32;
    ``b_prev`` read only with ``HAS_PREV``): shared by :func:`_gain` and the fused mask
    (``scape.kernels.select``)."""
    b_a = b_age.to(tl.float32)
    if HAS_PREV:  # the owner's gradient summed over the wait (nothing yet where age == 0)
        b_cover = span + b_a
        b_mean = (b_ema * span + tl.where(b_a > 0.0, b_prev, 0.0)) / b_cover
        b_noise = b_var / b_cover
    else:
        b_mean = b_ema
        b_noise = b_var / span
    b_sig = tl.sqrt(tl.maximum(b_mean * b_mean - b_noise, 0.0))
    b_frac = tl.math.erf(b_sig / tl.sqrt(b_var * (2.0 * var_m_scale) + 1e-30))
    return b_sig * tl.maximum(b_frac * (b_a + 1.0), 1.0)


@triton.jit
def _gain(p_mu, p_s2, p_s2w, p_prev, offs, m_n, b_age, span, var_m_scale,
          HAS_PREV: tl.constexpr):
    """The gain score of the entries ``offs`` (``b_age`` their int32 ages, loaded by the
    caller): shared by :func:`_gain_score_kernel` and ``scape.kernels.gain_topk``, so both
    rank the same fp32 values."""
    if HAS_PREV:
        b_prev = tl.load(p_prev + offs, mask=m_n, other=0.0)
    else:
        b_prev = b_age
    b_ema, b_var = _gain_moments(tl.load(p_mu + offs, mask=m_n, other=0.0),
                                 tl.load(p_s2 + offs, mask=m_n, other=0.0),
                                 tl.load(p_s2w + offs, mask=m_n, other=1.0))
    return _gain_of(b_ema, b_var, b_prev, b_age, span, var_m_scale, HAS_PREV)


@triton.jit
def _gain_score_kernel(p_mu, p_s2, p_s2w, p_age, p_prev, p_out, n, span, var_m_scale,
                       HAS_PREV: tl.constexpr, TILE: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * TILE + tl.arange(0, TILE)
    m_n = offs < n
    b_age = tl.load(p_age + offs, mask=m_n, other=0)
    tl.store(p_out + offs, _gain(p_mu, p_s2, p_s2w, p_prev, offs, m_n, b_age, span,
                                 var_m_scale, HAS_PREV), mask=m_n)


GAIN_TILE = 2048


def gain_score_triton(mu: torch.Tensor, s2: torch.Tensor, s2w: torch.Tensor,
                      age: torch.Tensor, prev: torch.Tensor | None, span: float,
                      var_m_scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """Launch :func:`_gain_score_kernel` (arguments already validated)."""
    n = mu.numel()
    out = torch.empty_like(mu) if out is None else out
    _gain_score_kernel[(triton.cdiv(n, GAIN_TILE),)](
        mu, s2, s2w, age, mu if prev is None else prev, out, n, span, var_m_scale,
        HAS_PREV=prev is not None, TILE=GAIN_TILE, num_warps=8)
    return out


def gain_factors(beta: float, beta1: float, world: int) -> tuple[float, float]:
    """``(span, var_m_scale)`` of :func:`gain_score`, validated: the steps the EMA covers,
    ``(1 + beta) / (1 - beta)``, and ``(1 - beta1) / (1 + beta1) / world``."""
    for name, b in (("beta", beta), ("beta1", beta1)):
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not 0.0 <= b < 1.0:
            raise ValueError(f"{name} must be a float in [0, 1), got {b!r}")
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"world must be an int >= 1, got {world!r}")
    return (1.0 + beta) / (1.0 - beta), (1.0 - beta1) / (1.0 + beta1) / world


def check_gain_inputs(mu: torch.Tensor, s2: torch.Tensor, s2w: torch.Tensor,
                      age: torch.Tensor, prev: torch.Tensor | None) -> int:
    """The gain score's inputs (:func:`gain_score`, :func:`scape.kernels.gain_topk`): fp32
    1-D ``mu``, ``s2``, ``s2w`` and ``prev`` (if given), int32 ``age``, one length and one
    device; returns the length."""
    check_tensor("mu", mu, dtypes=(torch.float32,), ndim=1)
    n = mu.numel()
    named = (("s2", s2), ("s2w", s2w)) + ((("prev", prev),) if prev is not None else ())
    for name, t in named:
        check_tensor(name, t, dtypes=(torch.float32,), ndim=1)
        check_numel(name, t, n, "same length as mu")
    check_tensor("age", age, dtypes=(torch.int32,), ndim=1)
    check_numel("age", age, n, "same length as mu")
    check_same_device(mu=mu, s2=s2, s2w=s2w, age=age,
                      **({"prev": prev} if prev is not None else {}))
    return n


def gain_score(mu: torch.Tensor, s2: torch.Tensor, s2w: torch.Tensor, age: torch.Tensor, *,
               beta: float, beta1: float, world: int,
               prev: torch.Tensor | None = None,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """Per coordinate, what sending it now is worth (``scape.rules.gain_score``), a new fp32
    tensor; the inputs are those :func:`noise_ema_` keeps (fp32 1-D, one length; ``age``
    int32) and are not written::

        ema   = mu / s2w,   var = max(s2 / s2w - ema^2, 0)       (s2w floored at 1e-12)
        span  = (1 + beta) / (1 - beta)                          (the steps the EMA covers)
        mean  = ema,  cover = span                               (without prev)
        mean  = (span * ema + where(age > 0, prev, 0)) / cover,  cover = span + age
        sig   = sqrt(max(mean^2 - var / cover, 0))
        frac  = erf(sig / sqrt(2 var (1 - beta1) / (1 + beta1) / world + 1e-30))
        score = sig * max(frac * (age + 1), 1)

    ``beta`` is the EMAs' factor, ``beta1`` AdamS's, ``world`` the number of ranks (each
    rank's gradient is one of ``world`` equal parts of the mean). ``prev``, if given, is the
    owner's own gradient summed over each coordinate's wait (``age`` steps;
    ``scape.rules.gain_score_residual``). ``out`` (fp32, same length), if given, receives the
    score and is returned: a caller that scores every step reuses one buffer.
    """
    n = check_gain_inputs(mu, s2, s2w, age, prev)
    if out is not None:
        check_tensor("out", out, dtypes=(torch.float32,), ndim=1)
        check_numel("out", out, n, "same length as mu")
        check_same_device(mu=mu, out=out)
    span, var_m_scale = gain_factors(beta, beta1, world)
    if n == 0:
        return torch.empty_like(mu) if out is None else out
    if use_triton(mu):
        return gain_score_triton(mu, s2, s2w, age, prev, span, var_m_scale, out)
    if prev is not None and use_compiled(mu):
        return stats_torch.compiled_gain_score(mu, s2, s2w, age, span=span,
                                               var_m_scale=var_m_scale, prev=prev, out=out)
    if mu.device.type == "cpu":
        return stats_torch.gain_score(mu, s2, s2w, age, span=span, var_m_scale=var_m_scale,
                                      prev=prev, out=out)
    score = reference.gain_score(mu, s2, s2w, age, span=span, var_m_scale=var_m_scale,
                                 prev=prev)
    return score if out is None else out.copy_(score)
