"""Shared by the end-to-end training tests: a prepared dataset, a 1-process reference run, and CLI subprocesses."""

import math
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from typer.testing import CliRunner

from lctrain.cli import app
from lctrain.config import load_config
from lctrain.export_record import write_export_record
from lctrain.hardware import usable_cpus
from lctrain.rundir import RunDir

# prepare starts one tokenizer process per usable core at most: tests that watch two of them need two cores
two_tokenizer_workers = pytest.mark.skipif(usable_cpus() < 2, reason="data.num_workers=2 needs 2 usable CPU cores")

# Variables a launcher sets; a child `lctrain train` must not inherit them from the test process.
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

# The tiny Llama of the training tests (model.arch), a few seconds a step on one CPU core.
TINY_ARCH = (
    "{model_type: llama, hidden_size: 64, intermediate_size: 128, num_hidden_layers: 2, "
    "num_attention_heads: 4, num_key_value_heads: 2, tie_word_embeddings: true}"
)

Overrides = Callable[[Path, Path], list[str]]  # (data_dir, run_dir) -> --set items


def tiny_run(data_dir: Path, run_dir: Path, steps: int = 2, global_batch: int = 1) -> list[str]:
    """The --set items of a tiny CLI run into `run_dir` (TINY_ARCH on 128-token windows of a 6,000-token dataset at
    `data_dir`, no warmup, no evaluation export): a few seconds of training on one core."""
    return [
        "data.seq_len=128",
        "data.token_budget=6000",
        f"data.output_dir={data_dir}",
        f"train.run_dir={run_dir}",
        f"train.steps={steps}",
        f"train.global_batch={global_batch}",
        "train.micro_batch=1",
        "train.warmup_steps=0",
        "checkpoint.hf_last=0",
        f"model.arch={TINY_ARCH}",
    ]


def equivalence_run(data_dir: Path, run_dir: Path, *, steps: int, micro_batch: int, arch: str) -> list[str]:
    """A short run for comparing a setting with its absence: 2 windows of 128 tokens per step, lr 3e-3 from the first
    step and no clipping (so a wrong gradient moves the loss at once), no checkpoints."""
    return [
        "data.seq_len=128",
        "data.token_budget=12000",
        f"data.output_dir={data_dir}",
        f"train.run_dir={run_dir}",
        f"train.steps={steps}",
        "train.global_batch=2",
        f"train.micro_batch={micro_batch}",
        "train.warmup_steps=0",
        "train.lr=3e-3",
        "train.grad_clip=0",
        "checkpoint.save_final=false",
        "checkpoint.hf_last=0",
        f"model.arch={arch}",
    ]


def set_args(items: list[str]) -> list[str]:
    return [a for item in items for a in ("--set", item)]


def clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", **extra)
    return env


def cli_train_command(overrides: Overrides, workdir: Path, run_dir: Path, extra: list[str] = ()) -> list[str]:
    return [sys.executable, "-m", "lctrain.cli", "train"] + set_args(overrides(workdir / "data", run_dir) + list(extra))


def killed_in_checkpoint_command(overrides: Overrides, workdir: Path, run_dir: Path, step: int) -> list[str]:
    """A training process that kills itself inside the write of step `step`'s checkpoint (kill_in_checkpoint.py)."""
    script = Path(__file__).with_name("kill_in_checkpoint.py")
    return [sys.executable, str(script), str(step)] + set_args(overrides(workdir / "data", run_dir))


def prepared_workdir(tmp_path_factory, name: str, overrides: Overrides) -> Path:
    """A fresh directory whose `data/` holds the dataset the overrides describe."""
    from lctrain.data.prepare import prepare

    root = tmp_path_factory.mktemp(name)
    prepare(load_config(None, overrides(root / "data", root / "ref")))
    return root


def run_cli_train(overrides: Overrides, workdir: Path, name: str, extra: list[str], timeout: float = 400) -> Path:
    """`lctrain train` in a subprocess (the launcher path) into `workdir/name`; fails the test with its stderr."""
    run_dir = workdir / name
    proc = subprocess.run(
        cli_train_command(overrides, workdir, run_dir, extra),
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir


def metric_records(run_dir: Path) -> list[dict]:
    """The run's metrics.jsonl, one dict per step."""
    return RunDir(run_dir).read_metrics()


def losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in metric_records(run_dir)]


def reference_run(workdir: Path, overrides: Overrides) -> Path:
    """The uninterrupted 1-process run in this process, in `workdir/ref`."""
    from lctrain.train.command import train

    return train(load_config(None, overrides(workdir / "data", workdir / "ref")))


def one_error_line(result, code: int = 2) -> str:
    """The single `error: ...` line of a CLI run (typer's CliRunner result) that must end with exit code `code` (2: the
    command cannot run as given; 1: the run failed, lctrain/errors.py) and no traceback; progress bars may come before
    it."""
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.output, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, result.output
    return errors[0]


def show_config_refusal(overrides: list[str]) -> str:
    """The one line on stderr with which `lctrain show-config --set ...` refuses `overrides` (exit code 2)."""
    result = CliRunner().invoke(app, ["show-config", *set_args(overrides)])
    line = result.stderr.strip()
    assert result.exit_code == 2 and "\n" not in line, result.output
    return line


def export_by_hand(model, tokenizer, run: Path, step: int) -> Path:
    """An evaluation export of `run` at `step` written here rather than by training: the weights, the tokenizer and
    the record `lctrain eval` checks them against."""
    out = RunDir(run).export(step)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    write_export_record(out, step)
    return out


def nan_loss_at(monkeypatch, update: int):
    """Make the trainer's update `update` (0-based) end with a NaN loss, as a diverged step does; returns the real
    `Trainer.train_step`, to put back."""
    from lctrain.train.trainer import StepResult, Trainer

    real_step = Trainer.train_step

    def step(self, windows):
        result = real_step(self, windows)
        if self.state.step == update:
            return StepResult(math.nan, result.valid_labels, result.grad_norm, result.pairs)
        return result

    monkeypatch.setattr(Trainer, "train_step", step)
    return real_step


def export_lock_fails(monkeypatch, number: int) -> None:
    """Every export's lock file (`.lctrain-export-*.lock`) fails to open with errno `number`, as the machine would
    refuse it (a name too long, a read-only filesystem); every other file opens."""
    from lctrain import lifetime

    real_open = lifetime.os.open

    def refused(path, *args, **kwargs):
        if Path(path).name.startswith(".lctrain-export-"):
            raise OSError(number, os.strerror(number), str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(lifetime.os, "open", refused)
