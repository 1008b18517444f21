"""Triton kernels with torch reference implementations (imported as ``scape.kernels``).

CUDA tensors run the Triton kernels, CPU tensors the torch implementations in
:mod:`scape.kernels.reference` (the ground truth) or, for ``blockwise_topk``, its exact
two-level form in :mod:`scape.kernels.topk_torch`; ``set_backend("triton"|"torch")`` forces
one (``with backend(...)`` for a block). The backend starts as ``SCAPE_KERNELS`` says when the
package is imported (unset: ``auto``).
"""

from ._checks import BACKENDS, backend, get_backend, set_backend
from .catchup import catchup_agree_
from .mask_code import mask_nbytes, pack_mask, unpack_mask
from .moments import adams_dense_, adams_sparse_, adamw_dense_
from .pack import (
    absmax_scales,
    pack_offsets,
    pack_values,
    packed_nbytes,
    take_pack8_,
    unpack_offsets,
    unpack_values,
    word_layout,
)
from .reference import restore_ages_
from .select import gain_topk, noise_gain_topk_
from .sparse import gather, scatter_, take_
from .stats import gain_score, grad_stats, noise_ema_
from .topk import blockwise_topk

__all__ = [
    "BACKENDS",
    "set_backend",
    "get_backend",
    "backend",
    "blockwise_topk",
    "take_",
    "gather",
    "scatter_",
    "adams_dense_",
    "adams_sparse_",
    "adamw_dense_",
    "catchup_agree_",
    "grad_stats",
    "noise_ema_",
    "gain_score",
    "gain_topk",
    "noise_gain_topk_",
    "restore_ages_",
    "pack_values",
    "unpack_values",
    "packed_nbytes",
    "word_layout",
    "absmax_scales",
    "take_pack8_",
    "pack_offsets",
    "unpack_offsets",
    "pack_mask",
    "unpack_mask",
    "mask_nbytes",
]
