"""Output paths a command cannot write (a file where a directory must go, a special filesystem, a symbolic link to
nothing, a read-only directory): one line naming the option, the path and what to do, exit code 2, before the work
and with nothing written (lctrain/errors.py `output_dir` and `output_path`), for every command given one."""

import os
import sys
from pathlib import Path

import pytest
from test_plot_runs import fake_run
from test_report import fake_evaluated
from train_helpers import one_error_line, set_args
from typer.testing import CliRunner

from lctrain.cli import app
from lctrain.config import load_config
from lctrain.errors import UserError, output_dir

TINY = [
    "data.seq_len=128",
    "data.token_budget=6000",
    "model.arch={model_type: llama, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 1, "
    "num_attention_heads: 2, num_key_value_heads: 1, tie_word_embeddings: true}",
]
CHECK_SP = [
    "data.seq_len=128",
    "model.arch={model_type: llama, hidden_size: 64, intermediate_size: 128, num_hidden_layers: 1, "
    "num_attention_heads: 4, num_key_value_heads: 1}",
    "model.dtype=float32",
]
INIT = ["init", "--model", "meta-llama/Llama-2-7b-hf", "--seq-len", "32768", "--gpus", "8"]
AS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, Path]:
    """What the commands read: a trained run (plot), an evaluated one (report), a prepared dataset (inspect)."""
    from lctrain.data.prepare import prepare

    root = tmp_path_factory.mktemp("inputs")
    prepare(load_config(None, TINY + [f"data.output_dir={root / 'data'}"]))
    return {
        "run": fake_run(root, "trained", "full", [10.4, 9.1]),
        "evaluated": fake_evaluated(root, "evaluated", "anchor"),
        "data": root / "data",
    }


# command -> (its arguments with the output path `out`, the option naming it (None: an argument), the output's name)
COMMANDS = {
    "estimate": (lambda out, i: ["estimate", "--tflops", "100", "--out", out], "--out", "estimate.json"),
    "estimate --measure": (lambda out, i: ["estimate", "--measure", "--tflops", "100", "--out", out], "--out", "m"),
    "example-text": (lambda out, i: ["example-text", out], None, "shipped.jsonl"),
    "example-model": (lambda out, i: ["example-model", out], None, "model"),
    "plot": (lambda out, i: ["plot", str(i["run"]), "--out", out], "--out", "curves.png"),
    "report": (lambda out, i: ["report", str(i["evaluated"]), "--out", out], "--out", "report"),
    "inspect": (lambda out, i: ["inspect", str(i["data"]), "--out", out], "--out", "inspect"),
    "diagnose rope": (lambda out, i: ["diagnose", "rope", "tiny_anchor", "--out", out], "--out", "rope"),
    "check sp": (lambda out, i: ["check", "sp", "--out", out, *set_args(CHECK_SP)], "--out", "check_sp"),
    "init": (lambda out, i: [*INIT, "--out", out], "--out", "llama.yaml"),
    "plan --json": (lambda out, i: ["plan", "--json", out], "--json", "plan.json"),
}


def bad_place(kind: str, tmp_path: Path) -> tuple[Path, str]:
    """A directory that cannot be created, and the words that say why."""
    if kind == "under a file":
        (tmp_path / "afile").write_text("mine")
        return (
            tmp_path / "afile" / "sub",
            f"cannot create the directory (Not a directory): {tmp_path / 'afile'} is a file",
        )
    if kind == "under /proc":
        if not sys.platform.startswith("linux"):
            pytest.skip("/proc is Linux's")
        return Path("/proc/lctrain-test/sub"), "(No such file or directory): /proc takes no new directories"
    if kind == "through a dangling link":
        target = tmp_path / "missing" / "results"
        (tmp_path / "link").symlink_to(target)
        why = f"{tmp_path / 'link'} is a symbolic link to {target}, which does not exist"
        return tmp_path / "link" / "sub", f"{why}; create {target} or remove the link"
    if AS_ROOT:
        pytest.skip("root writes into read-only directories")
    (tmp_path / "ro").mkdir()
    (tmp_path / "ro").chmod(0o555)
    return tmp_path / "ro" / "sub", "cannot create the directory (Permission denied); fix the permissions"


@pytest.mark.parametrize("kind", ["under a file", "under /proc", "through a dangling link", "under a read-only dir"])
@pytest.mark.parametrize("command", COMMANDS)
def test_an_output_that_cannot_be_created_is_one_line_and_nothing_is_written(
    command, kind, inputs, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("lctrain.diagnostics.check_sp.allowed_processes", lambda: 8)  # the same on any machine
    args, option, name = COMMANDS[command]
    place, why = bad_place(kind, tmp_path)
    out = place / name
    before = sorted(tmp_path.rglob("*"))
    line = one_error_line(CliRunner().invoke(app, args(str(out), inputs)))
    named = f"{option} {out}" if option else str(out)
    assert line.startswith(f"error: {named}: ") and why in line, line
    assert sorted(tmp_path.rglob("*")) == before


@pytest.mark.parametrize("command", COMMANDS)
def test_a_dangling_link_as_the_output_names_its_target(command, inputs, tmp_path, monkeypatch):
    """mkdir's own error on a link to nothing read "File exists"; written through, a file failed or made the target's
    directories; renamed over, the link was lost."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("lctrain.diagnostics.check_sp.allowed_processes", lambda: 8)
    args, option, name = COMMANDS[command]
    target = tmp_path / "missing" / "results"
    (tmp_path / name).symlink_to(target)
    line = one_error_line(CliRunner().invoke(app, args(name, inputs)))
    named = f"{option} {name}" if option else name
    assert line == (
        f"error: {named}: a symbolic link to {target}, which does not exist; create {target} or remove the link"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]  # the link alone, its target not made


def test_a_relative_link_is_named_from_its_own_directory(tmp_path):
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "latest").symlink_to("gone")
    with pytest.raises(UserError, match=f"to {tmp_path / 'runs' / 'gone'}, which does not exist"):
        output_dir(tmp_path / "runs" / "latest" / "inspect")


@pytest.mark.skipif(AS_ROOT, reason="root writes into read-only directories")
def test_an_existing_directory_that_cannot_be_written_into_is_refused(tmp_path):
    (tmp_path / "ro").mkdir()
    (tmp_path / "ro").chmod(0o555)
    with pytest.raises(UserError, match=f"--out {tmp_path / 'ro'}: the directory {tmp_path / 'ro'} is not writable"):
        output_dir(tmp_path / "ro")


def test_an_output_that_can_be_created_is(tmp_path):
    assert output_dir(tmp_path / "a" / "b").is_dir()
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    assert output_dir(tmp_path / "link" / "c").is_dir() and (tmp_path / "real" / "c").is_dir()
