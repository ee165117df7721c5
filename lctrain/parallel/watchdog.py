"""A step watchdog on every rank: a step that has not finished long after it should have ends the run, with the
stack of every rank that can still show one and a record naming where each rank was.

Why: a rank that hangs (a stuck GPU, a stopped process, a reader blocked on a dead mount) leaves every other rank
waiting in a collective until the process group's timeout: 30 minutes with gloo and with the groups DeepSpeed builds
(torch's default, which `DEEPSPEED_TIMEOUT` does not change), and that error names a rank that timed out waiting, not
the one that hung. Here each rank's thread sees its own step overrun `train.step_timeout_minutes`, writes
`ranks.hang.RANK.json` (the step, how long, and where its main thread is: in a collective or elsewhere), prints that
thread's Python stack and ends the process; `hang_summary` (for `lctrain.parallel.launch`) then names the rank
that was not waiting for its peers, or that wrote nothing (a stopped process; a thread holding Python's lock inside
native code).

What is watched: each step from the second of a session on, through its logging; not a session's first step
(compilation, autotuning, allocator warm-up), nor a profiled one, nor checkpoint, export or trace writes, whose length
depends on the filesystem (the trainer's barrier after them starts the next step on every rank at once, so the ranks
that waited for a writer do not count that wait). A hang there is left to the process group's timeout. The limit is
the configured one or `SLOW_STEP_FACTOR` times the slowest watched step so far, whichever is longer, so a run whose
steps grow slow does not trip it by itself.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

from lctrain.parallel.records import read_records

HANG_PREFIX = "ranks.hang."  # + rank + ".json", in the ranks' directory (`run_on_ranks`' workdir)
SLOW_STEP_FACTOR = 5
GRACE_S = 5.0  # after its record, before the rank ends: its peers' watchdogs, about as late, write theirs
PAUSE_S = 2.0  # a poll returning later than this past its time: the process was stopped meanwhile
EXIT_CODE = 124  # as timeout(1): a scheduler's log then tells a hang from a crash
# Where a rank waiting for its peers is: a collective called through torch.distributed or DeepSpeed's comm layer.
_COLLECTIVE_PATHS = (f"torch{os.sep}distributed{os.sep}", f"deepspeed{os.sep}comm{os.sep}")
_PACKAGE = str(Path(__file__).resolve().parents[1]) + os.sep  # lctrain's own frames


def hang_file(directory: Path, rank: int) -> Path:
    return Path(directory) / f"{HANG_PREFIX}{rank}.json"


@dataclass(frozen=True)
class HangRecord:
    """Where one rank was when its step overran: `step` (1-based), `seconds` since it began, `in_collective`
    (waiting for its peers), `where` (the innermost frame, `file:line in function`)."""

    rank: int
    pid: int
    step: int
    seconds: float
    limit_s: float
    in_collective: bool
    where: str
    time: float

    @property
    def what(self) -> StepTimedOut:
        return StepTimedOut(f"step {self.step} had not finished after {self.seconds:.0f} s, at {self.where}")


def describe_stack(frames: list[traceback.FrameSummary]) -> tuple[bool, str]:
    """(whether the stack is inside a collective, where it is: its innermost frame, after the innermost of lctrain's
    own frames when that is another, each as `file:line in function`)."""
    in_collective = any(any(p in f.filename for p in _COLLECTIVE_PATHS) for f in frames)
    if not frames:
        return in_collective, "an unknown place"
    ours = [f for f in frames if f.filename.startswith(_PACKAGE) and f is not frames[-1]]
    return in_collective, " -> ".join(_frame_words(f) for f in [*ours[-1:], frames[-1]])


def _frame_words(frame: traceback.FrameSummary) -> str:
    """`file:line in function`, the file from its package on (`torch/distributed/distributed_c10d.py`)."""
    parts = Path(frame.filename).parts
    tops = [i for i, p in enumerate(parts) if p in ("site-packages", "dist-packages", "lctrain")]
    if tops:
        name = "/".join(parts[tops[-1] + (parts[tops[-1]] != "lctrain") :])
    else:
        name = frame.filename
    return f"{name}:{frame.lineno} in {frame.name}"


class StepWatchdog:
    """`arm(step)` as a watched step begins, `disarm()` when it has finished; `close()` at the end of training.
    `limit_s`: None or 0 watches nothing. `directory`: where the hang records go (None: nowhere), shared by the
    `world` ranks. `then`: what the user can do next (resume), asked for when it is said. `on_hang`: what ends the
    process (tests replace it).

    An overrun is said only if it lasts the grace: a step that finishes within it takes its record back with a note;
    the record is written first, so the peers' watchdogs, about as late, see it, and the lowest rank with a record
    then says which rank hung (`hang_summary`): under a launcher the user started, no other process gathers them.
    Time the process spent stopped (Ctrl-Z, a scheduler's suspend: the watchdog's own wait then returns late by as
    much) is not counted against the step."""

    def __init__(
        self,
        limit_s: float | None,
        rank: int,
        directory: Path | None,
        *,
        world: int = 1,
        then=lambda: "",
        on_hang=None,
        poll_s: float = 1.0,
        grace_s: float = GRACE_S,
    ):
        self.limit_s = limit_s or 0.0
        self.rank, self.world, self.directory, self.then = rank, world, directory, then
        self.poll_s, self.grace_s = poll_s, grace_s
        self.on_hang = on_hang or end_process
        self.slowest_s = 0.0
        self._armed_at: float | None = None
        self._step = 0
        self._main = threading.main_thread()
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._thread = None
        if directory is not None:  # an earlier session's record would be read as this one's peer's
            with contextlib.suppress(OSError):
                hang_file(directory, rank).unlink(missing_ok=True)
        if self.limit_s > 0:
            self._thread = threading.Thread(target=self._watch, name="lctrain-step-watchdog", daemon=True)
            self._thread.start()

    @property
    def current_limit_s(self) -> float:
        return max(self.limit_s, SLOW_STEP_FACTOR * self.slowest_s)

    def arm(self, step: int) -> None:
        with self._lock:
            self._step, self._armed_at = step, time.monotonic()

    def disarm(self) -> None:
        with self._lock:
            if self._armed_at is not None:
                self.slowest_s = max(self.slowest_s, time.monotonic() - self._armed_at)
            self._armed_at = None

    def close(self) -> None:
        self._closed.set()
        if self._thread is not None:
            self._thread.join()

    def _wait(self, seconds: float) -> bool:
        """Wait `seconds` or until closed (True); time beyond them, as when the process was stopped, is taken off the
        armed step's."""
        start = time.monotonic()
        closed = self._closed.wait(seconds)
        stopped = time.monotonic() - start - seconds - PAUSE_S
        if stopped > 0:
            with self._lock:
                if self._armed_at is not None:
                    self._armed_at += stopped
        return closed

    def _overrun(self) -> tuple[int, float, float] | None:
        with self._lock:
            if self._armed_at is None:
                return None
            seconds, limit = time.monotonic() - self._armed_at, self.current_limit_s
            return (self._step, seconds, limit) if seconds > limit else None

    def _watch(self) -> None:
        while not self._wait(self.poll_s):
            overrun = self._overrun()
            if overrun is not None and self._report(*overrun):
                return

    def _report(self, step: int, seconds: float, limit: float) -> bool:
        """Record the overrun of `step`, wait the grace and end the process if the step is still under way; True
        then (`on_hang` ends the process; a test's returns)."""
        frame = sys._current_frames().get(self._main.ident)
        frames = traceback.extract_stack(frame) if frame is not None else []
        in_collective, where = describe_stack(frames)
        record = HangRecord(
            self.rank, os.getpid(), step, round(seconds, 1), round(limit, 1), in_collective, where, time.time()
        )
        mine = hang_file(self.directory, self.rank) if self.directory is not None else None
        if mine is not None:
            with contextlib.suppress(OSError):  # the stack below still says it
                mine.parent.mkdir(parents=True, exist_ok=True)  # a launcher the user started made no ranks' directory
                mine.write_text(json.dumps(asdict(record)))
        if self._wait(self.grace_s) or self._overrun() is None or self._step != step:
            if mine is not None:
                mine.unlink(missing_ok=True)
            if not self._closed.is_set():
                print(f"note: rank {self.rank}: step {step} ran past the step timeout ({limit:.0f} s)", flush=True)
            return False
        waiting = "waiting for its peers in a collective" if in_collective else "not in a collective"
        then = self.then()
        said = [
            f"error: rank {self.rank}: step {step} has not finished after {seconds:.0f} s (the limit: {limit:.0f} s, "
            f"train.step_timeout_minutes or {SLOW_STEP_FACTOR}x the slowest step); it is {waiting}, at {where}; "
            f"{then}{'; ' if then else ''}its stack:\n{''.join(traceback.format_list(frames)).rstrip()}"
        ]
        records = read_records(self.directory, HANG_PREFIX) if self.directory is not None else []
        if self.world > 1 and records and self.rank == min(r["rank"] for r in records):
            said.append(f"error: {hang_summary(records, self.world)}{'; ' if then else ''}{then}")
        print("\n".join(said), file=sys.stderr, flush=True)
        self.on_hang(record)
        return True


