"""`logging.tensorboard`: the step metrics as TensorBoard scalars, read back with TensorBoard's own event reader; a
resumed run replaces what a killed run logged after its checkpoint; without the package, one line."""

import sys

import pytest

from lctrain.config import load_config
from lctrain.errors import UserError
from lctrain.rundir import RunDir
from lctrain.train.metrics import StepLogger, tensorboard_writer_class


def records(steps, loss_of):
    return [
        {"step": s, "loss": loss_of(s), "lr": 1e-3, "grad_norm": None, "tokens_per_s": 100.0 * s, "mfu": None}
        | {"peak_mem_gb": 1.5}
        for s in steps
    ]


def scalars(run_dir) -> dict[str, list[tuple[int, float]]]:
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    acc = event_accumulator.EventAccumulator(str(RunDir(run_dir).tensorboard_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_metrics_read_back_from_the_event_files(tmp_path):
    pytest.importorskip("tensorboard")
    cfg = load_config(None, ["logging.tensorboard=true", "logging.log_every=2"])
    run = RunDir(tmp_path / "run")
    run.path.mkdir(parents=True)
    logger = StepLogger(run, cfg, start_step=0, total_steps=6, wandb_id="x")
    for r in records(range(1, 7), lambda s: 10.0 - s):
        logger.log(r)
    logger.close()
    got = scalars(run.path)
    # None and the step itself are not scalars
    assert set(got) == {"train/loss", "train/lr", "train/tokens_per_s", "train/peak_mem_gb"}
    assert got["train/loss"] == [(2, 8.0), (4, 6.0), (6, 4.0)]
    assert got["train/tokens_per_s"] == [(2, 200.0), (4, 400.0), (6, 600.0)]
    # resumed from a checkpoint of step 2: the killed run's steps 3-6 are replaced
    logger = StepLogger(run, cfg, start_step=2, total_steps=6, wandb_id="x")
    for r in records(range(3, 7), lambda s: 100.0 + s):
        logger.log(r)
    logger.close()
    assert scalars(run.path)["train/loss"] == [(2, 8.0), (4, 104.0), (6, 106.0)]
    # the last step is logged whatever log_every says
    logger = StepLogger(run, cfg, start_step=6, total_steps=7, wandb_id="x")
    logger.log(records(range(7, 8), lambda s: 1.0)[0])
    logger.close()
    assert scalars(run.path)["train/loss"][-1] == (7, 1.0)


def test_without_the_package_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails as when not installed
    cfg = load_config(None, ["logging.tensorboard=true"])
    with pytest.raises(UserError, match=r"logging.tensorboard = true needs TensorBoard \(pip install") as e:
        tensorboard_writer_class(cfg)
    assert "\n" not in str(e.value)
