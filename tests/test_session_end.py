"""How a session ended, in its line of sessions.jsonl: the outcome of each kind of end, the line completed in place
(one line per session, so readers of the start fields see the same shape), and a failure to record that never hides
the error the session ended with. Then real runs: one that finishes, one stopped by a NaN loss."""

import json
from pathlib import Path

import pytest
import torch
from train_helpers import nan_loss_at, one_error_line, prepared_workdir, set_args, tiny_run
from typer.testing import CliRunner

from lctrain.cli import app
from lctrain.errors import RunFailed, UserError
from lctrain.hardware import device_peak_flops
from lctrain.lifetime import Terminated
from lctrain.rundir import RunDir
from lctrain.train.session import complete_last_session, record_end, session_end, software_note

STEPS = 2


def test_each_kind_of_end_has_its_outcome():
    finished = {"ended": "t", "end_step": 5, "diverged": False, "outcome": "finished"}
    assert session_end(5, None) | {"ended": "t"} == finished
    # a run whose loss diverged at step 3 (metrics.jsonl's "diverged" from there on), in this session or before it
    assert session_end(5, None, diverged_at=3) | {"ended": "t"} == {**finished, "diverged": True, "diverged_at": 3}
    assert session_end(3, Terminated())["outcome"] == "stopped by SIGTERM"
    assert session_end(3, KeyboardInterrupt())["outcome"] == "interrupted"
    failed = session_end(2, RuntimeError("CUDA error: an illegal memory access\nCUDA kernel errors might be..."))
    assert (failed["outcome"], failed["error"]) == ("failed", "RuntimeError: CUDA error: an illegal memory access")
    assert session_end(2, RuntimeError())["error"] == "RuntimeError"  # an error without a message: its type


def test_the_sessions_line_is_completed_in_place(tmp_path):
    rd = RunDir(tmp_path)
    first = {"started": "2026-01-01T00:00:00+00:00", "start_step": 0, "software": {"torch": "2.13.0"}}
    mine = {"started": "2026-01-02T00:00:00+00:00", "start_step": 4, "software": {"torch": "2.13.0"}}
    rd.append_session(first)
    rd.sessions_file.write_text(rd.sessions_file.read_text() + '{"started": "torn\n')  # a kill while appending
    rd.append_session(mine)
    record_end(rd, mine, 9, None)
    lines = rd.sessions_file.read_text().splitlines()
    assert lines[:2] == [json.dumps(first), '{"started": "torn']  # the other lines as they were
    assert len(lines) == 3 and json.loads(lines[2]) == {**mine, **json.loads(lines[2]), "start_step": 4}
    assert json.loads(lines[2])["end_step"] == 9 and json.loads(lines[2])["outcome"] == "finished"
    # the readers of the start fields read the completed line as before
    assert [s["start_step"] for s in rd.read_sessions()] == [0, 4]
    assert software_note(rd.read_sessions()[-1], mine) is None
    # a file removed since the session started: its whole record is appended
    rd.sessions_file.unlink()
    record_end(rd, mine, 9, Terminated())
    (alone,) = rd.read_sessions()
    assert alone["start_step"] == 4 and alone["outcome"] == "stopped by SIGTERM"


def test_a_session_its_workers_could_not_end_is_completed_by_the_command(tmp_path, capsys, monkeypatch):
    """A rank killed or hung: the launcher stops rank 0 before it records the end; `lctrain train` records it."""
    rd = RunDir(tmp_path)
    old = {"started": "2026-01-01T00:00:00+00:00", "start_step": 0, "software": {}}
    rd.append_session(old)
    complete_last_session(rd, UserError("rank 1 hung in step 4"), since="2026-01-02T00:00:00+00:00")
    assert rd.read_sessions() == [old]  # an earlier session's, not this command's: left as it is
    mine = {"started": "2026-01-02T00:00:05+00:00", "start_step": 2, "software": {}}
    rd.append_session(mine)
    rd.append_metrics({"step": 3, "loss": 1.0})
    complete_last_session(rd, UserError("rank 1 hung in step 4"), since="2026-01-02T00:00:00+00:00")
    ended = rd.read_sessions()[-1]
    assert (ended["end_step"], ended["outcome"], ended["error"]) == (3, "failed", "UserError: rank 1 hung in step 4")
    assert ended["diverged"] is False
    complete_last_session(rd, UserError("another"), since="2026-01-02T00:00:00+00:00")  # said already: kept
    assert rd.read_sessions()[-1] == ended
    later = {"started": "2026-01-03T00:00:00+00:00", "start_step": 3, "software": {}}
    rd.append_session(later)

    def unreadable(self):
        raise PermissionError(13, "Permission denied", str(self.metrics_file))

    monkeypatch.setattr(RunDir, "read_metrics", unreadable)  # a warning, and the command's own error goes on
    complete_last_session(rd, UserError("another"), since="2026-01-02T00:00:00+00:00")
    assert rd.read_sessions()[-1] == later
    assert capsys.readouterr().out.startswith("warning: could not record how this session ended in ")


