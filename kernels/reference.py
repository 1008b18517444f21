"""Pure-torch implementations of every op: the CPU path and the ground truth for the Triton
kernels. Arguments are assumed validated (the public functions in ``scape.kernels`` do it).

Everything is vectorised over blocks and elements. Masks are int16 ``[n_blocks, k]``
block-local offsets; the flat position of ``idx[b, j]`` is ``b * block_size + idx[b, j]``.
The indexed ops build those flat positions in int64 and use 1-D ``index_select`` /
``index_copy_`` / ``index_fill_``.
"""

from __future__ import annotations

import functools
import math

import torch

FLOAT32_MAX = float(torch.finfo(torch.float32).max)
"""The default ``limit`` of :func:`grad_stats`: every finite entry is within it."""
_CHUNK = 1 << 18  # elements per cache-sized slice of the dense element-wise updates


def _unique_keys(order: torch.Tensor, block_size: int) -> torch.Tensor:
    """Keys, one per entry of ``order`` (int32 ``[n_blocks, block_size]``, larger is
    better), all distinct within a row and ordered like ``order`` with ties going to the
    lower column: ``order * block_size + (block_size - 1 - column)``. int32 when every key
    fits (ages usually do: with exploration an age stays below about ``block_size``),
    else int64."""
    lo, hi = torch.aminmax(order)
    fits = -(2**31) // block_size < int(lo) and int(hi) < (2**31 - 1) // block_size - 1
    dtype = torch.int32 if fits else torch.int64
    rank_of_column = torch.arange(block_size - 1, -1, -1, dtype=dtype, device=order.device)
    return torch.add(rank_of_column, order, alpha=block_size)  # one pass


def _top_columns(keys: torch.Tensor, k: int) -> torch.Tensor:
    """Columns of the ``k`` largest (distinct) keys per row: exact, whatever the algorithm
    ``torch.topk`` uses, because no two keys of a row are equal."""
    return torch.topk(keys, k, dim=1, largest=True, sorted=False).indices


def _top_exact(order: torch.Tensor, k: int, block_size: int) -> torch.Tensor:
    """Columns of the ``k`` largest entries per row of int32 ``order``, ties to the lower
    column. Fast path: one ``torch.topk`` of ``k + 1``; where every row's k-th value is
    strictly above its (k+1)-th, the top-k *set* is unique and that is the answer. Otherwise
    (a tie across the boundary) unique int64 keys decide, exactly."""
    if k >= block_size:
        return torch.arange(block_size, device=order.device).expand(order.shape[0], -1)
    top = torch.topk(order, k + 1, dim=1, largest=True, sorted=True)
    if bool((top.values[:, k - 1] > top.values[:, k]).all()):
        return top.indices[:, :k]
    return _top_columns(_unique_keys(order, block_size), k)


def blockwise_topk(score: torch.Tensor, k: int, block_size: int, *,
                   age: torch.Tensor | None = None, k_explore: int = 0) -> torch.Tensor:
    """Per block, the ``k - k_explore`` offsets of largest ``|score|`` and then the
    ``k_explore`` offsets of largest ``age`` among the rest; int16 ``[n_blocks, k]``, sorted.

    Ranking is on the order-preserving integer image of ``|score|`` (the float's bits with
    the sign cleared: non-negative floats order like their bits, and -0.0 becomes 0.0); NaN
    maps to -1, below every number. One ``torch.topk`` per pass decides when no tie crosses
    the k-th place; otherwise each key is made unique by appending the reversed column, so
    ties go to the lower offset. The already chosen entries are pushed below every age
    before the ``age`` pass. Only the ``[n_blocks, k]`` result is sorted.
    """
    n_blocks = score.numel() // block_size
    x = score.view(n_blocks, block_size)
    if x.dtype != torch.float32:
        x = x.float()  # exact for bf16/fp16
    bits = x.view(torch.int32) & 0x7FFFFFFF  # |x| as ordered integers; NaN > +inf here
    bits.masked_fill_(bits > 0x7F800000, -1)
    k_top = k - k_explore
    parts = []
    if k_top > 0:
        parts.append(_top_exact(bits, k_top, block_size))
    if k_explore > 0:
        assert age is not None  # validated by the public function
        order = age.view(n_blocks, block_size)
        if parts:  # chosen entries go below every eligible age (-1 when ages are >= 0)
            if int(order.min()) >= 0:
                order = order.clone().scatter_(1, parts[0], -1)
            else:
                order = order.to(torch.int64).scatter_(1, parts[0], -(2**32))
        # ages tie all the time (every coordinate of a mask ages alike): keys at once
        parts.append(_top_columns(_unique_keys(order, block_size), k_explore))
    cols = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
    return cols.sort(dim=1).values.to(torch.int16)


