"""`lctrain report RUN [RUN...]`: the paper's Table 5 for any set of evaluated runs. One row per attention mode (per
experiment when modes repeat with other differences), the evaluated lengths as columns: RULER's mean over tasks and
held-out perplexity, each averaged over the last evaluation checkpoints (§4.2: the last five, saved every 10 steps
over the last 50) that every run evaluated, so that the rows compare the same training steps
(`averaged_checkpoints`), then over the runs that differ only in their seeds (`seed`, `data.seed`).

A difference between two rows is read against the seeds' spread: where the two rows' seed ranges [min, max]
overlap it is "within seed spread", not a finding; a row of one seed has no spread to read it against. The
checkpoint average is `lctrain.eval.score`'s, the same formula `lctrain eval` reports.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from statistics import mean, stdev

from rich.markup import escape
from rich.table import Table

from lctrain.config import Config, data_fingerprint, settings
from lctrain.console import plain_console
from lctrain.errors import UserError, output_dir, writing
from lctrain.eval import score as scoring
from lctrain.eval.ruler import PROMPT_START_ANCHOR
from lctrain.eval.runner import export_digest
from lctrain.export_record import EXPORT_RECORD
from lctrain.reports.trained_windows import Windows, trained_windows
from lctrain.rundir import RunDir, step_of

RESULTS_FILE = "results.json"
SPREAD = "std over seeds (sample standard deviation, n-1); rows compared by their seed ranges [min, max]"
WITHIN, BEYOND, UNKNOWN = "within seed spread", "beyond seed spread", "single seed: spread unknown"
# how `lctrain eval` scores perplexity (lctrain.eval.perplexity) and how it is averaged here, which a reader of the
# perplexity columns needs: the scoring mask is full attention's, whatever mask a run trained with
PERPLEXITY = (
    "perplexity: every mode scored with plain causal attention over each held-out window (full attention's training "
    "mask, which favours full); column L scores the first L tokens of each window; checkpoints averaged "
    "arithmetically (the mean of their perplexities)"
)
METRICS = {"ruler": "RULER, mean over tasks (higher is better)", "perplexity": "held-out perplexity (lower is better)"}
# what names, places or seeds a run, or how it was evaluated (checked on the results), rather than what it trains:
# runs equal in everything else are one experiment
_NOT_EXPERIMENT = (
    "name",
    "description",
    "seed",
    "data.seed",
    "data.output_dir",
    "data.num_workers",
    "data.strict",
    "data.shard_tokens",
    "train.run_dir",
    "checkpoint",
    "logging",
    "eval",
)


@dataclass(frozen=True)
class Evaluated:
    """One run's config as evaluated (`_as_evaluated`) and its `lctrain eval` results, with how the run's exports
    compare with them (`_exports_against`)."""

    path: Path  # the run directory
    results_file: Path
    cfg: Config
    results: dict
    # the run's exports (hf/step_N) its results do not score: written since the evaluation (a resume to more steps,
    # `lctrain export`), or left out of it
    not_evaluated: tuple[str, ...] = ()
    # exports its results scored, and recorded, that the run no longer holds: their scores cannot be checked
    gone: tuple[str, ...] = ()


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        out.update(_flat(v, f"{key}.") if isinstance(v, dict) else {key: v})
    return out


def _read_results(file: Path) -> dict:
    try:
        results = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{file}: not readable as JSON ({type(e).__name__}); run `lctrain eval` again") from None
    needed = ("checkpoints", "scores", "lengths", "tasks", "suite")
    missing = [k for k in needed if k not in results] if isinstance(results, dict) else list(needed)
    if missing:
        raise UserError(f"{file}: not the results.json of `lctrain eval` (no {', '.join(missing)})")
    results.setdefault("prompt_start", PROMPT_START_ANCHOR)  # every prompt did, before the start was recorded
    return results


def read_evaluated(path: str | Path) -> Evaluated:
    """A run directory evaluated by `lctrain eval` (its eval/results.json), an eval directory, or a results.json;
    the run's config comes from the run directory the results belong to."""
    p = Path(path)
    rd = RunDir(p)
    if p.is_file():
        file = p
    elif rd.is_run():
        file = rd.eval_dir / RESULTS_FILE
        if not file.is_file():
            raise UserError(f"{p}: not evaluated yet (no {file}); run `lctrain eval {p}` first")
    elif (p / RESULTS_FILE).is_file():
        file = p / RESULTS_FILE
    else:
        raise UserError(
            f"{p}: neither an evaluated run directory (config.yaml, eval/{RESULTS_FILE}) nor an eval directory "
            f"({RESULTS_FILE})"
        )
    results = _read_results(file)
    runs = [RunDir(file.parent.parent), RunDir(results.get("target") or file.parent.parent)]
    run = next((r for r in runs if r.is_run()), None)
    if run is None:
        raise UserError(
            f"{file}: evaluates {results.get('target')}, which is not a run directory (no config.yaml): the report "
            f"groups runs by their config; give run directories written by `lctrain train`"
        )
    not_evaluated, gone = _exports_against(run, file, results)
    return Evaluated(
        run.path, file, _as_evaluated(run.read_config(), results, file), results, tuple(not_evaluated), tuple(gone)
    )


