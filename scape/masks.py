"""The masks of one sparse bucket of :class:`scape.SCAPE`, and a saved mask fitted to them."""

from __future__ import annotations

from typing import Any

import torch


class MaskState:
    """Masks of one sparse bucket: the one used last and the next one (maybe in flight)."""

    def __init__(self, k: int, k_explore: int, n_blocks: int, n_local: int) -> None:
        self.k, self.k_explore = k, k_explore  # the budget of the next mask made
        self.n_blocks, self.n_local = n_blocks, n_local
        self.current: torch.Tensor | None = None  # mask of the last sparse step [n_blocks, k]
        self.next: torch.Tensor | None = None  # mask for the next sparse step [n_blocks, k]
        # (its contents valid once wait() returned: the packed all-gather unpacks into it)
        self.work: Any = None  # the all-gather filling `next`, if still in flight
        self.local: torch.Tensor | None = None  # this rank's rows of `next`
        self.made: torch.Tensor | None = None  # the next local mask, made before the take

    def wait(self) -> torch.Tensor | None:
        if self.work is not None:
            self.work.wait()
            self.work = None
        return self.next


def on_device(t: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    """``t`` on ``device`` (None stays None)."""
    return None if t is None else t.to(device)


def fit_mask(mask: torch.Tensor | None, m: MaskState,
              block_size: int) -> torch.Tensor | None:
    """A saved mask on this world size's block count: extra padding blocks select 0..k-1.
    It keeps its own ``k`` (the sparsity it was made at)."""
    if mask is None:
        return None
    k = mask.shape[1]
    if not 1 <= k <= block_size or bool((mask < 0).any()) or \
            bool((mask >= block_size).any()):
        raise ValueError(f"checkpoint mask has {k} coordinates per block with offsets outside "
                         f"[0, {block_size}) (block_size changed?)")
    if mask.shape[0] >= m.n_blocks:
        return mask[: m.n_blocks].contiguous()
    pad = torch.arange(k, dtype=torch.int16).expand(m.n_blocks - mask.shape[0], k)
    return torch.cat([mask, pad.to(mask.device)]).contiguous()
