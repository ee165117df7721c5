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


def stage_experiment(run: Runner, args) -> None:
    r = run.result
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
            str(args.experiment_train_seconds),
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