def _as_evaluated(cfg: Config, results: dict, where: Path) -> Config:
    """The run's config as its results were scored: its config.yaml with the train.steps `lctrain eval` recorded
    (`training.train_steps`). A resume to more steps since the evaluation (`lctrain resume RUN --set train.steps=N`)
    rewrote config.yaml but not the exports scored, which trained under the recorded value; the exports it added are
    warned about (`_export_warnings`). The evaluation records no other setting: the rest is config.yaml's."""
    steps = (results.get("training") or {}).get("train_steps")
    if steps is None or steps == cfg.train.steps:
        return cfg
    evaluated = cfg.model_copy(deep=True)
    try:
        evaluated.train.steps = steps
    except ValueError:  # pydantic's ValidationError
        raise UserError(
            f"{where}: its training record is damaged (train_steps {steps!r}); run `lctrain eval` again"
        ) from None
    return evaluated


def rewritten_exports(run: RunDir, results: dict) -> list[str]:
    """The exports `results` scored whose weights the run no longer holds as scored: their record (`export.json`) is
    not the one `lctrain eval` recorded (`export_records`, `lctrain.eval.runner.export_digest`), as after
    `train --force` or `export --force`. Results written before that record was kept, and exports without a record,
    have nothing to check against; exports since removed are not rewritten."""
    recorded = results.get("export_records")
    recorded = recorded if isinstance(recorded, dict) else {}
    exports = {p.name: p for p in run.exports()}
    return [
        name
        for name in map(str, results["checkpoints"])
        if recorded.get(name) is not None and name in exports and export_digest(exports[name]) != recorded[name]
    ]


def _exports_against(run: RunDir, file: Path, results: dict) -> tuple[list[str], list[str]]:
    """(the run's exports `results` do not score, but for those older than all it scores (eval's --last left them
    out), the scored exports the run no longer holds); refuses results of an
    export whose weights are not the ones scored (`rewritten_exports`). Results written before the exports' records
    were kept are compared by name only (as `lctrain experiment extend` compares them to decide an evaluation is
    current)."""
    rewritten = rewritten_exports(run, results)
    if rewritten:
        raise UserError(
            f"{run.path}: {run.exports_dir.name}/{rewritten[0]} is not the export {file} scored (its {EXPORT_RECORD} "
            f"changed since: trained again with --force, or exported again); evaluate it again: lctrain eval {run.path}"
        )
    exports = [p.name for p in run.exports()]
    scored = [str(c) for c in results["checkpoints"]]
    recorded = results.get("export_records")
    recorded = recorded if isinstance(recorded, dict) else {}
    gone = [name for name in scored if recorded.get(name) is not None and name not in exports]
    # eval scores a run's latest exports (--last): those before the first it scored were left out on purpose
    first = min((step_of(name) for name in scored if step_of(name) is not None), default=None)
    unscored = [name for name in exports if name not in scored]
    if first is not None:
        unscored = [name for name in unscored if step_of(name) is None or step_of(name) > first]
    return unscored, gone


def _evaluated_checkpoints(run: Evaluated) -> list[str]:
    """The checkpoints `run`'s results scored, oldest first."""
    ckpts = [str(c) for c in run.results["checkpoints"]]
    if not ckpts:
        raise UserError(f"{run.path}: no evaluated checkpoint in its results; run `lctrain eval` again")
    if all(step_of(c) is not None for c in ckpts):
        ckpts.sort(key=step_of)
    return ckpts


