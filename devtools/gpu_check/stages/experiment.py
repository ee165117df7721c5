"""The experiment stage: `lctrain experiment extend` (docs/experiment.md), SmolLM2-135M extended 8K -> 32K in full,
intra_doc and anchor modes on one GPU, sized to fit the stage: the driver times a few training steps first and picks
the steps per run from that rate (`--train-seconds`, capped by the prepared windows), and the evaluation is cut to
what the stage affords (`--experiment-tasks`, `--experiment-samples`, `--experiment-checkpoints`). The report's
table is the stage's."""

from __future__ import annotations

import json
from pathlib import Path

from devtools.gpu_check.runner import Runner, lctrain_cli


def report_rows(report: dict) -> tuple[list[str], list[list]]:
    """(columns, rows) of a `lctrain report` report.json: per row its label, seeds, tokens per run, then the mean
    (± std over seeds) of RULER and of perplexity at each length."""
    lengths = report["lengths"]
    columns = ["row", "seeds", "tokens per run"]
    columns += [f"RULER {L}" for L in lengths["ruler"]] + [f"ppl {L}" for L in lengths["perplexity"]]
    rows = []
    for row in report["rows"]:
        cells = []
        for metric in ("ruler", "perplexity"):
            for L in lengths[metric]:
                cell = row[metric].get(str(L))
                std = "" if cell is None or cell["std"] is None else f" ± {cell['std']:.3g}"
                cells.append("-" if cell is None else f"{cell['mean']:.4g}{std}")
        rows.append([row["label"], row["seeds"], row["training_tokens"], *cells])
    return columns, rows


# What the stage spends beside training, measured on one H200 (2026-11-26, SmolLM2-135M at 32K, 12 steps per run):
# the example model, corpus, prepare and the sizing run ~60 s; each run's start, exports and evaluation start ~50 s;
# ~1 s per needle sample generated (54 per run: 3 checkpoints x 2 tasks x 3 samples x 3 lengths, in 71 s with the
# checkpoints' loads: the model ends its answers with EOS, so decoding is short; prefill at 8K-32K); the report.
FIXED_S = 60.0
PER_RUN_S = 50.0
PER_SAMPLE_S = 1.0
REPORT_S = 15.0
MIN_TRAIN_S = 10.0  # under this a run is a handful of steps: the comparison is not worth the stage
MODES = 3  # full, intra_doc, anchor


def training_seconds(args, left: float) -> float:
    """Training seconds per run that let the whole experiment end within `left` seconds: the asked
    `--experiment-train-seconds`, or less when the stage has less time; raises ValueError when not even MIN_TRAIN_S
    fits (more seeds, checkpoints, tasks or samples than the time affords)."""
    runs = MODES * args.experiment_seeds
    samples = args.experiment_checkpoints * len(args.experiment_tasks.split(",")) * args.experiment_samples * 3
    other = FIXED_S + REPORT_S + runs * (PER_RUN_S + PER_SAMPLE_S * samples)
    fits = (left - other) / runs
    if fits < MIN_TRAIN_S:
        raise ValueError(
            f"the experiment needs about {other + runs * MIN_TRAIN_S:.0f} s ({runs} runs, {samples} needle samples "
            f"each) and the stage has {left:.0f} s: run it in a call of its own, or with fewer seeds, checkpoints, "
            "tasks or samples"
        )
    return min(args.experiment_train_seconds, fits)


def stage_experiment(run: Runner, args) -> None:
    r = run.result
    train_s = training_seconds(args, run.remaining())
    if train_s < args.experiment_train_seconds:
        r.notes.append(
            f"{train_s:.0f} s of training per run instead of {args.experiment_train_seconds:.0f}: the time left"
        )
    out = (Path(args.work) if args.work else run.log.parent) / "experiment"
    run.run(
        lctrain_cli()
        + [
            "experiment",
            "extend",
            "--out",
            str(out),
            "--device",
            "cuda",
            "--train-seconds",
            f"{train_s:.1f}",
            "--seeds",
            str(args.experiment_seeds),
            "--checkpoints",
            str(args.experiment_checkpoints),
            "--set",
            f"eval.tasks=[{args.experiment_tasks}]",
            "--set",
            f"eval.samples_per_task={args.experiment_samples}",
        ]
    )
    state = json.loads((out / "experiment.json").read_text())
    report = json.loads((out / "report" / "report.json").read_text())
    r.columns, r.rows = report_rows(report)
    r.data = {"sizing": state.get("sizing"), "steps": state["steps"], "prepared": state["prepared"], "report": report}
    r.notes.append(
        f"{state['steps']} steps, {state['tokens_per_run']:,} tokens per run; sizing {state.get('sizing')}; "
        f"tasks {args.experiment_tasks}, {args.experiment_samples} samples per task and length, last "
        f"{args.experiment_checkpoints} checkpoints; report in {out / 'report'}"
    )
