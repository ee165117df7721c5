"""Real text that ships with every Python, as a corpus for offline experiments and diagnostics: nothing to download.

Two kinds of document, each a record `{"text": ..., "meta": {"kind": ..., "name": ...}}` of a JSON-lines file that
`data.sources` (or `data.path`) and `diagnose rope --text` read like any other corpus:
- `prose`: Python's reference documentation as pydoc shows it (`pydoc_data.topics`, one document per topic: English
  prose with code and numbers, ~465 KB in CPython 3.11);
- `code`: the standard library's own modules (one document per `.py` file outside its tests, each text once, ~12 MB).

The documents are read in sorted order, so a given Python version gives the same corpus, byte for byte, on every
machine; another Python version gives another corpus (`fingerprint` tells them apart, and is recorded in the file).
"""

from __future__ import annotations

import json
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from pydoc_data.topics import topics

import xxhash

from lctrain.errors import UserError, output_path, writing

KINDS = ("prose", "code")
# the standard library's own test suites and bundled third-party sources are not its prose or its code
_SKIPPED_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}


def _stdlib_modules() -> Iterator[tuple[str, str]]:
    root = Path(sysconfig.get_path("stdlib"))
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if _SKIPPED_DIRS.intersection(rel.parts[:-1]):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue  # an unreadable module is not text this corpus promises
        if text.strip():
            yield rel.as_posix(), text


def documents(kinds: tuple[str, ...] = KINDS) -> Iterator[tuple[str, str, str]]:
    """(kind, name, text) of every document of `kinds`, in a fixed order."""
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown or not kinds:
        raise UserError(f"shipped text kinds are {', '.join(KINDS)}; got {', '.join(kinds) or 'none'}")
    if "prose" in kinds:
        for name in sorted(topics):
            yield "prose", name, topics[name]
    if "code" in kinds:
        # the standard library holds copies (CPython 3.11: __phello__/spam.py of __phello__/__init__.py, and two
        # one-line __init__.py; 3.12.3 a pair of long modules, which made two of a GPU run's ten rope probes one):
        # a copy adds no text to train on, and two probe sequences of one text are not two samples
        seen = set()
        for name, text in _stdlib_modules():
            digest = xxhash.xxh3_128_digest(text.encode())
            if digest not in seen:
                seen.add(digest)
                yield "code", name, text


def _hash(h, kind: str, name: str, text: str) -> None:
    h.update(f"{kind}\0{name}\0".encode())
    h.update(text.encode())


def fingerprint(kinds: tuple[str, ...] = KINDS) -> str:
    """A content hash of the corpus `kinds` gives on this Python."""
    h = xxhash.xxh3_64()
    for document in documents(kinds):
        _hash(h, *document)
    return h.hexdigest()


def write_jsonl(out: Path, kinds: tuple[str, ...] = KINDS) -> dict:
    """Write the corpus to `out` (staged, then renamed) and return what it holds: documents and characters per kind,
    the Python version and the fingerprint."""
    out = Path(out)
    if out.is_dir():
        raise UserError(f"{out}: a directory; give the file to write, e.g. {out / 'shipped.jsonl'}")
    output_path(out, None)
    counts = {k: {"documents": 0, "characters": 0} for k in kinds}
    h = xxhash.xxh3_64()
    staging = out.with_name(f".{out.name}.partial")
    with writing(out, "the shipped-text corpus"):
        with staging.open("w", encoding="utf-8") as f:
            for kind, name, text in documents(kinds):
                _hash(h, kind, name, text)
                f.write(json.dumps({"text": text, "meta": {"kind": kind, "name": name}}) + "\n")
                counts[kind]["documents"] += 1
                counts[kind]["characters"] += len(text)
        staging.replace(out)
    return {"path": str(out), "python": sys.version.split()[0], "fingerprint": h.hexdigest(), "kinds": counts}