def averaged_checkpoints(runs: list[Evaluated], last: int | None) -> tuple[list[list[str]], list[str]]:
    """The checkpoints each of `runs` is averaged over (oldest first), and the warnings when they are not a run's own
    latest. `last` (`--last N`; default the paper's 5, §4.2: its last five checkpoints): every run is averaged over the
    latest N checkpoints that all the runs evaluated, so that the rows compare the same training steps (all of those
    when fewer are shared). An N beyond the checkpoints a run evaluated is refused; by default a run of fewer averages
    all of them. Where the shared checkpoints are not each run's own latest N (fewer than N, or earlier), they are
    averaged and a warning names what each run leaves out; where the runs share none, each is averaged over its own
    latest N, other training steps, and a warning names each run's."""
    scoring.check_last(last)
    n = scoring.DEFAULT_LAST if last is None else last
    evaluated = [_evaluated_checkpoints(r) for r in runs]
    for r, ckpts in zip(runs, evaluated):
        if n > len(ckpts) and last is not None:
            raise UserError(
                f"{r.path}: --last {n} asks for more checkpoints than the {len(ckpts)} evaluated "
                f"({', '.join(ckpts)}); use --last {len(ckpts)} or evaluate more checkpoints"
            )
    own = [ckpts[-n:] for ckpts in evaluated]
    shared = [c for c in evaluated[0] if all(c in other for other in evaluated[1:])][-n:]
    if not shared:
        each = "; ".join(f"{r.path}: {', '.join(ckpts)}" for r, ckpts in zip(runs, own))
        return own, [
            f"warning: the runs share no evaluated checkpoint, so each is averaged over its own latest ({each}): the "
            f"rows' differences mix training steps with what the rows compare; evaluate the same steps of every run"
        ]
    left = [(r, [c for c in ckpts if c not in shared]) for r, ckpts in zip(runs, own)]
    left = [(r, ckpts) for r, ckpts in left if ckpts]
    if not left:
        return [shared] * len(runs), []
    asked = f" ({len(shared)} of the --last {last} asked)" if last is not None and len(shared) < last else ""
    return [shared] * len(runs), [
        f"warning: every run averaged over {', '.join(shared)}{asked}, the latest "
        f"{'checkpoint' if len(shared) == 1 else 'checkpoints'} all the runs evaluated, so that the rows compare the "
        f"same training steps; not averaged: " + "; ".join(f"{r.path}: {', '.join(ckpts)}" for r, ckpts in left)
    ]


def _by_length(table: dict) -> dict[int, float]:
    return {int(L): v for L, v in table.items()}


def checkpoint_average(results: dict, ckpts: list[str], where: str) -> tuple[dict[int, float], dict[int, float]]:
    """({length: RULER mean over tasks}, {length: perplexity}) averaged over `ckpts`; the perplexity is empty when
    those checkpoints have no per-length perplexity. `where` names the results in an error."""
    per_length = (results.get("perplexity") or {}).get("per_length") or {}
    try:
        scores = {c: {t: _by_length(per) for t, per in results["scores"][c].items()} for c in ckpts}
        ruler = scoring.mean_over_tasks(scoring.average_checkpoints(scores))
        if not all(c in per_length for c in ckpts):
            return ruler, {}
        ppl = scoring.average_checkpoints({c: {"perplexity": _by_length(per_length[c])} for c in ckpts})
    except (KeyError, ValueError) as e:
        raise UserError(
            f"{where}: the results of {', '.join(ckpts)} are damaged or incomplete ({e}); run `lctrain eval` again"
        ) from None
    return ruler, ppl["perplexity"]


def spread(values: list[float]) -> dict:
    """Mean, sample standard deviation (None for one value), min, max and count of a cell's per-seed values."""
    return {
        "mean": mean(values),
        "std": stdev(values) if len(values) > 1 else None,
        "min": min(values),
        "max": max(values),
        "n": len(values),
    }


def reading(cell: dict, reference: dict) -> str:
    """How a row's difference from the reference row at one length reads against the seeds' spread."""
    if cell["n"] < 2 or reference["n"] < 2:
        return UNKNOWN
    overlap = cell["min"] <= reference["max"] and reference["min"] <= cell["max"]
    return WITHIN if overlap else BEYOND


# what defines an evaluation, recorded in results.json by `lctrain eval`: (key path, what, how to make them equal).
# Runs that differ in any are scored on other samples or other windows, so their numbers do not compare
def _short_of_heldout(run: Evaluated) -> str | None:
    """Why `run` scored fewer perplexity windows than the other, when the cause is its training: `lctrain eval` scored
    every window its training leaves unread (`heldout_available`, recorded by it, equals the number scored), so
    another eval.ppl_windows would not help. None otherwise."""
    ppl = run.results.get("perplexity") or {}
    if ppl.get("heldout_available") is None or ppl.get("heldout_available") != ppl.get("windows"):
        return None
    return (
        f"as its training reads {run.cfg.windows_read():,} windows (train.steps x train.global_batch), which leave "
        f"{ppl['windows']} of {ppl.get('data')} unread"
    )


def _heldout_differs(what: str, first: Evaluated, other: Evaluated, a, b) -> str | None:
    """The refusal when two runs scored different numbers of perplexity windows because one's training leaves fewer
    unread (`_short_of_heldout`), whose fix is other held-out data rather than eval.ppl_windows; None otherwise."""
    if None in (a, b):
        return None
    short = first if a < b else other
    why = _short_of_heldout(short)
    if not why:
        return None
    sides = "; ".join(
        f"{run.results_file}: {n}" + (f", {why}" if run is short else "") for run, n in ((first, a), (other, b))
    )
    return (
        f"runs evaluated with different {what}: {sides}: score them on the same held-out windows, evaluating each "
        f"with `lctrain eval RUN --ppl-data DIR` (a dataset prepared apart from their training data), or prepare a "
        f"larger data.token_budget and train again"
    )


