"""`imap_ordered`: `prepare`'s worker processes. Results against the in-process `map`, in order and bounded; a worker's
exception raised with its traceback; a worker's death (by a signal or an exit code, while starting, computing or
idle) seen at once as `WorkerDied`; no worker outlives the iterator."""

import contextlib
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time

import pool_functions as fn
import psutil
import pytest

from lctrain.data.pool import WorkerDied, WorkerStartFailed, WorkerTraceback, imap_ordered


def workers_alive() -> list:
    return [p for p in multiprocessing.active_children() if p.name == "lctrain-worker"]


def test_results_come_in_the_items_order_from_every_worker():
    items = list(range(40))
    got = list(imap_ordered(fn.square_after_a_while, items, workers=2))
    assert [r for r, _ in got] == [x * x for x in items]
    assert len({pid for _, pid in got}) == 2 and os.getpid() not in {pid for _, pid in got}
    assert not workers_alive()


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_no_more_than_the_window_is_read_ahead_of_the_results(depth):
    taken = []

    def items():
        for x in range(30):
            taken.append(x)
            yield x

    results = imap_ordered(fn.square_after_a_while, items(), workers=2, depth=depth)
    for yielded, (r, _) in enumerate(results, start=1):
        assert r == (yielded - 1) ** 2
        assert len(taken) - yielded < 2 * depth * 2
    assert len(taken) == 30


def test_an_exception_in_a_worker_is_raised_with_its_worker_traceback():
    """In the failing item's turn, as `map` would: after the results of the items before it, whichever worker ends
    first."""
    results = imap_ordered(fn.fails_on_three, range(10), workers=2)
    assert [next(results) for _ in range(3)] == [0, 1, 2]
    with pytest.raises(ValueError, match="no threes here: 3") as e:
        next(results)
    assert isinstance(e.value.__cause__, WorkerTraceback)
    assert "in fails_on_three" in str(e.value.__cause__) and "pool_functions.py" in str(e.value.__cause__)
    assert not workers_alive()


def test_an_exception_that_does_not_travel_arrives_as_its_text():
    """One that does not pickle, and one that pickles but does not unpickle (its `__init__` wants other arguments)."""
    with pytest.raises(RuntimeError, match="Unpicklable: the worker's own words"):
        list(imap_ordered(fn.fails_unpicklably, range(4), workers=2))
    with pytest.raises(RuntimeError, match="NeedsTwoArguments: the worker's: other words"):
        list(imap_ordered(fn.fails_unpicklably, range(1, 4), workers=2))


def test_an_initializer_that_raises_is_worker_start_failed_with_its_exception():
    with pytest.raises(WorkerStartFailed, match="could not start: RuntimeError: this worker cannot start") as e:
        list(imap_ordered(fn.square_after_a_while, range(4), workers=2, initializer=fn.refuse_to_start))
    assert isinstance(e.value.__cause__, RuntimeError) and isinstance(e.value.__cause__.__cause__, WorkerTraceback)
    assert "refuse_to_start" in str(e.value.__cause__.__cause__)
    assert not workers_alive()


def test_initializer_arguments_that_do_not_unpickle_in_the_worker_are_worker_start_failed():
    args = (fn.BuiltByAModuleTheWorkerLacks(),)
    with pytest.raises(WorkerStartFailed, match="ModuleNotFoundError: No module named 'custom_tokenizer'") as e:
        list(imap_ordered(fn.square_after_a_while, range(4), 2, fn.takes_a_blob, args))
    assert isinstance(e.value.__cause__, ModuleNotFoundError)
    assert not workers_alive()


@pytest.mark.parametrize(
    ("death", "signal_name", "exitcode"),
    [
        (f"signal:{int(signal.SIGKILL)}", "SIGKILL", -9),
        (f"signal:{int(signal.SIGSEGV)}", "SIGSEGV", -11),
        ("exit:3", None, 3),
    ],
)
def test_a_worker_that_dies_computing_is_named_with_its_signal_or_exit_code(monkeypatch, death, signal_name, exitcode):
    monkeypatch.setenv("POOL_TEST_DEATH", death)  # the spawned workers inherit the environment
    got = []
    with pytest.raises(WorkerDied) as e:
        for x in imap_ordered(fn.dies_on_two, range(10), workers=2):
            got.append(x)
    assert got in ([], [0], [0, 1])  # the death is raised when seen, not after the items before it
    assert (e.value.signal, e.value.exitcode, e.value.workers) == (signal_name, exitcode, 2)
    how = f"was killed by {signal_name}" if signal_name else "exited with code 3"
    assert str(e.value) == f"a worker process (of 2) {how}"
    assert not workers_alive()


