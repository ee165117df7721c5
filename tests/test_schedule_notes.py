"""What a run says about its learning-rate schedule before its first step: a warmup that outlasts the run, and a
resume whose new settings move the rate of the next step away from the checkpoint's schedule. The expected rates are
written out from the schedule's definition (linear warmup, then cosine or linear decay to 0 after the last step)."""

import math

from lctrain.config import TrainConfig, load_config, settings
from lctrain.train.schedule import resumed_rate_note, warmup_warning


def test_a_run_that_is_all_warmup_says_its_highest_rate():
    assert warmup_warning(TrainConfig(steps=6, warmup_steps=5, lr=1e-3)) is None
    said = warmup_warning(TrainConfig(steps=6, warmup_steps=8, lr=1e-3, lr_schedule="cosine"))
    assert said == (
        "warning: train.warmup_steps = 8 >= train.steps = 6: the whole run is warmup; its highest learning rate is "
        "7.500e-04 at step 6 (train.lr = 0.001), and the cosine decay never starts"
    )  # 6/8 of 1e-3
    # as long as the run: train.lr at the last step only
    said = warmup_warning(TrainConfig(steps=4, warmup_steps=4, lr=2e-5))
    assert said.endswith("its highest learning rate is 2.000e-05 at step 4 (train.lr = 2e-05)")


def saved(**train) -> dict:
    """A checkpoint's settings (`config.settings`) with these train values."""
    return settings(load_config(None, [f"train.{k}={v}" for k, v in train.items()]))


def test_a_resume_to_more_steps_of_a_cosine_says_the_rate_jumps():
    before = saved(steps=6, warmup_steps=1, lr=1e-3, lr_schedule="cosine")
    now = TrainConfig(steps=12, warmup_steps=1, lr=1e-3, lr_schedule="cosine")
    # step 6 (index 5) is 4/5 through a decay of 5 steps; step 7 (index 6) 5/11 through one of 11, 1/1 in the old one
    last, nxt = 1e-3 * (1 + math.cos(math.pi * 4 / 5)) / 2, 1e-3 * (1 + math.cos(math.pi * 5 / 11)) / 2
    assert resumed_rate_note(6, before, now) == (
        f"note: the learning rate goes from {last:.3e} at step 6 (the last taken) to {nxt:.3e} at step 7 "
        f"(train.steps 6 -> 12; 0.000e+00 under the checkpoint's schedule)"
    )
    assert f"{last:.3e} {nxt:.3e}" == "9.549e-05 5.712e-04"  # the user's run: a sixfold jump
    # a stopped run resumed as it was, or to more steps of a constant rate after warmup: nothing changes
    assert resumed_rate_note(3, before, TrainConfig(**before["train"])) is None
    constant = saved(steps=6, warmup_steps=2, lr=1e-3)
    assert resumed_rate_note(6, constant, TrainConfig(steps=20, warmup_steps=2, lr=1e-3)) is None


def test_a_resume_with_another_rate_or_schedule_says_so():
    before = saved(steps=10, warmup_steps=0, lr=1e-3, lr_schedule="linear")
    # a lower rate after a divergence: step 4 at 1e-3 x (1 - 3/10), step 5 at 1e-4 x (1 - 4/10)
    assert resumed_rate_note(4, before, TrainConfig(steps=10, warmup_steps=0, lr=1e-4, lr_schedule="linear")) == (
        "note: the learning rate goes from 7.000e-04 at step 4 (the last taken) to 6.000e-05 at step 5 "
        "(train.lr 0.001 -> 0.0001; 6.000e-04 under the checkpoint's schedule)"
    )
    said = resumed_rate_note(4, before, TrainConfig(steps=10, warmup_steps=0, lr=1e-3, lr_schedule="constant"))
    assert said.endswith(
        "to 1.000e-03 at step 5 (train.lr_schedule 'linear' -> 'constant'; 6.000e-04 under the checkpoint's schedule)"
    )
    # a checkpoint from before configs were stored in it: nothing to compare with
    assert (
        resumed_rate_note(4, None, TrainConfig()) is None and resumed_rate_note(4, {"train": {}}, TrainConfig()) is None
    )
