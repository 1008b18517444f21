"""A research hook on the fp32 parameter wire: each sent update rounded to a chosen precision.

On the fp32 wire a sparse step's owner sends its master's new values at its mask entries and
every rank stores them. For ``RunConfig.hooks`` (``{"bench.research.update_rounding:factory":
{"bits": 10}}``) this hook makes the owner send instead ``model + round(master - model)`` at
those entries, ``round`` keeping ``bits`` of the update's 23 fp32 mantissa bits (round to
nearest, ties to even; the exponent is fp32's, so no scale, no range limit and no zero level:
each entry's relative error is at most ``2**-(bits + 1)``; an entry the rounding leaves as
it was is sent exactly as the library sends it, so ``bits=23`` is the library). Every rank
stores the same fp32 values, so the replicas stay identical (the wire's bytes are the fp32
wire's: this measures what an update's precision costs the training, not a code's bytes):

- with ``carry=False`` (the default) the owner sets its master to the value sent: each send's
  rounding error is dropped, the model copy equals the master after every send, as
  ``bench.research.update_codes``' ``follow=True`` does for the 8-bit codes;
- with ``carry=True`` the master keeps its value: the error waits in ``master - model`` for
  the entry's next send, as the library's 8-bit wire carries it.

With ``stochastic=True`` the rounding is stochastic instead (the kept mantissa rounded up
with the probability of the dropped part, from a generator seeded by the rank: unbiased per
entry and send, each error under one unit of the kept mantissa), which tells an error that
repeats its sign at an entry from one that does not.

``bits=3`` is e4m3's mantissa without its range; ``bits=7`` bf16's, ``bits=10`` fp16's. A
dose-response of the coded updates' cost (docs/research.md, "The coded updates' gaps"), not
a way to train.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from scape.kernels import gather, scatter_

FP32_MANTISSA = 23
"""fp32's explicit mantissa bits."""


def round_mantissa(x: torch.Tensor, bits: int,
                   generator: torch.Generator | None = None) -> torch.Tensor:
    """fp32 ``x`` with its mantissa rounded to ``bits`` bits, in place of ``x``'s bits: to
    nearest, ties to even, or with ``generator`` stochastically (each magnitude rounded up
    with the probability of the dropped bits' share of a kept unit, so the result's
    expectation is ``x``); ``bits=23`` leaves ``x`` unchanged. Finite inputs whose rounding
    stays finite only (a carry past fp32's largest exponent would make inf)."""
    if x.dtype != torch.float32:
        raise TypeError(f"round_mantissa takes fp32; got {x.dtype}")
    drop = FP32_MANTISSA - bits
    if drop == 0:
        return x
    i = x.view(torch.int32)
    if generator is None:  # half a unit, less one where the kept bit is even (ties to even)
        lsb = torch.bitwise_and(torch.bitwise_right_shift(i, drop), 1)
        i.add_(lsb + ((1 << (drop - 1)) - 1))  # two's-complement add = the magnitude's add
    else:  # up with the probability of the dropped part
        i.add_(torch.randint(0, 1 << drop, x.shape, generator=generator, dtype=torch.int32,
                             device=x.device))
    i.bitwise_and_(~((1 << drop) - 1))
    return x


class UpdateRounding:
    """The hook's state; built, it gives ``opt`` a copy of its rule whose ``update`` rounds
    (module docstring)."""

    def __init__(self, opt: Any, bits: int, carry: bool, stochastic: bool = False) -> None:
        self.bits, self.carry, self.stochastic = bits, carry, stochastic
        self.sends, self.entries = 0, 0
        generator = torch.Generator(device=opt.buckets[0].device)
        generator.manual_seed(1_000_003 + opt.comm.rank)
        rule_update = opt.rule.update
        hook = self

        def update(shard: Any, g: torch.Tensor, rows: torch.Tensor, block_size: int,
                   hp: dict, values: torch.Tensor) -> Any:
            out = rule_update(shard, g, rows, block_size, hp, values)
            b = opt.buckets[next(i for i, s in enumerate(opt.shards) if s is shard)]
            model = gather(b.param_flat[b.shard], rows, block_size, out_dtype=torch.float32)
            delta = values.sub(model)
            rounded = round_mantissa(delta.clone(), hook.bits,
                                     generator if hook.stochastic else None)
            # an entry its rounding leaves as it was keeps its exact value (23 bits: the library)
            values.copy_(torch.where(rounded == delta, values, model.add_(rounded)))
            if not hook.carry:
                scatter_(shard.master, rows, block_size, values)
            hook.sends += 1
            hook.entries += values.numel()
            return out

        opt.rule = dataclasses.replace(opt.rule, update=update)  # a frozen dataclass

    def after_step(self, step: int) -> None:
        """``RunConfig.hooks``' call after each step: nothing to do."""

    def result(self) -> dict[str, Any]:
        return {"bits": self.bits, "carry": self.carry, "stochastic": self.stochastic,
                "sends": self.sends, "entries": self.entries}


def factory(cfg: Any, module: torch.nn.Module, opt: Any, bits: int = 10,
            carry: bool = False, stochastic: bool = False) -> UpdateRounding:
    """``RunConfig.hooks`` factory (module docstring): ``bits`` in 1..23 of each sent update's
    mantissa kept; ``carry`` keeps each send's error in the master for the entry's next send
    instead of dropping it; ``stochastic`` rounds stochastically. Needs ``scape.SCAPE`` on
    the fp32 wire with an fp32 model."""
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= FP32_MANTISSA:
        raise ValueError(f"bench.research.update_rounding: bits must be an int in 1..23; "
                         f"got {bits!r}")
    for name, flag in (("carry", carry), ("stochastic", stochastic)):
        if not isinstance(flag, bool):
            raise ValueError(f"bench.research.update_rounding: {name} must be a bool; "
                             f"got {flag!r}")
    if getattr(opt, "param_comm_dtype", 0) is not None or not hasattr(opt, "rule"):
        raise ValueError("bench.research.update_rounding needs scape.SCAPE on the fp32 "
                         "parameter wire (param_comm_dtype=None); got "
                         f"{type(opt).__name__} with "
                         f"{getattr(opt, 'param_comm_dtype', None)!r}")
    if any(b.dtype != torch.float32 for b in opt.buckets):
        raise ValueError("bench.research.update_rounding needs an fp32 model")
    return UpdateRounding(opt, bits, carry, stochastic)
