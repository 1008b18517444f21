"""The engine of the benchmarks: how runs are launched (:mod:`bench.engine.launch`)."""
