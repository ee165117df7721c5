"""The software a command runs on: lctrain's version (and its git commit, when its source is a checkout), Python's,
and the libraries whose version changes numbers (kernels, summation orders, checkpoint formats). `lctrain --version`
prints it; every training session records it (`lctrain.train.session`). Versions are read from the installed
metadata: nothing is imported.
"""

from __future__ import annotations

import importlib.metadata
import platform
import subprocess
from pathlib import Path

from lctrain import __version__

LIBRARIES = ("torch", "transformers", "deepspeed", "flash-attn", "liger-kernel")


def source_commit() -> str | None:
    """`git describe --always --dirty` of lctrain's source when it is a git checkout (an editable install), else
    None (a wheel: its version says it)."""
    root = Path(__file__).resolve().parent.parent
    if not (root / ".git").exists():
        return None
    try:
        out = subprocess.run(
            ["git", "-C", str(root), "describe", "--always", "--dirty"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):  # no git on the machine, or a hung filesystem: unknown
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() or None


def versions() -> dict[str, str | None]:
    """{name: version} of lctrain, its source commit, Python and `LIBRARIES` (None: not installed)."""
    out: dict[str, str | None] = {"lctrain": __version__, "lctrain source": source_commit()}
    out["python"] = platform.python_version()
    for name in LIBRARIES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def changes(before: dict[str, str | None], now: dict[str, str | None]) -> list[str]:
    """'name old -> new' for each entry of `versions()` that differs between two records."""
    return [
        f"{name} {before.get(name) or 'none'} -> {now.get(name) or 'none'}"
        for name in now
        if before.get(name) != now.get(name)
    ]
