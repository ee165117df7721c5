"""The disk plan (`lctrain.disk`): a run's checkpoints and exports at their peak, before it starts.

The peak against a step-by-step replay of the trainer's order (checkpoint, prune to `keep`, export) and against the
bytes a real run has on its disk when its last checkpoint is about to complete (every stage and dtype: DeepSpeed's
files and the safetensors export); `train` refuses a run that would not fit, in one line, and counts what a resumed
run's directory already holds.
"""

import itertools
from pathlib import Path

import pytest
from train_helpers import TINY_ARCH, one_error_line, prepared_workdir
from typer.testing import CliRunner

from lctrain import disk
from lctrain.cli import app
from lctrain.config import CheckpointConfig, load_config
from lctrain.model import model_shape
from lctrain.rundir import RunDir
from lctrain.train import checkpoint as ckpt
from lctrain.train.schedule import hf_checkpoint_steps, resume_checkpoint_due

pytestmark = pytest.mark.usefixtures("one_thread")


def settings(steps: int, every: int, keep: int, hf_every: int, hf_last: int, save_final: bool = True) -> list[str]:
    return [
        f"train.steps={steps}",
        f"checkpoint.every_steps={every}",
        f"checkpoint.keep={keep}",
        f"checkpoint.hf_every={hf_every}",
        f"checkpoint.hf_last={hf_last}",
        f"checkpoint.save_final={str(save_final).lower()}",
    ]


def replayed_peak(cfg, c: int, x: int) -> int:
    """The largest bytes on the disk over a run, replaying the trainer's writes step by step: the checkpoint written
    whole beside the ones kept, then pruned to `keep`, then the step's export."""
    checkpoints, exports, peak = 0, 0, 0
    hf = hf_checkpoint_steps(cfg.train.steps, cfg.checkpoint)
    for step in range(1, cfg.train.steps + 1):
        if resume_checkpoint_due(step, cfg.train.steps, cfg.checkpoint):
            checkpoints += 1
            peak = max(peak, checkpoints * c + exports * x)
            checkpoints = min(checkpoints, cfg.checkpoint.keep)
        if step in hf:
            exports += 1
            peak = max(peak, checkpoints * c + exports * x)
    return peak


@pytest.mark.parametrize("dtype,stage", [("float32", 0), ("float32", 1), ("bfloat16", 1), ("bfloat16", 3)])
def test_the_peak_is_the_largest_of_a_replay_of_the_run(dtype, stage):
    n = 1_000_003
    base = load_config(None, [f"model.dtype={dtype}", f"parallel.zero_stage={stage}"])
    c, x = disk.checkpoint_bytes(n, dtype, stage), disk.export_bytes(n, dtype)
    for steps, every, keep, hf_every, hf_last, final in itertools.product(
        (1, 7, 50, 53), (1, 3, 10, 100), (1, 2, 5), (1, 10), (0, 5, 50), (True, False)
    ):
        checkpoint = CheckpointConfig(
            every_steps=every, keep=keep, hf_every=hf_every, hf_last=hf_last, save_final=final
        )
        cfg = base.model_copy(
            update={"checkpoint": checkpoint, "train": base.train.model_copy(update={"steps": steps})}
        )
        assert disk.plan_disk(cfg, n).total == replayed_peak(cfg, c, x), (steps, every, keep, hf_every, hf_last, final)
        due = [s for s in range(1, steps + 1) if resume_checkpoint_due(s, steps, checkpoint)]
        assert disk.checkpoint_steps(steps, checkpoint) == (len(due), due[-1] if due else 0)


def test_the_papers_schedule_peaks_while_its_last_checkpoint_is_written():
    """Llama-2-7B in bf16 at ZeRO-3 for 2,000 steps, keep 2, exports every 10 of the last 50: three checkpoints (the
    two kept and the last) beside the four exports before the last step, over 300 GB."""
    cfg = load_config(None, ["model.dtype=bfloat16", "parallel.zero_stage=3", *settings(2000, 10, 2, 10, 50)])
    n = 6_738_415_616
    planned = disk.plan_disk(cfg, n)
    assert (planned.checkpoints, planned.exports) == (3, 4)
    assert planned.total == 3 * 12 * n + 4 * 2 * n
    assert planned.words() == (
        "3 resume checkpoints of 80.86 GB (checkpoint.keep 2, and the last while it is written), 4 evaluation "
        "exports of 13.48 GB"
    )


