"""Run directories copied (`cp -a`) or moved with their project: their config.yaml keeps the train.run_dir and
workdir of the place they came from. Every command lctrain advises must act on the directory the user named, and
`train --config COPY/config.yaml` must not start over the run it was copied from. Reference: the original run's own
files, untouched, and the copy's metrics after following the advice word for word."""

import shlex
import shutil
from pathlib import Path

import pytest
from train_helpers import one_error_line, prepared_workdir, set_args, tiny_run
from typer.testing import CliRunner

from lctrain.cli import app
from lctrain.config import data_dir, load_config
from lctrain.data.manifest import MANIFEST
from lctrain.errors import UserError
from lctrain.rundir import RunDir
from lctrain.train.data import open_checked

tiny = tiny_run


def written_run(path: Path, *overrides: str) -> RunDir:
    """A run directory as `train` leaves it before its first step: its config.yaml, with `workdir`."""
    rd = RunDir(path)
    rd.write_config(load_config(None, [f"train.run_dir={path}", *overrides]))
    return rd


def copied(rd: RunDir, to: Path) -> RunDir:
    shutil.copytree(rd.path, to, symlinks=True)
    return RunDir(to)


def error_command(line: str) -> list[str]:
    """The command an error line advises, after its last "with " or "as in " and in its quotes (single, or double
    where a shell-quoted path is inside: `errors.cited`), as argv."""
    at, opener = max((line.rfind(f"{w} {q}") + len(w) + 1, q) for w in ("with", "as in") for q in "'\"")
    return shlex.split(line[at + 1 : line.rindex(opener)])


def test_a_copy_without_checkpoints_is_told_to_start_over_in_itself(tmp_path):
    original = written_run(tmp_path / "orig")
    original.append_metrics({"step": 1, "loss": 1.0})
    copy = copied(original, tmp_path / "my copy")
    result = CliRunner().invoke(app, ["resume", str(copy.path)])
    line = one_error_line(result)
    assert f"{copy.path}: no complete checkpoint to resume from" in line
    argv = error_command(line)
    assert argv == [
        "lctrain",
        "train",
        "--config",
        str(copy.config_file),
        "--set",
        f"train.run_dir={copy.path}",
        "--force",
    ]
    # its own run: the command as it was, no override
    lone = one_error_line(CliRunner().invoke(app, ["resume", str(original.path)]))
    assert error_command(lone) == ["lctrain", "train", "--config", str(original.config_file), "--force"]


def test_train_with_a_copys_config_is_refused_and_the_original_kept(tmp_path):
    original = written_run(tmp_path / "orig")
    original.append_metrics({"step": 1, "loss": 1.0})
    kept = {p.name: p.read_bytes() for p in original.path.iterdir()}
    copy = copied(original, tmp_path / "copy")
    for extra in (["--force"], ["--resume-if-exists"]):
        result = CliRunner().invoke(app, ["train", "--config", str(copy.config_file), *extra])
        assert one_error_line(result) == (
            f"error: {copy.config_file} is the config of the copied or moved run {copy.path}, and its train.run_dir "
            f"names {original.path}; add '--set train.run_dir={copy.path}' to act on the copy, or give "
            f"{original.path}'s own config"
        )
        assert {p.name: p.read_bytes() for p in original.path.iterdir()} == kept


def test_a_copys_config_trains_where_the_overrides_name(tmp_path, monkeypatch):
    """Past the refusal: `--set train.run_dir` (the copy, or another directory the user names), and a run's own
    config, or a config file that only has the name config.yaml."""
    import lctrain.train.command as command

    began = []
    monkeypatch.setattr(command, "preflight", lambda cfg: began.append(RunDir.of(cfg).path.resolve()) or 1 / 0)
    original = written_run(tmp_path / "orig")
    copy = copied(original, tmp_path / "copy")
    plain = tmp_path / "project" / "config.yaml"
    plain.parent.mkdir()
    plain.write_text(f"train: {{run_dir: {tmp_path / 'fresh'}}}\n")
    for args in (
        ["--config", str(copy.config_file), "--set", f"train.run_dir={copy.path}"],
        ["--config", str(copy.config_file), "--set", f"train.run_dir={tmp_path / 'third'}"],
        ["--config", str(original.config_file)],
        ["--config", str(plain)],
    ):
        assert isinstance(CliRunner().invoke(app, ["train", *args]).exception, ZeroDivisionError)
    assert began == [p.resolve() for p in (copy.path, tmp_path / "third", original.path, tmp_path / "fresh")]


def moved_project(tmp_path: Path, name: str, *, with_data: bool) -> tuple[RunDir, Path, Path]:
    """A project written at `old`, then moved whole to `new` (whose name has spaces): its run's config.yaml records
    the old workdir and relative paths."""
    old, new = tmp_path / "old", tmp_path / name
    written = written_run(old / "runs" / "r", "data.output_dir=prepared/d", f"workdir={old}")
    written.write_config(load_config(str(written.config_file), ["train.run_dir=runs/r"]))
    if with_data:
        (old / "prepared" / "d").mkdir(parents=True)
        (old / "prepared" / "d" / MANIFEST).write_text("{}")
    shutil.move(old, new)
    return RunDir(new / "runs" / "r"), old, new


