"""What the benchmarks train: the models (:mod:`bench.workloads.gpt`,
:mod:`bench.workloads.llama`) and the corpora (:mod:`bench.workloads.data`,
:mod:`bench.workloads.prose`)."""
