"""`lctrain plot RUN [RUN...]`: curves of metrics.jsonl metrics of several runs on one PNG, one panel per metric and
one line per run labelled with its name and attention mode, so `full` against `anchor` is one command."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from lctrain.errors import UserError, output_path
from lctrain.reports.plots import plot_curves
from lctrain.rundir import RunDir

DEFAULT_METRICS = ("loss", "tokens_per_s")
# drawn by default too where a run scored it (train.heldout_every): the curve comparable between attention modes
HELDOUT = "heldout_loss"


@dataclass(frozen=True)
class Curve:
    label: str
    steps: list[int]
    values: list[float]


def numeric_metrics(records: list[dict]) -> list[str]:
    """The metrics with a number in some record, in the records' key order (`step` is the x axis)."""
    keys = dict.fromkeys(
        k
        for r in records
        for k, v in r.items()
        if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)
    )
    return list(keys)


def series(records: list[dict], metric: str) -> tuple[list[int], list[float]]:
    """(steps, values) of `metric` in file order; a record without a value (MFU where the peak is unknown) is left
    out."""
    points = [(r["step"], r[metric]) for r in records if r.get(metric) is not None]
    return [s for s, _ in points], [v for _, v in points]


@dataclass(frozen=True)
class Run:
    path: Path
    name: str
    mode: str
    records: list[dict]


def read_run(path: str | Path) -> Run:
    """A run directory's name, attention mode and metrics, refusing in one line a directory that is not a run or
    has no step yet."""
    rd = RunDir(Path(path))
    why = rd.not_a_run()
    if why is not None:
        raise UserError(f"{path}: {why}; give directories written by 'lctrain train'")
    records = rd.read_metrics()
    if not records:
        raise UserError(f"{path}: no step recorded yet ({rd.metrics_file} is missing or empty)")
    cfg = rd.read_config()
    return Run(rd.path, cfg.name, cfg.attention.mode, records)


def labels(runs: list[Run]) -> list[str]:
    """`name (mode)` per run; the directory instead of the name where two runs share both."""
    short = [f"{r.name} ({r.mode})" for r in runs]
    return [s if short.count(s) == 1 else f"{r.path} ({r.mode})" for s, r in zip(short, runs)]


def curves(runs: list[Run], metrics: list[str]) -> dict[str, list[Curve]]:
    """Per metric, one curve per run; an unknown metric is refused in one line naming the ones there are."""
    known = numeric_metrics([rec for r in runs for rec in r.records])
    for m in metrics:
        if m not in known:
            raise UserError(f"--metric {m}: not in these runs' metrics.jsonl; one of {', '.join(known)}")
    names = labels(runs)
    return {m: [Curve(label, *series(r.records, m)) for label, r in zip(names, runs)] for m in metrics}


def plot(run_dirs: list[str], metrics: list[str] | None = None, out: str | Path = "curves.png") -> Path:
    """Draw the runs' curves of `metrics` (default loss, the held-out loss where a run scored it, and tokens/s) into
    the PNG `out` and say where."""
    if not run_dirs:
        raise UserError("give at least one run directory")
    runs = [read_run(p) for p in run_dirs]
    scored = any(HELDOUT in rec for r in runs for rec in r.records)
    chosen = list(metrics or [DEFAULT_METRICS[0], *([HELDOUT] if scored else []), *DEFAULT_METRICS[1:]])
    drawn = curves(runs, chosen)
    path = plot_curves(drawn, output_path(Path(out), "--out"))
    print(f"wrote {path}", flush=True)
    return path
