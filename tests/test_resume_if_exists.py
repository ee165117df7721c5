"""`lctrain train --resume-if-exists`: one command for a job script's first start and its requeues. Reference: the
run directory's own records (metrics.jsonl steps, sessions.jsonl starts) of the same command run again and again."""

import json
import re
import shlex

import pytest
from train_helpers import one_error_line, prepared_workdir, set_args, tiny_run
from typer.testing import CliRunner

from lctrain.cli import app
from lctrain.config import load_config, settings
from lctrain.rundir import RunDir
from lctrain.train import checkpoint as ckpt

tiny = tiny_run


@pytest.mark.slow  # three tiny runs, 8 s here
@pytest.mark.usefixtures("one_thread")
def test_the_same_command_starts_resumes_and_finds_the_run_complete(tmp_path_factory, tmp_path):
    workdir = prepared_workdir(tmp_path_factory, "resume_if_exists", tiny)
    rd = RunDir(tmp_path / "run")

    def job(*extra: str):
        items = tiny(workdir / "data", rd.path) + list(extra)
        return CliRunner().invoke(app, ["train", "--resume-if-exists", *set_args(items)])

    first = job()
    assert first.exit_code == 0, first.output
    assert "resuming" not in first.output
    assert [r["step"] for r in rd.read_metrics()] == [1, 2]

    requeued = job("train.steps=4")  # the job script's config, raised since: a resume's --set
    assert requeued.exit_code == 0, requeued.output
    assert f"{rd.path} has a checkpoint: resuming it (--resume-if-exists), with train.steps 2 -> 4" in requeued.output
    assert [r["step"] for r in rd.read_metrics()] == [1, 2, 3, 4]
    assert [s["start_step"] for s in rd.read_sessions()] == [0, 2]
    assert rd.read_config().train.steps == 4

    again = job("train.steps=4")
    assert again.exit_code == 0, again.output
    assert "is complete: step 4 of 4; nothing to resume" in again.output
    assert len(rd.read_sessions()) == 2

    other_model = job("train.steps=6", "model.arch.hidden_size=128")  # what resume refuses, refused
    assert other_model.exit_code == 2
    assert "model.arch.hidden_size" in one_error_line(other_model)
    assert [r["step"] for r in rd.read_metrics()] == [1, 2, 3, 4]


def test_a_run_stopped_before_its_first_checkpoint_starts_again(tmp_path, monkeypatch):
    """Nothing to resume from: the run starts over (its partial records go), as `train --force` would, said so."""
    import lctrain.train.command as command

    started = []
    monkeypatch.setattr(command, "train", lambda cfg, force=False: started.append(force) or RunDir.of(cfg).path)
    rd = RunDir(tmp_path / "run")
    cfg = load_config(None, [f"train.run_dir={rd.path}"])
    rd.write_config(cfg)
    rd.append_metrics({"step": 1, "loss": 1.0})
    result = CliRunner().invoke(app, ["train", "--resume-if-exists", "--set", f"train.run_dir={rd.path}"])
    assert result.exit_code == 0, result.output
    assert f"{rd.path} stopped before its first checkpoint: starting it again (--resume-if-exists)" in result.output
    assert started == [True]
    fresh = tmp_path / "fresh"
    assert CliRunner().invoke(app, ["train", "--resume-if-exists", "--set", f"train.run_dir={fresh}"]).exit_code == 0
    assert started == [True, False]


def test_force_and_resume_if_exists_contradict():
    result = CliRunner().invoke(app, ["train", "--resume-if-exists", "--force"])
    assert result.exit_code == 2
    assert one_error_line(result) == (
        "error: --force starts the run over and --resume-if-exists continues it: give one of them"
    )


def a_run(tmp_path) -> RunDir:
    """A run of the default config in "tmp_path/the run", with a checkpoint of step 1 (as far as resuming reads it)."""
    rd = RunDir(tmp_path / "the run")
    cfg = load_config(None, [f"train.run_dir={rd.path}", f"data.output_dir={tmp_path / 'data'}"])
    rd.write_config(cfg)
    fake_checkpoint(rd, 1, cfg)
    return rd


def advised(line: str) -> list[list[str]]:
    """The commands an error line cites, each as the shell splits it when copied: in double quotes, errors.cited's
    for a command that holds single quotes (a path or a value with a space)."""
    return [shlex.split(command) for command in re.findall(r'"([^"]*)"', line)]


