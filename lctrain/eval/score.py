"""RULER's scoring and the paper's checkpoint averaging (§4.2: scores averaged over the last five checkpoints)."""

from __future__ import annotations

from statistics import mean


def string_match_all(prediction: str, answers: tuple[str, ...] | list[str]) -> float:
    """RULER's metric for retrieval tasks: the fraction of expected strings found in the prediction (case-blind)."""
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


def task_score(per_sample: list[float]) -> float:
    """A task's score at one length, in percent, as RULER reports it."""
    return 100.0 * mean(per_sample)


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
