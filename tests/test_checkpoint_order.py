"""A step with both a resume checkpoint and an evaluation export writes the checkpoint first, so a failing export
(a full disk at the last step) loses no step of the run; the directories both go into are checked before the first
step; a failed write says which of the two failed, the remedy for its cause, and what continues the run."""

import contextlib
import errno
import json
import os
from pathlib import Path

import pytest
from train_helpers import one_error_line, set_args
from typer.testing import CliRunner

from lctrain.cli import app
from lctrain.config import load_config
from lctrain.errors import UserError, writing
from lctrain.files import TEMPORARY_PREFIX
from lctrain.rundir import RunDir
from lctrain.train import checkpoint as ckpt
from lctrain.train import trainer as trainer_module

TINY = [
    "data.seq_len=128",
    "data.token_budget=6000",
    "train.steps=4",
    "train.global_batch=2",
    "checkpoint.every_steps=2",
    "checkpoint.hf_every=2",
    "checkpoint.hf_last=4",
    "model.arch={model_type: llama, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 1, "
    "num_attention_heads: 2, num_key_value_heads: 1, tie_word_embeddings: true}",
]

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    from lctrain.data.prepare import prepare

    out = tmp_path_factory.mktemp("order") / "data"
    prepare(load_config(None, TINY + [f"data.output_dir={out}"]))
    return out


def train_args(data_dir: Path, run_dir: Path, *extra: str) -> list[str]:
    return ["train"] + set_args(TINY + [f"data.output_dir={data_dir}", f"train.run_dir={run_dir}", *extra])


def fake_checkpoint(run: RunDir, step: int) -> None:
    """A complete checkpoint as far as `latest_checkpoint` reads one: its state file and `latest`."""
    path = run.checkpoint(step)
    path.mkdir(parents=True)
    (path / ckpt.STATE_FILE).write_text(json.dumps({"step": step}))
    (run.checkpoints / ckpt.LATEST).write_text(path.name + "\n")


# ------------------------------------------------------------ before the first step


@pytest.mark.parametrize("where", ["hf", "checkpoints"])
def test_a_file_where_a_directory_goes_is_refused_before_step_1(data_dir, tmp_path, where):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / where).write_text("")
    line = one_error_line(CliRunner().invoke(app, train_args(data_dir, run_dir)))
    what = {"hf": "evaluation exports", "checkpoints": "resume checkpoints"}[where]
    assert line == (
        f"error: {run_dir / where}: the directory of the {what} is a file where it goes; move or remove the file, "
        f"then run the command again"
    )
    assert not RunDir(run_dir).metrics_file.exists()  # nothing trained
    assert (run_dir / where).is_file()