# What two compared runs must have been evaluated with: the results' keys, what they are called, the usual fix, and
# where a cause other than an eval setting is known, the refusal that names it (or None, where it does not apply).
_EVALUATION = (
    (("suite",), "suites", "evaluate them with the same data", None),
    (("prompt_start",), "prompt starts", "evaluate them with the same --anchor-prompts", None),
    (("seed",), "eval seeds (the offline suite's needles)", "evaluate them with the same eval.seed", None),
    (("samples_per_task",), "samples per task", "evaluate them with the same --samples", None),
    (("lengths",), "lengths", "evaluate them at the same --lengths", None),
    (("tasks",), "tasks", "evaluate them on the same task set (--tasks, --exclude)", None),
    (
        ("perplexity", "windows"),
        "numbers of perplexity windows",
        "evaluate them with the same eval.ppl_windows",
        _heldout_differs,
    ),
)


def _setting(results: dict, keys: tuple[str, ...]):
    for k in keys:
        results = results.get(k) if isinstance(results, dict) else None
    return results


def _shown(value) -> str:
    return "not recorded" if value is None else ", ".join(map(str, value)) if isinstance(value, list) else str(value)


def _check_same_evaluation(runs: list[Evaluated]) -> None:
    first = runs[0]
    for r in runs[1:]:
        for keys, what, fix, cause in _EVALUATION:
            a, b = _setting(first.results, keys), _setting(r.results, keys)
            if a != b:
                raise UserError(
                    (cause and cause(what, first, r, a, b))
                    or f"runs evaluated with different {what}: {first.results_file}: {_shown(a)}; "
                    f"{r.results_file}: {_shown(b)}; {fix}"
                )


def experiment_key(cfg: Config) -> str:
    """What a run trains, without its name, place, seeds and evaluation settings: equal for seed replicates."""
    flat = _flat(settings(cfg))
    kept = {k: v for k, v in flat.items() if not any(k == n or k.startswith(f"{n}.") for n in _NOT_EXPERIMENT)}
    return json.dumps(kept, sort_keys=True)


def trained(run: Evaluated) -> dict:
    """How far the run had trained when it was evaluated (`lctrain.eval.runner.training_progress`, recorded in its
    results): {"steps", "train_steps", "finished"}. Results written before that record was kept: the step of the
    last evaluated checkpoint, which `lctrain train` exports at the last step of a finished run."""
    recorded = run.results.get("training")
    if recorded:
        return recorded
    last = max((step_of(c) for c in run.results["checkpoints"] if step_of(c) is not None), default=None)
    steps = run.cfg.train.steps if last is None else last
    return {"steps": steps, "train_steps": run.cfg.train.steps, "finished": steps >= run.cfg.train.steps}


def _labels(groups: list[list[Evaluated]]) -> tuple[list[str], list[str]]:
    """Each group's label (its attention mode, plus the settings other than the mode in which the groups differ, so
    that a row is never read as the mode's effect alone when it differs in more), and those settings."""
    flats = [_flat(json.loads(experiment_key(g[0].cfg))) for g in groups]
    keys = sorted({k for f in flats for k in f} - {"attention.mode"})
    differing = [k for k in keys if len({json.dumps(f.get(k)) for f in flats}) > 1]
    modes = [g[0].cfg.attention.mode for g in groups]
    return [
        f"{m} ({', '.join(f'{k}={f.get(k)}' for k in differing)})" if differing else m for m, f in zip(modes, flats)
    ], differing


def _seed_text(run: Evaluated) -> str:
    return f"seed {run.cfg.seed}, data.seed {run.cfg.data.seed}"


