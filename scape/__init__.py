"""SCAPE: sparse, communication-efficient sharded AdamS for data-parallel pre-training.

``scape.SCAPE`` is the optimizer; ``scape.DistributedAdamW`` is the dense sharded AdamW
baseline on the same buffers. ``scape.rules`` holds the sparse-step rules (and
``scape.rules.register`` for new ones), ``scape.kernels`` the kernels, ``scape.comm`` the
communication layer.
"""

from scape import rules as rules
from scape.adamw import DistributedAdamW
from scape.diloco import DiLoCo
from scape.io import CheckpointError, load_checkpoint, save_checkpoint
from scape.io import resolve as resolve_checkpoint
from scape.optimizer import SCAPE
from scape.replicate import broadcast_parameters
from scape.schedules import SparsityRamp, sparsity_ramp
from scape.sparseloco import SparseLoCo
from scape.step_info import StepInfo
from scape.wrappers import skip_ddp_allreduce

__all__ = ["SCAPE", "DistributedAdamW", "StepInfo", "SparseLoCo", "DiLoCo",
           "save_checkpoint", "load_checkpoint", "CheckpointError", "sparsity_ramp",
           "SparsityRamp", "broadcast_parameters", "skip_ddp_allreduce", "resolve_checkpoint"]
__version__ = "0.1.0"
