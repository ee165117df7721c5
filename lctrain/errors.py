"""User-facing errors: the CLI prints their one-line message and exits with code 2, no traceback."""

from __future__ import annotations

import errno


class UserError(Exception):
    """A mistake the user can fix (bad config, missing data, unreadable input).

    The message must be a single line naming the file, key or value at fault and what to do.
    """

    exit_code = 2

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


# Failures of the machine around a command rather than of lctrain: a full disk or quota, a missing permission, a
# read-only filesystem, a path that runs through a file or a file where a directory must go.
ENVIRONMENT_ERRNOS = frozenset(
    {errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.EISDIR, errno.EEXIST}
)
# torch.save reports a failed write (a full disk) as a RuntimeError of its zip writer, without an errno.
_TORCH_WRITE_FAILED = "PytorchStreamWriter failed writing file"


def is_environment_error(e: BaseException) -> bool:
    if isinstance(e, OSError):
        return e.errno in ENVIRONMENT_ERRNOS or "No space left on device" in str(e)
    return isinstance(e, RuntimeError) and _TORCH_WRITE_FAILED in str(e)


def environment_error_message(e: BaseException) -> str | None:
    """One line for an environment failure (see ENVIRONMENT_ERRNOS), None for anything else."""
    if not is_environment_error(e):
        return None
    if isinstance(e, OSError):
        where = " -> ".join(str(f) for f in (e.filename, e.filename2) if f) or "a file"
        what = e.strerror or str(e)
    else:
        where, what = "a checkpoint file", "the write failed (is the disk full?)"
    return " ".join(
        f"{where}: {what}; free disk space, fix the permissions or choose another path, then run the "
        f"command again".split()
    )