def compare(runs: list[Evaluated], last: int | None = None) -> dict:
    """The report of evaluated runs (pure): groups of seed replicates in the order first given, per length the
    per-seed checkpoint averages and their spread, and each group's reading against the first group."""
    if not runs:
        raise UserError("give at least one evaluated run directory")
    _check_same_evaluation(runs)
    groups: dict[str, list[Evaluated]] = {}
    for r in runs:
        groups.setdefault(experiment_key(r.cfg), []).append(r)
    for members in groups.values():
        seen: dict[tuple, Path] = {}
        for r in members:
            seeds = (r.cfg.seed, r.cfg.data.seed)
            if seeds in seen:
                raise UserError(
                    f"{seen[seeds]} and {r.path}: the same experiment with the same seeds ({_seed_text(r)}); "
                    f"a spread over seeds needs different seeds: give one of them"
                )
            seen[seeds] = r.path
    ordered = list(groups.values())
    labels, differing = _labels(ordered)
    chosen, checkpoint_warnings = averaged_checkpoints(runs, last)
    averaged = {r.results_file: ckpts for r, ckpts in zip(runs, chosen)}
    # the windows each run read, only where modes differ (it reads the dataset): {run path: Windows or why not}
    counted: dict[str, Windows | str] = {}
    modes_differ = len({g[0].cfg.attention.mode for g in ordered}) > 1
    rows = []
    for label, members in zip(labels, ordered):
        per_run = []
        for r in members:
            ckpts = averaged[r.results_file]
            ruler, ppl = checkpoint_average(r.results, ckpts, str(r.results_file))
            progress = trained(r)
            if modes_differ:
                counted[str(r.path)] = trained_windows(r.cfg, progress["steps"], r.path)
            windows = counted.get(str(r.path))
            per_run.append(
                {
                    "path": str(r.path),
                    "results": str(r.results_file),
                    # the run's exports the results do not score, and those scored the run no longer holds
                    "exports_not_evaluated": list(r.not_evaluated),
                    "exports_gone": list(r.gone),
                    "seed": r.cfg.seed,
                    "data_seed": r.cfg.data.seed,
                    "data_fingerprint": data_fingerprint(r.cfg.data),
                    "steps": progress["steps"],
                    "train_steps": progress["train_steps"],
                    "finished": progress["finished"],
                    "training_tokens": r.cfg.tokens_read(progress["steps"]),
                    # which held-out text its perplexity scored: the dataset (`lctrain eval --ppl-data`, else the
                    # run's own prepared data), by its data fingerprint, and the windows of it
                    "perplexity_data": _setting(r.results, ("perplexity", "data")),
                    "perplexity_data_fingerprint": _setting(r.results, ("perplexity", "data_fingerprint")),
                    "perplexity_windows": _setting(r.results, ("perplexity", "rows")),
                    # the distinct windows its training read and how many held more than one document
                    "trained_windows": (
                        {"read": len(windows.rows), "multi_document": len(windows.multi_document)}
                        if isinstance(windows, Windows)
                        else None
                    ),
                    "checkpoints": ckpts,
                    "ruler": {str(L): v for L, v in ruler.items()},
                    "perplexity": {str(L): v for L, v in ppl.items()},
                }
            )
        cells = {}
        for metric in METRICS:
            cells[metric] = {}
            for L in sorted({int(L) for p in per_run for L in p[metric]}):
                values = [p[metric][str(L)] for p in per_run if str(L) in p[metric]]
                # a mean over the seeds that have the value; a length only some seeds have is not shown
                if values and len(values) == len(per_run):
                    cells[metric][str(L)] = spread(values)
        rows.append(
            {
                "label": label,
                "mode": members[0].cfg.attention.mode,
                "seeds": len(members),
                # what every run of the row trained at least (each run's own is in `runs`): an unfinished run's
                # fewer steps, not the config's
                "training_tokens": min(p["training_tokens"] for p in per_run),
                "unfinished": [p["path"] for p in per_run if not p["finished"]],
                # evaluated before some of the run's exports: its scores are not of the run as it now is
                "not_evaluated": [p["path"] for p in per_run if p["exports_not_evaluated"]],
                "runs": per_run,
                **cells,
            }
        )
    reference = rows[0]
    for row in rows[1:]:
        row["vs_reference"] = {
            metric: {
                L: {
                    "difference": cell["mean"] - reference[metric][L]["mean"],
                    "reading": reading(cell, reference[metric][L]),
                }
                for L, cell in row[metric].items()
                if L in reference[metric]
            }
            for metric in METRICS
        }
    return {
        "warnings": checkpoint_warnings + _heldout_warnings(rows) + _unfinished_warnings(rows) + _export_warnings(rows),
        "suite": runs[0].results["suite"],
        "tasks": runs[0].results["tasks"],
        # what every run was evaluated with (`_check_same_evaluation`), for a reader of the report alone
        "evaluation": {"_".join(keys): _setting(runs[0].results, keys) for keys, *_ in _EVALUATION},
        "lengths": {m: sorted({int(L) for row in rows for L in row[m]}) for m in METRICS},
        "last": last,
        "default_last": scoring.DEFAULT_LAST,
        # the checkpoints every run was averaged over; None when the runs share none (each run's are in `runs`)
        "checkpoints": chosen[0] if all(c == chosen[0] for c in chosen) else None,
        "spread": SPREAD,
        "metrics": METRICS,
        "reference": reference["label"],
        "other_differences": differing,
        "data_notes": _data_notes(rows),
        "mode_notes": _mode_notes(ordered, counted),
        "rows": rows,
    }


