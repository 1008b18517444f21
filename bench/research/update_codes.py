"""A research hook on the 8-bit parameter wire: what its rows hold, and another 8-bit code.

With ``param_comm_dtype=torch.int8`` a sparse step's owner sends ``delta = master - model``
at its mask entries coded on 255 uniform levels of each mask row's absmax
(:class:`scape.wire.ParamWire`). For ``RunConfig.hooks`` (``{"bench.research.update_codes:
factory": {"code": "e4m3", "stats_every": 37}}``) this hook

- with ``code="e4m3"`` codes ``delta`` as fp8 e4m3 of ``delta / (s / 448)`` instead (``s`` the
  row's absmax; ``torch.float8_e4m3fn``, rounded to nearest even): the same bytes (one code a
  coordinate, one fp32 scale a row), an error of at most 1/16 of each entry's own ``|delta|``
  (``s / 448 * 2**-10`` below e4m3's normals) where the uniform code leaves up to ``s / 255`` on
  every entry; every rank decodes the same bytes, so the replicas stay identical;
- with ``stats_every=N`` records, on rank 0, every N-th coded bucket-step's row statistics:
  quantiles of ``|delta| / s``, the share of entries below ``s / 255`` and ``s / 15``, and
  each code's error (the uniform 8- and 4-bit codes' and e4m3's, whichever is sent) as the L1
  norm of the error over the L1 norm of ``delta`` and as the median of an entry's error over
  its ``|delta|``; :meth:`UpdateCodes.result` returns them;
- with ``close_at_end=True`` sets every rank's model copy to the masters after the run's last
  step, so the final evaluation reads the masters: what the gaps left at the end cost;
- with ``close_every=N`` does the same after every N-th step (one all-gather of the
  parameters each time, a dense step's parameter bytes): what the gaps cost while they last;
- with ``follow=True`` the owner sets its master to the model copy at every entry it sends
  (the fp32 sum every rank stores, before the model's dtype rounds it): the code's error is
  dropped instead of carried to the entry's next send, so the model copy never trails the
  master (zero bytes; the updates lose each send's coding error);
- with ``repay=True`` (the uniform code) each sparse step's segment starts with 4-bit codes of
  the gaps the owner's previous sparse step left at its previous mask entries (each row coded
  on 16 levels of ``s / 255``, ``s`` that row's previous scale, which every rank received:
  no scales and no offsets on the wire, ``n k / 2`` bytes more a segment), applied on every
  rank before the step's own updates, which the owner codes after them: an entry's coding
  error is repaid one step later to within ``s / 3825``, the rest carried as before.

It replaces the methods of :class:`scape.wire.ParamWire` for the whole process (a launched
rank is a process of its own). None is a way to train: the e4m3 code was
tried and not kept (docs/research.md, "The parameter updates' rows, and fp8 e4m3 updates"),
nor was ``follow``, and ``close_every`` is a diagnostic at dense parameter bytes
(docs/research.md, "The coded updates' gaps").
"""

from __future__ import annotations

from typing import Any

import torch

from scape.kernels import gather, pack_values, scatter_, unpack_values
from scape.kernels.pack import packed_nbytes
from scape.wire import ParamWire

E4M3_MAX = 448.0
"""e4m3's largest finite value: a row's absmax codes to it."""
QUANTILES = (0.1, 0.25, 0.5, 0.75, 0.9)
"""The quantiles of ``|delta| / s`` recorded."""


def e4m3_code(delta: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scales, codes)``: fp32 ``s / 448`` per row of ``k`` (1 for a row of zeros) and the
    uint8 bytes of ``delta / scale`` in fp8 e4m3."""
    x = delta.view(-1, k)
    s = x.abs().amax(dim=1) / E4M3_MAX
    s = torch.where(s > 0, s, torch.ones_like(s))
    q = (x / s.view(-1, 1)).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return s, q.view(torch.uint8).view(-1)


def e4m3_decode(codes: torch.Tensor, scales: torch.Tensor, k: int) -> torch.Tensor:
    """The fp32 values of :func:`e4m3_code`'s bytes."""
    return (codes.view(torch.float8_e4m3fn).float().view(-1, k) * scales.view(-1, 1)).view(-1)


