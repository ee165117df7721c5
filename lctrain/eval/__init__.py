"""Evaluation of trained checkpoints: RULER on its own data (`ruler`) or the offline RULER-style suite (`tasks`),
averaged over checkpoints (`runner`), held-out perplexity, lm-evaluation-harness tasks (`harness`), and the planned
long-context generation they decode with (`generation`)."""
