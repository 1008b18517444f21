"""SCAPE: sparse, communication-efficient sharded AdamS for data-parallel pre-training.

``scape.SCAPE`` is the optimizer; ``scape.DistributedAdamW`` is the dense sharded AdamW
baseline on the same buffers. Kernels live in ``scape.kernels``, communication in
``scape.comm``.
"""

from scape.adamw import DistributedAdamW
from scape.diloco import DiLoCo
from scape.io import CheckpointError, load_checkpoint, save_checkpoint
from scape.optimizer import SCAPE
from scape.rules import RULES
from scape.schedules import sparsity_ramp
from scape.sparseloco import SparseLoCo
from scape.step_info import StepInfo

__all__ = ["SCAPE", "DistributedAdamW", "RULES", "StepInfo", "SparseLoCo", "DiLoCo",
           "save_checkpoint", "load_checkpoint", "CheckpointError", "sparsity_ramp"]
__version__ = "0.1.0"
