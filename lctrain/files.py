"""Replacing a file whole: a reader (another rank, `resume` after a kill, the next `prepare` after a power cut) finds
the old content or the new, never a part of either.

The content goes to a temporary file beside the target (same filesystem, so the rename is atomic), is flushed to
disk, renamed over the target, and the directory is synced so that the rename itself survives a power cut.
"""

from __future__ import annotations

import os
from pathlib import Path

from lctrain.errors import writing

TEMPORARY_PREFIX = ".tmp-"


def temporary_of(path: Path) -> Path:
    """Where `replace_file` writes `path` before the rename (a leftover of a kill, for cleanups to remove)."""
    return path.with_name(TEMPORARY_PREFIX + path.name)


def fsync_path(path: Path) -> None:
    """Wait until the kernel has written `path` to the disk: a file's data, or a directory's entries (a rename)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_file(path: Path, content: str | bytes, what: str) -> None:
    """Replace `path` by `content` atomically and durably; a full disk or a lost permission is one line naming `what`
    (errors.writing)."""
    tmp = temporary_of(path)
    with writing(path, what):
        try:
            with open(tmp, "wb" if isinstance(content, bytes) else "w") as f:
                f.write(content)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)  # on a full disk, the part written is space the user needs back
            raise
        fsync_path(path.parent)


def readable_as_config_json(directory: Path) -> None:
    """Give every file of a saved model directory the mode its config.json was created with (the umask's):
    safetensors writes the weights with mode 0600 whatever the umask, so on a shared filesystem a colleague or an
    evaluation service could read every file of the model but its weights."""
    mode = (directory / "config.json").stat().st_mode & 0o777
    for f in directory.iterdir():
        if f.is_file() and f.stat().st_mode & 0o777 != mode:
            f.chmod(mode)
