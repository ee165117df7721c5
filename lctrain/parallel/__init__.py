"""Multi-process plumbing: process groups, the self-relaunch, Ulysses sequence parallelism, the DeepSpeed config,
the step-normalised loss."""
