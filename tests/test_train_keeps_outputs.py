"""Destruction only on request, and no non-finite number taken for a result: `lctrain train` in a directory where a
run finished anything (checkpoints, metrics of its last step, evaluation exports) refuses without --force, for every
combination of save settings; a loss or gradient that is not a number stops training at that step, writing nothing of
it. Tiny runs (the tiny default at 256 tokens, 12 steps) on one prepared dataset."""

import hashlib
import math
from pathlib import Path

import pytest
from train_helpers import nan_loss_at, one_error_line, prepared_workdir, set_args
from typer.testing import CliRunner

from lctrain.cli import app
from lctrain.config import load_config
from lctrain.rundir import RunDir
from lctrain.train import checkpoint as ckpt
from lctrain.train.trainer import Trainer

STEPS = 12


def tiny(data_dir: Path, run_dir: Path) -> list[str]:
    """The tiny default (tiny_anchor, the config without --config) at 256 tokens and 12 steps."""
    return [
        "data.seq_len=256",
        "data.token_budget=40000",
        f"data.output_dir={data_dir}",
        f"train.run_dir={run_dir}",
        f"train.steps={STEPS}",
        "train.global_batch=2",
        "train.micro_batch=1",
    ]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return prepared_workdir(tmp_path_factory, "keep", tiny)


def train(workdir: Path, run_dir: Path, extra: list[str], *args: str):
    return CliRunner().invoke(app, ["train", *args] + set_args(tiny(workdir / "data", run_dir) + extra))