def overrides(data_dir: Path, run_dir: Path) -> list[str]:
    return [
        "data.seq_len=128",
        "data.token_budget=6000",
        f"data.output_dir={data_dir}",
        f"train.run_dir={run_dir}",
        "train.global_batch=1",
        "train.micro_batch=1",
        f"model.arch={TINY_ARCH}",
        *settings(steps=4, every=1, keep=2, hf_every=2, hf_last=4),
    ]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return prepared_workdir(tmp_path_factory, "disk", overrides)


def tensor_bytes(run: Path) -> int:
    """The bytes of the tensors' files under a run's checkpoints/ and hf/: DeepSpeed's archives (less the RNG
    states) and the exports' safetensors."""
    files = [*run.glob("checkpoints/*/*.pt"), *run.glob("hf/*/*.safetensors")]
    return sum(f.stat().st_size for f in files if not f.name.startswith("rng_"))


@pytest.mark.parametrize(
    "dtype,stage",
    [
        pytest.param("float32", 0, marks=pytest.mark.slow),
        pytest.param("float32", 1, marks=pytest.mark.slow),
        ("bfloat16", 2),
        pytest.param("bfloat16", 3, marks=pytest.mark.slow),
    ],
)
def test_the_plan_is_what_a_run_holds_when_its_last_checkpoint_completes(workdir, dtype, stage):
    """Measured while the last step's checkpoint is written, before the oldest is pruned: three checkpoints and
    step 2's export. The plan counts the tensors; the archives' structure adds a little (< 1%)."""
    from lctrain.train.command import train

    run = workdir / f"{dtype}_{stage}"
    cfg = load_config(None, [*overrides(workdir / "data", run), f"model.dtype={dtype}", f"parallel.zero_stage={stage}"])
    measured = {}
    train(cfg, before_checkpoint_complete=lambda step: measured.setdefault(step, tensor_bytes(run)))
    planned = disk.plan_disk(cfg, model_shape(cfg).param_count())
    assert (planned.checkpoints, planned.exports) == (3, 1)
    assert planned.total <= measured[4] < planned.total * 1.01
    export = sum(f.stat().st_size for f in (run / "hf" / "step_4").glob("*.safetensors"))
    assert planned.export_bytes <= export < planned.export_bytes * 1.01


def test_train_refuses_a_run_whose_peak_does_not_fit_and_counts_what_a_resume_holds(workdir, monkeypatch, tmp_path):
    run = tmp_path / "run"
    args = [f"--set={o}" for o in overrides(workdir / "data", run)]
    cfg = load_config(None, overrides(workdir / "data", run))
    peak = disk.plan_disk(cfg, model_shape(cfg).param_count()).total
    monkeypatch.setattr(disk, "free_bytes", lambda path: peak - 1)
    line = one_error_line(CliRunner().invoke(app, ["train", *args]))
    assert line.startswith(
        f"error: {run} needs {peak / 1e9:.1f} GB more disk than its filesystem has free ({(peak - 1) / 1e9:.1f} GB) "
        f"at its peak: 3 resume checkpoints of "
    )
    assert line.endswith("or set checkpoint.check_disk=false to start all the same")
    assert not run.exists()
    said = CliRunner().invoke(app, ["train", *args, "--set=checkpoint.check_disk=false", "--set=train.steps=2"])
    assert said.exit_code == 0, said.output
    # resumed for 4 steps: the two checkpoints it holds count towards the peak, which then fits
    written = sum(f.stat().st_size for d in ("checkpoints", "hf") for f in (run / d).rglob("*") if f.is_file())
    monkeypatch.setattr(disk, "free_bytes", lambda path: peak - written)
    said = CliRunner().invoke(app, ["resume", str(run), "--set", "train.steps=4"])
    assert said.exit_code == 0, said.output
    assert [p.name for p in ckpt.complete_checkpoints(RunDir(run))] == ["step_3", "step_4"]
