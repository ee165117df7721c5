"""Process lifetime: one trainer per run directory, children that die with their parent, signals that end a run the
way Ctrl-C does.

- `RunLock`: an exclusive `flock` on `RUN_DIR/.lctrain.lock`, held for as long as anything trains the run directory.
  The kernel drops it when its holder dies, however it dies; a second `train` or `resume` is refused in one line that
  names the holder (pid, host, command, start time). `lock_holder` tells whether a run is being trained now. The same
  lock keeps two `lctrain eval`s out of one output directory and two `lctrain export`s off one target.
- `Reading`: the same lock, one file per reader, marks a directory this process reads (a training its prepared
  dataset, an evaluation its run): `refuse_while_read` keeps the commands that would replace or clear it from doing so
  under the reader.
- `supervise`: runs a launcher (torchrun, DeepSpeed's) in its own session, forwards SIGTERM and Ctrl-C to it and, on
  either, stops every process under it quietly: the launchers are killed before they can print their own
  tracebacks, the workers get SIGTERM. The caller prints "interrupted" once.
- `exit_with(process)`: a daemon thread that ends this process when another one is gone: tokenizer workers when
  `prepare` dies, training workers when the `lctrain train` that launched them dies (even by `kill -9`, which no
  handler can see; the orphaned launcher then exits too, having no workers left).
- `terminate_as_interrupt`: SIGTERM raises `Terminated` (a KeyboardInterrupt) in the main thread, so cleanup runs
  exactly as for Ctrl-C.
- `StopRequest`: while a loop runs, SIGTERM asks it to stop at its next boundary instead (training writes a checkpoint
  there), and `supervise(..., on_terminate=...)` passes such a request on to the workers instead of killing them.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from lctrain.errors import UserError

LOCK_NAME = ".lctrain.lock"
# Set by a supervising `lctrain train` for the workers it launches: "pid:create_time" of the supervisor.
SUPERVISOR_ENV = "LCTRAIN_SUPERVISOR"
POLL_S = 0.5
# Signals a process raises on itself when its native code fails (abort(), a bad access): not sent from outside.
CRASH_SIGNALS = frozenset({"SIGABRT", "SIGSEGV", "SIGBUS", "SIGFPE", "SIGILL"})


class Terminated(KeyboardInterrupt):
    """SIGTERM, handled like Ctrl-C (exit code 143 instead of 130)."""


def terminate_as_interrupt() -> None:
    def raise_terminated(signum, frame):
        raise Terminated()

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, raise_terminated)


class StopRequest:
    """While entered (in the main thread), SIGTERM sets `requested` instead of raising: the loop that polls it stops at
    its next boundary, where its work can be kept (a scheduler's time limit or preemption then costs nothing since the
    last checkpoint). Further SIGTERMs are the same request: a scheduler signals every process of a job, and the
    launchers pass it on again. Ctrl-C still stops at once. On exit the previous handler is back. `say`: a line to
    write at the first request (a step can take minutes: the log shows at once that the signal was seen), written
    straight to stdout's file descriptor, since a handler that printed while the interrupted code was printing would
    re-enter Python's buffered writer."""

    def __init__(self, say: str | None = None):
        self.requested = False
        self._previous = None
        self._say = say

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._request)
        return self

    def _request(self, signum, frame) -> None:
        if not self.requested and self._say is not None:
            with contextlib.suppress(OSError, ValueError, AttributeError):  # a stdout without a descriptor: unsaid
                os.write(sys.stdout.fileno(), (self._say + "\n").encode())
        self.requested = True

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None


