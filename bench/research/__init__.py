"""The research side of SCAPE: rules and schedules that are not part of the library's product
surface. Everything here plugs into ``scape`` through its public API (``scape.rules.register``,
the optimizer's public attributes); the library imports nothing from here.

- :mod:`bench.research.rules`: the research rules; ``import bench.research.rules`` registers
  every one under its name, so ``scape.SCAPE(..., update="catchup_agree_trust2_accum")`` works
  afterwards (docs/research.md). :mod:`bench.engine.optimizers` imports it for every benchmark.
- :mod:`bench.research.rows`: the rows of the convergence ablation (``python -m
  bench.convergence --variants NAME``) and the schedules they run (ramps, the measured
  per-group split, the lr-following bound).
- :mod:`bench.research.allot`: the per-group split of one sparsity budget, made from outside
  the optimizer.
- :mod:`bench.research.rotate`: training in a transform domain (the ``-dct64`` rows).
"""