def _heldout_warnings(rows: list[dict]) -> list[str]:
    """One line when the runs' perplexity scored different held-out datasets (told by the data fingerprint `lctrain
    eval` records: `--ppl-data` given to some runs, or their own data prepared otherwise): its columns then compare
    text as well as runs. Warned rather than refused, as the RULER columns still compare; runs without perplexity
    per length, or whose results predate the fingerprint, are not compared."""
    runs = [r for row in rows for r in row["runs"] if r["perplexity"] and r["perplexity_data_fingerprint"]]
    prints = sorted({r["perplexity_data_fingerprint"] for r in runs})
    if len(prints) < 2:
        return []
    datasets = []
    for fp in prints:
        scored = [r for r in runs if r["perplexity_data_fingerprint"] == fp]
        places = ", ".join(sorted({str(r["perplexity_data"]) for r in scored}))
        datasets.append(f"{fp[:12]} ({places}): {', '.join(r['path'] for r in scored)}")
    return [
        f"warning: perplexity scored on {len(prints)} different held-out datasets (data fingerprints "
        f"{'; '.join(datasets)}): its columns compare other text as well as the runs; score every run on one "
        f"dataset: lctrain eval RUN --ppl-data DIR"
    ]


def _unfinished_warnings(rows: list[dict]) -> list[str]:
    """One line per run evaluated before its last step. Warned and marked rather than refused: refusing would block
    the report of a run in progress, and a researcher may want the early numbers; what must not happen is such a run
    passing silently as a full seed replicate (its spread would swallow a real difference)."""
    return [
        f"warning: {r['path']} is unfinished (trained {r['steps']} of its {r['train_steps']} steps), yet a seed of "
        f"row {row['label']}: resume it and evaluate again, or leave it out"
        for row in rows
        for r in row["runs"]
        if not r["finished"]
    ]


def _export_warnings(rows: list[dict]) -> list[str]:
    """One line per run whose results do not score all of its exports (warned and marked as an unfinished run is,
    for the same reasons), and one per run whose scored exports are gone (deleted since, or the run started over)."""
    lines = []
    for row in rows:
        for r in row["runs"]:
            if r["exports_not_evaluated"]:
                names = ", ".join(f"hf/{n}" for n in r["exports_not_evaluated"])
                lines.append(
                    f"warning: {r['path']}: {names} not scored by {r['results']} (exported since the evaluation, or "
                    f"left out of it), yet a seed of row {row['label']}: evaluate again (lctrain eval {r['path']}), "
                    f"or leave it out"
                )
            if r["exports_gone"]:
                names = ", ".join(f"hf/{n}" for n in r["exports_gone"])
                lines.append(
                    f"warning: {r['path']}: {names}, scored by {r['results']}, no longer there (deleted, or the run "
                    f"started over): those scores cannot be checked against the run's exports"
                )
    return lines


def _scored_text(run: dict, by_data: bool) -> tuple | None:
    """The held-out text a run's perplexity scored: (its dataset's fingerprint when `by_data`, the windows' rows);
    None when its results do not record the rows. The same rows of another dataset are other text."""
    if run["perplexity_windows"] is None:
        return None
    return run["perplexity_data_fingerprint"] if by_data else None, tuple(run["perplexity_windows"])


def _data_notes(rows: list[dict]) -> list[str]:
    """What the rows' text differs in although their experiments do not: the prepared dataset each run trained on
    (its data fingerprint; `data.seed` is one of its settings), the seeds (`seed`: the initial weights and the
    windows' order) and the held-out text its perplexity scored
    (`_scored_text`: the windows depend on the run's seed and train.steps, `lctrain.eval.perplexity.heldout_rows`)."""
    runs = [r for row in rows for r in row["runs"]]
    # the held-out datasets are compared where every run records its own; results from before: the windows alone
    scored = partial(_scored_text, by_data=all(r["perplexity_data_fingerprint"] for r in runs))
    notes = []
    prints = {r["data_fingerprint"] for r in runs}
    if len(prints) > 1:
        by_print = "; ".join(
            f"{fp[:12]}: {', '.join(r['path'] for r in runs if r['data_fingerprint'] == fp)}" for fp in sorted(prints)
        )
        notes.append(f"runs trained on {len(prints)} prepared datasets (data fingerprints {by_print})")
    seeds = [sorted({r["seed"] for r in row["runs"]}) for row in rows]
    # rows of several seeds each are read against their spread; a row of one seed has none to absorb the seed's part
    if any(s != seeds[0] for s in seeds[1:]) and any(len(s) == 1 for s in seeds):
        by_row = "; ".join(f"{row['label']}: {', '.join(map(str, s))}" for row, s in zip(rows, seeds))
        notes.append(
            f"the rows trained from different seeds ({by_row}): a seed sets the initial weights and the order the "
            f"windows are read in, so their differences mix seed with what the rows differ in; train every row with "
            f"the same seeds"
        )
    for row in rows:
        if len({scored(r) for r in row["runs"]} - {None}) > 1:
            notes.append(
                f"perplexity of {row['label']}: its runs scored different held-out windows (they depend on seed and "
                f"train.steps): its spread mixes text with seed"
            )
    # rows of the same seeds score the same windows; results that do not record theirs are not compared. What each
    # row's mean is over: the texts its runs scored, however many seeds scored each
    per_row = [set(map(scored, row["runs"])) for row in rows]
    if all(scored(r) is not None for r in runs) and any(w != per_row[0] for w in per_row[1:]):
        notes.append(
            "perplexity: the rows scored different held-out windows: their differences mix text with attention mode"
        )
    return notes


