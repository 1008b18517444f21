"""The density after the ramp following the learning rate (``bench.lr_sweep``'s ``-follow<q>``
rows under ``python -m bench.research``; a ``RunConfig.hooks`` entry
``bench.research.follow:Hook`` with ``{"q": q}``).

After the ramp (or the dense warm-up) a sparse group's density ``1 - sparsity`` follows
``(lr / peak)^q``, scaled so its mean over those steps is the group's own
(:func:`follow_density`): more sent while the lr is high, the same bytes in all.
"""

from __future__ import annotations

from typing import Any

from bench.engine.run_config import RunConfig, lr_at


def check_q(q: Any) -> float:
    """``q`` as a float; ValueError unless it is a power in (0, 4]."""
    if isinstance(q, bool) or not isinstance(q, (int, float)) or not 0.0 < q <= 4.0:
        raise ValueError(f"follow: q must be a power in (0, 4], got {q!r}")
    return float(q)


def follow_mean(cfg: RunConfig, q: float) -> float:
    """The mean of ``(lr / peak)^q`` over the steps after the ramp (:func:`follow_density`)."""
    weights = [(lr_at(t, cfg) / cfg.lr) ** q for t in range(cfg.ramp_end, cfg.steps)]
    return sum(weights) / max(1, len(weights))


def follow_density(step: int, cfg: RunConfig, end: float, mean: float, q: float) -> float:
    """The sparsity a group of sparsity ``end`` makes its mask at, at 0-based ``step``: the
    mask is sent at the next step, whose lr weighs the density ``1 - end`` by ``(lr /
    peak)^q`` over ``mean``, that weight's mean across the steps after the ramp
    (:func:`follow_mean`). Raises ValueError where a step would turn dense."""
    d = (1.0 - end) * (lr_at(step + 1, cfg) / cfg.lr) ** q / mean
    if d >= 1.0:
        raise ValueError(f"follow{q:g}: density {d:.3g} at step {step + 1} (sparsity {end})")
    return 1.0 - d


def check(cfg: RunConfig, q: float) -> None:
    """Refuse, before launch, a row that is not SCAPE or whose densest group would turn dense
    at the peak lr."""
    check_q(q)
    if cfg.optimizer != "scape":
        raise ValueError(f"follow applies to scape rows, not {cfg.optimizer!r}")
    low = min([cfg.sparsity, *(cfg.group_sparsity or {}).values()])
    if (1.0 - low) / follow_mean(cfg, q) >= 1.0:
        raise ValueError(f"follow{q:g}: sparsity {low} would turn dense at the peak lr")


class Hook:
    """The ``RunConfig.hooks`` factory of the ``-follow<q>`` rows: writes each sparse group's
    sparsity before every step after the ramp."""

    def __init__(self, cfg: RunConfig, module: Any, opt: Any, q: float = 1.0) -> None:
        self.cfg, self.opt, self.q = cfg, opt, check_q(q)
        self.ends = [g.get("sparsity") for g in opt.param_groups]  # before any ramp writes
        self.mean = follow_mean(cfg, self.q)

    @staticmethod
    def check(cfg: RunConfig, q: float = 1.0) -> None:
        """Before launch (``RunConfig`` calls it): :func:`check`."""
        check(cfg, q)

    def before_step(self, step: int) -> None:
        if step + 1 < self.cfg.ramp_end:
            return
        for g, end in zip(self.opt.param_groups, self.ends):
            if end:
                g["sparsity"] = follow_density(step, self.cfg, end, self.mean, self.q)
