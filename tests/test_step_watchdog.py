"""The step watchdog (lctrain/parallel/watchdog.py): a watched step that overruns its limit ends the process with a
record of where the main thread was; disarmed or quick steps never do; the limit grows with the slowest step; and the
launcher's one line names the rank that hung from the ranks' records. The run-level case (a rank stopped with SIGSTOP
in a 2-process run) is in tests/test_killed_processes.py."""

import json
import threading
import time
import traceback
from pathlib import Path

import pytest

import lctrain
from lctrain.parallel import watchdog
from lctrain.parallel.watchdog import SLOW_STEP_FACTOR, StepWatchdog, describe_stack, hang_summary, rank_list


class Fired:
    def __init__(self):
        self.records, self.event = [], threading.Event()

    def __call__(self, record):
        self.records.append(record)
        self.event.set()


def blocked_here(seconds: float) -> None:
    time.sleep(seconds)


def test_an_overrun_step_is_reported_with_where_the_main_thread_waits(tmp_path, capsys):
    fired = Fired()
    dog = StepWatchdog(
        0.2, rank=3, directory=tmp_path, then=lambda: "resume it", on_hang=fired, poll_s=0.02, grace_s=0.05
    )
    try:
        dog.arm(7)
        blocked_here(0.6)
        assert fired.event.wait(5)
    finally:
        dog.close()
    (record,) = fired.records
    assert (record.rank, record.step, record.in_collective) == (3, 7, False)
    assert record.seconds >= 0.2 and record.limit_s == 0.2
    assert record.where == f"{__file__}:{blocked_here.__code__.co_firstlineno + 1} in blocked_here"
    assert json.loads((tmp_path / "ranks.hang.3.json").read_text())["step"] == 7
    err = capsys.readouterr().err
    assert err.startswith("error: rank 3: step 7 has not finished after") and "resume it; its stack:" in err
    assert "blocked_here" in err


def test_quick_and_unwatched_steps_never_fire():
    fired = Fired()
    dog = StepWatchdog(0.2, rank=0, directory=None, on_hang=fired, poll_s=0.02, grace_s=0)
    try:
        for step in range(5):
            dog.arm(step)
            time.sleep(0.01)
            dog.disarm()
        time.sleep(0.5)  # disarmed: a checkpoint write, however long
    finally:
        dog.close()
    assert fired.records == []


def test_the_limit_is_the_configured_one_or_a_multiple_of_the_slowest_step():
    fired = Fired()
    dog = StepWatchdog(0.05, rank=0, directory=None, on_hang=fired, poll_s=0.01, grace_s=0)
    try:
        dog.arm(1)
        time.sleep(0.1)  # over the configured limit, but the poll may miss it by a little: give the record a chance
        fired.event.wait(1)
        assert len(fired.records) == 1
        assert dog.current_limit_s == 0.05
    finally:
        dog.close()
    dog = StepWatchdog(0.05, rank=0, directory=None, on_hang=fired, poll_s=0.01, grace_s=0)
    dog.slowest_s = 0.1  # as after a watched step of 0.1 s
    try:
        assert dog.current_limit_s == pytest.approx(SLOW_STEP_FACTOR * 0.1)
        dog.arm(2)
        time.sleep(0.2)  # four times the configured limit, under the slowest step's multiple
        dog.disarm()
    finally:
        dog.close()
    assert len(fired.records) == 1
    assert dog.slowest_s >= 0.2


def test_a_step_that_finishes_within_the_grace_takes_its_record_back(tmp_path, capsys):
    fired = Fired()
    dog = StepWatchdog(0.1, rank=0, directory=tmp_path, on_hang=fired, poll_s=0.02, grace_s=0.5)
    try:
        dog.arm(4)
        time.sleep(0.25)  # over the limit, within the grace
        assert (tmp_path / "ranks.hang.0.json").is_file()
        dog.disarm()
        time.sleep(0.5)
    finally:
        dog.close()
    assert fired.records == [] and not (tmp_path / "ranks.hang.0.json").exists()
    assert "note: rank 0: step 4 ran past the step timeout (0 s)" in capsys.readouterr().out