def _mode_notes(groups: list[list[Evaluated]], counted: dict[str, Windows | str]) -> list[str]:
    """Whether the modes could differ on the windows the runs trained on (`lctrain.reports.trained_windows`): how many
    held more than one document, and when none did, that the modes trained identically there. Runs of the same seed
    read the same windows, so they are counted once over all runs. And whether intra_doc and intra_doc_reset were one
    computation there (`_same_as_reset`)."""
    if not counted:
        return []
    found = [w for w in counted.values() if isinstance(w, Windows)]
    notes = [
        f"attention modes: the windows {path} trained on are not counted ({why})"
        for path, why in counted.items()
        if isinstance(why, str)
    ]
    if found:
        read = {(w.dataset, r) for w in found for r in w.rows}
        multi = {(w.dataset, r) for w in found for r in w.multi_document}
        runs = "the runs" if len(found) == len(counted) else "the counted runs"
        if multi:
            notes.append(
                f"attention modes: {len(multi)} of the {len(read)} windows {runs} trained on held more than one "
                f"document (only there do the modes' masks and positions differ)"
            )
            if _same_as_reset(groups, counted):
                notes.append(
                    "intra_doc and intra_doc_reset: one computation in fp32 on these windows (the same mask; positions "
                    "that differ by one offset per document, which RoPE, being relative, does not see): their "
                    "difference is rounding, not the modes'"
                )
        else:
            notes.append(
                f"attention modes: none of the {len(read)} windows {runs} trained on held more than one document, "
                f"so the modes trained identically on them (one mask, the same positions): the rows' differences are "
                f"not the masks'"
            )
    return notes


def _same_as_reset(groups: list[list[Evaluated]], counted: dict[str, Windows | str]) -> bool:
    """intra_doc and intra_doc_reset rows whose runs are mathematically the same training: fp32 (the paper's
    difference between them is bf16 rounding of RoPE at large positions, its §3.2), no document of the windows read
    cut into interleaved chunks (there reset positions close the gaps between a document's chunks, which changes
    relative distances), and no 'dynamic' RoPE scaling (it rescales by the largest position, which reset lowers)."""
    pair = [r for g in groups for r in g if r.cfg.attention.mode in ("intra_doc", "intra_doc_reset")]
    if {r.cfg.attention.mode for r in pair} != {"intra_doc", "intra_doc_reset"}:
        return False
    for r in pair:
        windows = counted.get(str(r.path))
        scaling = r.cfg.model.rope_scaling or {}
        if r.cfg.model.dtype != "float32" or not isinstance(windows, Windows) or windows.chunked:
            return False
        if (scaling.get("rope_type") or scaling.get("type")) == "dynamic":
            return False
    return True


def _cell(cell: dict | None, digits: int) -> str:
    if cell is None:
        return "-"
    if cell["std"] is None:
        return f"{cell['mean']:.{digits}f}"
    return f"{cell['mean']:.{digits}f} ± {cell['std']:.{digits}f}"


_DIGITS = {"ruler": 2, "perplexity": 3}


def _checkpoint_lines(report: dict) -> list[str]:
    lines = []
    for row in report["rows"]:
        for r in row["runs"]:
            ck = r["checkpoints"]
            lines.append(
                f"{row['label']}: {r['results']} (seed {r['seed']}, data.seed {r['data_seed']}): {len(ck)} "
                f"checkpoint{'s' * (len(ck) > 1)} {', '.join(ck)}"
            )
    return lines


def _seeds_cell(row: dict) -> str:
    """The row's number of seeds, and how many of them are unfinished or not evaluated on all their exports."""
    marks = [f"{len(row['unfinished'])} unfinished"] * bool(row["unfinished"])
    marks += [f"{len(row['not_evaluated'])} with exports not evaluated"] * bool(row.get("not_evaluated"))
    return f"{row['seeds']} ({', '.join(marks)})" if marks else str(row["seeds"])


def _averaged_cell(row: dict) -> str:
    """The checkpoints a row's runs were averaged over, each distinct list once."""
    return "; ".join(dict.fromkeys(", ".join(r["checkpoints"]) for r in row["runs"]))