def test_the_launchers_cause_replaces_the_symptom_rank_0_recorded(tmp_path):
    """A rank killed: rank 0 records the collective that failed with it; the launcher, which names the dead rank,
    puts that in `error` and keeps rank 0's as `symptom`. Without `cause`, or for a session that finished or was
    stopped, what is recorded stays."""
    rd = RunDir(tmp_path)
    mine = {"started": "2026-01-02T00:00:05+00:00", "start_step": 2, "software": {}}
    rd.append_session(mine)
    record_end(rd, mine, 5, RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:51106"))
    ended = rd.read_sessions()[-1]
    killed = RunFailed("rank 1 (pid 42) was killed by SIGKILL")
    complete_last_session(rd, killed, since="2026-01-02T00:00:00+00:00")
    assert rd.read_sessions()[-1] == ended
    complete_last_session(rd, killed, since="2026-01-02T00:00:00+00:00", cause=True)
    amended = rd.read_sessions()[-1]
    assert amended == {
        **ended,
        "error": "RunFailed: rank 1 (pid 42) was killed by SIGKILL",
        "symptom": "RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:51106",
    }
    stopped = {"started": "2026-01-03T00:00:00+00:00", "start_step": 5, "software": {}}
    rd.append_session(stopped)
    record_end(rd, stopped, 6, Terminated())
    complete_last_session(rd, killed, since="2026-01-02T00:00:00+00:00", cause=True)
    assert rd.read_sessions()[-1]["outcome"] == "stopped by SIGTERM" and "error" not in rd.read_sessions()[-1]
    assert rd.read_sessions()[-2] == amended


def test_a_session_its_workers_could_not_end_says_whether_the_run_had_diverged(tmp_path):
    """Its end record reads the divergence from the metrics the run logged: from the first step that says so."""
    rd = RunDir(tmp_path)
    mine = {"started": "2026-01-02T00:00:05+00:00", "start_step": 2, "software": {}}
    rd.append_session(mine)
    for step, diverged in ((1, False), (2, True), (3, True), (4, True)):
        rd.append_metrics({"step": step, "loss": 1.0, "diverged": diverged})
    complete_last_session(rd, UserError("rank 1 hung in step 5"), since="2026-01-02T00:00:00+00:00")
    ended = rd.read_sessions()[-1]
    assert (ended["end_step"], ended["diverged"], ended["diverged_at"]) == (4, True, 2)


def test_a_failure_to_record_is_a_warning_and_hides_nothing(tmp_path, capsys):
    rd = RunDir(tmp_path)
    rd.sessions_file.mkdir()  # unreadable as a file
    record_end(rd, {"start_step": 0}, 1, UserError("the original"))  # returns: the caller re-raises its own error
    out = capsys.readouterr().out
    assert out.startswith(f"warning: could not record how this session ended in {rd.sessions_file} (")


tiny = tiny_run


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return prepared_workdir(tmp_path_factory, "sessions", tiny)


def train(workdir: Path, run_dir: Path, extra: list[str] = ()):
    return CliRunner().invoke(app, ["train", *set_args(tiny(workdir / "data", run_dir) + list(extra))])


@pytest.mark.slow  # three tiny runs: 7 s here, over the 2 s a default test may take
@pytest.mark.usefixtures("one_thread")
def test_runs_record_how_they_ended_and_say_what_their_schedule_does(workdir, tmp_path, monkeypatch):
    """A finished run, its resume to more steps of a cosine (the rate jumps up: said, with the numbers), and a run
    stopped by a NaN loss whose warmup outlasts it (said at its start)."""
    rd = RunDir(tmp_path / "done")
    done = train(workdir, rd.path, ["train.lr_schedule=cosine", "train.lr=1e-3", "logging.peak_tflops=7"])
    assert done.exit_code == 0, done.output
    assert "warning: train.warmup_steps" not in done.output
    (session,) = rd.read_sessions()
    assert (session["start_step"], session["end_step"], session["outcome"]) == (0, STEPS, "finished")
    assert session["ended"] >= session["started"] and "error" not in session
    assert session["diverged"] is False and "diverged_at" not in session
    assert session["peak_tflops"] == 7.0  # what its MFU divides by
    resumed = CliRunner().invoke(app, ["resume", str(rd.path), "--set", "train.steps=6"])
    assert resumed.exit_code == 0, resumed.output
    # cosine over 2 steps: step 2 at (1 + cos(pi / 2)) / 2 = 0.5 of 1e-3; over 6: step 3 at (1 + cos(pi / 3)) / 2
    assert (
        "note: the learning rate goes from 5.000e-04 at step 2 (the last taken) to 7.500e-04 at step 3 "
        "(train.steps 2 -> 6; 0.000e+00 under the checkpoint's schedule)"
    ) in resumed.output
    assert [r["lr"] for r in rd.read_metrics()][1:3] == pytest.approx([5e-4, 7.5e-4], rel=1e-12)
    first, second = rd.read_sessions()
    assert first == session and (second["start_step"], second["end_step"], second["outcome"]) == (2, 6, "finished")

    nan_loss_at(monkeypatch, 1)  # the 2nd update
    failed = train(workdir, tmp_path / "nan", ["train.warmup_steps=4", "train.lr=1e-3"])
    assert (
        "warning: train.warmup_steps = 4 >= train.steps = 2: the whole run is warmup; its highest learning rate is "
        "5.000e-04 at step 2 (train.lr = 0.001)\n"
    ) in failed.output
    line = one_error_line(failed, code=1)  # the error as ever, nothing of the recording in it
    (session,) = RunDir(tmp_path / "nan").read_sessions()
    assert (session["end_step"], session["outcome"]) == (1, "failed")
    assert (session["diverged"], session["diverged_at"]) == (True, 2)  # the NaN step's loss, never logged
    # without logging.peak_tflops: this CPU's, measured in the run's dtype
    peak = device_peak_flops(torch.device("cpu"), None, RunDir(tmp_path / "nan").read_config().model.dtype)
    assert session["peak_tflops"] == peak / 1e12  # unrounded: what the MFU divided by
    assert session["error"] == "RunFailed: " + line.removeprefix("error: ")


def test_a_resume_of_a_run_without_sessions_says_its_earlier_software_is_unknown():
    started = {"start_step": 0, "software": {"torch": "2.13.0"}}
    assert software_note(None, started) is None
    note = software_note(None, {**started, "start_step": 10})
    assert note.startswith("note: sessions.jsonl starts at step 10: the steps before were trained by an lctrain")


@pytest.mark.slow  # a tiny run and its prepared data: 5 s
@pytest.mark.usefixtures("one_thread")
def test_a_session_whose_launching_command_was_killed_keeps_only_its_start(workdir, tmp_path, monkeypatch):
    """`kill -9` of `lctrain train` ends its ranks (each watches it): rank 0 recorded the session as failed with the
    gloo error its collective met when rank 1 went ("Connection closed by peer"), as if the run had crashed, where a
    killed session keeps only its start (signals explorer: 2 of 4 such kills)."""
    from lctrain.train import trainer

    nan_loss_at(monkeypatch, 1)  # the error rank 0 meets as its peers go
    monkeypatch.setattr(trainer, "supervisor_gone", lambda: True)
    train(workdir, tmp_path / "killed")
    (session,) = RunDir(tmp_path / "killed").read_sessions()
    assert "ended" not in session and "outcome" not in session


def test_a_launching_command_is_gone_when_its_process_is(monkeypatch):
    import subprocess
    import sys

    import psutil

    from lctrain.lifetime import SUPERVISOR_ENV, exit_with_supervisor, supervisor_gone, supervisor_token

    monkeypatch.delenv(SUPERVISOR_ENV, raising=False)
    assert not supervisor_gone()  # started by no lctrain command
    monkeypatch.setenv(SUPERVISOR_ENV, supervisor_token())
    assert not supervisor_gone()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    token = f"{child.pid}:{psutil.Process(child.pid).create_time()}"
    monkeypatch.setenv(SUPERVISOR_ENV, token)
    assert not supervisor_gone()
    child.kill()
    child.wait()
    assert supervisor_gone()
    me = psutil.Process()
    monkeypatch.setenv(SUPERVISOR_ENV, f"{me.pid}:{me.create_time() - 5}")  # its pid taken by another process
    assert supervisor_gone()
    # every command reads the variable as it starts: one set otherwise is no supervisor, not a ValueError traceback
    monkeypatch.setenv(SUPERVISOR_ENV, "1")
    assert not supervisor_gone()
    exit_with_supervisor()
