"""User-facing errors: the CLI prints their one-line message and exits with their `exit_code`, no traceback.

The exit codes, as click's (2 = usage), for scripts (Slurm, CI) to tell "fix the command" from "the run failed":
0 success; 2 the command cannot run as given (`UserError`: a bad option, config key or value, missing or damaged
input, a run or export already there, a locked run directory, and environment failures: a full disk, a permission);
1 the work ran and failed (`RunFailed`: a NaN or infinite loss, a rank out of memory, killed or hung, an experiment
whose runs failed: resubmitting or resuming may help); 130 Ctrl-C; 143 SIGTERM (docs/troubleshooting.md)."""

from __future__ import annotations

import errno
import os
import re
import resource
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


class UserError(Exception):
    """A mistake the user can fix (bad config, missing data, unreadable input).

    The message must be a single line naming the file, key or value at fault and what to do.
    """

    exit_code = 2

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


class RunFailed(UserError):
    """The inputs were valid and the work ran, then failed: a loss or gradient norm that is not a number, a rank out of
    memory, killed or hung, an experiment whose runs failed. One line as a UserError, but exit code 1: resubmitting or
    resuming may help, where exit code 2 says to fix the command."""

    exit_code = 1


def error_of(message: str, exit_code: int) -> UserError:
    """The UserError (or RunFailed) that exits with `exit_code`: how a rank's error, reported by its exit code and
    message, is raised again by the process that launched it."""
    return RunFailed(message) if exit_code == RunFailed.exit_code else UserError(message)


# Failures of the machine around a command rather than of lctrain: a full disk or quota, a missing permission, a
# read-only filesystem, a path that runs through a file or a file where a directory must go.
ENVIRONMENT_ERRNOS = frozenset(
    {
        errno.ENOSPC,
        errno.EDQUOT,
        errno.EACCES,
        errno.EPERM,
        errno.EROFS,
        errno.EBUSY,
        errno.ENOTDIR,
        errno.EISDIR,
        errno.EEXIST,
        errno.EFBIG,
    }
)
# torch.save reports a failed write (a full disk) as a RuntimeError of its zip writer without an errno:
# "PytorchStreamWriter failed writing file" or, when the disk fills between two records, "inline_container.cc ...
# unexpected pos".
_TORCH_WRITE_FAILED = re.compile(r"PytorchStreamWriter failed writing file|inline_container\.cc.*unexpected pos", re.S)
# Rust libraries (tokenizers, safetensors) raise a plain Exception whose text ends in "(os error 28)"; pyarrow's
# OSError may carry the errno only in its text ("[errno 28]").
_ERRNO_IN_TEXT = re.compile(r"\(os error (\d+)\)|\[errno (\d+)\]", re.I)


def _torch_cause() -> str:
    """Why torch's serializer may have failed to write: a full disk, or, where this process has one, its file-size
    limit (`ulimit -f`: the write fails as on a full disk, with free space left)."""
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit == resource.RLIM_INFINITY:
        return "is the disk full?"
    return f"is the disk full, or a file past this process's file-size limit of {limit:,} bytes (ulimit -f)?"


# What to do about each cause: the remedy follows the cause in the one line.
_REMEDY = {
    errno.ENOSPC: "free disk space or choose a path on another filesystem",
    errno.EDQUOT: "free space within your quota or choose a path on another filesystem",
    errno.EROFS: "choose a path on a writable filesystem",
    errno.EACCES: "fix the permissions or choose a writable path",
    errno.EPERM: "fix the permissions or choose a writable path",
    errno.EBUSY: "it is a mount point or in use: choose a directory inside it or stop what holds it",
    errno.EFBIG: "raise this shell's file-size limit (ulimit -f unlimited) or choose another filesystem",
}


def cited(command: str) -> str:
    """A command as a message quotes it, to be copied whole: in single quotes, or in double quotes where a path in it
    is shell-quoted (single quotes inside single quotes broke it apart)."""
    return f'"{command}"' if "'" in command else f"'{command}'"


def first_and_more(items: list[str], most: int) -> str:
    """The first `most` of a message's items, comma-separated, and how many more ("a, b and 3 more")."""
    more = f" and {len(items) - most:,} more" if len(items) > most else ""
    return ", ".join(items[:most]) + more


def _errno_of(e: BaseException) -> int | None:
    if isinstance(e, OSError) and e.errno is not None:
        return e.errno
    m = _ERRNO_IN_TEXT.search(str(e))
    if m:
        return int(m.group(1) or m.group(2))
    return errno.ENOSPC if "No space left on device" in str(e) else None


def is_environment_error(e: BaseException) -> bool:
    if isinstance(e, RuntimeError) and _TORCH_WRITE_FAILED.search(str(e)):
        return True
    if not isinstance(e, Exception):
        return False
    number = _errno_of(e)
    # An errno read from a non-OSError's text counts only for a write failure: "(os error 2)" in a parse error is
    # the library's business.
    return number in ENVIRONMENT_ERRNOS if isinstance(e, OSError) else number in _REMEDY


