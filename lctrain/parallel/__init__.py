"""Multi-process plumbing: the parallel layout (degrees, accumulation, DeepSpeed config, sharding), process groups,
starting workers under a launcher, and DeepSpeed-Ulysses around the attention engines."""
