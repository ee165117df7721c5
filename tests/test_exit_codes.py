"""The exit-code contract (lctrain/errors.py, docs/troubleshooting.md): 2 when the command cannot run as given (fix
the command or its inputs), 1 when the work ran and failed (a NaN loss, a rank out of memory, killed or hung: a
resubmit or a resume may help), so that a job script can tell the two apart; 130 Ctrl-C, 143 SIGTERM."""

import errno
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from train_helpers import clean_env, nan_loss_at, one_error_line, prepared_workdir, set_args, tiny_run
from typer.testing import CliRunner

from lctrain.cli import app, user_errors
from lctrain.errors import RunFailed, UserError
from lctrain.lifetime import Terminated
from lctrain.parallel.launch import ProcessKilled, RanksHung


def tiny(data_dir: Path, run_dir: Path) -> list[str]:
    return tiny_run(data_dir, run_dir, steps=3, global_batch=2)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return prepared_workdir(tmp_path_factory, "exit_codes", tiny)


@pytest.mark.parametrize(
    "error, code",
    [
        (UserError("train.stesp: not a 'train' configuration key"), 2),
        (OSError(errno.ENOSPC, "No space left on device", "runs/x/metrics.jsonl"), 2),  # the machine's: as ever
        (RunFailed("step 2: the loss is nan"), 1),
        (ProcessKilled("rank 1 (pid 4242)", "SIGKILL", Path("runs/x/ranks/launcher.log")), 1),
        (RanksHung("rank 1 hung in step 6", Path("runs/x/ranks/launcher.log")), 1),
        (KeyboardInterrupt(), 130),
        (Terminated(), 143),
    ],
    ids=["user-error", "disk-full", "run-failed", "rank-killed", "ranks-hung", "ctrl-c", "sigterm"],
)
def test_each_end_exits_with_its_code(error, code, capsys):
    @user_errors
    def command():
        raise error

    with pytest.raises(typer.Exit) as exited:
        command()
    assert exited.value.exit_code == code
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.usefixtures("one_thread")
def test_a_nan_loss_exits_1_and_a_config_typo_2(workdir, tmp_path, monkeypatch):
    typo = CliRunner().invoke(app, ["train", *set_args(tiny(workdir / "data", tmp_path / "typo") + ["train.stesp=4"])])
    assert "train.stesp" in one_error_line(typo, code=2)
    nan_loss_at(monkeypatch, 0)  # the first update
    failed = CliRunner().invoke(app, ["train", *set_args(tiny(workdir / "data", tmp_path / "nan"))])
    assert one_error_line(failed, code=1).startswith("error: step 1: the loss is nan;")


@pytest.mark.slow  # a 2-process run on the CPU
def test_a_nan_loss_in_launched_ranks_exits_1(workdir, tmp_path):
    """The ranks' RunFailed crosses the launcher: `lctrain train` of 2 processes exits 1, not 2."""
    extra = ["parallel.nproc_per_node=2", "train.lr=1e30", "checkpoint.save_final=false"]
    cmd = [sys.executable, "-m", "lctrain.cli", "train", *set_args(tiny(workdir / "data", tmp_path / "run") + extra)]
    proc = subprocess.run(cmd, env=clean_env(CUDA_VISIBLE_DEVICES=""), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    line = errors[0]
    assert line.startswith("error: step ") and (" is nan" in line or " is inf" in line), line