def remedy_of(e: BaseException) -> str:
    """What to do about the environment failure `e`, by its errno (`_REMEDY`); one without an errno (torch's
    serializer) is taken for a full disk, or a file-size limit where this process has one. For a `WriteFailed`, pass
    the error it was raised from (its `__cause__`)."""
    number = _errno_of(e)
    if number is None and resource.getrlimit(resource.RLIMIT_FSIZE)[0] != resource.RLIM_INFINITY:
        return f"{_REMEDY[errno.ENOSPC]}, or raise this shell's file-size limit (ulimit -f unlimited)"
    return _REMEDY.get(number or errno.ENOSPC, "fix the path or choose another one")


def environment_error_message(e: BaseException) -> str | None:
    """One line for an environment failure (see ENVIRONMENT_ERRNOS), None for anything else."""
    if not is_environment_error(e):
        return None
    if isinstance(e, OSError):
        where = " -> ".join(str(f) for f in (e.filename, e.filename2) if f) or "a file"
        what = e.strerror or str(e)
    elif _errno_of(e) is None:
        where, what = "a checkpoint file", f"the write failed ({_torch_cause()})"
    else:
        where, what = "a file", os.strerror(_errno_of(e))
    return " ".join(f"{where}: {what}; {remedy_of(e)}, then run the command again".split())


class WriteFailed(UserError):
    """Writing `path` (`what`, in words) failed for a reason of the machine: `cause`, in words."""

    def __init__(self, path: str | os.PathLike, what: str, cause: str, remedy: str):
        self.path, self.what, self.cause = Path(path), what, cause
        super().__init__(f"cannot write {what} {path}: {cause}; {remedy}, then run the command again")


@contextmanager
def writing(path: str | os.PathLike, what: str) -> Iterator[None]:
    """Every write of a run's or a dataset's artefacts goes through here: a full disk or quota, a read-only
    filesystem, a lost permission or a busy mount point, whichever library raised it (an OSError, torch's serializer,
    tokenizers' or safetensors' plain Exception, pyarrow), becomes one `WriteFailed` line naming the file, the cause
    and what to do. Anything else passes through unchanged."""
    try:
        yield
    except UserError:
        raise
    except Exception as e:
        if not is_environment_error(e):
            raise
        number = _errno_of(e)
        # None: torch's serializer, which gives no errno
        cause = f"the write failed; {_torch_cause()}" if number is None else os.strerror(number)
        remedy = remedy_of(e)
        where = e.filename if isinstance(e, OSError) and e.filename else path
        raise WriteFailed(where, what, cause, remedy) from e


def output_dir(path: Path, option: str | None = "--out") -> Path:
    """Create the output directory a command was given, before its work, and check it can be written into: one that
    cannot be (a file in the way, a symbolic link to nothing, a read-only or special filesystem) is one line naming
    the option, not a traceback after minutes of computing. `option` None: a command's argument, named by its path."""
    return _directory(path, path, option)


def output_path(path: Path, option: str | None = "--out") -> Path:
    """As `output_dir`, for an output file, or a directory a command writes whole and renames into place: its parent
    directory is created and checked, and a symbolic link to nothing in its place is refused (written through, it
    failed; renamed over, the link was lost)."""
    _directory(path.parent, path, option)
    if path.is_symlink() and not path.exists():
        raise UserError(_dangling(path, path, option))
    return path


def _directory(directory: Path, given: Path, option: str | None) -> Path:
    """Create `directory` for the output `given` as `option`, or raise the one line that says why it cannot be."""
    named = _named(given, option)
    another = f"choose another {option}" if option else "choose another path"
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        # mkdir's own error names the first step that failed, not why: "File exists" for a link to nothing,
        # "No such file or directory" where a special filesystem (/proc) takes no new directory
        check_creatable(directory, given, option)
        if e.errno == errno.ENOENT:
            base = next(p for p in (directory, *directory.parents) if p.exists())
            why = f"({e.strerror}): {base} takes no new directories; {another}"
        else:
            why = f"({e.strerror}); {_REMEDY.get(e.errno, another)}"
        raise UserError(f"{named}: cannot create the directory {why}") from None
    if not os.access(directory, os.W_OK | os.X_OK):
        raise UserError(f"{named}: the directory {directory} is not writable; fix its permissions or {another}")
    return directory


def check_creatable(directory: Path, given: Path, option: str | None = "--out") -> None:
    """Refuse, without creating anything, a `directory` (for the output `given` as `option`) that runs through a
    symbolic link to nothing or through a file: for a command that checks its options before it writes."""
    steps = list(reversed([directory, *directory.parents]))  # from the root: the first fault decides
    link = next((p for p in steps if p.is_symlink() and not p.exists()), None)
    if link is not None:
        raise UserError(_dangling(link, given, option))
    blocker = next((p for p in steps if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        kind = "a file" if blocker.is_file() else "not a directory"
        another = f"choose another {option}" if option else "choose another path"
        why = f"({os.strerror(errno.ENOTDIR)}): {blocker} is {kind}; move it away or {another}"
        raise UserError(f"{_named(given, option)}: cannot create the directory {why}")


def _dangling(link: Path, given: Path, option: str | None) -> str:
    """The line for an output path that runs through `link`, a symbolic link to nothing."""
    target = link.parent / os.readlink(link)  # a relative target is read from the link's directory
    where = "a symbolic link" if link == given else f"{link} is a symbolic link"
    return f"{_named(given, option)}: {where} to {target}, which does not exist; create {target} or remove the link"


def _named(given: Path, option: str | None) -> str:
    return f"{option} {given}" if option else str(given)