def test_a_worker_that_dies_while_writing_a_result_is_worker_died():
    """The parent reads a result cut short by the worker's death as multiprocessing's OSError "got end of file during
    message" (a tokenizer worker killed while encoding, once in CI), not EOFError: the same death."""
    from lctrain.data import pool

    class CutShort:
        def recv(self):
            raise OSError("got end of file during message")

    class Killed:
        exitcode = -signal.SIGKILL

        def join(self, timeout=None):
            pass

    worker = object.__new__(pool._Worker)
    worker.results, worker.process = CutShort(), Killed()
    with pytest.raises(WorkerDied, match="was killed by SIGKILL"):
        worker.receive(2)


def test_a_worker_killed_while_starting_is_seen():
    with pytest.raises(WorkerDied, match="was killed by SIGKILL"):
        list(imap_ordered(fn.square_after_a_while, range(4), workers=2, initializer=fn.killed_while_starting))


def test_a_worker_killed_before_it_reads_its_start_is_seen():
    """Each worker is SIGKILLed the moment its interpreter exists, long before it could read an 8 MB initializer
    argument. Given to the process itself, that argument would leave `Process.start()` writing forever into a pipe
    whose reading end the parent holds (multiprocessing's spawn); it travels on the worker's own pipe instead."""
    me = psutil.Process()
    stop = threading.Event()

    def kill_every_worker_as_it_appears():
        while not stop.is_set():
            for child in me.children():
                with contextlib.suppress(psutil.Error):
                    if "spawn_main" in " ".join(child.cmdline()):
                        child.kill()
            time.sleep(0.001)

    outcome = []

    def run_the_pool():
        try:
            list(imap_ordered(fn.square_after_a_while, range(4), 2, fn.takes_a_blob, (b"x" * 8_000_000,)))
        except WorkerDied as e:
            outcome.append(e)

    threading.Thread(target=kill_every_worker_as_it_appears, daemon=True).start()
    pool = threading.Thread(target=run_the_pool, daemon=True)
    pool.start()
    pool.join(timeout=60)
    stop.set()
    assert not pool.is_alive(), "the pool hung on a worker killed as it started"
    assert len(outcome) == 1 and outcome[0].signal == "SIGKILL"
    assert not workers_alive()


def test_an_idle_worker_killed_is_seen_while_the_other_computes(tmp_path):
    """One item for two workers: the one without work is killed; the caller, waiting on the other's 30 s item, learns of
    it at once."""
    busy = tmp_path / "busy.pid"

    def kill_the_idle_one():
        while not busy.exists() or not busy.read_text():
            time.sleep(0.01)
        idle = [p for p in workers_alive() if p.pid != int(busy.read_text())]
        os.kill(idle[0].pid, signal.SIGKILL)

    killer = threading.Thread(target=kill_the_idle_one, daemon=True)
    killer.start()
    start = time.monotonic()
    with pytest.raises(WorkerDied, match="was killed by SIGKILL"):
        list(imap_ordered(fn.sleeps_and_says_who, [str(busy)], workers=2))
    assert time.monotonic() - start < 20
    assert not workers_alive()


def test_ctrl_c_never_reaches_a_worker_even_while_its_interpreter_starts():
    """A terminal's Ctrl-C goes to the whole process group; here it reaches the workers the moment they are started
    (the items are read only then), long before their imports end."""

    def items():
        for p in workers_alive():
            os.kill(p.pid, signal.SIGINT)
        yield from range(6)

    # Ctrl-C live here, as in a terminal: a test run started in the background has SIGINT ignored, which the workers
    # would inherit, and the test would pass whatever the pool does
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        got = [r for r, _ in imap_ordered(fn.square_after_a_while, items(), workers=2)]
    finally:
        signal.signal(signal.SIGINT, previous)
    assert got == [x * x for x in range(6)]


def test_every_worker_starts_with_ctrl_c_blocked_in_a_fresh_interpreter():
    """Only a fresh interpreter starts multiprocessing's resource tracker with its first worker, and the tracker's start
    unblocks SIGINT on its way out: the first worker then started with Ctrl-C live (CI saw its import traceback)."""
    code = "import json, pool_functions; print(json.dumps(pool_functions.spawn_masks()))"
    here = os.path.dirname(fn.__file__)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([here, os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.splitlines()[-1])
    workers = [blocked for kind, blocked in seen if kind == "worker"]
    assert workers == [True, True], seen


def test_closing_early_ends_every_worker():
    results = imap_ordered(fn.square_after_a_while, range(1000), workers=2)
    assert next(results)[0] == 0
    assert len(workers_alive()) == 2
    results.close()
    assert not workers_alive()
