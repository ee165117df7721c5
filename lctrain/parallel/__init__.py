"""Multi-process plumbing: the parallel layout (a pure value: degrees, ranks, head splitting), process groups,
starting workers under a launcher, and DeepSpeed-Ulysses around the attention engines."""
