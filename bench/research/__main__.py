"""Run a benchmark job with the research registered (:mod:`bench.research`: its rules, the
``-follow<q>`` and ``-drift`` rows), e.g.::

    python -m bench.research bench.lr_sweep --optimizers adams scape-0.99@early_lead
    python -m bench.research bench.step_compute --update catchup_agree_accum

The first argument is the job's module; the rest go to its ``main(argv)``.
"""

from __future__ import annotations

import importlib
import sys

import bench.research  # noqa: F401 (registers the research)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    job = importlib.import_module(argv[0])
    sys.argv = [argv[0], *argv[1:]]  # the job's usage lines name the job
    return int(job.main(argv[1:]) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