class RunLock:
    """Exclusive lock on a run directory for the life of this object (use as a context manager).

    The same primitive guards other directories a command must write alone (`lctrain eval`'s output, `lctrain
    export`'s target): `name` is the lock file's name in the directory, `remove` removes it on release (an output
    directory the user chose keeps nothing of lctrain's), and a subclass words the refusals for its command (`busy`,
    `cannot_create`) and adds to the record it leaves for them (`record`)."""

    # False: a second holder is refused at once. True where only a probe (`lock_holder`, an instant) can hold it.
    wait = False

    def __init__(self, run_dir: str | Path, command: str, name: str = LOCK_NAME, remove: bool = False):
        self.path = Path(run_dir) / name
        self.command = command
        self.remove = remove
        self.fd: int | None = None

    def busy(self, holder: str, pid: str) -> str:
        """The one-line refusal while `holder` (pid `pid`, or "it") holds the lock."""
        return (
            f"{self.path.parent} is being trained by {holder}; wait for it to finish or stop it "
            f"(kill {pid}) before starting another run there"
        )

    def cannot_create(self, e: OSError) -> UserError:
        """The refusal when the lock file cannot be created (a read-only filesystem, a file in the way)."""
        return UserError(
            f"{self.path.parent}: cannot create the run directory's lock file ({e.strerror or e}); "
            f"check the path and its permissions"
        )

    def record(self) -> dict:
        """What the holder writes into the lock file, for `busy` and `lock_holder`."""
        return {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "command": self.command,
            "since": time.strftime("%Y-%m-%d %H:%M:%S"),
        }

    def __enter__(self) -> RunLock:
        while True:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as e:
                raise self.cannot_create(e) from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX if self.wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                who, pid = _read_holder(fd)
                os.close(fd)
                raise UserError(self.busy(who, pid)) from None
            if not self.remove or _is_current(fd, self.path):
                break
            os.close(fd)  # its last holder removed it after this opened it: lock the file now in its place
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(self.record()).encode(), 0)
        except OSError:
            os.close(fd)  # e.g. a full disk: do not keep the lock of a run that cannot start
            raise
        self.fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self.fd is not None:
            if self.remove:  # while still held: whoever opened it meanwhile sees it replaced (`_is_current`)
                with contextlib.suppress(OSError):
                    self.path.unlink()
            os.close(self.fd)  # releases the lock; a run's file stays (removing it would race with a new holder)
            self.fd = None


READER_PREFIX = ".lctrain-reader-"


class _Unmarked(Exception):
    """`Reading` found no place for its file: the directory is read unmarked."""


class Reading(RunLock):
    """Marks `directory` as read by this process while entered (a training its prepared dataset, an evaluation its
    run's exports): `refuse_while_read` refuses to replace or clear it meanwhile, naming `reader` (words: "the training
    in runs/x"). Each reader holds a lock file of its own, `READER_PREFIX<host>-<pid>.lock`, the run lock's
    primitive rather than a marker file checked by its pid: the kernel drops the lock when its holder dies however it
    dies, so the file a killed reader leaves is a stale record that blocks nothing, and a pid reused since cannot pass
    for a live reader. That holds for processes of one machine (a lock taken on another host over a shared filesystem
    is not seen here). A directory that does not exist, or cannot take the file (a read-only dataset: nothing here can
    replace it either), is read unmarked: marking it is no reason to fail the reading."""

    wait = True  # its file is its own, named by its pid: only a probe holds it meanwhile

    def __init__(self, directory: str | Path, command: str, reader: str):
        name = f"{READER_PREFIX}{socket.gethostname()}-{os.getpid()}.lock"
        super().__init__(directory, command, name=name, remove=True)
        self.reader = reader

    def record(self) -> dict:
        return {**super().record(), "reader": self.reader}

    def cannot_create(self, e: OSError) -> Exception:
        return _Unmarked()

    def __enter__(self) -> Reading:
        if not self.path.parent.is_dir():  # RunLock would create it: a directory to be read is not made here
            return self
        try:
            return super().__enter__()
        except (_Unmarked, OSError):  # OSError: its record not written (a full disk)
            return self


def readers(directory: str | Path) -> list[dict]:
    """The records of the live readers of `directory` (`Reading`), by file name; the stale ones left out."""
    names = sorted(p.name for p in Path(directory).glob(f"{READER_PREFIX}*.lock"))
    return [h for h in (lock_holder(directory, n) for n in names) if h is not None]


