"""`lctrain --version`: what a bug report needs, read from the installed packages' metadata."""

import importlib.metadata
import platform
from pathlib import Path

from typer.testing import CliRunner

import lctrain
from lctrain.cli import app


def test_version_names_lctrain_python_and_the_libraries_that_run_the_step():
    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0
    line = result.output.strip()
    assert line.startswith(f"lctrain {lctrain.__version__} (python {platform.python_version()}, ")
    assert f"torch {importlib.metadata.version('torch')}" in line
    assert "flash-attn " in line  # installed or not, it is named
    assert importlib.metadata.version("lctrain") == lctrain.__version__  # the package's version has one home
    # an editable install from a git checkout names its commit (`git describe`), which its version cannot
    checkout = (Path(lctrain.__file__).resolve().parent.parent / ".git").exists()
    assert ("; source " in line) == checkout and line.endswith(")")
