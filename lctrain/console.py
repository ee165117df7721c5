"""The console lctrain's commands print through: rich's, whose lines are never wrapped. rich wraps text at the
terminal's width, and at 80 columns when the output is a log file (nohup, a batch scheduler's `--output`), splitting
a path or a number across two lines that grep then misses. Tables are still laid out to the width, which outside a
terminal is `LOG_WIDTH`: at 80 a results table's cells (task names, paths) were cut onto second lines in every log.

stdout carries a command's data (a table, `plan --json -`, `show-config > frozen.yaml`, training's step lines);
warnings, notes and progress go to stderr (`say`, `message_console`), so a script reads the one without the other.
Where the terminal cannot show rich's box-drawing characters (TERM=dumb, a locale that is not UTF-8 such as LANG=C)
tables are drawn in ASCII, and so is typer's --help (`lctrain.compat.typer.ascii_help`). A reader that goes away
(`lctrain train | head`) ends nothing (`survive_closed_outputs`)."""

from __future__ import annotations

import functools
import io
import os
import sys
from typing import TYPE_CHECKING

from lctrain.lifetime import is_supervised

if TYPE_CHECKING:
    from rich.console import Console

# Wide enough for the widest table lctrain prints (eval's per-checkpoint scores, report's modes x lengths); a table
# takes only the width it needs.
LOG_WIDTH = 200

STDOUT_CLOSED = (
    "note: stdout was closed by its reader; lctrain goes on without writing to it (a training run's metrics and "
    "checkpoints are in its run directory)"
)


def launched_rank() -> bool:
    """A rank that lctrain's own launcher started (`parallel.launch.run_on_ranks`): its stderr is the launcher's log
    (RUN/ranks/launcher.log), so what the user must see goes to stdout, the one stream it shares with the command."""
    return is_supervised() and "RANK" in os.environ


def _utf8_locale() -> bool:
    """Whether the environment's locale (LC_ALL, else LC_CTYPE, else LANG) has UTF-8 characters; none set counts as
    UTF-8, as Python takes it (PEP 538). Under LANG=C Python itself sets LC_CTYPE=C.UTF-8 and turns on its UTF-8
    mode: that LC_CTYPE is Python's, not the user's, and says nothing of what the terminal shows."""
    python_set_ctype = sys.flags.utf8_mode and "PYTHONUTF8" not in os.environ and "utf8" not in sys._xoptions
    for var in ("LC_ALL", "LC_CTYPE", "LANG"):
        name = os.environ.get(var)
        if name and not (var == "LC_CTYPE" and python_set_ctype):
            return "utf-8" in name.lower() or "utf8" in name.lower()
    return True


def plain_terminal() -> bool:
    """Whether the terminal cannot show rich's box-drawing characters: TERM=dumb, or a locale without UTF-8."""
    return os.environ.get("TERM") == "dumb" or not _utf8_locale()


@functools.cache
def _console_class() -> type[Console]:
    """rich's console whose encoding reads as ASCII where the terminal cannot show rich's box-drawing characters
    (TERM=dumb, a locale without UTF-8): rich then draws tables and bars in ASCII instead of mojibake. Made on first
    use: `lctrain.cli` imports this module for `survive_closed_outputs`, and rich costs every command's start-up."""
    from rich.console import Console

    class PlainConsole(Console):
        @property
        def encoding(self) -> str:
            if plain_terminal():
                return "ascii"
            return super().encoding

    return PlainConsole


def plain_console(**kwargs) -> Console:
    """`kwargs`: rich's own (`stderr=True`, `width=...`). Outside a terminal, without `width` or `COLUMNS`, tables
    are laid out to `LOG_WIDTH` columns."""
    console = _console_class()(highlight=False, soft_wrap=True, **kwargs)
    if "width" not in kwargs and "COLUMNS" not in os.environ and not console.is_terminal:
        console.width = LOG_WIDTH
    return console


def message_console(**kwargs) -> Console:
    """The console of progress and messages: stderr (stdout in a `launched_rank`)."""
    return plain_console(stderr=not launched_rank(), **kwargs)


def say(text: str) -> None:
    """A warning or a note, as one line on stderr (stdout in a `launched_rank`), written at once."""
    print(text, file=sys.stdout if launched_rank() else sys.stderr, flush=True)


class _Descriptor(io.RawIOBase):
    """File descriptor 1 or 2 under sys.stdout or sys.stderr. When its reader has gone away (a pipe closed: `| head`,
    a pager quit) the write that finds out points the descriptor at /dev/null, so every later write, ours or a
    library's or native code's, succeeds without a sound and the work goes on; a closed stdout is said once on
    stderr."""

    def __init__(self, fd: int):
        super().__init__()
        self.fd = fd
        self.name = ("<stdout>", "<stderr>")[fd - 1]

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self.fd

    def isatty(self) -> bool:
        return os.isatty(self.fd)

    def write(self, data) -> int:
        try:
            return os.write(self.fd, data)
        except BrokenPipeError:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self.fd)
            os.close(devnull)
            if self.fd == 1 and sys.stderr is not None:
                sys.stderr.write(STDOUT_CLOSED + "\n")
                sys.stderr.flush()
            return len(data)


def survive_closed_outputs() -> None:
    """Put sys.stdout and sys.stderr on `_Descriptor`s, for the life of this process (a command's `main`; libraries
    imported after it keep these streams): a closed reader then ends no command, not even a training whose console
    is piped into `head`. The encoding stays; characters it lacks (PYTHONIOENCODING=ascii) are written as escapes
    instead of failing the command. A stream that is not the interpreter's own (a test's capture) is left alone."""
    for name, fd in (("stdout", 1), ("stderr", 2)):
        stream = getattr(sys, name)
        if stream is None or stream is not getattr(sys, f"__{name}__"):
            continue
        stream.flush()
        guarded = io.TextIOWrapper(
            io.BufferedWriter(_Descriptor(fd)),
            encoding=stream.encoding,
            errors="backslashreplace" if stream.errors == "strict" else stream.errors,
            line_buffering=stream.line_buffering,
            write_through=stream.write_through,
        )
        setattr(sys, name, guarded)


def no_library_bars() -> None:
    """Turn off Hugging Face's progress bars (transformers' "Loading weights", the hub's) for this process: lctrain's
    commands show their own progress, which a library's bar would tear through, and in a log file a bar is a line
    of carriage returns."""
    # transformers on use: the console is imported by commands that never load it (start-up time)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
