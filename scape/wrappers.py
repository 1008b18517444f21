"""Data-parallel wrappers around a model SCAPE trains: found, and refused or made safe.

The sharded optimizers do the data-parallel communication themselves. A model that is also
wrapped in ``DistributedDataParallel`` gets a dense all-reduce of every gradient on top of the
optimizer's own traffic, silently; with ``gradient_as_bucket_view=True`` DDP copies the
gradient buffer (gradient *and* error-feedback residual) into its bucket views, which the
optimizer then folds in again: the residual counts twice. So the first ``step()`` looks for a
DDP module holding the optimizer's parameters and raises on every rank, unless the wrap was
made safe with :func:`skip_ddp_allreduce` (the trainer needs the wrapper, as the Hugging Face
Trainer does) and keeps ``gradient_as_bucket_view=False``. Parameters already sharded by
FSDP (DTensors) are refused at construction by the parameter checks.

The search walks the garbage collector's objects once, at the first step.
"""

from __future__ import annotations

import gc
from typing import Any

import torch

SKIP_ATTR = "_scape_skips_allreduce"
"""Set on a DDP module by :func:`skip_ddp_allreduce`."""


def _local_bucket(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks annotations
    """A DDP communication hook that communicates nothing: the bucket keeps this rank's own
    gradient (the optimizer reduces it, sparsely)."""
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def skip_ddp_allreduce(ddp: Any) -> Any:
    """Switch off ``ddp``'s gradient all-reduce through DDP's own communication-hook API, for a
    trainer that must keep its DDP wrap; the optimizer then does the reduction. Returns
    ``ddp``. Needs ``gradient_as_bucket_view=False`` (DDP's default)."""
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(ddp, DistributedDataParallel):
        raise TypeError(f"skip_ddp_allreduce: expected a DistributedDataParallel module, got "
                        f"{type(ddp).__name__}")
    if ddp.gradient_as_bucket_view:
        raise ValueError("skip_ddp_allreduce: this DDP module has gradient_as_bucket_view="
                         "True, which copies the optimizer's gradient buffer (gradient and "
                         "error-feedback residual) into DDP's buckets; wrap with "
                         "gradient_as_bucket_view=False")
    ddp.register_comm_hook(None, _local_bucket)
    setattr(ddp, SKIP_ATTR, True)
    return ddp


def check_not_wrapped(params: list[torch.Tensor], name: str) -> bool:
    """Raise ``ValueError`` if a ``DistributedDataParallel`` module reduces any of ``params``
    (not made safe by :func:`skip_ddp_allreduce`); return whether one made safe holds them."""
    from torch.nn.parallel import DistributedDataParallel

    owned = {id(p) for p in params}
    skipped = False
    for obj in gc.get_objects():
        # type(), not isinstance(): some objects warn when their __class__ is read
        if not issubclass(type(obj), DistributedDataParallel):
            continue
        holds = any(id(p) in owned for p in obj.module.parameters())
        if getattr(obj, SKIP_ATTR, False):
            skipped = skipped or holds
            continue
        if holds:
            raise ValueError(
                f"{name}: the model is wrapped in DistributedDataParallel, which all-reduces "
                "every gradient densely on top of the optimizer's own sparse traffic"
                + (" and, with gradient_as_bucket_view=True, counts the error-feedback "
                   "residual twice" if obj.gradient_as_bucket_view else "")
                + ". Remove the DDP wrap (the optimizer does the data-parallel communication),"
                " or, where the trainer needs it, call scape.skip_ddp_allreduce(ddp_model) "
                "(with gradient_as_bucket_view=False)")
    return skipped
