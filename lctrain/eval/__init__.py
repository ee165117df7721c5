"""Evaluation and diagnostics: RULER on its own data (`ruler`) or the offline RULER-style suite (`tasks`), averaged
over checkpoints (`runner`), held-out perplexity, the RoPE-drift diagnostic of the paper's Section 2 (`rope_drift`),
dataset inspection and the training-time estimate. Each command's stage function is imported lazily by the CLI."""
