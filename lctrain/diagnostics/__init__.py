"""Numerical diagnostics of the training setup: RoPE in bf16 (the paper's Figures 1 and 7, `rope_drift`) on real text
(`probe_text`), and sequence parallelism against one process (Table 8, `check_sp`)."""