def row_stats(delta: torch.Tensor, k: int) -> dict[str, Any]:
    """The statistics of one bucket-step's ``delta`` rows of ``k`` (module docstring)."""
    x = delta.view(-1, k)
    s = x.abs().amax(dim=1, keepdim=True)
    keep = s.view(-1) > 0
    x, s = x[keep], s[keep]
    flat = x.reshape(-1).contiguous()
    ratio = (flat.abs().view(-1, k) / s).view(-1)
    out: dict[str, Any] = {
        "rows": int(x.shape[0]), "k": k,
        "ratio_q": torch.quantile(ratio, torch.tensor(QUANTILES)).tolist(),
        "frac_below_1_255": float((ratio < 1 / 255).float().mean()),
        "frac_below_1_15": float((ratio < 1 / 15).float().mean())}
    decoded = {f"uniform{bits}": unpack_values(pack_values(flat, s.view(-1), k, bits),
                                               s.view(-1), k, bits, flat.numel())
               for bits in (8, 4)}
    sc, codes = e4m3_code(flat, k)
    decoded["e4m3"] = e4m3_decode(codes, sc, k)
    l1, mag = flat.abs().sum(), flat.abs().clamp(min=1e-30)
    for name, dec in decoded.items():
        err = (dec - flat).abs()
        out[f"{name}_l1_err"] = float(err.sum() / l1)
        out[f"{name}_rel_err_median"] = float((err / mag).median())
    return out


def update_delta(wire: ParamWire, master: torch.Tensor, model_shard: torch.Tensor,
                 rows: torch.Tensor) -> torch.Tensor:
    """What :meth:`scape.wire.ParamWire.code` codes: ``master - model_shard`` (fp32) at the
    owner's mask ``rows``."""
    delta = gather(master, rows, wire.block_size)
    return delta.sub_(gather(model_shard, rows, wire.block_size, out_dtype=torch.float32))


def _add_at(flat: torch.Tensor, rows: torch.Tensor, block_size: int,
            values: torch.Tensor) -> None:
    """``flat[rows] += values`` in fp32, stored in ``flat``'s dtype, as
    :meth:`scape.wire.ParamWire.apply` adds (``values``, fp32, is overwritten)."""
    values.add_(gather(flat, rows, block_size, out_dtype=torch.float32))
    scatter_(flat, rows, block_size, values)


def e4m3_segment(wire: ParamWire, delta: torch.Tensor) -> torch.Tensor:
    """:meth:`scape.wire.ParamWire.code`'s segment of ``delta`` (:func:`update_delta`) with
    e4m3 codes: ``[n fp32 scales | n k codes | zero bytes to the segment's size]``."""
    n, k = wire.n_local, wire.k
    scales, codes = e4m3_code(delta, k)
    parts = [scales.view(torch.uint8), codes]
    pad = wire.seg - 4 * n - n * k
    if pad:
        parts.append(torch.zeros(pad, dtype=torch.uint8, device=codes.device))
    return torch.cat(parts)


def e4m3_apply(wire: ParamWire, param_flat: torch.Tensor, mask: torch.Tensor,
               segs: torch.Tensor) -> None:
    """:meth:`scape.wire.ParamWire.apply` of :func:`e4m3_segment`'s segments."""
    n, k = wire.n_local, wire.k
    scales = segs[:, :4 * n].contiguous().view(torch.float32).view(-1)
    codes = segs[:, 4 * n:4 * n + n * k].contiguous().view(-1)
    _add_at(param_flat, mask, wire.block_size, e4m3_decode(codes, scales, k))


REPAY_BITS = 4
"""The width of :class:`Repay`'s codes."""


