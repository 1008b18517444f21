"""What a mask takes of each block: the budget at a sparsity (:func:`block_budget`) and whether
that budget is wide enough for the masks to read the wait (:func:`reads_wait`)."""

from __future__ import annotations

import math

from scape.rules.estimators import NOISE_BETA


def round_half_up(x: float) -> int:
    """``round`` with halves going up (Python's ``round`` goes to even)."""
    return int(math.floor(x + 0.5))


def block_budget(sparsity: float, block_size: int, explore: float) -> tuple[int, int]:
    """``(k_b, k_x)``: coordinates per block a mask takes at ``sparsity``, and how many of them
    are chosen by age (``explore`` of them)."""
    k = max(1, round_half_up((1.0 - sparsity) * block_size))
    return k, round_half_up(explore * k)


def reads_wait(k: int, block_size: int) -> bool:
    """Whether a mask of ``k`` per block is dense enough for the short wait (``agree``'s
    smaller bound, :data:`scape.rules.TRUST`; the research's masks that read the wait,
    :func:`gain_score_residual`, else :func:`gain_score`): when a mask takes at least
    ``(1 - beta) / (1 + beta)`` = 1/39 of each block (sparsity up to 0.974), so the mean
    wait, ``block_size / k`` steps, is within the EMA's 39; a longer wait outweighs the fresh
    mean (docs/research.md, entry 21)."""
    return k * (1.0 + NOISE_BETA) >= (1.0 - NOISE_BETA) * block_size

