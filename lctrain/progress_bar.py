"""Progress of long work (prepare, eval, diagnose, check sp), on a terminal and in a log.

On a terminal it is rich's live bar. Anywhere else (nohup, a redirect, a batch scheduler's log file) that bar writes
nothing until the work ends, which leaves someone following a cluster job's log unable to tell a slow job from a hung
one; there the same columns (less the bar) are written as one plain line when work starts (a task added while no
other is under way: the first sample of a long evaluation can take minutes), every `every_s` seconds and once at the
end, each time only for the tasks that moved since their last line (a diagnosis's finished and waiting cases stay
quiet).
Training has its own per-step lines (`train.metrics.StepLogger`).

Progress is not a command's data: unless a caller hands over a console of its own, it goes where messages go
(`console.message_console`: stderr), so `lctrain eval ... > scores.txt` keeps only the scores.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.text import Text

from lctrain.console import message_console

LOG_EVERY_S = 30.0


class ProgressBar(Progress):
    """rich's `Progress` on a terminal (`shown`); in a log, a plain line of its columns every `every_s` seconds and
    at `stop()`, unless `log_lines` is False (training writes its own)."""

    def __init__(
        self,
        *columns: str | ProgressColumn,
        console: Console | None = None,
        disable: bool = False,
        every_s: float = LOG_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
        log_lines: bool = True,
        **kwargs,
    ):
        console = console or message_console()
        self.shown = not disable and (console.is_terminal or console.is_jupyter)
        self.in_log = not disable and not self.shown and log_lines
        # what is printed to stdout meanwhile goes above the bar only when stdout is on the same screen: redirected,
        # a command's data would land on the terminal instead of in its file or pipe
        on_screen = sys.stdout is not None and sys.stdout.isatty()
        super().__init__(
            *columns, console=console, disable=not self.shown, get_time=clock, redirect_stdout=on_screen, **kwargs
        )
        self.every_s, self.clock = every_s, clock
        self.last_line = clock()
        # each task's (description, completed) at its last line; one that has not moved yet has nothing to say
        self.written: dict[TaskID, tuple] = {}

    def add_task(self, description: str, *args, **kwargs) -> TaskID:
        under_way = any(not t.finished for t in self.tasks)
        task_id = super().add_task(description, *args, **kwargs)
        if self.in_log and not under_way:
            self._write_lines(starting=task_id)
        return task_id

    def update(self, task_id: TaskID, **kwargs) -> None:
        super().update(task_id, **kwargs)
        self._tick()

    def advance(self, task_id: TaskID, advance: float = 1) -> None:
        super().advance(task_id, advance)
        self._tick()

    def stop(self) -> None:
        super().stop()
        if self.in_log:
            self._write_lines()

    def _tick(self) -> None:
        if self.in_log and self.clock() - self.last_line >= self.every_s:
            self._write_lines()

    def _write_lines(self, starting: TaskID | None = None) -> None:
        self.last_line = self.clock()
        for task in self.tasks:
            state = (task.description, task.completed)
            moved = self.written.get(task.id, (task.description, 0)) != state
            if task.visible and (moved or task.id == starting):
                self.written[task.id] = state
                cells = [column(task) for column in self.columns if not isinstance(column, BarColumn)]
                line = " ".join(c.plain if isinstance(c, Text) else str(c) for c in cells)
                self.console.print(line, markup=False, highlight=False, soft_wrap=True)


def counted_bar(console: Console | None = None) -> ProgressBar:
    """The bar of work counted in items of a known total (samples, checkpoints): description, done/total, elapsed and
    remaining time."""
    return ProgressBar(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=False,
    )