def test_the_check_names_a_parent_in_the_way_and_the_errno_s_cause(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("")
    with pytest.raises(UserError) as info:
        ckpt.check_output_dir(tmp_path / "file" / "hf", "evaluation exports")
    assert str(info.value) == (
        f"{tmp_path / 'file' / 'hf'}: the directory of the evaluation exports cannot be created: "
        f"{tmp_path / 'file'} is a file; move or remove the file, then run the command again"
    )

    def read_only(*args, **kwargs):  # what a read-only parent or filesystem raises (root passes chmod 555)
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(ckpt.tempfile, "mkdtemp", read_only)
    with pytest.raises(UserError) as info:
        ckpt.check_output_dir(tmp_path / "run" / "checkpoints", "resume checkpoints")
    assert str(info.value) == (
        f"{tmp_path / 'run' / 'checkpoints'}: cannot create the directory of the resume checkpoints or write into it "
        f"(Read-only file system); choose a path on a writable filesystem, then run the command again"
    )
    assert not (tmp_path / "run").exists()  # what the check created, it removed


def test_the_check_leaves_nothing_and_skips_what_the_session_does_not_write(tmp_path):
    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    cfg = load_config(None, TINY)
    trainer_module.check_output_dirs(cfg, run, 0)
    assert list(run.path.iterdir()) == []
    run.exports_dir.write_text("")  # no export after step 4 of 4; none at all with hf_last 0
    trainer_module.check_output_dirs(cfg, run, 4)
    trainer_module.check_output_dirs(load_config(None, TINY + ["checkpoint.hf_last=0"]), run, 0)
    with pytest.raises(UserError, match="evaluation exports"):
        trainer_module.check_output_dirs(cfg, run, 3)


# ------------------------------------------------------------ the messages of a failed write


def failed(run: RunDir, step: int, what: str, error: OSError, total: int = 4) -> str:
    with pytest.raises(UserError) as info, trainer_module._write_of_step(run, step, total, what):
        with writing(run.path / "x", f"the {what}"):
            raise error
    return str(info.value)


def test_a_failed_export_at_the_last_step_names_the_export_and_its_checkpoint(tmp_path):
    run = RunDir(tmp_path / "run")
    fake_checkpoint(run, 4)
    msg = failed(run, 4, trainer_module.EXPORT, OSError(errno.ENOSPC, "No space left on device"))
    assert msg == (
        f"{run}: cannot write the step 4 evaluation export (No space left on device) at {run.path / 'x'}; free disk "
        f"space or choose a path on another filesystem, then 'lctrain resume {run}' writes it from checkpoint step_4"
    )  # and trains nothing more: the run is at its last step


def test_a_failed_export_before_the_last_step_says_resume_continues(tmp_path):
    run = RunDir(tmp_path / "run")
    fake_checkpoint(run, 2)
    msg = failed(run, 2, trainer_module.EXPORT, OSError(errno.EDQUOT, "Disk quota exceeded"))
    assert "cannot write the step 2 evaluation export (Disk quota exceeded)" in msg
    assert msg.endswith(
        f"free space within your quota or choose a path on another filesystem, then 'lctrain resume {run}' writes it "
        f"from checkpoint step_2 and continues from step_2"
    )


def test_a_failed_checkpoint_without_one_before_it_promises_no_resume(tmp_path):
    run = RunDir(tmp_path / "run")
    msg = failed(run, 2, trainer_module.CHECKPOINT, OSError(errno.EEXIST, "File exists"))
    assert "cannot write the step 2 resume checkpoint (File exists)" in msg
    assert "free disk space" not in msg and "lctrain resume" not in msg
    start_over = run.start_over_command()
    assert msg.endswith(
        f"fix the path or choose another one; no checkpoint was written yet: '{start_over}' starts it over"
    )
    fake_checkpoint(run, 2)
    msg = failed(run, 4, trainer_module.CHECKPOINT, OSError(errno.EACCES, "Permission denied"))
    assert msg.endswith(
        f"fix the permissions or choose a writable path, then 'lctrain resume {run}' continues from step_2"
    )


def test_an_error_not_through_writing_is_the_same_line(tmp_path):
    run = RunDir(tmp_path / "run")
    fake_checkpoint(run, 4)
    with pytest.raises(UserError) as info, trainer_module._write_of_step(run, 4, 4, trainer_module.EXPORT):
        raise OSError(errno.ENOSPC, "No space left on device")
    assert str(info.value).startswith(
        f"{run}: cannot write the step 4 evaluation export (No space left on device) at {run.export(4)}; free disk"
    )
    with pytest.raises(ValueError), trainer_module._write_of_step(run, 4, 4, trainer_module.EXPORT):
        raise ValueError("not the machine's")


# ------------------------------------------------------------ real tiny runs


@pytest.mark.slow
def test_a_step_with_both_writes_the_checkpoint_then_the_export(data_dir, tmp_path, monkeypatch):
    writes = []
    save_resume, save_hf = ckpt.save_resume, ckpt.save_hf

    def resume_spy(engine, run, step, *args, **kwargs):
        writes.append(("checkpoint", step))
        return save_resume(engine, run, step, *args, **kwargs)

    def hf_spy(engine, lm, tokenizer, anchor, run, step, **kwargs):
        assert ckpt.latest_checkpoint(run).name == f"step_{step}"  # complete before its export starts
        writes.append(("export", step))
        return save_hf(engine, lm, tokenizer, anchor, run, step, **kwargs)

    monkeypatch.setattr(ckpt, "save_resume", resume_spy)
    monkeypatch.setattr(ckpt, "save_hf", hf_spy)
    result = CliRunner().invoke(app, train_args(data_dir, tmp_path / "run"))
    assert result.exit_code == 0, result.output
    assert writes == [("checkpoint", 2), ("export", 2), ("checkpoint", 4), ("export", 4)]


@pytest.mark.parametrize("sync", [True, False])
def test_every_file_of_a_checkpoint_is_on_the_disk_before_it_is_complete(data_dir, tmp_path, monkeypatch, sync):
    """checkpoint.sync_files: every rank's DeepSpeed files (model and ZeRO optimizer states) and RNG state are synced
    (fsync) before trainer_state.json, which makes the checkpoint complete; with it off, only lctrain's own state
    file and renames are."""
    synced = []
    real_fsync = os.fsync

    def recording(fd):
        synced.append(Path(os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording)
    run_dir = tmp_path / "run"
    extra = ["train.steps=2", "checkpoint.hf_last=0", "parallel.zero_stage=1", f"checkpoint.sync_files={sync}"]
    result = CliRunner().invoke(app, train_args(data_dir, run_dir, *extra))
    assert result.exit_code == 0, result.output
    step = RunDir(run_dir).checkpoint(2)
    written = step.with_name(TEMPORARY_PREFIX + step.name)  # the files were synced under the temporary name
    complete = synced.index(written / (TEMPORARY_PREFIX + ckpt.STATE_FILE))
    files = sorted(f.name for f in step.iterdir() if f.name != ckpt.STATE_FILE)
    assert {"mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt", "rng_rank0.pt"} <= set(files)
    before = {p.name for p in synced[:complete] if p.parent == written}
    assert before == (set(files) if sync else set())


@pytest.mark.slow
def test_an_export_failing_at_the_last_step_keeps_its_checkpoint(data_dir, tmp_path, monkeypatch):
    record = ckpt.write_export_record

    def full_at_step_4(directory, step):  # the disk fills with the export's last file
        if step == 4:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return record(directory, step)

    monkeypatch.setattr(ckpt, "write_export_record", full_at_step_4)
    run_dir = tmp_path / "run"
    rd = RunDir(run_dir)
    line = one_error_line(CliRunner().invoke(app, train_args(data_dir, run_dir)))
    assert line == (
        f"error: {run_dir}: cannot write the step 4 evaluation export (No space left on device) at "
        f"{rd.exports_dir / (TEMPORARY_PREFIX + 'step_4')}; free disk space or choose a path on another filesystem, "
        f"then 'lctrain resume {run_dir}' writes it from checkpoint step_4"
    )
    assert ckpt.latest_checkpoint(rd) == rd.checkpoint(4)
    assert ckpt.read_state(rd.checkpoint(4))["step"] == 4
    assert [p.name for p in rd.exports_dir.iterdir()] == ["step_2"]  # no half-written step_4 left taking space


@pytest.mark.slow
def test_an_export_failing_before_the_last_step_then_resume_continues(data_dir, tmp_path, monkeypatch):
    def full(directory, step):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    run_dir = tmp_path / "run"
    with monkeypatch.context() as m:
        m.setattr(ckpt, "write_export_record", full)
        line = one_error_line(CliRunner().invoke(app, train_args(data_dir, run_dir)))
    assert "cannot write the step 2 evaluation export (No space left on device)" in line
    assert line.endswith(f"'lctrain resume {run_dir}' writes it from checkpoint step_2 and continues from step_2")
    result = CliRunner().invoke(app, ["resume", str(run_dir)])
    assert result.exit_code == 0, result.output
    assert f"{run_dir}/hf/step_2 was not written" in result.output
    assert [p.name for p in RunDir(run_dir).exports()] == ["step_2", "step_4"]  # as the advice said


@pytest.mark.slow
def test_a_checkpoint_failing_on_a_full_disk_leaves_no_partial_one(data_dir, tmp_path, monkeypatch):
    """A full disk while writing a checkpoint: its partial files went only at the next resume, so the disk stayed
    full and the session's end could not be recorded (explorer: 42 MB left in checkpoints/.tmp-step_2 on a 40 MB
    filesystem, sessions.jsonl without an outcome)."""
    rng_file = ckpt.rng_file

    def full_at_step_4(rank):  # the disk fills after DeepSpeed wrote the model and optimizer states
        if (tmp_path / "run" / "checkpoints" / (TEMPORARY_PREFIX + "step_4")).is_dir():
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return rng_file(rank)

    monkeypatch.setattr(ckpt, "rng_file", full_at_step_4)
    run_dir = tmp_path / "run"
    rd = RunDir(run_dir)
    line = one_error_line(CliRunner().invoke(app, train_args(data_dir, run_dir)))
    assert line.startswith(f"error: {run_dir}: cannot write the step 4 resume checkpoint (No space left on device)")
    assert sorted(p.name for p in rd.checkpoints.iterdir()) == sorted(["step_2", ckpt.LATEST])
    assert rd.read_sessions()[-1]["outcome"] == "failed"


def test_a_failed_writes_file_is_closed_before_its_checkpoint_is_removed(tmp_path):
    """A write that failed holds its file open from its frame while the error lives, so removing it freed no space
    on a full disk (a 40 MB tmpfs stayed full and sessions.jsonl got no outcome); the frames are cleared first."""
    path = tmp_path / "mp_rank_00_model_states.pt"

    def open_files() -> list[str]:
        links = []
        for n in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):  # the listing's own descriptor is gone by now
                links.append(os.readlink(f"/proc/self/fd/{n}"))
        return links

    def write_until_full():
        f = open(path, "wb")  # noqa: SIM115 - held open by the frame, as torch.save's zip writer is
        f.write(b"x")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    try:
        try:
            write_until_full()
        except OSError as cause:
            raise UserError("cannot write the resume checkpoint") from cause
    except UserError as e:
        assert str(path) in open_files()
        ckpt._release_files(e)
        assert str(path) not in open_files()