def test_time_the_process_spent_stopped_is_not_the_steps(monkeypatch):
    """SIGSTOP (Ctrl-Z, a scheduler's suspend) stops the watchdog's thread too: its wait returns that much late."""
    monkeypatch.setattr(watchdog, "PAUSE_S", 0.05)
    fired = Fired()
    dog = StepWatchdog(0.3, rank=0, directory=None, on_hang=fired, poll_s=0.02, grace_s=0)
    wait, stopped = dog._closed.wait, threading.Event()

    def stopped_once(seconds):
        if dog._armed_at is not None and not stopped.is_set():
            stopped.set()
            time.sleep(0.6)  # as the whole process, stopped
        return wait(seconds)

    dog._closed.wait = stopped_once
    try:
        dog.arm(2)
        time.sleep(0.65)
        dog.disarm()
    finally:
        dog.close()
    assert stopped.is_set() and fired.records == []


def test_the_lowest_rank_with_a_record_names_the_rank_that_hung(tmp_path, capsys):
    """Under a launcher the user started, no process gathers the records: the ranks' watchdogs do."""
    fired = Fired()
    dogs = [
        StepWatchdog(0.1, rank=r, directory=tmp_path, world=3, on_hang=fired, poll_s=0.02, grace_s=0.3) for r in (1, 2)
    ]
    try:
        for dog in dogs:
            dog.arm(5)
        time.sleep(0.7)
    finally:
        for dog in dogs:
            dog.close()
    summaries = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: step 5 had")]
    assert summaries == [
        "error: step 5 had not finished after 0 s (the limit: 0 s) and no rank was waiting in a collective: "
        + "; ".join(f"rank {r} at {fired.records[0].where}" for r in (1, 2))
        + "; rank 0 wrote no stack (a stopped process, or one stuck in native code)"
    ]


def test_no_limit_starts_no_thread():
    dog = StepWatchdog(None, rank=0, directory=None)
    assert dog._thread is None
    dog.arm(1)
    dog.disarm()
    dog.close()


def frames(*files: str) -> list[traceback.FrameSummary]:
    return [traceback.FrameSummary(f, i + 1, f"f{i}") for i, f in enumerate(files)]


def test_a_stack_in_torch_distributed_or_deepspeed_comm_is_waiting_in_a_collective():
    trainer = str(Path(lctrain.__file__).parent / "train" / "trainer.py")
    c10d = "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py"
    ds = "/venv/lib/python3.11/site-packages/deepspeed/comm/comm.py"
    item = "/venv/lib/python3.11/site-packages/torch/_tensor.py"
    assert describe_stack(frames(trainer, c10d))[0]
    assert describe_stack(frames(trainer, ds, item))[0]
    assert not describe_stack(frames(trainer, item))[0]
    assert describe_stack([]) == (False, "an unknown place")
    assert describe_stack(frames(c10d))[1] == "torch/distributed/distributed_c10d.py:1 in f0"
    # lctrain's innermost frame, then the innermost
    assert describe_stack(frames(trainer, item)) == (
        False,
        "lctrain/train/trainer.py:1 in f0 -> torch/_tensor.py:2 in f1",
    )


def test_rank_lists_name_runs():
    assert rank_list([3]) == "rank 3"
    assert rank_list([7, 0, 2, 3, 4]) == "ranks 0, 2-4, 7"


def record(rank, in_collective, where="w", at=0.0):
    return {"rank": rank, "step": 17, "seconds": 612.4, "limit_s": 600.0, "in_collective": in_collective,
            "where": where, "time": at}  # fmt: skip


def test_the_summary_names_the_silent_rank_the_others_waited_for():
    line = hang_summary([record(0, True), record(2, True), record(3, True)], world=4)
    assert line == (
        "rank 1 hung in step 17: rank 1 wrote no stack (a stopped process, or one stuck in native code); "
        "ranks 0, 2-3 waited for it in a collective for 612 s (the limit: 600 s)"
    )


def test_the_summary_names_the_rank_stuck_outside_a_collective():
    line = hang_summary([record(0, True), record(1, False, "lctrain/data/store.py:9 in read")], world=2)
    assert line == (
        "rank 1 hung in step 17: rank 1 at lctrain/data/store.py:9 in read; rank 0 waited for it in a collective "
        "for 612 s (the limit: 600 s)"
    )


def test_the_summary_when_every_rank_waits_or_none_does():
    assert hang_summary([record(0, True), record(1, True)], world=2).startswith(
        "every rank waited in a collective in step 17 for 612 s (the limit: 600 s): the ranks called collectives"
    )
    assert hang_summary([record(0, False, "a.py:1 in f"), record(1, False, "b.py:2 in g")], world=3) == (
        "step 17 had not finished after 612 s (the limit: 600 s) and no rank was waiting in a collective: "
        "rank 0 at a.py:1 in f; rank 1 at b.py:2 in g; rank 2 wrote no stack (a stopped process, or one stuck in "
        "native code)"
    )
