"""Resumable `prepare`: the hidden build directory and the state saved in it each time a shard is complete.

`prepare` builds a dataset in `.NAME.partial/` beside its output directory. Each time a shard is complete (written,
synced, checksummed), the whole state of the single-process half of the pipeline is saved there atomically
(`progress.pkl`: the shuffle buffer, the mixture, the packer with its window in progress, the generators, the
statistics, what was read so far, and the windows and documents between them). A `prepare` that is stopped or killed
(even by `kill -9`) starts again from that state: it skips the source records already consumed without tokenizing
them and goes on, so its output is byte-identical to an uninterrupted run's. The state is used only when it was
saved for the same data settings, source files, shard size and format; any doubt starts over.

An exclusive `flock` on `.NAME.partial/.lock` keeps two `prepare`s from building the same directory; the kernel drops
it when its holder dies, however it dies.
"""

from __future__ import annotations

import fcntl
import os
import pickle
import shutil
from pathlib import Path

from lctrain.errors import UserError
from lctrain.files import replace_file, temporary_of

PROGRESS = "progress.pkl"
LOCK = ".lock"


class Partial:
    """`.NAME.partial/` for the output directory `out`, locked by this process from `open()` to `close()`."""

    def __init__(self, out: Path):
        self.out = out
        self.dir = out.parent / f".{out.name}.partial"
        self._lock = None

    def open(self) -> None:
        self.dir.mkdir(exist_ok=True)
        fd = os.open(self.dir / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise UserError(
                f"another 'lctrain prepare' is building {self.out} right now (it holds {self.dir / LOCK}); wait for "
                f"it to finish or stop it"
            ) from None
        self._lock = fd

    def load(self, key: dict) -> dict | None:
        """The state saved for `key` by an interrupted run, or None (none, another key, unreadable)."""
        try:
            with open(self.dir / PROGRESS, "rb") as f:
                saved = pickle.load(f)  # our own file, in our own hidden directory
        except Exception:  # none, or a damaged one: a reason to start over, whatever unpickling raised
            return None
        if not isinstance(saved, dict) or saved.get("key") != key:
            return None
        return saved["state"]

    def save(self, key: dict, state: dict) -> None:
        replace_file(
            self.dir / PROGRESS,
            pickle.dumps({"key": key, "state": state}, protocol=pickle.HIGHEST_PROTOCOL),
            "prepare's progress",
        )

    def start_over(self) -> None:
        """Remove everything an earlier run left here but the lock."""
        for p in self.dir.iterdir():
            if p.name == LOCK:
                continue
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink()

    def has_progress(self) -> bool:
        return (self.dir / PROGRESS).is_file()

    def finish(self) -> None:
        """Leave only the dataset in the directory, ready to be renamed into place (the lock is held until
        `close`)."""
        for path in (self.dir / PROGRESS, temporary_of(self.dir / PROGRESS), self.dir / LOCK):
            path.unlink(missing_ok=True)

    def close(self, keep: bool) -> None:
        """Release the lock; `keep`: leave the directory for the next run to resume, else remove it."""
        if self._lock is not None:
            if not keep:
                shutil.rmtree(self.dir, ignore_errors=True)
            os.close(self._lock)
            self._lock = None