def _tables(report: dict) -> list[tuple[str, list[str], list[list[str]]]]:
    """(title, header, rows) of each table: the values per metric, then the differences from the reference row. Where
    the runs were averaged over other checkpoints (they share none), a column names each row's."""
    # matplotlib, via reports.plots, on use (start-up time)
    from lctrain.reports.plots import length_label

    own = report["checkpoints"] is None  # each run averaged over its own latest: name them
    out = []
    for metric, title in report["metrics"].items():
        lengths = [str(L) for L in report["lengths"][metric]]
        if not lengths:
            continue
        heads = [length_label(int(L)) for L in lengths]
        body = [
            [
                row["label"],
                _seeds_cell(row),
                ", ".join(f"{t:,}" for t in sorted({r["training_tokens"] for r in row["runs"]})),
                *[_averaged_cell(row)] * own,
            ]
            + [_cell(row[metric].get(L), _DIGITS[metric]) for L in lengths]
            for row in report["rows"]
        ]
        columns = ["row", "seeds", "tokens per run", *["checkpoints averaged"] * own]
        out.append((f"{title}; mean ± std over seeds", [*columns, *heads], body))
        diffs = [
            [row["label"], *[_averaged_cell(row)] * own]
            + [
                f"{d['difference']:+.{_DIGITS[metric]}f} ({d['reading']})" if d else "-"
                for d in (row["vs_reference"][metric].get(L) for L in lengths)
            ]
            for row in report["rows"][1:]
        ]
        if diffs:
            header = ["row", *["checkpoints averaged"] * own, *heads]
            out.append((f"{title}: difference from {report['reference']}", header, diffs))
    return out


def _samples_said(samples) -> str:
    if isinstance(samples, dict):  # RULER files of different sizes (results.json: samples_per_task)
        counts = sorted({n for per in samples.values() for n in per.values()})
        return f"{counts[0]}-{counts[-1]} samples per task and length"
    return f"{samples} samples per task" if samples is not None else ""


def _evaluated_with(report: dict) -> str:
    """The evaluation settings every run shares, in words (reports from before they were recorded: "")."""
    ev = report.get("evaluation")
    if ev is None:
        return ""
    said = [
        _samples_said(ev["samples_per_task"]),
        f"eval seed {ev['seed']}" if ev["seed"] is not None else "",
        f"prompts start with {ev['prompt_start']}" if ev["prompt_start"] else "",
        f"perplexity over {ev['perplexity_windows']} held-out windows" if ev["perplexity_windows"] else "",
    ]
    return "; ".join(filter(None, said))


def _notes(report: dict) -> list[str]:
    evaluated = "; ".join(filter(None, [f"tasks: {', '.join(report['tasks'])}", _evaluated_with(report)]))
    notes = [f"suite: {report['suite']}; {evaluated}", f"spread: {report['spread']}"]
    if report["other_differences"]:
        notes.append(f"rows also differ in: {', '.join(report['other_differences'])}")
    notes += [f"rows also differ in their text: {n}" for n in report["data_notes"]]
    notes += report["mode_notes"]
    if not any(row["perplexity"] for row in report["rows"]):
        notes.append(
            "perplexity: none per length in these results (evaluated before per-length perplexity, or none held out)"
        )
    else:
        notes.append(PERPLEXITY)
    return notes + [f"averaged: {line}" for line in _checkpoint_lines(report)]


def markdown(report: dict) -> str:
    """The report as Markdown: the tables, then what was averaged and how to read it."""
    parts = ["# lctrain report", ""] + [f"**{w}**\n" for w in report["warnings"]]
    for title, header, body in _tables(report):
        parts += [f"## {title}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        parts += ["| " + " | ".join(r) + " |" for r in body] + [""]
    parts += [f"- {n}" for n in _notes(report)]
    return "\n".join(parts) + "\n"


def print_report(report: dict, out: Path) -> None:
    console = plain_console()
    for w in report["warnings"]:
        console.print(escape(w), soft_wrap=True)
    for title, header, body in _tables(report):
        table = Table(title=title)
        for i, h in enumerate(header):
            table.add_column(h, justify="left" if i == 0 else "right")
        for r in body:
            table.add_row(*map(escape, r))
        console.print(table)
    for n in _notes(report):
        console.print(escape(n), soft_wrap=True)
    console.print(f"wrote {out}/report.json, report.md, report.png", soft_wrap=True)


def write_report(run_dirs: list[Path], out: Path, last: int | None = None, left_out: list[str] = ()) -> dict:
    """Compare the evaluated runs `run_dirs` (run directories, eval directories or results.json files), averaging
    every run over the latest `last` checkpoints they all evaluated (`averaged_checkpoints`); write report.json,
    report.md and report.png to `out` and return the report. `left_out`: runs of the comparison that are not in it,
    each with why (an experiment's failed runs), warned about in the report itself, which may be read without its
    log."""
    # matplotlib, via reports.plots, on use (start-up time)
    from lctrain.reports.plots import plot_report

    scoring.check_last(last)  # before any run is read: the arguments first
    report = compare([read_evaluated(p) for p in run_dirs], last)
    report["warnings"] += [f"warning: left out of this report: {run}" for run in left_out]
    out = output_dir(Path(out))
    with writing(out, "the report"):
        (out / "report.json").write_text(json.dumps(report, indent=2))
        (out / "report.md").write_text(markdown(report))
        plot_report(report, out / "report.png")
    return report
