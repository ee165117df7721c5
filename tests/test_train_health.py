"""How a diverging run is told apart from a noisy one: the checkpoint a NaN's advice points to, and the one warning
when the loss passes the loss of guessing uniformly."""

import math

from lctrain.train.trainer import DIVERGED, divergence_warning, loss_rise


def records(*losses):
    return [{"step": i + 1, "loss": loss} for i, loss in enumerate(losses)]


def test_a_checkpoint_of_diverged_weights_is_told_from_a_noisy_one():
    # lr 10 on the tiny model (explore session): 10.4, 1578, 3109, 4991 at the checkpoint of step 4, NaN at step 6
    assert loss_rise(records(10.4, 1578.0, 3109.0, 4991.0, 5894.0), 4) == (4991.0, 10.4, 1)
    assert loss_rise(records(10.4, 9.1, 8.0, 8.3, 7.9), 4) is None  # a spike above the trend, not a divergence
    assert loss_rise(records(10.4, 9.1, 8.0, 2 * DIVERGED * 8.0), 4) == (32.0, 8.0, 3)
    assert loss_rise(records(10.4, math.nan, 8.0, 9.0), 4) is None  # a NaN logged before is no lowest loss
    assert loss_rise([], 4) is None and loss_rise(records(10.4), 1) is None  # nothing before it to compare with


def test_one_warning_when_the_loss_passes_the_uniform_guess():
    vocab = 32000  # ln V = 10.37: a random init starts there
    assert divergence_warning(10.5, 1, vocab, warned=False) is None
    said = divergence_warning(52.0, 3, vocab, warned=False)
    assert said.startswith("warning: step 3: loss 52 is over 2 x that of guessing uniformly over the 32,000-token")
    assert "(10.37): training is diverging; lower train.lr" in said
    assert divergence_warning(90.0, 4, vocab, warned=True) is None  # once a run