class Repay:
    """What ``repay=True`` keeps between sparse steps (module docstring): per bucket, the
    owner's previous mask rows and their scales (keyed by its master's storage) and every
    rank's copy of the previous full mask and all owners' scales (keyed by the model's flat
    buffer)."""

    def __init__(self) -> None:
        self.owned: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    @staticmethod
    def nbytes(rows: torch.Tensor) -> int:
        """Bytes of one owner's repay codes for its previous ``rows`` (``[n, k]``)."""
        return packed_nbytes(rows.numel(), REPAY_BITS)

    def code(self, wire: ParamWire, code_of: Any, master: torch.Tensor,
             model_shard: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The owner's segment: ``[repay codes | the library's segment of master minus the
        model copy as every rank will hold it after the repay]``."""
        key, bs = master.data_ptr(), wire.block_size
        landed = model_shard.to(torch.float32, copy=True)
        parts = []
        if key in self.owned:
            prev, scales = self.owned[key]
            k = prev.shape[1]
            gap = gather(master, prev, bs).sub_(gather(landed, prev, bs))
            rs = scales / 255.0
            codes = pack_values(gap, rs, k, REPAY_BITS)
            _add_at(landed, prev, bs, unpack_values(codes, rs, k, REPAY_BITS, gap.numel()))
            landed = landed.to(model_shard.dtype).to(torch.float32)  # as the model stores it
            parts.append(codes)
        seg = code_of(wire, master, landed, rows)
        self.owned[key] = (rows.clone(), seg[:4 * wire.n_local].clone().view(torch.float32))
        return torch.cat(parts + [seg])

    def apply(self, wire: ParamWire, apply_of: Any, param_flat: torch.Tensor,
              mask: torch.Tensor, segs: torch.Tensor) -> None:
        """Every rank: the repay at the previous mask, then the library's apply."""
        key, bs, n = param_flat.data_ptr(), wire.block_size, wire.n_local
        if key in self.seen:
            prev, scales = self.seen[key]
            k, rb = prev.shape[1], self.nbytes(prev[:n])
            rs = scales / 255.0
            values = torch.cat([unpack_values(segs[w, :rb].contiguous(), rs[w], k, REPAY_BITS,
                                              n * k) for w in range(wire.world)])
            _add_at(param_flat, prev, bs, values)
            segs = segs[:, rb:]
        apply_of(wire, param_flat, mask, segs)
        self.seen[key] = (mask.clone(), segs[:, :4 * n].contiguous().view(torch.float32)
                          .reshape(wire.world, n).clone())