def test_a_moved_projects_run_is_resumed_with_its_new_workdir(tmp_path, monkeypatch):
    run, old, new = moved_project(tmp_path, "my prój ét", with_data=True)
    monkeypatch.chdir(tmp_path)  # the run's project found from the run, not the current directory
    cfg = run.read_config()
    assert data_dir(cfg) == old / "prepared" / "d"
    with pytest.raises(UserError) as e:
        open_checked(cfg)
    assert str(e.value) == (
        f"{old / 'prepared' / 'd'}: no prepared dataset for this config; the run has moved from {old}, the workdir "
        f"its config.yaml records: add '--set workdir={shlex.quote(str(new))}' to the command, as in 'lctrain resume "
        f"{shlex.quote(str(run.path))} --set workdir={shlex.quote(str(new))}'"
    )
    assert error_command(str(e.value))[1:] == ["resume", str(run.path), "--set", f"workdir={new}"]
    # what the advice does: the config read with it finds the dataset beside the run
    assert data_dir(run.read_config([f"workdir={new}"])) == new / "prepared" / "d"


def test_a_moved_project_without_its_dataset_is_told_which_directory_to_give(tmp_path):
    run, old, _ = moved_project(tmp_path, "moved", with_data=False)
    with pytest.raises(UserError) as e:
        open_checked(run.read_config())
    assert str(e.value).endswith(
        f"the run has moved from {old}, the workdir its config.yaml records: add '--set workdir=DIR' to the command, "
        f"as in 'lctrain resume {run.path} --set workdir=DIR', DIR the directory that holds prepared/d (prepared "
        f"there) now"
    )


def test_a_project_copied_into_a_folder_of_its_old_workdir_is_told_its_new_one(tmp_path):
    """A copy below the old workdir was taken for the run in its own project: told to prepare with its config, which
    would rebuild the dataset at the old place, where the copy beside it needed only --set workdir."""
    old = tmp_path / "project"
    written = written_run(old / "runs" / "r", "data.output_dir=prepared/d", f"workdir={old}")
    written.write_config(load_config(str(written.config_file), ["train.run_dir=runs/r"]))
    new = old / "moved"
    (new / "prepared" / "d").mkdir(parents=True)
    (new / "prepared" / "d" / MANIFEST).write_text("{}")
    shutil.copytree(written.path, new / "runs" / "r")
    run = RunDir(new / "runs" / "r")
    with pytest.raises(UserError) as e:
        open_checked(run.read_config())
    assert str(e.value).endswith(
        f"the run has moved from {old}, the workdir its config.yaml records: add '--set workdir={new}' to the "
        f"command, as in 'lctrain resume {run.path} --set workdir={new}'"
    )
    with pytest.raises(UserError, match="no prepared dataset for this config; run 'lctrain prepare --config "):
        open_checked(written.read_config())  # the original, where its config says: told to prepare


def test_a_run_in_its_own_project_is_told_to_prepare(tmp_path):
    run = written_run(tmp_path / "a b" / "runs" / "r", "data.output_dir=prepared/d", f"workdir={tmp_path / 'a b'}")
    with pytest.raises(UserError, match="no prepared dataset for this config; run 'lctrain prepare --config ") as e:
        open_checked(run.read_config())
    assert shlex.quote(str(run.config_file)) in str(e.value)


@pytest.mark.slow  # two tiny runs, about 6 s here
@pytest.mark.usefixtures("one_thread")
def test_the_advice_for_a_copy_trains_the_copy_and_keeps_the_original(tmp_path_factory, tmp_path):
    workdir = prepared_workdir(tmp_path_factory, "copied_runs", tiny)
    original = RunDir(tmp_path / "orig")
    trained = CliRunner().invoke(app, ["train", *set_args(tiny(workdir / "data", original.path))])
    assert trained.exit_code == 0, trained.output
    kept = original.metrics_file.read_bytes()
    checkpoints = sorted(p.name for p in original.checkpoints.iterdir())
    copy = copied(original, tmp_path / "a copy")
    shutil.rmtree(copy.checkpoints)
    argv = error_command(one_error_line(CliRunner().invoke(app, ["resume", str(copy.path)])))
    again = CliRunner().invoke(app, argv[1:])
    assert again.exit_code == 0, again.output
    assert f"done: {copy.path}" in again.output
    assert f"lctrain plot {shlex.quote(str(copy.path))}" in again.output
    assert [r["step"] for r in copy.read_metrics()] == [1, 2]
    assert RunDir.of(copy.read_config()).path == copy.path  # its config.yaml names it now
    assert original.metrics_file.read_bytes() == kept
    assert sorted(p.name for p in original.checkpoints.iterdir()) == checkpoints
