"""The console lctrain's commands print through: rich's, whose lines are never wrapped. rich wraps text at the
terminal's width, and at 80 columns when the output is a log file (nohup, a batch scheduler's `--output`), splitting
a path or a number across two lines that grep then misses. Tables are still laid out to the width."""

from rich.console import Console


def plain_console(**kwargs) -> Console:
    """`kwargs`: rich's own (`stderr=True`, `width=...`)."""
    return Console(highlight=False, soft_wrap=True, **kwargs)
