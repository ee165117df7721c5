"""ProgressBar: rich's live bar on a terminal; in a log, a plain line of the same columns every `every_s` seconds and
at the end (where the live bar would write nothing until the end). Against a fake clock."""

import io

from rich.console import Console
from rich.progress import BarColumn, TextColumn, TimeElapsedColumn

from lctrain.progress_bar import ProgressBar, counted_bar


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def out_console(out) -> Console:
    return Console(file=out, force_terminal=False, width=200)


def prepare_like_bar(console, clock) -> ProgressBar:
    return ProgressBar(
        TextColumn("[bold]prepare"),
        BarColumn(),
        TextColumn("{task.completed:,}/{task.total:,} tokens"),
        TextColumn("{task.fields[docs]:,} docs"),
        TimeElapsedColumn(),
        console=console,
        every_s=30,
        clock=clock,
    )


def test_in_a_log_a_plain_line_every_interval_and_at_the_end():
    out, clock = io.StringIO(), Clock()
    console = Console(file=out, force_terminal=False, width=200)
    with prepare_like_bar(console, clock) as bar:
        assert bar.in_log
        task = bar.add_task("prepare", total=10000, docs=0)
        for t, done, docs in [(10, 1000, 3), (29, 2000, 6), (31, 3000, 9), (45, 4000, 12), (62, 5000, 15)]:
            clock.now = 1000 + t
            bar.update(task, completed=done, docs=docs)
        clock.now = 1070
        bar.advance(task, 500)
    assert out.getvalue().splitlines() == [
        "prepare 0/10,000 tokens 0 docs 0:00:00",
        "prepare 3,000/10,000 tokens 9 docs 0:00:31",
        "prepare 5,000/10,000 tokens 15 docs 0:01:02",
        "prepare 5,500/10,000 tokens 15 docs 0:01:10",
    ]


def test_in_a_log_only_the_tasks_that_moved():
    """Three cases run one after another (as `diagnose rope` does): a line when the work starts, then for the cases
    that moved since their last one, never for those waiting or done."""
    out, clock = io.StringIO(), Clock()
    columns = TextColumn("{task.description} {task.completed}/{task.total}")
    with ProgressBar(columns, console=out_console(out), clock=clock) as bar:
        jobs = [bar.add_task(case, total=4) for case in ("fp32", "bf16", "random")]
        for t, job, n in [(31, 0, 2), (40, 0, 2), (62, 1, 4), (70, 2, 1)]:
            clock.now = 1000 + t
            bar.advance(jobs[job], n)
    assert out.getvalue().splitlines() == ["fp32 0/4", "fp32 2/4", "fp32 4/4", "bf16 4/4", "random 1/4"]


def test_in_a_log_a_line_when_work_starts_after_earlier_work_ended():
    """eval: its samples are generated, then its checkpoints evaluated; the second task's start has its own line, a
    task added beside one under way waits for its first move."""
    out, clock = io.StringIO(), Clock()
    columns = TextColumn("{task.description} {task.completed}/{task.total}")
    with ProgressBar(columns, console=out_console(out), clock=clock) as bar:
        bar.advance(bar.add_task("generating", total=2), 2)
        clock.now += 5
        evaluating = bar.add_task("evaluating", total=3)
        bar.add_task("beside", total=1)
        clock.now += 31
        bar.advance(evaluating)
    assert out.getvalue().splitlines() == ["generating 0/2", "generating 2/2", "evaluating 0/3", "evaluating 1/3"]


def test_on_a_terminal_the_live_bar_and_no_plain_lines():
    out, clock = io.StringIO(), Clock()
    console = Console(file=out, force_terminal=True, width=200)
    with prepare_like_bar(console, clock) as bar:
        assert not bar.in_log
        task = bar.add_task("prepare", total=10000, docs=0)
        clock.now = 1100
        bar.update(task, completed=5000, docs=15)
    text = out.getvalue()
    assert "━" in text and "\x1b[" in text  # the bar, drawn with the terminal's escapes
    assert "prepare 5,000/10,000 tokens 15 docs 0:01:40\n" not in text


def test_disabled_writes_nothing_anywhere():
    """As on the ranks other than 0."""
    for terminal in (False, True):
        out = io.StringIO()
        with ProgressBar(TextColumn("x"), console=Console(file=out, force_terminal=terminal), disable=True) as bar:
            bar.update(bar.add_task("x", total=1), advance=1)
        assert out.getvalue() == "" and not bar.in_log


def test_the_counted_bar_in_a_log_ends_with_its_line():
    out = io.StringIO()
    with counted_bar(Console(file=out, force_terminal=False, width=200)) as bar:
        bar.advance(bar.add_task("ruler 4096", total=8), 2)
    lines = out.getvalue().splitlines()
    assert [line.split()[:3] for line in lines] == [["ruler", "4096", "0/8"], ["ruler", "4096", "2/8"]]
