"""Functions tests/test_pool.py runs in `imap_ordered`'s spawned workers (module-level: the workers import them)."""

import os
import signal
import time
from pathlib import Path


def square_after_a_while(x: int) -> tuple[int, int]:
    """x*x after a delay that varies with x (so results finish out of order), and the worker's pid."""
    time.sleep(0.02 * (x % 3))
    return x * x, os.getpid()


def fails_on_three(x: int) -> int:
    """Item 0 is slow, so item 3's error (on the other worker) arrives before item 0's result."""
    if x == 0:
        time.sleep(0.5)
    if x == 3:
        raise ValueError(f"no threes here: {x}")
    return x


class Unpicklable(Exception):
    def __reduce__(self):
        raise TypeError("this exception does not pickle")


class NeedsTwoArguments(Exception):
    """Pickles (as its type and args), but does not unpickle: its `__init__` wants two arguments, args holds one."""

    def __init__(self, what: str, why: str):
        super().__init__(f"{what}: {why}")


def fails_unpicklably(x: int) -> int:
    if x == 0:
        raise Unpicklable("the worker's own words")
    raise NeedsTwoArguments("the worker's", "other words")


def dies_on_two(x: int) -> int:
    """Item 2 ends its worker the way the OS would (`("signal", n)`) or with an exit code (`("exit", n)`)."""
    how, n = os.environ["POOL_TEST_DEATH"].split(":")
    if x == 2:
        if how == "signal":
            os.kill(os.getpid(), int(n))
        os._exit(int(n))
    return x


def refuse_to_start() -> None:
    raise RuntimeError("this worker cannot start")


def cannot_import_its_class(name: str):
    raise ModuleNotFoundError(f"No module named '{name}'")


class BuiltByAModuleTheWorkerLacks:
    """Pickles here; unpickling it (in a worker) fails as a tokenizer of `trust_remote_code` would without its
    module."""

    def __reduce__(self):
        return cannot_import_its_class, ("custom_tokenizer",)


def takes_a_blob(blob: bytes) -> None:
    """An initializer with a large argument, as a tokenizer is."""
    assert len(blob) > 0


def killed_while_starting() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def sleeps_and_says_who(path: str) -> int:
    """Writes its pid to `path`, then works for a long time."""
    Path(path).write_text(str(os.getpid()))
    time.sleep(30)
    return 0


def spawn_masks() -> list[tuple[str, bool]]:
    """Run a pool in this (fresh) interpreter and say, for each process multiprocessing spawns for it, whether SIGINT
    was blocked in the spawning thread, i.e. in the child as its interpreter starts. The first worker also starts
    multiprocessing's resource tracker, which blocks and then *unblocks* SIGINT around its own spawn."""
    import multiprocessing.util

    from lctrain.data.pool import imap_ordered

    seen = []
    spawn = multiprocessing.util.spawnv_passfds

    def watched(path, args, passfds):
        kind = "worker" if "spawn_main" in str(args) else "tracker"
        seen.append((kind, signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, [])))
        return spawn(path, args, passfds)

    multiprocessing.util.spawnv_passfds = watched
    assert [r for r, _ in imap_ordered(square_after_a_while, range(4), workers=2)] == [0, 1, 4, 9]
    return seen
