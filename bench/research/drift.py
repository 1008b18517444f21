"""Dead reckoning for the coordinates a sparse step did not send (a research option of the
harness: ``bench.lr_sweep``'s ``-drift`` rows under ``python -m bench.research``, a
``RunConfig.hooks`` entry ``bench.research.drift:hook``).

Between two sends a coordinate of SCAPE's model stands still and then jumps by its whole
catch-up; dense AdamS moves it a little every step. Here every rank moves the coordinates it
did not receive this step along the mean rate of their last jump, ``(p_sent - p_before) /
wait``, for at most as many steps as that wait, so the forward pass sees each coordinate
where its last rate puts it. Nothing is sent for it: every rank holds the same model, sees
the same values arrive and computes the same positions, bit for bit. The positions are
written through ``p.data``, which the optimizer does not adopt as outside writes: its master
weights stay where the catch-ups put them, and the next send of a coordinate replaces the
reckoned position with the owner's. Memory: three copies of the parameters and two int32
counters per coordinate on every rank.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


class Drift:
    """Call :meth:`after_step` after each ``opt.step()``, once the step's values are in the
    model (``opt.finish_param_sync()``). A coordinate counts as sent when its value differs
    from what :meth:`after_step` left there (the optimizer writes sent coordinates only)."""

    def __init__(self, params: Iterable[torch.nn.Parameter]) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.shown = [p.detach().clone() for p in self.params]
        """What the model held after the last call (the reckoned positions included)."""
        self.track = [p.detach().clone() for p in self.params]
        """Each coordinate's value as last sent."""
        self.rate = [torch.zeros_like(p, dtype=torch.float32) for p in self.params]
        self.since = [torch.zeros_like(p, dtype=torch.int32) for p in self.params]
        self.wait = [torch.ones_like(p, dtype=torch.int32) for p in self.params]

    @torch.no_grad()
    def after_step(self) -> int:
        """Advance every unsent coordinate; returns how many coordinates were sent."""
        sent_total = 0
        for p, shown, track, rate, since, wait in zip(self.params, self.shown, self.track,
                                                      self.rate, self.since, self.wait):
            x = p.data
            sent = x != shown
            since.add_(1)
            rate.copy_(torch.where(sent, (x.float() - track.float()) / since, rate))
            wait.copy_(torch.where(sent, since, wait))
            track.copy_(torch.where(sent, x, track))
            since.masked_fill_(sent, 0)
            ahead = track.float() + rate * torch.minimum(since, wait)
            x.copy_(torch.where(sent, x, ahead.to(x.dtype)))
            shown.copy_(x)
            sent_total += int(sent.sum())
        return sent_total


class _Hook:
    """:class:`Drift` as a rank's step hook (:attr:`bench.engine.run_config.RunConfig.hooks`)."""

    def __init__(self, module: torch.nn.Module, opt: Any) -> None:
        self.opt, self.drift = opt, Drift(module.parameters())

    def after_step(self, step: int) -> None:
        self.opt.finish_param_sync()  # the step's values in the model, then the reckoning
        self.drift.after_step()


def hook(cfg: Any, module: torch.nn.Module, opt: Any) -> _Hook:
    """The ``RunConfig.hooks`` factory of the ``-drift`` rows (SCAPE rows only)."""
    check(cfg)
    return _Hook(module, opt)


def check(cfg: Any) -> None:
    """Before launch (``RunConfig`` calls it): SCAPE rows only."""
    if cfg.optimizer != "scape":
        raise ValueError(f"drift applies to scape rows, not {cfg.optimizer!r}")


hook.check = check  # type: ignore[attr-defined]
