"""`prepare`'s worker processes: an ordered, bounded map over items that sees a worker's death the moment it happens.

Why not `concurrent.futures.ProcessPoolExecutor`: its workers share one task queue and one result queue, each guarded
by a lock in shared memory, and a manager thread with feeder threads stands between them and the caller. A worker
killed by the OS (the out-of-memory killer's SIGKILL) can die holding one of those locks or with a feeder mid-write, and
the executor's recovery runs through all of them: CI once saw `prepare` still running two minutes after such a kill,
on a run that ends in a second every other time; and it hands its initializer's arguments (here a tokenizer) to each
process's start, which blocks forever when the worker is killed as it starts (see `_Worker`). Here nothing is shared
between workers: each has a pipe in and a pipe out, and the caller waits on every result pipe and every worker's exit
at once, so a death is seen whatever the worker was doing (starting, reading a task, computing, writing a result) and
no lock can be left held.

Each worker keeps `depth` items queued (a thread reads its pipe in, so the caller never blocks on a worker busy
writing a result), so the next item is there when one ends; results come back in the items' order, and the caller
holds at most `2 * depth * workers` items between reading one and yielding its result (memory stays bounded on any
corpus).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.resource_tracker
import pickle
import queue
import signal
import threading
import traceback
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from multiprocessing.connection import wait

from lctrain.lifetime import exit_with_parent, signal_name

DEPTH = 2
_STOP = object()


class WorkerDied(Exception):
    """A worker ended without reporting an error: killed by a signal, or exited on its own."""

    def __init__(self, workers: int, exitcode: int | None):
        self.workers = workers
        self.exitcode = exitcode
        self.signal = signal_name(-exitcode) if exitcode is not None and exitcode < 0 else None
        super().__init__(f"a worker process (of {workers}) {self.how}")

    @property
    def how(self) -> str:
        if self.signal:
            return f"was killed by {self.signal}"
        return "ended (its exit code unknown)" if self.exitcode is None else f"exited with code {self.exitcode}"


class WorkerStartFailed(Exception):
    """A worker could not start: its initializer raised, or the initializer's arguments did not unpickle in it (a
    class it cannot import). The `__cause__` is that exception, with its worker traceback as its own cause."""

    def __init__(self, workers: int, error: BaseException):
        self.workers = workers
        super().__init__(f"a worker process (of {workers}) could not start: {type(error).__name__}: {error}")


class WorkerTraceback(Exception):
    """The worker-side traceback of an exception a worker raised (the `__cause__` of the exception re-raised here)."""


def imap_ordered(
    func: Callable,
    items: Iterable,
    workers: int,
    initializer: Callable | None = None,
    initargs: tuple = (),
    depth: int = DEPTH,
) -> Iterator:
    """`map(func, items)` over `workers` spawned processes, results in the items' order.

    `func` and `initializer` must be importable module-level functions (the workers are spawned, not forked: a fork
    after a tokenizer's threads have started can deadlock). An exception `func` raises is raised here in its item's
    turn (after the results of the items before it), with its worker traceback as its `__cause__`. A worker that
    cannot start (`initializer` raised, or its `initargs` do not unpickle there) is `WorkerStartFailed` as soon as it
    is seen, one that dies `WorkerDied`: the results of items before it that are still computing are not waited for.
    Every worker is gone when the iterator ends, fails or is closed."""
    ctx = multiprocessing.get_context("spawn")
    pool: list[_Worker] = []
    try:
        for _ in range(workers):
            pool.append(_Worker(ctx, func))
        for w in pool:
            w.post((initializer, initargs), workers)
        yield from _ordered(pool, iter(items), depth)
    finally:
        for w in pool:
            w.end()


class _Worker:
    def __init__(self, ctx, func):
        tasks_out, self.tasks = ctx.Pipe(duplex=False)
        self.results, results_in = ctx.Pipe(duplex=False)
        # The initializer's arguments (a tokenizer: megabytes) go through `tasks`, not with the process: `start()`
        # writes what it is given into a pipe whose reading end the parent itself holds until the write ends, so a
        # child that dies before reading it all (killed as it starts) would leave `start()` blocked forever.
        self.process = ctx.Process(
            target=_serve, args=(tasks_out, results_in, func), daemon=True, name="lctrain-worker"
        )
        # Ctrl-C in a terminal goes to the whole process group; it is the caller's to handle (it ends the workers), so
        # a worker must never see it, not even while its interpreter starts: it inherits SIGINT blocked (the mask
        # survives exec), and `_serve` ignores it before unblocking it, which discards one sent in between. The first
        # `start()` in an interpreter also starts multiprocessing's resource tracker, which unblocks SIGINT after its
        # own spawn, before the worker's: it is started here first.
        multiprocessing.resource_tracker.ensure_running()
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            self.process.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        # the worker's ends live in the worker only: its death closes them, which ends our reads and writes at once
        tasks_out.close()
        results_in.close()
        self.outstanding: deque[int] = deque()

    def post(self, message, workers: int) -> None:
        try:
            self.tasks.send(message)
        except (BrokenPipeError, ConnectionResetError):
            raise self.died(workers) from None

    def send(self, seq: int, item, workers: int) -> None:
        self.post(item, workers)
        self.outstanding.append(seq)

    def receive(self, workers: int) -> tuple[int, bool, object]:
        """(seq, raised, value) of the oldest item this worker holds: `value` is the result, or the exception `func`
        raised on it (raised here in its turn). A worker that could not start is `WorkerStartFailed` at once."""
        try:
            kind, value, trace = self.results.recv()
        except (EOFError, OSError):
            # EOFError: it died between results; OSError "got end of file during message": while writing one (CI:
            # a tokenizer worker killed while encoding ended prepare with this traceback instead of its one line)
            raise self.died(workers) from None
        if kind == "ok":
            return self.outstanding.popleft(), False, value
        value.__cause__ = WorkerTraceback(trace)
        if kind == "failed to start":
            raise WorkerStartFailed(workers, value) from value
        return self.outstanding.popleft(), True, value

    def died(self, workers: int) -> WorkerDied:
        self.process.join(timeout=10)  # its pipes closed as it died: reaping it is immediate
        return WorkerDied(workers, self.process.exitcode)

    def end(self) -> None:
        self.process.kill()  # nothing a worker holds outlives it: no locks, no files, only results nobody wants
        self.process.join(timeout=10)  # a process stuck in the kernel (a dead network mount) must not hold us too
        self.tasks.close()
        self.results.close()


def _ordered(pool: list[_Worker], items: Iterator, depth: int) -> Iterator:
    window = 2 * depth * len(pool)
    done: dict[int, tuple[bool, object]] = {}  # seq -> (raised, result or exception)
    sent = yielded = 0
    exhausted = False
    while True:
        while not exhausted and sent - yielded < window:
            w = min(pool, key=lambda w: len(w.outstanding))
            if len(w.outstanding) >= depth:
                break
            try:
                item = next(items)
            except StopIteration:
                exhausted = True
                break
            w.send(sent, item, len(pool))
            sent += 1
        if yielded in done:
            raised, value = done.pop(yielded)
            if raised:
                raise value
            yield value
            yielded += 1
            continue
        if exhausted and yielded == sent:
            return
        ready = set(wait([w.results for w in pool] + [w.process.sentinel for w in pool]))
        for w in pool:
            # a result written just before its worker died is still read (and an error it reported still raised)
            if w.results in ready or (w.process.sentinel in ready and w.results.poll()):
                seq, raised, value = w.receive(len(pool))
                done[seq] = raised, value
            elif w.process.sentinel in ready:
                raise w.died(len(pool))


def _serve(tasks, results, func) -> None:
    """A worker's life: initialize (the first message on `tasks`), then one result per item in the order they came,
    until the caller closes its end of `tasks` (or dies)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    exit_with_parent()  # a caller killed with SIGKILL cannot end us: stop mid-item rather than compute for nobody
    try:
        initializer, initargs = tasks.recv()
    except (EOFError, OSError):
        return
    except Exception as e:  # the arguments do not unpickle here: whatever unpickling them raised
        _report(results, "failed to start", e)
        return
    try:
        if initializer is not None:
            initializer(*initargs)
    except Exception as e:
        _report(results, "failed to start", e)
        return
    inbox: queue.SimpleQueue = queue.SimpleQueue()

    def read():
        try:
            while True:
                inbox.put(tasks.recv())
        except (EOFError, OSError):
            inbox.put(_STOP)

    threading.Thread(target=read, name="lctrain-worker-inbox", daemon=True).start()
    while (item := inbox.get()) is not _STOP:
        try:
            result = func(item)
        except Exception as e:
            _report(results, "raised", e)
        else:
            results.send(("ok", result, None))


def _report(results, kind: str, e: Exception) -> None:
    trace = traceback.format_exc()
    try:
        pickle.loads(pickle.dumps(e))  # the caller must be able to rebuild it, not only this process to write it
    except Exception:  # an exception that does not travel still reaches the caller, as its text
        e = RuntimeError(f"{type(e).__name__}: {e}")
    results.send((kind, e, trace))