def refuse_while_read(directory: str | Path, before: str) -> None:
    """Raise a one-line refusal naming every live reader of `directory` (`Reading`) and what to do; `before` says what
    the refused command would do to the directory ("rebuilding it")."""
    found = readers(directory)
    if not found:
        return
    who = ", ".join(
        f"{r.get('reader', 'another process')} (pid {r.get('pid', '?')} on {r.get('host', '?')}, since "
        f"{r.get('since', '?')})"
        for r in found
    )
    them = "it" if len(found) == 1 else "them"
    pids = " ".join(str(r["pid"]) for r in found if "pid" in r) or "them"
    raise UserError(
        f"{directory}: {who} {'reads' if len(found) == 1 else 'read'} it now; wait for {them} to finish or stop "
        f"{them} (kill {pids}) before {before}"
    )


def _is_current(fd: int, path: Path) -> bool:
    """Whether `fd` is still the file at `path` (not one removed since it was opened)."""
    try:
        here, there = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


def lock_holder(directory: str | Path, name: str = LOCK_NAME) -> dict | None:
    """Who holds `directory`'s lock now (a `RunLock`'s): what the holder wrote into the lock file ({"pid", "host",
    "command", "since"}; {} when unreadable), or None while nobody holds it. Held means alive: the kernel drops the
    lock when its holder dies. Probed by taking a shared lock and dropping it at once: a `train` starting in that
    instant would be refused, so this is for the rare moments a command must know (a checkpoint vanished, a run
    evaluated before its last step), not for polling."""
    try:
        fd = os.open(Path(directory) / name, os.O_RDONLY)
    except OSError:
        return None  # no lock file: never locked
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return _holder_info(fd)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def _holder_info(fd: int) -> dict:
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except (ValueError, OSError):
        return {}
    return info if isinstance(info, dict) else {}


def _read_holder(fd: int) -> tuple[str, str]:
    """(a description of the lock's holder, its pid or "it") from what the holder wrote into the lock file."""
    info = _holder_info(fd)
    try:
        return f"pid {info['pid']} on {info['host']} ('{info['command']}', since {info['since']})", str(info["pid"])
    except KeyError:
        return "another process", "it"


def is_alive(process: psutil.Process | int) -> bool:
    """Whether a process (a `psutil.Process`, or a pid) still runs. A killed process stays a zombie until its parent
    reaps it: it is gone all the same. A `psutil.Process` also notices its pid reused by a newer process."""
    try:
        p = process if isinstance(process, psutil.Process) else psutil.Process(process)
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True  # it exists, as another user's


def exit_with(process: psutil.Process, code: int = 1) -> None:
    """End this process (`os._exit(code)`) once `process` is no longer running."""

    def watch():
        while is_alive(process):
            time.sleep(POLL_S)
        os._exit(code)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def exit_with_parent() -> None:
    exit_with(psutil.Process(os.getppid()))


def supervisor_token() -> str:
    me = psutil.Process()
    return f"{me.pid}:{me.create_time()}"


def signal_name(number: int) -> str:
    """9 -> "SIGKILL"; a number that is no signal of this platform stays a number."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def death_of(name: str) -> str:
    """How a process killed by the signal `name` ended and the likely cause, in words ("was killed by SIGKILL (...)"),
    the one wording of every line about a killed process: tokenizer workers, training ranks, launchers, stages."""
    if name in CRASH_SIGNALS:
        return f"crashed with {name} in native code (a library aborted or faulted)"
    if name == "SIGKILL":
        return "was killed by SIGKILL (most likely the kernel's out-of-memory killer: the host ran out of memory)"
    return f"was killed by {name} (stopped from outside: a scheduler or a user)"


# A supervised lctrain command stopped by a signal it turned into `KeyboardInterrupt` exits with one of these.
STOPPED = {128 + signal.SIGINT: "SIGINT", 128 + signal.SIGTERM: "SIGTERM"}


def is_supervised() -> bool:
    """Started by an lctrain command's `supervise`, which stops it on Ctrl-C and says "interrupted" itself."""
    return bool(os.environ.get(SUPERVISOR_ENV))


def _supervisor() -> psutil.Process | None:
    """The lctrain command that started this process, None where none did (or the variable is not the
    `supervisor_token` it sets: every command reads it as it starts); raises `psutil.NoSuchProcess` when it has
    ended (its pid gone, or reused by another process)."""
    pid, _, created = os.environ.get(SUPERVISOR_ENV, "").partition(":")
    try:
        pid_number, started = int(pid), float(created)
    except ValueError:
        return None
    supervisor = psutil.Process(pid_number)
    if abs(supervisor.create_time() - started) > 1e-3:
        raise psutil.NoSuchProcess(pid_number)
    return supervisor


