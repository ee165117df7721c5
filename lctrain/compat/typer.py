"""typer's command-line errors and the console of its help, written against typer 0.29.2, which vendors click as the
private `typer._click` (earlier releases raise click's own exceptions, which the same names reach)."""

from __future__ import annotations

import sys

import typer

try:
    from typer._click import exceptions as click_exceptions
except ImportError:  # typer before it vendored click
    from click import exceptions as click_exceptions


def run(app, args: list[str], prog_name: str) -> int:
    """Run the typer `app` and return its exit code, a command-line error (an unknown option, a value of the wrong
    type, a missing argument) written as one line on stderr, as lctrain's own errors are: typer's standalone mode
    draws it in a box under the usage, wrapped at the terminal's width, which a log cannot grep."""
    try:
        # standalone_mode=False: errors are raised to here, and typer.Exit's code is returned
        result = app(args=args, prog_name=prog_name, standalone_mode=False)
    except click_exceptions.NoArgsIsHelpError as e:  # a group given no command: its help (rich's is printed already)
        if e.format_message():
            print(e.format_message(), file=sys.stderr)
        return e.exit_code
    except click_exceptions.UsageError as e:
        where = f"; see '{e.ctx.command_path} --help'" if e.ctx is not None else ""
        print(f"error: {e.format_message().rstrip('.')}{where}", file=sys.stderr)
        return e.exit_code
    except click_exceptions.ClickException as e:
        print(f"error: {e.format_message()}", file=sys.stderr)
        return e.exit_code
    except typer.Abort:  # end of input at a prompt
        print("aborted", file=sys.stderr)
        return 1
    return result if isinstance(result, int) else 0


class _AsciiText:
    """A text stream whose encoding reads as ASCII, every other character written as a backslash escape (as Python
    writes them under PYTHONIOENCODING=ascii)."""

    encoding = "ascii"

    def __init__(self, stream):
        self._stream = stream

    def write(self, text: str) -> int:
        return self._stream.write(text.encode("ascii", "backslashreplace").decode("ascii"))

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def ascii_help() -> None:
    """typer's --help in ASCII, for a terminal that shows no more (`lctrain.console.plain_terminal`): rich draws its
    panels' boxes in ASCII on a console whose file's encoding is ASCII, and the help texts' other characters (a '§',
    a 'Δ') are written as escapes. typer builds that console in the private `rich_utils._get_rich_console`; imported
    here, not at start-up: rich costs every command's start-up."""
    from typer import rich_utils

    typers_console = rich_utils._get_rich_console

    def ascii_console(stderr: bool = False):
        console = typers_console(stderr=stderr)
        console.file = _AsciiText(console.file)
        return console

    rich_utils._get_rich_console = ascii_console
