"""Commands that replace or clear a directory another lctrain process reads refuse while it lives, in one line naming
it: `prepare --force` a dataset a training reads, `train --force` a run an evaluation reads, `export` the step the
running training exports itself; `eval --harness` takes the output directory's lock as RULER's eval does.

The other process is a real one (a Python child holding the lock, as the command it stands for does); a killed one
leaves its lock file behind, a stale record that must block nothing."""

import errno
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from test_eval_export_concurrency import fake_run, invoke, with_checkpoints
from test_eval_harness import write_tasks
from train_helpers import export_lock_fails, one_error_line, prepared_workdir, set_args, tiny_run

from lctrain import lifetime
from lctrain.config import load_config, write_resolved
from lctrain.errors import UserError
from lctrain.eval.runner import EVAL_LOCK, Target, evaluating
from lctrain.lifetime import READER_PREFIX, Reading, readers, refuse_while_read
from lctrain.rundir import RunDir


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return prepared_workdir(tmp_path_factory, "concurrent", tiny_run)


def holder(code: str) -> subprocess.Popen:
    """A Python process that runs `code` (which enters a lock), says so and waits to be killed."""
    proc = subprocess.Popen(
        [sys.executable, "-c", f"import sys, time\n{code}\n    print('ready', flush=True)\n    time.sleep(60)"],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline() == "ready\n"
    return proc


def reading(directory: Path, command: str, reader: str) -> subprocess.Popen:
    return holder(f"from lctrain.lifetime import Reading\nwith Reading({str(directory)!r}, {command!r}, {reader!r}):")


def killed(proc: subprocess.Popen) -> None:
    """SIGKILL: no handler runs, the lock file stays behind."""
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def reader_files(directory: Path) -> list[str]:
    return [p.name for p in directory.iterdir() if p.name.startswith(READER_PREFIX)]


# ------------------------------------------------------------------ prepare --force


def test_prepare_force_refuses_while_a_training_reads_the_dataset(workdir):
    data = workdir / "data"
    prepare = ["prepare", "--force", *set_args(tiny_run(data, workdir / "run"))]
    shards = sorted(p.name for p in data.rglob("*.arrow"))
    proc = reading(data, "lctrain train", f"the training in {workdir / 'run'}")
    try:
        line = one_error_line(invoke(*prepare))
        assert line.startswith(f"error: {data}: the training in {workdir / 'run'} (pid {proc.pid} on ")
        assert line.endswith(
            f"reads it now; wait for it to finish or stop it (kill {proc.pid}) before rebuilding it here (or set "
            f"data.output_dir to prepare the new dataset elsewhere)"
        )
        assert sorted(p.name for p in data.rglob("*.arrow")) == shards  # untouched
    finally:
        killed(proc)
    assert len(reader_files(data)) == 1  # the dead reader's stale record...
    assert readers(data) == []  # ...which blocks nothing
    result = invoke(*prepare)
    assert result.exit_code == 0, result.output
    assert reader_files(data) == []  # the rebuild replaced the directory


def test_the_refusal_names_every_reader_and_one_with_an_unreadable_record(tmp_path):
    first = reading(tmp_path, "lctrain train", "the training in runs/a")
    # a live holder whose record is not JSON: still a reader
    garbled = holder(
        f"import fcntl, os\nfd = os.open({str(tmp_path / (READER_PREFIX + 'x.lock'))!r}, os.O_RDWR | os.O_CREAT)\n"
        f"os.write(fd, b'not json')\nfcntl.flock(fd, fcntl.LOCK_EX)\nif True:"
    )
    try:
        with pytest.raises(UserError) as e:
            refuse_while_read(tmp_path, "rebuilding it")
        message = str(e.value)
        assert "the training in runs/a (pid " in message and "another process (pid ? on ?, since ?)" in message
        assert message.endswith(
            f"read it now; wait for them to finish or stop them (kill {first.pid}) before rebuilding it"
        )
    finally:
        killed(first)
        killed(garbled)
    refuse_while_read(tmp_path, "rebuilding it")


def test_a_reader_never_creates_the_directory_and_reads_unmarked_where_it_cannot_write(tmp_path, monkeypatch):
    missing = tmp_path / "not-prepared"
    with Reading(missing, "lctrain train", "the training in runs/a"):
        assert not missing.exists()
    real_open = lifetime.os.open

    def read_only(path, *args, **kwargs):
        if Path(path).name.startswith(READER_PREFIX):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(lifetime.os, "open", read_only)
    with Reading(tmp_path, "lctrain train", "the training in runs/a"):
        assert reader_files(tmp_path) == []


@pytest.mark.slow  # a 1-step training: 3 s
def test_a_training_marks_its_dataset_while_it_runs(workdir):
    from lctrain.train.command import train

    run = workdir / "marked"
    seen = []
    train(
        load_config(None, tiny_run(workdir / "data", run, steps=1)),
        before_checkpoint_complete=lambda step: seen.extend(readers(workdir / "data")),
    )
    assert [(r["pid"], r["reader"]) for r in seen] == [(os.getpid(), f"the training in {run.absolute()}")]
    assert reader_files(workdir / "data") == []


# ------------------------------------------------------------------ train --force


def test_train_force_refuses_while_an_evaluation_reads_the_run(workdir):
    run = workdir / "evaluated"
    items = tiny_run(workdir / "data", run)
    write_resolved(load_config(None, items), run)
    RunDir(run).eval_dir.mkdir()
    (RunDir(run).eval_dir / "results.json").write_text("{}")
    proc = reading(run, "lctrain eval", f"the evaluation into {run / 'eval'}")
    try:
        line = one_error_line(invoke("train", "--force", *set_args(items)))
        assert line.startswith(f"error: {run}: the evaluation into {run / 'eval'} (pid {proc.pid} on ")
        assert line.endswith(f"wait for it to finish or stop it (kill {proc.pid}) before starting a run over here")
        assert (RunDir(run).eval_dir / "results.json").is_file()
    finally:
        killed(proc)
    RunDir(run).clear_outputs()  # the stale record blocks nothing
    assert not RunDir(run).eval_dir.exists()


def test_an_evaluation_marks_the_run_it_scores_not_a_model(tmp_path):
    run = fake_run(tmp_path)
    cfg = RunDir(run).read_config()
    out = tmp_path / "elsewhere"
    with evaluating(Target("run", run, cfg), out):
        assert [(r["pid"], r["reader"]) for r in readers(run)] == [(os.getpid(), f"the evaluation into {out}")]
        assert (out / EVAL_LOCK).is_file()
    assert reader_files(run) == [] and not (out / EVAL_LOCK).exists()
    model = RunDir(run).export(2)
    with evaluating(Target("model", model, cfg), model / "eval"):
        assert reader_files(model) == []


# ------------------------------------------------------------------ eval --harness


def test_a_harness_evaluation_is_refused_beside_another_evaluation(tmp_path):
    run = fake_run(tmp_path)
    out = RunDir(run).eval_dir
    tasks = write_tasks(tmp_path)
    # EvalLock's file, held as RULER's evaluation holds it
    proc = holder(f"from lctrain.lifetime import RunLock\nwith RunLock({str(out)!r}, 'lctrain eval', {EVAL_LOCK!r}):")
    try:
        line = one_error_line(invoke("eval", run, "--harness", "tiny_mc", "--harness-tasks", tasks))
        assert line.startswith(f"error: {out}: another evaluation is writing its report there, pid {proc.pid} on ")
        assert not (out / "harness.json").exists()
    finally:
        killed(proc)


# ------------------------------------------------------------------ export


def training_session(run: Path, start_step: int) -> None:
    RunDir(run).append_session({"start_step": start_step})


def test_an_export_of_the_step_the_running_training_exports_is_refused(tmp_path):
    """train.steps=20, hf_every 10: the training exports step 10 right after its checkpoint; until it logs step 11,
    `lctrain export --step 10` would write beside it."""
    run = with_checkpoints(fake_run(tmp_path), 10)
    training_session(run, 0)
    RunDir(run).append_metrics({"step": 10})
    damaged = f"error: {RunDir(run).checkpoint(10)}: damaged (mp_rank_00_model_states.pt is missing)"
    assert one_error_line(invoke("export", run, "--step", 10)).startswith(damaged)  # no training: it goes on
    proc = holder(f"from lctrain.lifetime import RunLock\nwith RunLock({str(run)!r}, 'lctrain train'):")
    try:
        assert one_error_line(invoke("export", run, "--step", 10)) == (
            f"error: {RunDir(run).export(10)}: the training running in {run} (pid {proc.pid}) writes this export "
            f"itself (checkpoint.hf_every / hf_last); wait for it to write it, or stop the training (kill {proc.pid}), "
            f"or export to another --out"
        )
        # into another directory, it is the user's own
        assert one_error_line(invoke("export", run, "--step", 10, "--out", tmp_path / "x")).startswith(damaged)
        RunDir(run).append_metrics({"step": 11})  # past it: its export is written
        assert one_error_line(invoke("export", run, "--step", 10)).startswith(damaged)
    finally:
        killed(proc)


def test_an_export_the_running_training_does_not_write_goes_on(tmp_path):
    """A step off the schedule, or one before the step the training resumed at."""
    run = with_checkpoints(fake_run(tmp_path), 9, 10)
    training_session(run, 10)
    proc = holder(f"from lctrain.lifetime import RunLock\nwith RunLock({str(run)!r}, 'lctrain train'):")
    try:
        for step in (9, 10):
            line = one_error_line(invoke("export", run, "--step", step))
            assert line.startswith(f"error: {RunDir(run).checkpoint(step)}: damaged"), line
    finally:
        killed(proc)


def test_a_lock_file_that_cannot_be_created_for_another_reason_suggests_out(tmp_path, monkeypatch):
    run = with_checkpoints(fake_run(tmp_path), 18)
    export_lock_fails(monkeypatch, errno.ENAMETOOLONG)
    out = tmp_path / "x"
    assert one_error_line(invoke("export", run, "--step", 18, "--out", out)) == (
        f"error: --out {out}: cannot create its lock file {tmp_path / '.lctrain-export-x.lock'} (File name too long); "
        f"choose another --out"
    )


# ------------------------------------------------------------------ whose_config


def test_whose_config_tells_a_runs_config_from_a_file_named_like_it(tmp_path):
    run = RunDir(tmp_path / "run")
    run.write_config(load_config(None))
    assert RunDir.whose_config(load_config(str(run.config_file))) == RunDir(run.path.absolute())
    old = fake_run(tmp_path / "old")  # a config.yaml without workdir, and no origin.json beside it
    assert RunDir.whose_config(load_config(str(old / "config.yaml"))) is None
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.yaml").write_text(json.dumps({"train": {"steps": 3}}))
    assert RunDir.whose_config(load_config(str(mine / "config.yaml"))) is None


def test_the_trainings_own_export_waits_for_a_users_export_of_that_step(tmp_path, monkeypatch):
    """A user's `lctrain export --step N` that holds the step's lock when the training reaches its own export of N:
    the training waits for it (its export is part of the run), then writes the step; never both at once. (flock
    locks are per open file, so a thread of this process stands for the other process.)"""
    import threading

    from lctrain.train import checkpoint

    run = RunDir(fake_run(tmp_path))
    written = []
    monkeypatch.setattr(checkpoint, "write_export", lambda final, *a, **k: written.append(final))
    monkeypatch.setattr(checkpoint, "barrier", lambda: None)
    cfg = load_config(None, [])
    training = threading.Thread(
        target=checkpoint.save_hf, args=(None, None, None, None, run, 10), kwargs=dict(rank=0, zero_stage=1, cfg=cfg)
    )
    with checkpoint.TargetLock(run.export(10), None):
        training.start()
        training.join(timeout=0.5)
        assert training.is_alive() and written == []  # waiting
    training.join(timeout=10)
    assert written == [run.export(10)]
