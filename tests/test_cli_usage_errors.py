"""A command-line error (unknown option, wrong type, missing argument) is one line on stderr with exit code 2, as
lctrain's own errors are; typer's standalone mode drew it in a box under the usage."""

import subprocess
import sys

import pytest

from lctrain.cli import app
from lctrain.compat import typer as compat_typer


def run(capsys, *args: str) -> tuple[int, str, str]:
    code = compat_typer.run(app, list(args), prog_name="lctrain")
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(
    "args, line",
    [
        (
            ["plan", "--gpumem", "3"],
            "error: No such option: --gpumem (Possible options: --gpu-mem); see 'lctrain plan --help'",
        ),
        (["eval"], "error: Missing argument 'target'; see 'lctrain eval --help'"),
        (["nosuch"], "error: No such command 'nosuch'; see 'lctrain --help'"),
    ],
    ids=["unknown-option", "missing-argument", "unknown-command"],
)
def test_a_command_line_error_is_one_line_and_exit_2(capsys, args, line):
    code, out, err = run(capsys, *args)
    assert (code, out, err) == (2, "", line + "\n")


def test_a_value_of_the_wrong_type_names_the_option(capsys):
    code, out, err = run(capsys, "plan", "-c", "tiny_anchor", "--gpu-mem", "abc")
    assert code == 2 and out == "" and err.count("\n") == 1
    assert err.startswith("error: Invalid value for '--gpu-mem': ") and "'lctrain plan --help'" in err


def test_no_command_prints_the_help_and_lctrains_own_errors_and_successes_keep_their_codes(capsys):
    code, out, err = run(capsys)
    assert code == 2 and "Usage: lctrain" in out and "prepare" in out and err == ""
    code, out, err = run(capsys, "plan", "-c", "no-such-config")
    assert code == 2 and err.startswith("error: config 'no-such-config' not found") and err.count("\n") == 1
    code, out, err = run(capsys, "configs")
    assert code == 0 and "tiny_anchor" in out and err == ""


def test_the_installed_command_exits_with_the_code():
    cmd = [sys.executable, "-c", "from lctrain.cli import main; main()", "plan", "--gpumem", "3"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert (
        proc.stderr.splitlines()[-1]
        == "error: No such option: --gpumem (Possible options: --gpu-mem); see 'lctrain plan --help'"
    )
