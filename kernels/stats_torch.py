"""``noise_ema_`` and ``gain_score`` on the CPU in cache-sized slices: what the public ops run
for CPU tensors. Bit for bit the torch twins of :mod:`scape.kernels.reference`, which stay the
plain ground truth.

Why: the twins are written as whole-shard torch expressions. Each one allocates a
shard-sized temporary (fresh pages the kernel must fault in) and streams the shard through
memory again: the gain score makes about 25 such passes, the noise estimate about 10, and
on one CPU core they were most of a sparse step of the default rule. Here every op runs on a
slice of ``SLICE`` entries with its temporaries in a workspace allocated once per call, so
each state tensor is read from memory once and written once; the per-entry arithmetic is
the same torch ops in the same order, so every result is bitwise that of the twin (torch's
element-wise CPU kernels give an entry the same value whatever slice it is computed in:
the slices are multiples of the vector width, as the shards are).

The noise estimate skips non-finite entries (a step about to be skipped); a slice learns
whether it holds one from ``sum(local * 0)``, NaN exactly then, and only such a slice takes
the twin's masked path.
"""

from __future__ import annotations

from typing import Any

import torch

SLICE = 1 << 15
"""Entries per slice: seven fp32 temporaries of 128 KiB stay in a 1 MiB L2 cache."""


def noise_ema_(buf: torch.Tensor, prev: torch.Tensor, age: torch.Tensor, s2: torch.Tensor,
               s2w: torch.Tensor, *, beta: float, error_feedback: bool,
               mu: torch.Tensor | None = None) -> None:
    """:func:`scape.kernels.reference.noise_ema_`, slice by slice (arguments validated)."""
    n = buf.numel()
    width = min(SLICE, n)
    local = torch.empty(width, dtype=torch.float32)
    synced = torch.empty(width, dtype=torch.bool)
    zero = torch.zeros(width, dtype=torch.float32)
    states = (s2, s2w) if mu is None else (s2, s2w, mu)
    for s in range(0, n, SLICE):
        e = min(s + SLICE, n)
        w = e - s
        b, loc = buf[s:e], local[:w]
        if error_feedback:
            p = prev[s:e]
            torch.eq(age[s:e], 0, out=synced[:w])
            p.masked_fill_(synced[:w], 0.0)
            torch.sub(b, p, out=loc)
        else:
            loc.copy_(b)
        part = [t[s:e] for t in states]
        finite = not bool(torch.dot(loc, zero[:w]).isnan())  # NaN iff an entry is not finite
        kept = None
        if not finite:
            bad = ~torch.isfinite(loc)
            kept = [t[bad] for t in part]
        part[0].mul_(beta).addcmul_(loc, loc, value=1.0 - beta)
        part[1].mul_(beta).add_(1.0 - beta)
        if mu is not None:
            part[2].mul_(beta).add_(loc, alpha=1.0 - beta)
        if kept is not None:
            for t, old in zip(part, kept):
                t[bad] = old
    prev.copy_(buf)