class UpdateCodes:
    """The hook's state: the statistics recorded (module docstring); with ``close_after`` a
    step index, :meth:`close_gaps` of ``opt`` after that step. Built, it replaces
    :meth:`scape.wire.ParamWire.code` and :meth:`~scape.wire.ParamWire.apply` for the process."""

    def __init__(self, code: str, stats_every: int, rank: int, opt: Any = None,
                 close_after: int | None = None, close_every: int = 0,
                 follow: bool = False, repay: bool = False) -> None:
        self.code, self.stats_every, self.rank = code, stats_every, rank
        self.opt, self.close_after = opt, close_after
        self.close_every, self.follow = close_every, follow
        self.repay = Repay() if repay else None
        self.closes = 0
        self.calls = 0
        self.stats: list[dict[str, Any]] = []
        self.closed = False
        code_of, apply_of = ParamWire.code, ParamWire.apply  # the library's
        hook = self

        def coded(wire: ParamWire, master: torch.Tensor, model_shard: torch.Tensor,
                  rows: torch.Tensor) -> torch.Tensor:
            hook.calls += 1
            if hook.repay is not None:
                return hook.repay.code(wire, code_of, master, model_shard, rows)
            sampled = bool(hook.stats_every) and hook.rank == 0 \
                and hook.calls % hook.stats_every == 0
            e4m3 = code == "e4m3" and wire.bits == 8
            if not (sampled or e4m3 or hook.follow):
                return code_of(wire, master, model_shard, rows)
            delta = update_delta(wire, master, model_shard, rows)
            if sampled:
                hook.stats.append({"call": hook.calls, **row_stats(delta, wire.k)})
            seg = e4m3_segment(wire, delta) if e4m3 else code_of(wire, master, model_shard, rows)
            if hook.follow:  # what every rank will store, in fp32, becomes the master there
                own = ParamWire(1, wire.n_local, wire.k, wire.block_size, wire.bits)
                landed = model_shard.to(torch.float32, copy=True)
                applied(own, landed, rows, seg.view(1, -1))
                scatter_(master, rows, wire.block_size, gather(landed, rows, wire.block_size))
            return seg

        def applied(wire: ParamWire, param_flat: torch.Tensor, mask: torch.Tensor,
                    segs: torch.Tensor) -> None:
            if hook.repay is not None:
                return hook.repay.apply(wire, apply_of, param_flat, mask, segs)
            if code == "e4m3" and wire.bits == 8:
                return e4m3_apply(wire, param_flat, mask, segs)
            return apply_of(wire, param_flat, mask, segs)

        ParamWire.code = coded  # type: ignore[method-assign]
        ParamWire.apply = applied  # type: ignore[method-assign]

    def close_gaps(self, opt: Any) -> None:
        """Every rank's model copy becomes the owners' fp32 masters in the model's dtype (one
        all-gather of the parameters per bucket, a dense step's parameter bytes), as a load
        does (:func:`scape.checkpoint.finish_load`)."""
        opt.finish_param_sync()
        for b, s in zip(opt.buckets, opt.shards):
            opt.comm.all_gather(b.param_flat, s.master.to(b.dtype)).wait()
            b.publish()

    def after_step(self, step: int) -> None:
        """``RunConfig.hooks``' call after each step: close the gaps after ``close_after`` and
        after every ``close_every``-th step."""
        if step == self.close_after or (self.close_every and (step + 1) % self.close_every == 0):
            self.close_gaps(self.opt)
            self.closes += 1
            self.closed = self.closed or step == self.close_after

    def result(self) -> dict[str, Any]:
        return {"code": self.code, "stats_every": self.stats_every, "calls": self.calls,
                "closed_at_end": self.closed, "closes": self.closes,
                "close_every": self.close_every, "follow": self.follow,
                "repay": self.repay is not None, "stats": self.stats}


def factory(cfg: Any, module: torch.nn.Module, opt: Any, code: str = "uniform",
            stats_every: int = 0, close_at_end: bool = False, close_every: int = 0,
            follow: bool = False, repay: bool = False) -> UpdateCodes:
    """``RunConfig.hooks`` factory (module docstring): ``code`` ``"uniform"`` (the library's)
    or ``"e4m3"``; ``stats_every`` 0 records nothing; ``close_at_end`` closes every gap
    between master and model copy after step ``cfg.steps`` (:meth:`UpdateCodes.close_gaps`),
    so the final evaluation reads the masters; ``close_every`` N > 0 closes them after every
    N-th step too; ``follow`` drops each send's coding error; ``repay`` repays it one step
    later in 4-bit codes (module docstring; the uniform code only, without ``follow`` or
    ``stats_every``)."""
    if code not in ("uniform", "e4m3"):
        raise ValueError(f"bench.research.update_codes: code must be 'uniform' or 'e4m3'; "
                         f"got {code!r}")
    for name, v in (("stats_every", stats_every), ("close_every", close_every)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"bench.research.update_codes: {name} must be an int >= 0; "
                             f"got {v!r}")
    for name, b in (("follow", follow), ("repay", repay)):
        if not isinstance(b, bool):
            raise ValueError(f"bench.research.update_codes: {name} must be a bool; got {b!r}")
    if repay and (code != "uniform" or follow or stats_every):
        raise ValueError("bench.research.update_codes: repay takes the uniform code alone "
                         "(no follow, no stats_every)")
    if getattr(opt, "param_comm_dtype", None) != torch.int8:
        raise ValueError("bench.research.update_codes needs scape.SCAPE with "
                         "param_comm_dtype=torch.int8 (its bytes are the 8-bit wire's); got "
                         f"{type(opt).__name__} with "
                         f"{getattr(opt, 'param_comm_dtype', None)!r}")
    return UpdateCodes(code, stats_every, opt.comm.rank, opt,
                       cfg.steps - 1 if close_at_end else None, close_every, follow, repay)