def exit_with_supervisor() -> None:
    """In a training worker: end with the `lctrain train` that launched it, if one did."""
    try:
        supervisor = _supervisor()
    except psutil.NoSuchProcess:
        os._exit(1)
    if supervisor is not None:
        exit_with(supervisor)


def supervisor_gone() -> bool:
    """Whether the `lctrain train` that launched this worker has ended before it: killed (it waits for its workers
    otherwise), so the other ranks are ending with it and a collective's failure here is their end, not a fault."""
    try:
        _supervisor()
    except psutil.NoSuchProcess:
        return True
    return False


def _stop_tree(root: psutil.Process, grace_s: float, sig: int = signal.SIGTERM) -> None:
    """Kill the launchers in the tree first (so they do not report their workers' deaths), then send the workers
    `sig`; SIGKILL whatever remains after `grace_s`. Ctrl-C passes on as SIGINT, which stops a training worker at
    once: SIGTERM asks it to finish its step and checkpoint (`StopRequest`), and said so, which a Ctrl-C did not do."""
    try:
        tree = [root] + root.children(recursive=True)
    except psutil.NoSuchProcess:
        return
    leaves = [p for p in tree if _is_leaf(p)]
    for p in tree:
        if p not in leaves:
            _signal(p, signal.SIGKILL)
    for p in leaves:
        _signal(p, sig)
    _, alive = psutil.wait_procs(tree, timeout=grace_s)
    for p in alive:
        _signal(p, signal.SIGKILL)
    psutil.wait_procs(alive, timeout=grace_s)


def _is_leaf(p: psutil.Process) -> bool:
    try:
        return not p.children()
    except psutil.NoSuchProcess:
        return True


def _signal(p: psutil.Process, sig: int) -> None:
    try:
        p.send_signal(sig)
    except psutil.NoSuchProcess:
        pass


def supervise(
    cmd: list[str],
    env: dict,
    grace_s: float = 10.0,
    stderr: Path | None = None,
    on_terminate: Callable[[psutil.Process], None] | None = None,
) -> int:
    """Run `cmd` (a launcher) to completion and return its exit code; `stderr`: a file that takes its standard error
    (appended). Ctrl-C or SIGTERM to this process stops the whole tree under it and re-raises here as
    KeyboardInterrupt / Terminated.

    With `on_terminate`, SIGTERM is a request instead: `on_terminate(launcher)` passes it on (to the workers, whose
    `StopRequest` stops them at a boundary where their work is kept), and this waits for the tree to end by itself,
    however long that takes, before re-raising `Terminated`; further SIGTERMs are ignored, Ctrl-C stops it at once.
    The launcher itself starts with SIGTERM ignored (a scheduler signals every process of the job: a launcher's own
    handling kills its workers 30 s later: torchrun's unless its `cmd` says otherwise, see `launch.worker_command`)."""
    env = {**env, SUPERVISOR_ENV: supervisor_token()}
    # Its own session: a terminal's Ctrl-C reaches only us, and we decide how the tree ends.
    with open(stderr, "ab") if stderr is not None else contextlib.nullcontext() as err:
        proc = subprocess.Popen(
            cmd, env=env, start_new_session=True, stderr=err, preexec_fn=_ignore_sigterm if on_terminate else None
        )
    try:
        return proc.wait()
    except Terminated as stop:
        if on_terminate is None:
            _stop_tree(psutil.Process(proc.pid), grace_s)
            proc.wait()
            raise
        previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            with contextlib.suppress(psutil.NoSuchProcess):
                on_terminate(psutil.Process(proc.pid))
            proc.wait()
        except KeyboardInterrupt:
            _stop_tree(psutil.Process(proc.pid), grace_s, signal.SIGINT)
            proc.wait()
            raise
        finally:
            signal.signal(signal.SIGTERM, previous)
        raise stop
    except KeyboardInterrupt:
        _stop_tree(psutil.Process(proc.pid), grace_s, signal.SIGINT)
        proc.wait()
        raise


def _ignore_sigterm() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
