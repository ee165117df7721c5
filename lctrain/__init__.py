"""lctrain: long-context continual pretraining with AnchorAttention (arXiv 2411.13476)."""

__version__ = "0.1.0"
