"""Running a stage's commands: its log, its remaining time and the environment every stage shares."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from devtools.gpu_check import ROOT
from devtools.gpu_check.result import StageResult


class Runner:
    """Runs a stage's commands with its log, its remaining time and the environment every stage shares."""

    def __init__(self, result: StageResult, out: Path, limit: float):
        self.result = result
        self.limit = limit
        self.deadline = time.monotonic() + limit
        self.log = out / f"{result.stage}.log"
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", "WANDB_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false"}

    def timeout_note(self) -> str:
        return f"stopped at the stage's time limit ({self.limit:.0f} s)"

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def start(self, cmd: list[str], cwd: Path | None = None) -> subprocess.Popen:
        self.result.commands.append(shlex.join(cmd))
        with open(self.log, "a") as log:
            log.write(f"\n$ {shlex.join(cmd)}\n")
            log.flush()
            return subprocess.Popen(
                cmd, cwd=cwd or ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    def wait(self, proc: subprocess.Popen) -> int:
        try:
            return proc.wait(timeout=max(1.0, self.remaining()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise TimeoutError(self.timeout_note()) from None

    def run(self, cmd: list[str], cwd: Path | None = None, check: bool = True) -> int:
        rc = self.wait(self.start(cmd, cwd))
        if check and rc:
            raise RuntimeError(f"exit code {rc}: {shlex.join(cmd)} (see {self.log.name})")
        return rc


def python() -> list[str]:
    return [sys.executable]


def lctrain_cli() -> list[str]:
    return [sys.executable, "-m", "lctrain.cli"]
