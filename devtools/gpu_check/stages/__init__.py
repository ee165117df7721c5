"""The stages by name, and running one into its StageResult."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from pathlib import Path

from devtools.gpu_check.result import STAGES, StageResult
from devtools.gpu_check.runner import Runner
from devtools.gpu_check.stages.benchmarks import (
    stage_attention,
    stage_figure6,
    stage_fused,
    stage_generation,
    stage_memory,
    stage_peer,
    stage_train,
)
from devtools.gpu_check.stages.end_to_end import stage_cli
from devtools.gpu_check.stages.experiment import stage_experiment
from devtools.gpu_check.stages.gpu_tests import stage_tests
from devtools.gpu_check.stages.install import stage_install
from devtools.gpu_check.stages.rope import stage_rope, stage_rope_real

STAGE_LIMIT_S = 570  # one stage fits a 10-minute slot with room for the interpreter start and the report
MIN_STAGE_S = 60  # under this a stage measures nothing worth its start (installs, model loads)


def select_stages(names: list[str]) -> list[str]:
    """Stage names (or 'all', or none) -> the stages to run: `install` first (the others need what it installs),
    then the others in the order given, which is their priority when --total-limit runs out (every stage with
    'all' or none, in their canonical order)."""
    if not names or names == ["all"]:
        return list(STAGES)
    unknown = [n for n in names if n not in STAGES]
    if unknown:
        raise SystemExit(
            f"gpu_check: unknown stage {', '.join(unknown)}; expected 'all' or some of {', '.join(STAGES)}"
        )
    return ["install"] * ("install" in names) + [s for s in dict.fromkeys(names) if s != "install"]


STAGE_FNS: dict[str, Callable] = {
    "install": stage_install,
    "tests": stage_tests,
    "attention": stage_attention,
    "train": stage_train,
    "fused": stage_fused,
    "peer": functools.partial(stage_peer, length=65536),
    "peer_32k": functools.partial(stage_peer, length=32768),
    "peer_tuned": functools.partial(stage_peer, length=65536, tuned=True),
    "cli": stage_cli,
    "rope": stage_rope,
    "rope_real": stage_rope_real,
    "generation": stage_generation,
    "figure6": stage_figure6,
    "memory": stage_memory,
    "experiment": stage_experiment,
}


def run_stage(stage: str, args, out: Path, limit: float | None = None) -> StageResult:
    """Run `stage` for at most `limit` seconds (default `args.stage_limit`)."""
    result = StageResult(stage)
    runner = Runner(result, out, args.stage_limit if limit is None else limit)
    runner.log.write_text("")
    t0 = time.monotonic()
    try:
        STAGE_FNS[stage](runner, args)
    except Exception as e:  # a stage that breaks is reported, and the next stage still runs
        result.status = "error"
        result.notes.append(f"{type(e).__name__}: {e}")
    result.seconds = time.monotonic() - t0
    return result


def skipped(stage: str, why: str) -> StageResult:
    """A stage that did not run; in a report it never replaces a result of an earlier invocation."""
    return StageResult(stage, status="skipped", notes=[why])
