"""How a diverging run is told apart from a noisy one: the checkpoint a NaN's advice points to, the one warning
when the loss passes the loss of guessing uniformly, and the run's records of it, kept across resumes."""

import math

import pytest
from train_helpers import prepared_workdir, set_args, tiny_run
from typer.testing import CliRunner

from lctrain.cli import app
from lctrain.rundir import RunDir
from lctrain.train.metrics import SLOW_WINDOW, SlowSteps, slow_step
from lctrain.train.trainer import DIVERGED, StepResult, Trainer, divergence_warning, loss_rise


def records(*losses):
    return [{"step": i + 1, "loss": loss} for i, loss in enumerate(losses)]


def test_a_checkpoint_of_diverged_weights_is_told_from_a_noisy_one():
    # lr 10 on the tiny model (explore session): 10.4, 1578, 3109, 4991 at the checkpoint of step 4, NaN at step 6
    assert loss_rise(records(10.4, 1578.0, 3109.0, 4991.0, 5894.0), 4) == (4991.0, 10.4, 1)
    assert loss_rise(records(10.4, 9.1, 8.0, 8.3, 7.9), 4) is None  # a spike above the trend, not a divergence
    assert loss_rise(records(10.4, 9.1, 8.0, 2 * DIVERGED * 8.0), 4) == (32.0, 8.0, 3)
    assert loss_rise(records(10.4, math.nan, 8.0, 9.0), 4) is None  # a NaN logged before is no lowest loss
    assert loss_rise([], 4) is None and loss_rise(records(10.4), 1) is None  # nothing before it to compare with


def test_a_nans_advice_judges_a_checkpoint_by_the_loss_computed_on_its_weights(tmp_path):
    """Step k's loss is computed before its update, on step_{k-1}'s weights: step_1 held diverged weights when step
    2 logged 4492 (verify explorer: the advice said to lower the rate and resume step_1, which diverged again)."""
    import json

    from lctrain.config import load_config
    from lctrain.errors import RunFailed
    from lctrain.train import checkpoint as ckpt
    from lctrain.train.trainer import check_finite

    rd = RunDir(tmp_path / "run")
    rd.path.mkdir()
    rd.metrics_file.write_text("".join(json.dumps(r) + "\n" for r in records(10.39, 4491.9, 7350.4)))
    for step in (1, 2):  # complete checkpoints as far as the advice reads them
        rd.checkpoint(step).mkdir(parents=True)
        (rd.checkpoint(step) / ckpt.STATE_FILE).write_text(json.dumps({"step": step}))
    (rd.checkpoints / ckpt.LATEST).write_text("step_1\n")
    nan = StepResult(math.nan, 1, None, 0)
    with pytest.raises(RunFailed) as failed:
        check_finite(nan, 3, load_config(None, []), rd)  # step 4
    said = str(failed.value)
    assert "the last checkpoint, step_1, had diverged already (loss 4492 at step 2, computed on its weights" in said
    assert "no earlier checkpoint is kept" in said
    (rd.checkpoints / ckpt.LATEST).write_text("step_2\n")
    with pytest.raises(RunFailed) as failed:
        check_finite(nan, 3, load_config(None, []), rd)
    assert "step_2, had diverged already (loss 7350 at step 3" in str(failed.value)
    assert f"resume step_1, the newest kept before it (write its name into {rd.checkpoints / ckpt.LATEST}" in str(
        failed.value
    )


def test_one_warning_when_the_loss_passes_the_uniform_guess():
    vocab = 32000  # ln V = 10.37: a random init starts there
    assert divergence_warning(10.5, 1, vocab, warned=False) is None
    said = divergence_warning(52.0, 3, vocab, warned=False)
    assert said.startswith("warning: step 3: loss 52 is over 2 x that of guessing uniformly over the 32,000-token")
    assert "(10.37): training is diverging; lower train.lr" in said
    assert divergence_warning(90.0, 4, vocab, warned=True) is None  # once a run


