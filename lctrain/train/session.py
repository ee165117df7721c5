"""What each session of a run ran under, one line per `train` and per `resume` in `runs/NAME/sessions.jsonl`: when,
the command, the step it started from, the host and the world, the config's fingerprint and the software (lctrain
and its commit, Python, torch, transformers, DeepSpeed, ...).

config.yaml holds the settings of the latest session only (a `resume --set train.lr=...` rewrites it) and a
checkpoint the settings it was written under; this file keeps which code and settings trained which steps, so a run
can be reproduced and a change of software between sessions is seen: a resume under other versions than the last
session's says which, since other kernels or summation orders continue the run on other bits than an uninterrupted
one.

Each line is completed when its session ends (`record_end`): when, the last step reached, how it ended and whether
the run had diverged by then, so the file also says which sessions finished, were stopped by SIGTERM or failed (and
with which error), and which ran on diverged weights. The line is rewritten in place, one line per session still, so
a reader of the start fields sees no other shape of record; a session killed with -9, or lost with its machine, keeps
only its start.
"""

from __future__ import annotations

import datetime
import json
import os
import shlex
import socket
import sys

from lctrain import software
from lctrain.config import Config, config_fingerprint
from lctrain.files import replace_file
from lctrain.lifetime import Terminated
from lctrain.rundir import RunDir

# Set by the `train` and `resume` commands, for the workers a launcher starts (their own argv is the launcher's).
COMMAND_VAR = "LCTRAIN_COMMAND"


def record_command() -> None:
    """Remember this process's command line for the session record of the workers it launches."""
    os.environ.setdefault(COMMAND_VAR, shlex.join(["lctrain", *sys.argv[1:]]))


def now() -> str:
    """The time as a session record says it: UTC, ISO 8601 to the second (so such strings sort as times)."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def session_record(cfg: Config, start_step: int, world: int, device: str, peak_flops: float | None) -> dict:
    """A session's line of sessions.jsonl as it starts. `peak_tflops` is what the session's MFU divides by per device
    (null: no MFU), unrounded: a CPU's is measured at every start, so two sessions' MFU compare only through it (log
    explorer: rounded to 4 decimals, a CPU's 0.1125 recomputed MFU 8e-5 off)."""
    return {
        "started": now(),
        "command": os.environ.get(COMMAND_VAR) or shlex.join(sys.argv),
        "start_step": start_step,
        "host": socket.gethostname(),
        "world": world,
        "device": device,
        "peak_tflops": None if peak_flops is None else peak_flops / 1e12,
        "config_fingerprint": config_fingerprint(cfg),
        "software": software.versions(),
    }


def software_note(previous: dict | None, now: dict) -> str | None:
    """One line when `now` runs other software than the `previous` session of the run, or when a resumed run has no
    previous session (trained so far by an lctrain that recorded none: what it ran under is unknown), else None."""
    if previous is None:
        if now["start_step"] == 0:
            return None
        return (
            f"note: sessions.jsonl starts at step {now['start_step']}: the steps before were trained by an lctrain "
            f"that recorded no sessions (before 2026-11-27), so whether this session runs other software is unknown"
        )
    changed = software.changes(previous.get("software", {}), now["software"])
    if not changed:
        return None
    return (
        f"note: this session runs other software than the last one (from step {previous['start_step']}): "
        f"{', '.join(changed)}; the steps from here may differ in their last bits from an uninterrupted run's"
    )


def session_end(end_step: int, error: BaseException | None, diverged_at: int | None = None) -> dict:
    """The fields that complete a session's record: `ended`, `end_step` (the last step reached), `diverged` (whether the
    run's loss had diverged by its end, in this session or an earlier one: metrics.jsonl's `diverged`, or the run
    stopped at a step whose loss or gradient norm was not a number) with the step it diverged at in `diverged_at`, and
    `outcome`: finished, stopped by SIGTERM, interrupted (Ctrl-C) or failed, the last with the error's first line in
    `error`."""
    end = {"ended": now(), "end_step": end_step, "diverged": diverged_at is not None}
    if diverged_at is not None:
        end["diverged_at"] = diverged_at
    if error is None:
        return {**end, "outcome": "finished"}
    if isinstance(error, Terminated):
        return {**end, "outcome": "stopped by SIGTERM"}
    if isinstance(error, KeyboardInterrupt):
        return {**end, "outcome": "interrupted"}
    return {**end, "outcome": "failed", "error": _error_text(error)}


def _error_text(error: BaseException) -> str:
    """An error as a session's record names it: its type and its message's first line."""
    first = next(iter(str(error).splitlines()), "")
    return f"{type(error).__name__}: {first}" if first else type(error).__name__


def complete_last_session(rd: RunDir, error: BaseException, since: str, cause: bool = False) -> None:
    """Complete the run's last session with `error` if it started at `since` or later (an ISO time, as `started`)
    and has not said how it ended: its workers were stopped before rank 0 could (killed, hung, out of memory). Its
    last step is the last one logged. With `cause` (the launcher names the rank that died or hung), a session rank 0
    recorded as failed with what it met (a collective's "Connection closed by peer") gets `error` in its place, rank
    0's kept as `symptom`. Never raises (`record_end`): it runs while the command fails with `error`."""
    try:
        sessions, logged = rd.read_sessions(), rd.read_metrics()
    except OSError as e:
        _not_recorded(rd, e)
        return
    if not sessions or sessions[-1].get("started", "") < since:
        return
    last = sessions[-1]
    if "ended" not in last:
        end_step = logged[-1]["step"] if logged else last["start_step"]
        record_end(rd, last, end_step, error, diverged_step(logged))
    elif cause and last.get("outcome") == "failed":
        _replace_record(rd, last, {**last, "error": _error_text(error), "symptom": last.get("error")})


def _replace_record(rd: RunDir, old: dict, new: dict) -> None:
    """sessions.jsonl with its last line that is `old` replaced by `new`, the file replaced whole (a kill while it is
    written keeps the old one); the run lock keeps other sessions out meanwhile, and a file removed or replaced since
    gets `new` appended. Never raises: a failure is one warning line."""
    try:
        path = rd.sessions_file
        lines = path.read_text(errors="replace").splitlines() if path.is_file() else []
        written = json.dumps(old)
        at = next((i for i in range(len(lines) - 1, -1, -1) if lines[i] == written), None)
        if at is None:
            lines.append(json.dumps(new))
        else:
            lines[at] = json.dumps(new)
        replace_file(path, "".join(line + "\n" for line in lines), "the sessions record")
    except Exception as e:
        _not_recorded(rd, e)


def diverged_step(records: list[dict]) -> int | None:
    """The step from which the metrics `records` say the run diverged, None where none does."""
    return next((r["step"] for r in records if r.get("diverged")), None)


def record_end(
    rd: RunDir, session: dict, end_step: int, error: BaseException | None, diverged_at: int | None = None
) -> None:
    """Complete this session's line of sessions.jsonl (`session`, as `RunDir.append_session` wrote it) with how it
    ended (`session_end`); the file is replaced whole (a kill while it is written keeps the old one). Never raises: a
    failure to record is one warning line, so it neither hides the error the session ended with nor fails a finished
    run."""
    _replace_record(rd, session, {**session, **session_end(end_step, error, diverged_at)})


def _not_recorded(rd: RunDir, e: Exception) -> None:
    print(f"warning: could not record how this session ended in {rd.sessions_file} ({e})", flush=True)