class StepTimedOut(Exception):
    """How a session ended by its watchdog ended, for the record of it (`HangRecord.what`)."""


def end_process(record: HangRecord) -> None:
    """End without a teardown, which would wait on the collective or the device that hangs."""
    sys.stdout.flush()
    os._exit(EXIT_CODE)


def rank_list(ranks: list[int]) -> str:
    """`[0, 2, 3, 4, 7]` -> "ranks 0, 2-4, 7"; one rank -> "rank 3"."""
    runs: list[list[int]] = []
    for r in sorted(ranks):
        if runs and r == runs[-1][-1] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    words = ", ".join(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}" for run in runs)
    return f"rank{'s' if len(ranks) > 1 else ''} {words}"


def hang_summary(records: list[dict], world: int) -> str:
    """One line from the hang records (`HangRecord` as dicts) of a `world`-rank run: the ranks that hung are those
    not waiting in a collective while others wait for them, and those that wrote no record (a stopped process, or one
    holding Python's lock in native code)."""
    by_rank = {r["rank"]: r for r in records}
    first = min(records, key=lambda r: r["time"])
    step, overran = first["step"], f"{first['seconds']:.0f} s (the limit: {first['limit_s']:.0f} s)"
    waiting = [r for r, rec in by_rank.items() if rec["in_collective"]]
    elsewhere = sorted(r for r, rec in by_rank.items() if not rec["in_collective"])
    silent = [r for r in range(world) if r not in by_rank]
    said = [f"rank {r} at {by_rank[r]['where']}" for r in elsewhere]
    said += [f"{rank_list(silent)} wrote no stack (a stopped process, or one stuck in native code)"] if silent else []
    if not waiting:
        return (
            f"step {step} had not finished after {overran} and no rank was waiting in a collective: {'; '.join(said)}"
        )
    if not said:
        return (
            f"every rank waited in a collective in step {step} for {overran}: the ranks called collectives in "
            f"different orders, or the network between them stopped carrying them"
        )
    hung = sorted(elsewhere + silent)
    return (
        f"{rank_list(hung)} hung in step {step}: {'; '.join(said)}; {rank_list(waiting)} waited for "
        f"{'it' if len(hung) == 1 else 'them'} in a collective for {overran}"
    )
