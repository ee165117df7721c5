"""The console lctrain's commands print through: rich's, whose lines are never wrapped. rich wraps text at the
terminal's width, and at 80 columns when the output is a log file (nohup, a batch scheduler's `--output`), splitting
a path or a number across two lines that grep then misses. Tables are still laid out to the width, which outside a
terminal is `LOG_WIDTH`: at 80 a results table's cells (task names, paths) were cut onto second lines in every log."""

import os

from rich.console import Console

# Wide enough for the widest table lctrain prints (eval's per-checkpoint scores, report's modes x lengths); a table
# takes only the width it needs.
LOG_WIDTH = 200


def plain_console(**kwargs) -> Console:
    """`kwargs`: rich's own (`stderr=True`, `width=...`). Outside a terminal, without `width` or `COLUMNS`, tables
    are laid out to `LOG_WIDTH` columns."""
    console = Console(highlight=False, soft_wrap=True, **kwargs)
    if "width" not in kwargs and "COLUMNS" not in os.environ and not console.is_terminal:
        console.width = LOG_WIDTH
    return console


def no_library_bars() -> None:
    """Turn off Hugging Face's progress bars (transformers' "Loading weights", the hub's) for this process: lctrain's
    commands show their own progress, which a library's bar would tear through, and in a log file a bar is a line
    of carriage returns."""
    # transformers on use: the console is imported by commands that never load it (start-up time)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