def gain_score(mu: torch.Tensor, s2: torch.Tensor, s2w: torch.Tensor, age: torch.Tensor, *,
               span: float, var_m_scale: float,
               prev: torch.Tensor | None = None,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`scape.kernels.reference.gain_score`, slice by slice, into ``out`` if given
    (arguments validated)."""
    n = mu.numel()
    out = torch.empty(n, dtype=torch.float32) if out is None else out
    width = min(SLICE, n)
    weight, mean, var, a, cover, work = (torch.empty(width, dtype=torch.float32)
                                         for _ in range(6))
    waited = torch.empty(width, dtype=torch.bool)
    zero = torch.zeros((), dtype=torch.float32)
    for s in range(0, n, SLICE):
        e = min(s + SLICE, n)
        w = e - s
        wt, mn, vr, ag, cv, wk = (t[:w] for t in (weight, mean, var, a, cover, work))
        torch.clamp(s2w[s:e], min=1e-12, out=wt)
        torch.div(mu[s:e], wt, out=mn)
        torch.div(s2[s:e], wt, out=vr)
        vr.sub_(torch.square(mn, out=wk)).clamp_(min=0.0)
        ag.copy_(age[s:e])
        if prev is None:
            noise = torch.div(vr, span, out=cv)
        else:
            torch.add(ag, span, out=cv)
            torch.gt(age[s:e], 0, out=waited[:w])
            mn.mul_(span).add_(torch.where(waited[:w], prev[s:e], zero, out=wk)).div_(cv)
            noise = torch.div(vr, cv, out=cv)
        sig = mn.square_().sub_(noise).clamp_(min=0.0).sqrt_()
        frac = torch.special.erf(torch.div(sig, vr.mul_(2.0 * var_m_scale).add_(1e-30).sqrt_(),
                                           out=wk), out=wk)
        torch.mul(sig, frac.mul_(ag.add_(1.0)).clamp_(min=1.0), out=out[s:e])
    return out


# ---------------------------------------------------------------- SCAPE_KERNELS=compile
# The same formulas as whole-shard element-wise expressions, for torch.compile: Inductor
# fuses each into one loop over the shard (one read of every input, one write of every
# output), as the Triton kernels do. Not bitwise the twins (Inductor may contract or reorder
# the fp32 arithmetic); within their fp32 rounding (tests/test_kernels_stats_torch.py).


def _noise_ema_fused(buf: torch.Tensor, prev: torch.Tensor, age: torch.Tensor,
                     s2: torch.Tensor, s2w: torch.Tensor, mu: torch.Tensor,
                     beta: float) -> None:
    local = buf - torch.where(age == 0, 0.0, prev)
    ok = torch.isfinite(local)
    s2.copy_(torch.where(ok, s2 * beta + (1.0 - beta) * (local * local), s2))
    s2w.copy_(torch.where(ok, s2w * beta + (1.0 - beta), s2w))
    mu.copy_(torch.where(ok, mu * beta + (1.0 - beta) * local, mu))
    prev.copy_(buf)


def _gain_score_fused(mu: torch.Tensor, s2: torch.Tensor, s2w: torch.Tensor, age: torch.Tensor,
                      prev: torch.Tensor, out: torch.Tensor, span: float,
                      var_m_scale: float) -> None:
    w = s2w.clamp(min=1e-12)
    ema = mu / w
    var = (s2 / w - ema * ema).clamp(min=0.0)
    a = age.float()
    cover = a + span
    mean = (ema * span + torch.where(age > 0, prev, 0.0)) / cover
    sig = (mean * mean - var / cover).clamp(min=0.0).sqrt()
    frac = torch.special.erf(sig / (var * (2.0 * var_m_scale) + 1e-30).sqrt())
    out.copy_(sig * (frac * (a + 1.0)).clamp(min=1.0))


_COMPILED: dict[str, Any] = {}


def _compiled(fn: Any) -> Any:
    """``torch.compile(fn, dynamic=True)``, built once per process (one compilation serves
    every shard length; Inductor caches it on disk across processes)."""
    if fn.__name__ not in _COMPILED:
        _COMPILED[fn.__name__] = torch.compile(fn, dynamic=True)
    return _COMPILED[fn.__name__]


def compiled_noise_ema_(buf: torch.Tensor, prev: torch.Tensor, age: torch.Tensor,
                        s2: torch.Tensor, s2w: torch.Tensor, *, beta: float,
                        mu: torch.Tensor) -> None:
    """:func:`noise_ema_` with error feedback and ``mu`` (the default rule's form), compiled."""
    _compiled(_noise_ema_fused)(buf, prev, age, s2, s2w, mu, beta)


def compiled_gain_score(mu: torch.Tensor, s2: torch.Tensor, s2w: torch.Tensor,
                        age: torch.Tensor, *, span: float, var_m_scale: float,
                        prev: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`gain_score` with ``prev`` (the default rule's form), compiled."""
    out = torch.empty_like(mu) if out is None else out
    _compiled(_gain_score_fused)(mu, s2, s2w, age, prev, out, span, var_m_scale)
    return out
