"""`lctrain train --resume-if-exists`: one command for a job script's first start and its requeues. Reference: the
run directory's own records (metrics.jsonl steps, sessions.jsonl starts) of the same command run again and again."""

import pytest
from train_helpers import one_error_line, prepared_workdir, set_args, tiny_run
from typer.testing import CliRunner

from lctrain.cli import app
from lctrain.config import load_config
from lctrain.rundir import RunDir

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
