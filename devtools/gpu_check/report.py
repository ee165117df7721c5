"""The report: merged across invocations (newest result per stage) as JSON, rendered as markdown, with the
machine's versions."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from devtools.gpu_check.result import STAGES, StageResult


def merge_report(path: Path, results: list[StageResult], meta: dict) -> dict:
    """Read the report at `path` (if any), replace the stages just run, and write it back."""
    report = json.loads(path.read_text()) if path.is_file() else {"stages": {}}
    report["meta"] = {**report.get("meta", {}), **meta}
    for r in results:
        if r.status != "skipped" or r.stage not in report["stages"]:
            report["stages"][r.stage] = vars(r)
    report["stages"] = {s: report["stages"][s] for s in STAGES if s in report["stages"]}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1, default=str))
    return report


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    return "" if value is None else str(value).replace("|", "\\|")


def render_markdown(report: dict) -> str:
    meta = report.get("meta", {})
    lines = ["# lctrain GPU check", ""]
    lines += [f"- {k}: {v}" for k, v in meta.items()]
    lines += ["", "| stage | status | seconds |", "|---|---|---|"]
    lines += [f"| {s} | {r['status']} | {r['seconds']:.0f} |" for s, r in report["stages"].items()]
    targets = [t for r in report["stages"].values() for t in r["targets"]]
    if targets:
        lines += ["", "## Targets", "", "| target | measured | goal | met |", "|---|---|---|---|"]
        lines += [
            f"| {t['name']} | {_cell(t['value'])} | {t['goal']} | {'yes' if t['met'] else 'NO'} |" for t in targets
        ]
    for stage, r in report["stages"].items():
        lines += ["", f"## {stage}: {r['status']} ({r['seconds']:.0f} s)", ""]
        lines += [f"    {c}" for c in r["commands"]]
        if r["columns"]:
            lines += ["", "| " + " | ".join(r["columns"]) + " |", "|" + "---|" * len(r["columns"])]
            lines += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in r["rows"]]
        if r["notes"]:
            lines += [""] + [f"- {n}" for n in r["notes"]]
    return "\n".join(lines) + "\n"


def gpu_meta() -> dict:
    meta = {"python": sys.version.split()[0], "date": time.strftime("%Y-%m-%d %H:%M")}
    try:  # torch and transformers are optional here: the report is written even where they fail to import
        import torch

        meta["torch"] = torch.__version__
        if torch.cuda.is_available():
            meta["gpu"] = torch.cuda.get_device_name()
        import transformers  # optional, as torch above

        meta["transformers"] = transformers.__version__
    except ImportError as e:
        meta["import_error"] = str(e)
    return meta
