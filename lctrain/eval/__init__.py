"""Evaluation and diagnostics: RULER-style long-context tasks averaged over checkpoints (`runner`), held-out
perplexity, the RoPE-drift diagnostic of the paper's Section 2 (`rope_drift`), dataset inspection and the training-time
estimate. Each command's stage function is imported lazily by the CLI."""