def test_a_step_under_half_the_usual_throughput_is_slow():
    usual = [1000.0, 1100.0, 900.0, 1050.0, 950.0]  # median 1000
    assert slow_step(499.0, usual) == 1000.0
    assert slow_step(500.0, usual) is None  # half is not under half
    assert slow_step(10.0, usual[:4]) is None  # too few steps to know the usual: the first ones warm up
    assert slow_step(400.0, usual + [1.0, 1.0]) == 950.0  # a median: two slow steps before barely move it


def test_slow_steps_are_said_once_in_a_while_leaving_out_profiled_and_checkpoint_steps():
    watch = SlowSteps()
    said = {}
    for step in range(1, 260):
        # 1000 tokens/s, but a quarter of that every 10th step (step 30 profiled, so not judged), and from step 150 on
        rate = 250.0 if step % 10 == 0 or step >= 150 else 1000.0
        note = watch.note(step, rate, usual=step != 30)
        if note is not None:
            said[step] = note
    # the first slow step, then at most one note per SLOW_NOTE_EVERY = 50 steps
    assert list(said) == [10, 60, 110, 160]
    assert said[10] == (
        "note: step 10 ran at 250 tokens/s, under 50% of the median of the last 9 usual steps (1,000 tokens/s)"
    )
    assert said[60] == (
        f"note: step 60 ran at 250 tokens/s, under 50% of the median of the last {SLOW_WINDOW} usual steps "
        f"(1,000 tokens/s); 3 more slow steps since step 10"
    )  # 20, 40, 50
    assert said[110].endswith("; 4 more slow steps since step 60")  # 70, 80, 90, 100
    # 120, 130, 140 and 150-159: by step 160 the slowdown for good is the window's median, and step 160 says them
    assert said[160] == (
        "note: 13 more slow steps since step 110, under 50% of the median tokens/s of the usual steps before each"
    )


@pytest.mark.slow  # three tiny runs
@pytest.mark.usefixtures("one_thread")
def test_a_divergence_stays_recorded_across_resumes_from_the_step_it_happened(tmp_path_factory, monkeypatch):
    """Step 2's loss far above ln V (as a too-high learning rate makes it), the others the model's own: metrics.jsonl
    says "diverged" from step 2 on in the first session and in a resumed one, and so do both sessions' end records
    and the summary; resumed from a checkpoint before step 2 (its records cut there), the run has not diverged."""
    root = prepared_workdir(tmp_path_factory, "diverged_resumed", tiny_run)
    real_step = Trainer.train_step

    def step(self, windows):
        result = real_step(self, windows)
        loss = 1e4 if self.state.step == 1 else result.loss
        return StepResult(loss, result.valid_labels, result.grad_norm, result.pairs)

    monkeypatch.setattr(Trainer, "train_step", step)
    rd = RunDir(root / "run")
    keep_all = ["checkpoint.every_steps=1", "checkpoint.keep=10"]
    first = CliRunner().invoke(app, ["train", *set_args(tiny_run(root / "data", rd.path, steps=3) + keep_all)])
    assert first.exit_code == 0, first.output
    resumed = CliRunner().invoke(app, ["resume", str(rd.path), "--set", "train.steps=5"])
    assert resumed.exit_code == 0, resumed.output
    assert [(r["step"], r["diverged"]) for r in rd.read_metrics()] == [(1, False)] + [(s, True) for s in range(2, 6)]
    assert "note: the run had diverged at step 2 (" in resumed.output
    assert f"done: {rd.path} (diverged at step 2)" in resumed.stdout.splitlines()
    ends = [(s["start_step"], s["end_step"], s["diverged"], s.get("diverged_at")) for s in rd.read_sessions()]
    assert ends == [(0, 3, True, 2), (3, 5, True, 2)]

    monkeypatch.setattr(Trainer, "train_step", real_step)
    (rd.checkpoints / "latest").write_text("step_1\n")  # the checkpoint before the divergence
    again = CliRunner().invoke(app, ["resume", str(rd.path), "--set", "train.steps=6"])
    assert again.exit_code == 0, again.output
    assert [(r["step"], r["diverged"]) for r in rd.read_metrics()] == [(s, False) for s in range(1, 7)]
    assert f"done: {rd.path}" in again.stdout.splitlines() and "the run had diverged" not in again.output
    last = rd.read_sessions()[-1]
    assert (last["start_step"], last["end_step"], last["diverged"]) == (1, 6, False)
