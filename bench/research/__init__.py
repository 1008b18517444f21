"""The research side of SCAPE: rules and schedules that are not part of the library's product
surface. Everything here plugs into ``scape`` through its public API (``scape.rules.register``,
the optimizer's public attributes) and into the benchmarks' engine through its registries; the
library and the engine import nothing from here.

Importing this package registers the research: the research rules (:mod:`bench.research.rules`,
``scape.SCAPE(..., update="catchup_agree_trust2_accum")`` works afterwards), the research's
rows of the benchmark jobs (:mod:`bench.research.sweep_rows`, into
:data:`bench.engine.rows.ROWS`), and its own name in :data:`bench.engine.run_config.PLUGINS`, so
the ranks of every run built while it is loaded import it too. ``python -m bench.research
bench.lr_sweep ARGS`` runs a job with it.

- :mod:`bench.research.rows`: the rows of the convergence ablation (``python -m
  bench.research.convergence --variants NAME``) and the schedules they run (ramps, the measured
  per-group split, the lr-following bound).
- :mod:`bench.research.allot`: the per-group split of one sparsity budget, made from outside
  the optimizer.
- :mod:`bench.research.rotate`: training in a transform domain (the ``-dct64`` rows).
- :mod:`bench.research.drift`, :mod:`bench.research.follow`: the rank hooks of the ``-drift``
  and ``-follow1`` rows (``RunConfig.hooks``).
- :mod:`bench.research.global_view`: a diagnostic rank hook whose owner observes the whole
  batch's gradient, not its own share (what 1/W of the batch costs the masks).
- :mod:`bench.research.update_codes`: a rank hook on the 8-bit parameter wire that records
  its rows' statistics and can code them as fp8 e4m3 instead (the ``*_e4m3_*`` rows).
- :mod:`bench.research.update_rounding`: a rank hook on the fp32 parameter wire that rounds
  each sent update to a chosen number of mantissa bits (the ``g2000_pr*`` rows).
- :mod:`bench.research.workload3`: the third workload's protocol (best lr, two seeds, steps to
  reach dense AdamS's loss) and its plot, from ``bench/results/workload3_headers_bpe.json``.
"""

from bench.engine import run_config
from bench.research import (
    rules,  # noqa: F401 (registers the research rules on import)
    sweep_rows,  # noqa: F401 (registers the research's rows on import)
)

if __name__ not in run_config.PLUGINS:
    run_config.PLUGINS.append(__name__)
