"""What each session of a run ran under, one line per `train` and per `resume` in `runs/NAME/sessions.jsonl`: when,
the command, the step it started from, the host and the world, the config's fingerprint and the software (lctrain
and its commit, Python, torch, transformers, DeepSpeed, ...).

config.yaml holds the settings of the latest session only (a `resume --set train.lr=...` rewrites it) and a
checkpoint the settings it was written under; this file keeps which code and settings trained which steps, so a run
can be reproduced and a change of software between sessions is seen: a resume under other versions than the last
session's says which, since other kernels or summation orders continue the run on other bits than an uninterrupted
one.
"""

from __future__ import annotations

import datetime
import os
import shlex
import socket
import sys

from lctrain import software
from lctrain.config import Config, config_fingerprint

# Set by the `train` and `resume` commands, for the workers a launcher starts (their own argv is the launcher's).
COMMAND_VAR = "LCTRAIN_COMMAND"


def record_command() -> None:
    """Remember this process's command line for the session record of the workers it launches."""
    os.environ.setdefault(COMMAND_VAR, shlex.join(["lctrain", *sys.argv[1:]]))


def session_record(cfg: Config, start_step: int, world: int, device: str) -> dict:
    return {
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": os.environ.get(COMMAND_VAR) or shlex.join(sys.argv),
        "start_step": start_step,
        "host": socket.gethostname(),
        "world": world,
        "device": device,
        "config_fingerprint": config_fingerprint(cfg),
        "software": software.versions(),
    }


def software_note(previous: dict | None, now: dict) -> str | None:
    """One line when `now` runs other software than the `previous` session of the run, else None."""
    if previous is None:
        return None
    changed = software.changes(previous.get("software", {}), now["software"])
    if not changed:
        return None
    return (
        f"note: this session runs other software than the last one (from step {previous['start_step']}): "
        f"{', '.join(changed)}; the steps from here may differ in their last bits from an uninterrupted run's"
    )
