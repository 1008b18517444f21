"""The engine of the benchmarks: one run configuration (:mod:`bench.engine.run_config`), one
launcher (:mod:`bench.engine.launch`), the body of a rank (:mod:`bench.engine.run_rank`), the
driver that summarizes a run (:mod:`bench.engine.runner`), the optimizers it builds
(:mod:`bench.engine.optimizers`), and what they need: communication counters, a communicator
that moves nothing, emulated nodes in network namespaces, tables and plots."""
