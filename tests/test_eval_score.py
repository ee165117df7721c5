"""RULER scoring and the checkpoint average, against hand computations from the definitions in NVIDIA/RULER's
scripts/eval/synthetic/constants.py and scripts/eval/evaluate.py."""

import pytest

from lctrain.eval.score import (
    average_checkpoints,
    mean_over_tasks,
    postprocess,
    string_match_all,
    string_match_part,
    task_score,
)


def test_string_match_all():
    answers = ("1234567", "7654321", "ABC", "xyz")
    assert string_match_all("1234567, 7654321, abc and XYZ.", answers) == 1.0
    assert string_match_all("The numbers are 1234567 and abc", answers) == 0.5
    assert string_match_all("", answers) == 0.0
    assert string_match_all("nothing here", answers) == 0.0
    with pytest.raises(ValueError):
        string_match_all("x", ())


def test_string_match_part():
    assert string_match_part("It was Paris.", ("Paris", "the capital")) == 1.0
    assert string_match_part("It was Lyon.", ("Paris", "the capital")) == 0.0
    assert string_match_part("", ("Paris",)) == 0.0


def test_worked_examples_of_rulers_definitions():
    # niah_multivalue: four values expected, the prediction names three of them -> 3/4
    values = ("4417329", "9020165", "1298764", "6617743")
    assert string_match_all(" 4417329, 9020165 and 1298764.", values) == 0.75
    # a value inside a longer number still counts: RULER matches substrings, not tokens
    assert string_match_all("44173291", ("4417329",)) == 1.0
    # qa: any acceptable answer scores the whole sample; string_match_all would give 1/3
    refs = ("Denver Broncos", "the Broncos", "Broncos")
    assert string_match_part("The broncos won.", refs) == 1.0
    assert string_match_all("The broncos won.", refs) == pytest.approx(2 / 3)


def test_postprocess_like_ruler():
    assert postprocess("  abc\tdef\x00g \n") == "abc\ndef\ng"
    assert postprocess("\x1f\x01 x") == "x"
    assert postprocess("no change") == "no change"
    assert postprocess("\x7f stays") == "\x7f stays"  # only \x00-\x1f are control characters to RULER


def test_task_score_is_percent_rounded_like_ruler():
    assert task_score([1.0, 0.5, 0.0, 0.5]) == 50.0
    assert task_score([1.0, 0.0, 0.0]) == 33.33
    assert task_score([1.0, 1.0, 0.0]) == 66.67
    assert task_score([0.75, 1.0, 1.0]) == 91.67


def test_checkpoint_average_by_hand():
    scores = {
        "step_10": {"niah": {4096: 100.0, 8192: 50.0}, "vt": {4096: 20.0, 8192: 0.0}},
        "step_20": {"niah": {4096: 80.0, 8192: 70.0}, "vt": {4096: 40.0, 8192: 10.0}},
        "step_30": {"niah": {4096: 90.0, 8192: 30.0}, "vt": {4096: 60.0, 8192: 20.0}},
    }
    avg = average_checkpoints(scores)
    assert avg == {"niah": {4096: 90.0, 8192: 50.0}, "vt": {4096: 40.0, 8192: 10.0}}
    assert mean_over_tasks(avg) == {4096: 65.0, 8192: 30.0}


def test_checkpoint_average_refuses_gaps():
    with pytest.raises(ValueError, match="other tasks/lengths"):
        average_checkpoints({"a": {"vt": {4096: 1.0}}, "b": {"vt": {8192: 1.0}}})
    with pytest.raises(ValueError):
        average_checkpoints({})