def _flat(idx: torch.Tensor, block_size: int) -> torch.Tensor:
    """int64 flat positions ``b * block_size + idx[b, j]``, block-major (1-D index ops on
    these beat gather/scatter along dim 1 of the block view several-fold at low density)."""
    rows = torch.arange(idx.shape[0], device=idx.device, dtype=torch.int64) * block_size
    return (rows[:, None] + idx).view(-1)


def take_(src: torch.Tensor, idx: torch.Tensor, block_size: int, *,
          out: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
          keep_error: bool = False) -> torch.Tensor:
    """``values = src[flat]`` cast, then ``src[flat] = 0`` (``keep_error``: what the cast
    lost, in fp32, 0 where not finite)."""
    flat = _flat(idx, block_size)
    vals = src.index_select(0, flat)
    got = _emit(vals, out, out_dtype)
    if keep_error:
        err = vals.float() - got.float()
        src.index_copy_(0, flat, torch.where(torch.isfinite(err), err, 0.0).to(src.dtype))
    else:
        src.index_fill_(0, flat, 0.0)
    return got


def gather(src: torch.Tensor, idx: torch.Tensor, block_size: int, *,
           residual: torch.Tensor | None = None, out: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``src[flat] (+ residual[flat])`` summed in fp32, cast; inputs untouched."""
    flat = _flat(idx, block_size)
    vals = src.index_select(0, flat)
    if residual is not None:
        vals = vals.float() + residual.index_select(0, flat).float()
    return _emit(vals, out, out_dtype if out_dtype is not None or out is not None
                 else src.dtype)


def _emit(vals: torch.Tensor, out: torch.Tensor | None,
          out_dtype: torch.dtype | None) -> torch.Tensor:
    if out is not None:
        out.copy_(vals)
        return out
    return vals.to(out_dtype) if out_dtype is not None else vals


def scatter_(dst: torch.Tensor, idx: torch.Tensor, block_size: int,
             values: torch.Tensor) -> None:
    """``dst[flat] = values`` cast to ``dst.dtype``; nothing else is written."""
    dst.index_copy_(0, _flat(idx, block_size), values.to(dst.dtype))


def adams_dense_(p: torch.Tensor, m: torch.Tensor, g: torch.Tensor, *, lr: float,
                 beta1: float, beta2: float, eps: float, weight_decay: float,
                 model_out: torch.Tensor | None = None) -> None:
    """AdamS on every coordinate, in place on fp32 ``p`` and ``m``::

        v = b2*m^2 + (1-b2)*g^2          (old m)
        m = b1*m + (1-b1)*g
        p = p*(1 - lr*wd) - lr*m/(sqrt(v) + eps)

    Processed in cache-sized slices so the two temporaries never leave the cache: main
    memory sees one read of p, m, g and one write of p, m (and of ``model_out``).
    """
    n = p.numel()
    decay = 1.0 - lr * weight_decay
    for s in range(0, n, _CHUNK):
        e = min(s + _CHUNK, n)
        ps, ms = p[s:e], m[s:e]
        gs = g[s:e] if g.dtype == torch.float32 else g[s:e].float()
        d = torch.mul(ms, ms)
        d.mul_(beta2).addcmul_(gs, gs, value=1.0 - beta2).sqrt_().add_(eps)
        ms.mul_(beta1).add_(gs, alpha=1.0 - beta1)
        if decay != 1.0:
            ps.mul_(decay)
        ps.addcdiv_(ms, d, value=-lr)
        if model_out is not None:
            model_out[s:e].copy_(ps)


def _log(x: float) -> float:
    """``log(x)`` with ``log(0) = -inf`` (so that ``exp(a * log(0)) = 0`` for ``a > 0``)."""
    return math.log(x) if x > 0.0 else -math.inf


def _write_selected(p: torch.Tensor, m: torch.Tensor, age: torch.Tensor | None,
                    flat: torch.Tensor,
                    p_sel: torch.Tensor, m_sel: torch.Tensor,
                    model_out: torch.Tensor | None) -> None:
    """The end of a sparse update: the masked coordinates' new weights and moments back into
    the shard, every age up by one and the masked ones reset (``age`` None: advanced before),
    the new weights to the model."""
    p.index_copy_(0, flat, p_sel)
    m.index_copy_(0, flat, m_sel)
    if age is not None:
        _age_step_(age, flat)
    if model_out is not None:
        model_out.copy_(p_sel)


def adams_sparse_(p: torch.Tensor, m: torch.Tensor, age: torch.Tensor, g: torch.Tensor,
                  idx: torch.Tensor, block_size: int, *, lr: float, beta1: float,
                  beta2: float, eps: float, weight_decay: float,
                  model_out: torch.Tensor | None = None,
                  catchup: float | None = None) -> None:
    """AdamS at the masked coordinates only, lazy weight decay, ages advanced.

    At a masked coordinate with age ``a``: ``v = b2*m^2 + (1-b2)*g^2`` (old m),
    ``m = b1*m + (1-b1)*g``, ``p = p*(1-lr*wd)^(a+1) - lr*m/(sqrt(v)+eps)``, ``age = 0``.
    Everywhere else ``p`` and ``m`` are untouched and ``age += 1``. ``model_out`` (compact)
    receives the new ``p`` at the masked coordinates, cast to its dtype.

    ``catchup=c`` replays the ``a + 1`` steps the coordinate missed from their mean
    gradient ``g / (a+1)``: ``v`` is built from that mean, ``m = b1^(a+1)*m +
    (1-b1^(a+1))*mean`` and ``p`` moves ``(a+1)^c`` normalized steps.
    """
    flat = _flat(idx, block_size)
    p_sel = p.index_select(0, flat)
    m_sel = m.index_select(0, flat)
    g_sel = g.float()
    replay = catchup is not None
    a1 = age.index_select(0, flat).float().add_(1.0) if replay or weight_decay != 0.0 \
        else None
    if replay:
        assert a1 is not None
        g_sel = g_sel / a1
    denom = (m_sel * m_sel).mul_(beta2).addcmul_(g_sel, g_sel, value=1.0 - beta2)
    denom.sqrt_().add_(eps)
    if replay:
        assert a1 is not None
        keep = (a1 * _log(beta1)).exp_()  # beta1^(a+1)
        m_sel.mul_(keep).addcmul_(1.0 - keep, g_sel)
    else:
        m_sel.mul_(beta1).add_(g_sel, alpha=1.0 - beta1)
    if weight_decay != 0.0:
        # (1-lr*wd)^(a+1) = exp((a+1) * log1p(-lr*wd)): log1p in float64 on the host keeps
        # the decay exact to fp32 rounding for any age (pow of a rounded base would not).
        assert a1 is not None
        log_decay = math.log1p(-lr * weight_decay)
        p_sel.mul_((a1 * log_decay).exp_())
    if replay:
        assert a1 is not None and catchup is not None
        p_sel.addcmul_(m_sel / denom, a1 if catchup == 1.0 else a1.pow(catchup), value=-lr)
    else:
        p_sel.addcdiv_(m_sel, denom, value=-lr)
    _write_selected(p, m, age, flat, p_sel, m_sel, model_out)


def adamw_dense_(p: torch.Tensor, m: torch.Tensor, v: torch.Tensor, g: torch.Tensor, *,
                 lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                 step: int, model_out: torch.Tensor | None = None) -> None:
    """``torch.optim.AdamW`` (single-tensor path) on fp32 ``p``, ``m``, ``v``::

        p *= 1 - lr*wd;  m = lerp(m, g, 1-b1);  v = b2*v + (1-b2)*g^2
        p -= lr/(1-b1^t) * m / (sqrt(v)/sqrt(1-b2^t) + eps)

    The same torch operations in the same order as torch's own implementation, so the
    result is bitwise that of ``torch.optim.AdamW(foreach=False)``. Sliced like
    :func:`adams_dense_` so the ``denom`` temporary stays in cache.
    """
    n = p.numel()
    bias1 = 1.0 - beta1 ** step
    bias2_sqrt = (1.0 - beta2 ** step) ** 0.5
    step_size = lr / bias1
    for s in range(0, n, _CHUNK):
        e = min(s + _CHUNK, n)
        ps, ms, vs = p[s:e], m[s:e], v[s:e]
        gs = g[s:e] if g.dtype == torch.float32 else g[s:e].float()
        ps.mul_(1.0 - lr * weight_decay)
        ms.lerp_(gs, 1.0 - beta1)
        vs.mul_(beta2).addcmul_(gs, gs, value=1.0 - beta2)
        d = vs.sqrt().div_(bias2_sqrt).add_(eps)
        ps.addcdiv_(ms, d, value=-step_size)
        if model_out is not None:
            model_out[s:e].copy_(ps)


@functools.lru_cache(maxsize=16)
def _square_f32(limit: float) -> float:
    """``limit**2`` as fp32 computes it (the limit rounded to fp32 first; inf past the range):
    the sum of squares :func:`grad_stats` compares, once per limit rather than every call."""
    return float(torch.tensor(limit, dtype=torch.float32).square())


def grad_stats(x: torch.Tensor, limit: float = FLOAT32_MAX) -> torch.Tensor:
    """fp32 ``[sum of squares of all entries, number of entries not within limit]``: the
    non-finite entries and those with ``|x| > limit`` (by default the largest fp32, so the
    non-finite ones alone).

    The sum runs over every entry, so it is inf/NaN when a non-finite entry exists (callers
    decide to skip on the count, not on the sum). It is accumulated in fp32. The count is
    exact up to 2^24 (stored as fp32). On CPU the count pass runs only when the sum is not
    finite or reaches ``limit**2`` in fp32 (an entry beyond ``limit`` makes it so: a sum of
    squares rounds monotonically, so it is at least that entry's rounded square).
    """
    xf = x if x.dtype == torch.float32 else x.float()
    sumsq = torch.dot(xf, xf)
    total = float(sumsq) if x.device.type == "cpu" else math.inf
    if total < _square_f32(limit):
        count = torch.zeros((), dtype=torch.float32)
    else:
        count = (~(xf.abs() <= limit)).sum(dtype=torch.float32)
    return torch.stack([sumsq.float(), count])


def noise_ema_(buf: torch.Tensor, prev: torch.Tensor, age: torch.Tensor, s2: torch.Tensor,
               s2w: torch.Tensor, *, beta: float, error_feedback: bool,
               mu: torch.Tensor | None = None) -> None:
    """The EMA of the local gradient's square, and of the gradient itself if ``mu`` is given
    (see ``scape.kernels.noise_ema_``)."""
    local = buf - prev.masked_fill_(age == 0, 0.0) if error_feedback else buf.clone()
    bad = ~torch.isfinite(local)
    states = (s2, s2w) if mu is None else (s2, s2w, mu)
    kept = [t[bad] for t in states] if bool(bad.any()) else None  # not observations
    s2.mul_(beta).addcmul_(local, local, value=1.0 - beta)
    s2w.mul_(beta).add_(1.0 - beta)
    if mu is not None:
        mu.mul_(beta).add_(local, alpha=1.0 - beta)
    if kept is not None:
        for t, old in zip(states, kept):
            t[bad] = old
    prev.copy_(buf)


def gain_score(mu: torch.Tensor, s2: torch.Tensor, s2w: torch.Tensor, age: torch.Tensor, *,
               span: float, var_m_scale: float,
               prev: torch.Tensor | None = None) -> torch.Tensor:
    """What sending each coordinate now is worth (see ``scape.kernels.gain_score``; ``span``
    and ``var_m_scale`` are its two factors, computed there)."""
    w = s2w.clamp(min=1e-12)
    mean = mu / w
    var = (s2 / w).sub_(mean.square()).clamp_(min=0.0)
    a = age.float()
    if prev is None:
        noise = var / span
    else:
        cover = a + span
        mean.mul_(span).add_(torch.where(age > 0, prev, 0.0)).div_(cover)
        noise = var / cover
    sig = mean.square_().sub_(noise).clamp_(min=0.0).sqrt_()
    frac = torch.special.erf(sig / var.mul_(2.0 * var_m_scale).add_(1e-30).sqrt_())
    return sig.mul_(frac.mul_(a.add_(1.0)).clamp_(min=1.0))


def catchup_agree_(p: torch.Tensor, m: torch.Tensor, age: torch.Tensor, s2: torch.Tensor,
                   s2w: torch.Tensor, g: torch.Tensor, idx: torch.Tensor, block_size: int, *,
                   lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                   world: int, trust: float | None = None,
                   model_out: torch.Tensor | None = None,
                   age_at_mask: torch.Tensor | None = None) -> None:
    """The agreement catch-up at the mask (see ``scape.kernels.catchup_agree_``), in the
    order of ``scape.rules.catchup_snr(..., agree=True)``, whose result it equals bit for bit.
    The per-block RMS of ``p`` is taken ``_CHUNK`` entries at a time (no shard-sized
    temporary; each block's mean is the same reduction)."""
    flat = _flat(idx, block_size)
    p_sel, m_sel = p.index_select(0, flat), m.index_select(0, flat)
    waited = age.index_select(0, flat) if age_at_mask is None else age_at_mask
    a1 = waited.float().add_(1.0)
    gbar = g.float() / a1
    denom = (m_sel * m_sel).mul_(beta2).addcmul_(gbar, gbar, value=1.0 - beta2)
    denom.sqrt_().add_(eps)
    s2_sel = s2.index_select(0, flat).div_(s2w.index_select(0, flat).clamp_(min=1e-12))
    sigma2 = (s2_sel - m_sel.square()).clamp_(min=0.0).div_(world).add_(1e-30)
    mu2 = (gbar.square() - sigma2 / a1).clamp_(min=0.0)
    sigma_m2 = sigma2 * ((1.0 - beta1) / (1.0 + beta1))
    frac = torch.special.erf(mu2.div_(sigma_m2.mul_(2.0)).sqrt_())
    steps = torch.maximum(a1 * frac, a1.pow(0.0))
    if trust is not None and lr > 0.0:
        rows = p.view(-1, block_size)
        step = max(1, _CHUNK // block_size)
        rms = torch.empty(rows.shape[0], dtype=torch.float32, device=p.device)
        square = torch.empty(min(step, rows.shape[0]), block_size, dtype=torch.float32,
                             device=p.device)
        for r in range(0, rows.shape[0], step):
            e = min(r + step, rows.shape[0])
            torch.mean(torch.square(rows[r:e], out=square[: e - r]), dim=1, out=rms[r:e])
        reach = rms.sqrt_().mul_(trust / lr).repeat_interleave(idx.shape[1])
        steps = torch.minimum(steps, torch.maximum(a1.sqrt(), reach))
    keep = torch.pow(beta1, a1)  # beta1^(a+1); 0 when beta1 = 0
    m_sel.mul_(keep).addcmul_(1.0 - keep, gbar)
    if weight_decay != 0.0:
        p_sel.mul_(a1.mul(math.log1p(-lr * weight_decay)).exp_())
    p_sel.addcmul_(m_sel / denom, steps, value=-lr)
    _write_selected(p, m, age if age_at_mask is None else None, flat, p_sel, m_sel,
                    model_out)


def advance_ages_(age: torch.Tensor, idx: torch.Tensor, block_size: int) -> torch.Tensor:
    """A sparse step's ages, in place: every age up by one, the mask's (``idx``) reset to 0;
    returns the mask entries' ages from before (int32, compact, block-major)."""
    flat = _flat(idx, block_size)
    before = age.index_select(0, flat)
    _age_step_(age, flat)
    return before


def _age_step_(age: torch.Tensor, flat: torch.Tensor) -> None:
    """Every age up by one, those at the flat positions ``flat`` reset to 0."""
    age.add_(1)
    age.index_fill_(0, flat, 0)


def restore_ages_(age: torch.Tensor, idx: torch.Tensor, block_size: int,
                  age_at_mask: torch.Tensor) -> None:
    """Undo :func:`advance_ages_` (a step skipped after its ages were advanced)."""
    age.sub_(1)
    age.index_copy_(0, _flat(idx, block_size), age_at_mask)


def noise_gain_topk_(buf: torch.Tensor, prev: torch.Tensor, age: torch.Tensor,
                     s2: torch.Tensor, s2w: torch.Tensor, mu: torch.Tensor, cur: torch.Tensor,
                     k: int, block_size: int, *, k_explore: int, beta: float, span: float,
                     var_m_scale: float, error_feedback: bool,
                     residual: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The noise EMAs, the ages advanced at ``cur``, then the mask of largest gain (see
    ``scape.kernels.noise_gain_topk_``)."""
    noise_ema_(buf, prev, age, s2, s2w, beta=beta, error_feedback=error_feedback, mu=mu)
    age_at_mask = advance_ages_(age, cur, block_size)
    score = gain_score(mu, s2, s2w, age, span=span, var_m_scale=var_m_scale,
                       prev=prev if residual else None)
    idx = blockwise_topk(score, k, block_size, age=age if k_explore else None,
                         k_explore=k_explore)
    return idx, age_at_mask