def test_a_run_of_another_config_is_refused_as_such_naming_what_differs(tmp_path):
    """A job script's config B pointed at the directory of a run of config A: what differs is B's, not the --set flags
    the user typed (which are no part of it), and the start-over advice is the user's own command with --force."""
    rd = a_run(tmp_path)
    ran = rd.read_config()
    config = tmp_path / "my configs" / "B.yaml"
    config.parent.mkdir()
    config.write_text(
        f"base: tiny_anchor\nseed: 5\ntrain:\n  global_batch: {2 * ran.train.global_batch}\n  run_dir: {rd.path}\n"
        f"data:\n  output_dir: {tmp_path / 'data'}\n"
    )
    before = {p.name: p.read_bytes() for p in rd.path.iterdir() if p.is_file()}
    sets = ["description=two words"]
    line = one_error_line(CliRunner().invoke(app, ["train", "-c", str(config), "--resume-if-exists", *set_args(sets)]))
    assert line.startswith(
        f"error: {rd.path} holds a run of another config than {config} (seed {ran.seed} -> 5, train.global_batch "
        f"{ran.train.global_batch} -> {2 * ran.train.global_batch}), and its checkpoint step_1 resumes only with the "
        f"model, data and batch it was written with; set train.run_dir to another directory, start over there "
        f"(deleting that run) with "
    )
    assert line.endswith(f', or resume it with its own config: "lctrain resume {shlex.quote(str(rd.path))}"')
    assert advised(line) == [
        ["lctrain", "train", "--config", str(config), *set_args(sets), "--force"],  # theirs, starting over
        ["lctrain", "resume", str(rd.path)],
    ]
    assert {p.name: p.read_bytes() for p in rd.path.iterdir() if p.is_file()} == before
    # another config and a --set: still the other config's run, every difference named
    config.write_text(f"base: tiny_anchor\nseed: 5\ntrain:\n  run_dir: {rd.path}\n")
    line = one_error_line(
        CliRunner().invoke(app, ["train", "-c", str(config), "--resume-if-exists", "--set", "train.global_batch=1"])
    )
    assert f"holds a run of another config than {config} (seed {ran.seed} -> 5, train.global_batch " in line


def test_set_flags_that_change_what_the_checkpoint_fixes_are_named_as_typed(tmp_path):
    rd = a_run(tmp_path)
    sets = [f"train.run_dir={rd.path}", f"data.output_dir={tmp_path / 'data'}", "seed=7", "description=two words"]
    line = one_error_line(CliRunner().invoke(app, ["train", "--resume-if-exists", *set_args(sets)]))
    assert line.startswith(
        "error: --set seed=7: seed 0 -> 7 changed since checkpoint step_1; a checkpoint resumes only with the model, "
        "data and batch it was written with: restore them, or start over with "
    )
    # the default config by its bundled name: `lctrain train` without --config trains the same
    assert advised(line) == [["lctrain", "train", "--config", "tiny_anchor", *set_args(sets), "--force"]]


def test_a_refused_resume_advises_to_start_over_with_its_own_set_flags(tmp_path):
    """The start-over command of a refused `resume --set ...` trains what that resume asked (its --set flags, a value
    with a space quoted), copied whole: the reference is the shell's own split of the cited command."""
    rd = a_run(tmp_path)
    sets = ["seed=7", "description=two words"]
    line = one_error_line(CliRunner().invoke(app, ["resume", str(rd.path), *set_args(sets)]))
    assert line.startswith("error: --set seed=7: seed 0 -> 7 changed since checkpoint step_1; a checkpoint resumes ")
    assert advised(line) == [["lctrain", "train", "--config", str(rd.config_file), *set_args(sets), "--force"]]


def fake_checkpoint(rd: RunDir, step: int, cfg) -> None:
    """A complete resume checkpoint of `step` as far as `resume`'s checks read it: its trainer state."""
    path = rd.checkpoint(step)
    path.mkdir(parents=True)
    (path / ckpt.STATE_FILE).write_text(json.dumps({"step": step, "config": settings(cfg)}))
    (rd.checkpoints / ckpt.LATEST).write_text(path.name + "\n")
