"""RULER's scoring and the paper's checkpoint averaging (§4.2: "we suggest reporting the average RULER performance
across five checkpoints, saving a checkpoint every 10 steps over the last 50 training steps").

The metrics, the post-processing and the rounding follow NVIDIA/RULER's scripts/eval/synthetic/constants.py and
scripts/eval/evaluate.py (commit c3f5e3b): a prediction is stripped, its control characters become newlines, and a
task's score at one length is the mean per-sample metric in percent, rounded to two decimals.
"""

from __future__ import annotations

import re
from statistics import mean

from lctrain.errors import UserError

_CONTROL = re.compile(r"[\x00-\x1f]")


def postprocess(prediction: str) -> str:
    """RULER's clean-up of a generated answer before matching."""
    return _CONTROL.sub("\n", prediction.strip()).strip()


def string_match_all(prediction: str, answers: tuple[str, ...] | list[str]) -> float:
    """RULER's metric for every task but QA: the fraction of expected strings found in the prediction (case-blind)."""
    if not answers:
        raise ValueError("a sample needs at least one expected answer")
    pred = prediction.lower()
    return sum(a.lower() in pred for a in answers) / len(answers)


def string_match_part(prediction: str, answers: tuple[str, ...] | list[str]) -> float:
    """RULER's metric for QA: 1 if any of the acceptable answers is found in the prediction."""
    if not answers:
        raise ValueError("a sample needs at least one expected answer")
    pred = prediction.lower()
    return float(any(a.lower() in pred for a in answers))


METRICS = {"all": string_match_all, "part": string_match_part}


def sample_score(metric: str, answers: tuple[str, ...] | list[str], prediction: str) -> float:
    """One sample's score: its task's metric on the cleaned-up prediction."""
    return METRICS[metric](postprocess(prediction), answers)


def settled(metric: str, answers: tuple[str, ...] | list[str], prediction: str) -> bool:
    """Whether the prediction so far already scores the most a sample can (every answer, or one for QA, is in it).
    The metrics only look for answers inside the text, so a longer prediction keeps them: generation can stop here
    with the score it would have had at the full RULER length (128 new tokens for a needle), at a fraction of the
    decoding. A match touching the text's last character is not trusted: tokenizers may rewrite a text's end when
    more tokens follow (a partial UTF-8 character, spaces cleaned up before punctuation)."""
    return sample_score(metric, answers, prediction[:-1]) >= 1.0


def task_score(per_sample: list[float]) -> float:
    """A task's score at one length, in percent, rounded as RULER's summary.csv reports it."""
    return round(100.0 * mean(per_sample), 2)


DEFAULT_LAST = 5  # the paper's five checkpoints over the last 50 steps (§4.2)


def check_last(last: int | None) -> None:
    """`--last N` of eval and report: at least one checkpoint."""
    if last is not None and last < 1:
        raise UserError(f"--last {last}: average over at least 1 checkpoint")


def average_checkpoints(scores: dict[str, dict[str, dict[int, float]]]) -> dict[str, dict[int, float]]:
    """{checkpoint: {task: {length: score}}} -> {task: {length: mean over checkpoints}}.

    Every checkpoint must hold the same tasks and lengths; a gap would silently bias the average."""
    ckpts = list(scores)
    if not ckpts:
        raise ValueError("no checkpoint scores to average")
    layout = {t: sorted(v) for t, v in scores[ckpts[0]].items()}
    for c in ckpts[1:]:
        if {t: sorted(v) for t, v in scores[c].items()} != layout:
            raise ValueError(f"checkpoint {c} was scored on other tasks/lengths than {ckpts[0]}")
    return {t: {L: mean(scores[c][t][L] for c in ckpts) for L in lengths} for t, lengths in layout.items()}


def mean_over_tasks(table: dict[str, dict[int, float]]) -> dict[int, float]:
    """{task: {length: score}} -> {length: mean over tasks} (the paper's per-length RULER number)."""
    lengths = sorted({L for v in table.values() for L in v})
    return {L: mean(v[L] for v in table.values() if L in v) for L in lengths}