def tree(run_dir: Path) -> dict[str, str]:
    """Every file of the run directory (but its lock) with a hash of its content."""
    return {
        str(p.relative_to(run_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(run_dir.rglob("*"))
        if p.is_file() and p.name != ".lctrain.lock"
    }


SETTINGS = [
    pytest.param(save_final, hf_last, every, id=f"final={save_final}-hf={hf_last}-every={every}")
    for save_final in (True, False)
    for hf_last in (0, 50)
    for every in (5, 100)  # checkpoints at steps 5 and 10 kept, or none before the last step
]


@pytest.mark.slow  # each case trains once, ~20 s on 2 cores; test_force_starts_over is the case, fast
@pytest.mark.parametrize("save_final, hf_last, every", SETTINGS)
def test_a_finished_run_is_never_deleted_without_force(workdir, tmp_path, save_final, hf_last, every):
    run_dir = tmp_path / "run"
    extra = [f"checkpoint.save_final={str(save_final).lower()}", f"checkpoint.hf_last={hf_last}"]
    extra += [f"checkpoint.every_steps={every}", "checkpoint.hf_every=10"]
    first = train(workdir, run_dir, extra)
    assert first.exit_code == 0, first.output
    rd = RunDir(run_dir)
    kept = [p.name for p in ckpt.complete_checkpoints(rd)]
    expected = ["step_5", "step_10"] * (every == 5) + ["step_12"] * save_final
    assert kept == expected[-2:]  # checkpoint.keep = 2
    exports = [p.name for p in rd.exports()]
    assert exports == (["step_2", "step_12"] if hf_last else [])
    before = tree(run_dir)

    line = one_error_line(train(workdir, run_dir, extra))
    assert "metrics.jsonl" in line and "--force" in line
    for name in exports:
        assert f"hf/{name}" in line
    if kept:
        assert f"lctrain resume {run_dir}" in line and f"checkpoints/{kept[-1]}" in line
    else:
        assert "no checkpoint to resume from" in line and "lctrain resume" not in line
    assert tree(run_dir) == before  # nothing touched


@pytest.mark.slow  # a second run of 6 s: the default suite is at its 5 minutes
def test_force_starts_over(workdir, tmp_path):
    run_dir = tmp_path / "run"
    extra = ["checkpoint.save_final=false", "checkpoint.every_steps=100"]  # the run: exports, no checkpoint
    assert train(workdir, run_dir, extra).exit_code == 0
    before = tree(run_dir)
    line = one_error_line(train(workdir, run_dir, extra))
    assert "metrics.jsonl, hf/step_2, hf/step_12" in line and "no checkpoint to resume from" in line
    assert tree(run_dir) == before
    again = train(workdir, run_dir, extra + ["train.steps=3", "checkpoint.hf_last=0"], "--force")
    assert again.exit_code == 0, again.output
    rd = RunDir(run_dir)
    assert [r["step"] for r in rd.read_metrics()] == [1, 2, 3] and rd.exports() == []


def test_what_counts_as_finished(tmp_path):
    rd = RunDir(tmp_path)
    rd.write_config(load_config(None, ["train.steps=4"]))
    assert rd.finished_outputs() == []
    rd.append_metrics({"step": 1, "loss": 2.0})
    assert rd.finished_outputs() == []  # a run stopped before its last step, with nothing to resume: no result
    (rd.exports_dir / ".tmp-step_2").mkdir(parents=True)  # an export being written
    assert rd.finished_outputs() == []
    rd.export(2).mkdir()
    assert rd.finished_outputs() == ["hf/step_2"]
    for step in (2, 3, 4):
        rd.append_metrics({"step": step, "loss": 1.0})
    assert rd.finished_outputs() == ["metrics.jsonl", "hf/step_2"]
    rd.metrics_file.write_text('{"step": 1, "lo\n{"step": 2}\n')  # damaged: kept, as if finished
    assert rd.finished_outputs()[0] == "metrics.jsonl"


def test_a_learning_rate_that_diverges_stops_at_the_first_non_finite_step(workdir, tmp_path):
    run_dir = tmp_path / "run"
    extra = ["train.lr=1e30", "train.warmup_steps=0", "checkpoint.every_steps=1", "checkpoint.hf_every=1"]
    line = one_error_line(train(workdir, run_dir, extra), code=1)  # the run failed, not its command
    rd = RunDir(run_dir)
    logged = rd.read_metrics()
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in logged)
    bad = len(logged) + 1  # the first step that is not logged is the one named
    assert line.startswith(f"error: step {bad}: the ") and " is nan" in line
    assert "train.lr = 1e+30" in line and "model.dtype = float32" in line
    # nothing of the bad step or after it: the checkpoints and exports end with the last good step
    assert [ckpt.readable_state(p)["step"] for p in ckpt.complete_checkpoints(rd)] == list(range(1, bad))[-2:]
    assert [p.name for p in rd.exports()] == [f"step_{s}" for s in range(1, bad)]
    if bad > 1:  # the bad step computed on the last checkpoint's weights: resuming it fails whatever the rate
        assert f"this step computes on the weights of the last checkpoint, step_{bad - 1}, so resuming it" in line
        earlier = "no earlier checkpoint is kept" if bad == 2 else f"resume step_{bad - 2}, the newest kept before it"
        assert earlier in line
    start_over = f"lctrain train --config {run_dir / 'config.yaml'} --set train.lr=1e+29 --force"
    assert f"start over with a lower train.lr, e.g. '{start_over}'" in line


@pytest.mark.slow  # 3-7 s in CI: slow-marked to keep `make test` under its 5 minutes
def test_an_injected_nan_loss_names_the_step_and_keeps_the_checkpoint_before_it(workdir, tmp_path, monkeypatch):
    real_step = nan_loss_at(monkeypatch, 6)  # the 7th update
    run_dir = tmp_path / "run"
    line = one_error_line(train(workdir, run_dir, ["checkpoint.every_steps=5", "checkpoint.hf_last=0"]), code=1)
    assert line.startswith("error: step 7: the loss is nan;")
    assert line.endswith(
        f"the last checkpoint is step_5: lower train.lr in {run_dir / 'config.yaml'}, then 'lctrain resume {run_dir}'"
    )
    rd = RunDir(run_dir)
    assert [r["step"] for r in rd.read_metrics()] == list(range(1, 7))
    assert [p.name for p in ckpt.complete_checkpoints(rd)] == ["step_5"]
    monkeypatch.setattr(Trainer, "train_step", real_step)
    resumed = CliRunner().invoke(app, ["resume", str(run_dir)])  # the kept checkpoint resumes
    assert resumed.exit_code == 0, resumed.output
    assert [r["step"] for r in rd.read_metrics()] == list(range(1, STEPS + 1))


def test_a_single_process_out_of_host_memory_is_one_line(workdir, tmp_path, monkeypatch):
    """torch's CPU allocator raises a plain RuntimeError: one line naming it and the plan, as for a launched rank;
    the resume advice where a checkpoint exists, else how to start over."""

    def no_memory(self, windows):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 4294967296 bytes.")

    monkeypatch.setattr(Trainer, "train_step", no_memory)
    line = one_error_line(train(workdir, tmp_path / "run", ["checkpoint.hf_last=0"]), code=1)
    assert line == (
        "error: the run ran out of memory (DefaultCPUAllocator: can't allocate memory: you tried to allocate "
        "4294967296 bytes.); `lctrain plan` shows what fits; no checkpoint was written yet: 'lctrain train --config "
        f"{RunDir(tmp_path / 'run').config_file} --force' starts it over"
    )


@pytest.mark.parametrize("backend, device_ids", [("gloo", None), ("nccl", [3])])
def test_checkpoint_barriers_name_their_gpu_on_nccl(monkeypatch, backend, device_ids):
    """NCCL's barrier warns at every checkpoint of a one-GPU run unless it is told its device (seen on an H200)."""
    import deepspeed.comm
    import torch

    calls = []
    monkeypatch.setattr(torch.distributed, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(deepspeed.comm, "barrier", lambda **kw: calls.append(kw))
    ckpt.barrier()
    assert calls == [{"device_ids": device_ids}]
