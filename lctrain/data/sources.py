"""Where documents come from, as a stream of raw record batches (parsing and tokenization happen in the workers).

- `synthetic`: document indices of the seeded generator;
- `local`: a file, a glob, or a directory of `.jsonl`, `.jsonl.zst`, `.json`, `.json.zst` (JSON Lines, or one JSON
  array of records) or `.parquet` files (a SlimPajama download `train/chunk*/*.jsonl.zst` included: a directory
  with a `<split>/` folder reads that folder); files of other types are skipped and named, and a file that cannot
  be records as a whole (compressed otherwise than its name says, UTF-16, not UTF-8, no JSON object) is refused
  saying what it is;
- `hub`: a Hugging Face dataset streamed with `datasets` (SlimPajama-627B by default);
- `data.sources`: several of the above, drawn document by document by weight or token share (`mixed_batches`).

File order is shuffled with the data seed; documents are shuffled further by the token buffer in `prepare`.
"""

from __future__ import annotations

import codecs
import errno
import glob
import io
import itertools
import json
import os
import stat
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import xxhash

from lctrain.errors import UserError
from lctrain.units import GiB

JSONL_SUFFIXES = (".jsonl", ".json", ".jsonl.zst", ".json.zst")
PARQUET_SUFFIXES = (".parquet",)
SUPPORTED = JSONL_SUFFIXES + PARQUET_SUFFIXES
# what data.path reads of a record (parquet columns); data.sources read their own text_field and domain_field
PATH_FIELDS = ("text", "meta")
UNSUPPORTED = f"unsupported file type: not {', '.join(SUPPORTED[:-1])} or {SUPPORTED[-1]}"
BATCH_RECORDS = 256
BATCH_BYTES = 4 << 20
# the whitespace JSON allows before a value
_JSON_BLANK = b" \t\r\n"
# the first bytes of compressed files, and the tool that decompresses each: a corpus compressed in a way its name does
# not say would otherwise be read as lines of garbage and skipped record by record
_COMPRESSED = (
    (b"\x1f\x8b", "gzip", "gzip -dc"),
    (b"\x28\xb5\x2f\xfd", "zstd", "zstd -dc"),
    (b"\xfd7zXZ\x00", "xz", "xz -dc"),
    (b"PK\x03\x04", "zip", "unzip -p"),
)
# bzip2's "BZh" is plain ASCII: the block magic after the level digit makes it unambiguous
_BZIP2 = b"1AY&SY"
# UTF-32 LE first: its byte-order mark starts with UTF-16 LE's
_BOMS = (
    (codecs.BOM_UTF32_LE, "UTF-32"),
    (codecs.BOM_UTF32_BE, "UTF-32"),
    (codecs.BOM_UTF16_LE, "UTF-16"),
    (codecs.BOM_UTF16_BE, "UTF-16"),
)
# a file without one JSON object is parsed whole to say what shape it has, up to this size on disk (as arrays are)
_SHAPE_BYTES = GiB


@dataclass
class RawBatch:
    """Records for one worker call. `kind`: 'jsonl' (bytes lines), 'rows' (dicts) or 'synthetic' (document
    indices). `first` is the line (or row) number of the first record, 1-based, for messages."""

    kind: str
    source: str
    first: int
    items: list
    params: dict = field(default_factory=dict)


def _named(path: Path, suffixes: str | tuple[str, ...]) -> bool:
    """Whether the file's name ends with one of `suffixes`, in any case (`CORPUS.JSONL`, as some exports name them)."""
    return path.name.lower().endswith(suffixes)


def _supported(p: Path) -> bool:
    return _named(p, SUPPORTED)


_NOT_REGULAR = {
    stat.S_IFIFO: "a named pipe",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
}


@dataclass
class LocalFiles:
    """The input files of `data.path` in their seeded order, and the candidates left out with the reason."""

    files: list[Path]
    skipped: list[tuple[Path, str]]

    def identity(self) -> dict:
        """What tells two sets of input files apart without reading them (names, sizes, modification times)."""
        h = xxhash.xxh3_128()
        for f in self.files:
            st = f.stat()
            h.update(f"{f}\t{st.st_size}\t{st.st_mtime_ns}\n".encode())
        return {"files": len(self.files), "xxh3_128": h.hexdigest()}


def _candidates(path: str, split: str) -> tuple[list[Path], list[tuple[Path, str]]]:
    """Entries with a supported name under `data.path`; the others, and unlistable directories, with the reason. A
    path that exists is taken as a path even when its name holds glob characters (a directory `data[1]`); only one
    that does not is a pattern. A folder's hidden entries are passed over, as Python's glob passes them over unless
    the pattern spells their dot; a file path or pattern that names a hidden file reads it."""
    p = Path(path)
    if p.exists() or p.is_symlink():
        if not p.is_dir():
            if not _supported(p):
                raise UserError(f"data.path = '{path}': unsupported file type; use one of {', '.join(SUPPORTED)}")
            return [p], []
        root = p / split if (p / split).is_dir() else p
        found, other, unlistable = [], [], []
        for top, dirs, names in os.walk(root, onerror=lambda e: unlistable.append((Path(e.filename), e.strerror))):
            # hidden files and folders (.DS_Store, .git/, .ipynb_checkpoints/, macOS's ._a.jsonl, the hub client's
            # .cache/) are bookkeeping, not data someone expected read: reading them would add copies or binary
            # files, naming them would only bury the files that matter, and a glob over the folder skips them too
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            for n in sorted(names):
                if n.startswith("."):
                    continue
                (found if _supported(Path(n)) else other).append(Path(top) / n)
        if not found and not unlistable:
            raise UserError(f"data.path = '{path}': no {', '.join(SUPPORTED)} files under {root}{_others(other)}")
        return sorted(found), [(d, f"directory cannot be listed: {why}") for d, why in unlistable] + [
            (f, UNSUPPORTED) for f in sorted(other)
        ]
    if any(ch in path for ch in "*?["):
        matched = [
            m for m in sorted(Path(m) for m in glob.glob(path, recursive=True)) if m.is_symlink() or not m.is_dir()
        ]
        found = [m for m in matched if _supported(m)]
        other = [m for m in matched if not (_supported(m) or m.is_dir())]  # a linked folder is not a file
        if not found:
            raise UserError(f"data.path = '{path}': the pattern matches no {'/'.join(SUPPORTED)} file{_others(other)}")
        return found, [(f, UNSUPPORTED) for f in other]
    raise UserError(f"data.path = '{path}': no such file or directory")


def _others(files: list[Path]) -> str:
    """The files of other types found instead, for a message that says none was usable."""
    if not files:
        return ""
    return f" ({len(files)} file(s) of other types, e.g. {files[0].name}; convert them to one of these)"


def _why_unreadable(f: Path) -> str | None:
    """None for a regular file this process may read; the reason to skip it otherwise. Refuses (UserError) a pipe,
    a device or a socket: reading one would block or never end. Nothing is opened here."""
    try:
        mode = os.stat(f).st_mode
    except OSError as e:
        if f.is_symlink():
            return "symlink loop" if e.errno == errno.ELOOP else "dangling symlink (its target does not exist)"
        return e.strerror or str(e)
    kind = _NOT_REGULAR.get(stat.S_IFMT(mode))
    if kind is not None:
        raise UserError(
            f"{f} is {kind}, not a regular file; lctrain reads only regular files: remove it from data.path"
        )
    if not stat.S_ISREG(mode):
        return "not a regular file"
    if not os.access(f, os.R_OK):
        return "permission denied"
    return None


def resolve_local_files(path: str, split: str, seed: int) -> LocalFiles:
    """The input files of `data.path`, in a seeded shuffled order, and those skipped with the reason (dangling
    symlinks, unreadable files and directories)."""
    candidates, skipped = _candidates(path, split)
    files = []
    for f in candidates:
        why = _why_unreadable(f)
        if why is None:
            files.append(f)
        else:
            skipped.append((f, why))
    if not files:
        first, why = skipped[0]
        raise UserError(
            f"data.path = '{path}': no readable {'/'.join(SUPPORTED)} file ({len(skipped)} skipped; {first}: {why})"
        )
    order = np.random.default_rng(seed).permutation(len(files))
    return LocalFiles([files[i] for i in order], skipped)


def _compression(head: bytes) -> tuple[str, str] | None:
    """(format, the command that decompresses it) when `head`, a file's first bytes, is a compressor's magic."""
    for magic, kind, tool in _COMPRESSED:
        if head.startswith(magic):
            return kind, tool
    # zstd's skippable frames (pzstd writes one first) have magics 0x184D2A50-5F, stored little-endian
    if head[1:4] == b"\x2a\x4d\x18" and 0x50 <= head[0] <= 0x5F:
        return "zstd", "zstd -dc"
    if head.startswith(b"BZh") and head[4:10] == _BZIP2:
        return "bzip2", "bzip2 -dc"
    return None


def _check_compression(path: Path) -> None:
    """Refuses a file compressed otherwise than its name says: a `.jsonl` that is gzip, a `.zst` that is not zstd."""
    try:
        with open(path, "rb") as f:
            head = f.read(16)
    except OSError:
        return  # reading it says why
    found = _compression(head)
    name = path.name
    if _named(path, ".zst"):
        if found is not None and found[0] != "zstd":
            raise UserError(
                f"{path}: {found[0]}-compressed, not zstd as its name says; decompress it ({found[1]}) and compress "
                f"it again with zstd, or remove it from the input"
            )
        if found is None and head.removeprefix(codecs.BOM_UTF8).lstrip(_JSON_BLANK)[:1] in (b"{", b"["):
            raise UserError(f"{path}: plain JSON text, not zstd-compressed as its name says; rename it to {name[:-4]}")
    elif found is not None:
        kind, tool = found
        if _named(path, PARQUET_SUFFIXES):
            raise UserError(f"{path}: {kind}-compressed, not a parquet file; decompress it ({tool})")
        if kind == "zstd":
            raise UserError(f"{path}: zstd-compressed, but its name does not say so; rename it to {name}.zst")
        raise UserError(
            f"{path}: {kind}-compressed, not plain JSON text as its name says; decompress it ({tool}), or compress "
            f"it with zstd instead and name it {name}.zst, or remove it from the input"
        )


def _check_encoding(path: Path, first_line: bytes) -> None:
    """Refuses a file whose byte-order mark says it is UTF-16 or UTF-32: its every line would be skipped."""
    for bom, encoding in _BOMS:
        if first_line.startswith(bom):
            raise UserError(
                f"{path}: {encoding} text (it starts with a {encoding} byte-order mark), not UTF-8; convert it to "
                f"UTF-8 (iconv -f {encoding} -t UTF-8), or remove it from the input"
            )


def _stem(path: Path) -> str:
    """The file's name without its JSON and zstd suffixes."""
    name = path.name[:-4] if _named(path, ".zst") else path.name
    return next((name[: -len(s)] for s in (".jsonl", ".json") if name.lower().endswith(s)), name)


def parse_line(line: bytes):
    """The JSON value of a JSON Lines line, or the skip reason: the one reading of a line, in the workers and here."""
    try:
        s = line.decode("utf-8").removeprefix("\ufeff")  # a byte-order mark opens files saved by some editors
    except UnicodeDecodeError:
        return None, "undecodable"
    if not s.strip():
        return None, "blank_line"
    try:
        return json.loads(s), None
    except (ValueError, RecursionError):  # RecursionError: nesting deeper than the parser's stack ('[' * 200000)
        return None, "malformed_json"


class _FirstObject:
    """The lines of a JSON Lines file up to its first JSON object: enough to say what a file without one is (another
    encoding, binary data, one JSON document spread over lines, JSON values that are not records)."""

    def __init__(self):
        self.found = False
        self.lines = 0  # not blank
        self.undecodable = 0
        self.nul = 0
        self.values: Counter = Counter()  # the JSON types of lines that parse to something else
        self.opens = b""  # the first character of the first line that is not blank

    def add(self, line: bytes) -> None:
        value, reason = parse_line(line)
        if reason == "blank_line":
            return
        if isinstance(value, dict):
            self.found = True
            return
        if not self.lines:
            self.opens = line.removeprefix(codecs.BOM_UTF8).lstrip(_JSON_BLANK)[:1]
        self.lines += 1
        # JSON text has no raw NUL: one means UTF-16/32 without a byte-order mark, or binary data
        self.nul += b"\x00" in line
        if reason == "undecodable":
            self.undecodable += 1
        elif reason is None:
            self.values[type(value).__name__] += 1


def _count(n: int, noun: str) -> str:
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


def _no_records(path: Path, seen: _FirstObject) -> str:
    """What a JSON Lines file without one JSON object is and what to do, for a one-line refusal."""
    n = _count(seen.lines, "line")
    if seen.nul:
        return (
            f"{path}: not UTF-8 JSON Lines: {seen.nul:,} of its {n} hold NUL bytes (UTF-16 or UTF-32 text without a "
            f"byte-order mark, or binary data); convert it to UTF-8 JSON Lines, or remove it from the input"
        )
    if seen.undecodable == seen.lines:
        return (
            f"{path}: not UTF-8 text: none of its {n} decodes as UTF-8 (Latin-1 or another legacy encoding?); "
            f"convert it to UTF-8 (iconv -f ENCODING -t UTF-8), or remove it from the input"
        )
    shape = _document_shape(path) if seen.opens in (b"{", b"[") else None
    if shape:
        return shape
    if set(seen.values) == {"str"}:
        return (
            f"{path}: its {n} are JSON strings, not records; lctrain reads records, objects with the text in a field: "
            f"write each as one (jq -c '{{text: .}}'), or remove it from the input"
        )
    values = sum(seen.values.values())
    counts = {"not JSON": seen.lines - seen.undecodable - values, "not UTF-8": seen.undecodable, "not objects": values}
    return (
        f"{path}: not JSON Lines: none of its {n} is a JSON object "
        f"({', '.join(f'{c:,} {what}' for what, c in counts.items() if c)}); records are one JSON object per line: "
        f"repair it, or remove it from the input"
    )


def _document_shape(path: Path) -> str | None:
    """What a JSON Lines file that is one JSON document spread over lines holds, and what to do; None when it is not
    one (or too large to read whole)."""
    if path.stat().st_size > _SHAPE_BYTES:
        return None
    try:
        with _open_binary(path) as f:
            value = json.loads(f.read())
    except Exception:  # whatever reading or parsing raised, the file is not one JSON document: its lines say more
        return None
    if isinstance(value, list):
        zst = path.name[-4:] if _named(path, ".zst") else ""
        return _array_problem(path, value) or (
            f"{path}: one JSON array of {_count(len(value), 'record')} spread over lines, not JSON Lines; rename it to "
            f"{_stem(path)}.json{zst} (a .json file that starts with '[' is read as one array of records)"
        )
    if isinstance(value, dict):
        wrapped = _wrapped_list(value)
        if wrapped:
            return _wrapped_message(f"{path}: the file is", *wrapped)
        return (
            f"{path}: one JSON object spread over lines (keys: {_field_names(value)}), not JSON Lines; write each "
            f"record on one line (jq -c .)"
        )
    return None


def _array_problem(path: Path, records: list) -> str | None:
    """Why a JSON array holds no record (no element is an object), for a one-line refusal; None when it holds some,
    or none at all."""
    if not records or any(isinstance(r, dict) for r in records):
        return None
    if all(isinstance(r, str) for r in records):
        return (
            f"{path}: one JSON array of {_count(len(records), 'string')}, not of records; lctrain reads records, "
            f"objects with the text in a field: write them as JSON Lines (jq -c '.[] | {{text: .}}')"
        )
    return (
        f"{path}: one JSON array of {_count(len(records), 'value')}, none of them a record (an object with the text "
        f"in a field)"
    )


def _longest_string(obj: dict, prefix: str = "", levels: int = 16) -> tuple[int, str] | None:
    """(length, dotted key) of the longest string in `obj` and the objects nested in it (down to `levels`): where a
    record most likely keeps its text."""
    best = None
    for k, v in obj.items():
        if isinstance(v, str):
            found = (len(v), f"{prefix}{k}")
        elif isinstance(v, dict) and levels > 1:
            found = _longest_string(v, f"{prefix}{k}.", levels - 1)
        else:
            continue
        if found is not None and (best is None or found[0] > best[0]):
            best = found
    return best


def _wrapped_list(record: dict) -> tuple[str, list] | None:
    """(key, items) when `record` is a corpus wrapped in one object (`{"data": [{"text": ...}, ...]}`) rather than a
    record: its largest value is a list of objects or of strings, larger than any of its strings."""
    lists = [
        (k, v)
        for k, v in record.items()
        if isinstance(v, list) and v and (all(isinstance(x, dict) for x in v) or all(isinstance(x, str) for x in v))
    ]
    if not lists:
        return None
    # sized as JSON text; a parquet row's values (timestamps, bytes) are sized as their str
    size = {k: len(json.dumps(v, default=str)) for k, v in lists}
    key, items = max(lists, key=lambda kv: size[kv[0]])
    longest = _longest_string(record)
    if longest is not None and longest[0] >= size[key]:
        return None
    return str(key), items


def _wrapped_message(where: str, key: str, items: list) -> str:
    strings = isinstance(items[0], str)
    path = f".{key}[]" if key.isidentifier() else f".[{json.dumps(key)}][]"
    return (
        f"{where} one JSON object holding a list of {_count(len(items), 'string' if strings else 'record')} under "
        f"'{key}', not a record; lctrain reads JSON Lines (one record per line) or a .json file that is one array of "
        f"records: write them out one per line (jq -c '{path}{' | {text: .}' if strings else ''}')"
    )


def field_at(obj, dotted: str, absent=None):
    """`obj`'s value at a dotted key (`meta.redpajama_set_name`, `doc.body`), reading a JSON-encoded string on the
    way (parquet SlimPajama stores `meta` as one); `absent` when there is none. A key with the dots in its own name is
    taken first: it named that key before dotted keys were read."""
    if isinstance(obj, dict) and dotted in obj:
        return obj[dotted]
    for part in dotted.split("."):
        if isinstance(obj, str):
            try:
                obj = json.loads(obj)
            except (ValueError, RecursionError):
                return absent
        if not isinstance(obj, dict) or part not in obj:
            return absent
        obj = obj[part]
    return obj


def _open_binary(path: Path):
    try:
        raw = open(path, "rb")
    except OSError as e:
        raise UserError(f"{path}: cannot read ({e.strerror}); check data.path and permissions") from None
    if _named(path, ".zst"):
        return io.BufferedReader(_ZstdReader(raw), 1 << 20)
    return raw


class TruncatedSource(Exception):
    pass


class _ZstdReader(io.RawIOBase):
    """Decompresses a .zst file frame by frame and, unlike zstandard's stream reader (which ends quietly at the end
    of its input), raises TruncatedSource when the file ends inside a frame: a cut download is not a short corpus."""

    def __init__(self, raw):
        # only .zst inputs need zstandard (start-up time)
        import zstandard

        self._raw = raw
        self._dctx = zstandard.ZstdDecompressor()
        self._frame = self._dctx.decompressobj()
        self._fed = False  # the current frame has received input
        self._out = bytearray()

    def readable(self) -> bool:
        return True

    def _feed(self, data: bytes) -> None:
        while data:
            self._out += self._frame.decompress(data)
            self._fed = True
            if not self._frame.eof:
                return
            data = self._frame.unused_data  # the next frame of a multi-frame file
            self._frame = self._dctx.decompressobj()
            self._fed = False

    def readinto(self, buffer) -> int:
        while not self._out:
            data = self._raw.read(1 << 20)
            if not data:
                if self._fed:
                    raise TruncatedSource("the file ends inside a zstd frame (truncated)")
                return 0
            self._feed(data)
        n = min(len(buffer), len(self._out))
        buffer[:n] = self._out[:n]
        del self._out[:n]
        return n

    def close(self) -> None:
        self._raw.close()
        super().close()


def _read_error(path: Path, e: Exception, where: str) -> UserError:
    if isinstance(e, TruncatedSource):
        return UserError(f"{path}: {e} {where}; re-download the file or remove it from data.path")
    # zstandard raises ZstdError, plain files OSError
    return UserError(f"{path}: unreadable {where} ({type(e).__name__}: {e}); re-download or remove the file")


def _jsonl_batches(path: Path) -> Iterator[RawBatch]:
    """The lines of a JSON Lines file; refused when it has no JSON object at all (another encoding, binary data, a JSON
    document that is not JSON Lines): its every line would be skipped, and the file lost in the skipped counts."""
    src = str(path)
    seen = _FirstObject()
    with _open_binary(path) as f:
        lines, size, first, lineno = [], 0, 1, 0
        try:
            for lineno, line in enumerate(f, start=1):
                if lineno == 1:
                    _check_encoding(path, line)
                if not seen.found:
                    seen.add(line)
                if not lines:
                    first = lineno
                lines.append(line)
                size += len(line)
                if len(lines) >= BATCH_RECORDS or size >= BATCH_BYTES:
                    yield RawBatch("jsonl", src, first, lines)
                    lines, size = [], 0
        except UserError:
            raise
        except Exception as e:
            raise _read_error(path, e, f"after line {lineno}" if lineno else "before its first line") from None
        if not seen.found and seen.lines:
            raise UserError(_no_records(path, seen))
        if lines:
            yield RawBatch("jsonl", src, first, lines)


def _is_json_array(path: Path) -> bool:
    """Whether a `.json` file is one JSON array (its first character past a byte-order mark and whitespace is `[`)
    rather than JSON Lines."""
    with _open_binary(path) as f:
        try:
            head = f.read(1 << 16).removeprefix(codecs.BOM_UTF8).lstrip(_JSON_BLANK)
            while not head:
                chunk = f.read(1 << 16)
                if not chunk:
                    return False
                head = chunk.lstrip(_JSON_BLANK)
        except Exception as e:
            raise _read_error(path, e, "at its start") from None
    return head.startswith(b"[")


def _text_size(item, text_field: str) -> int:
    """What a raw record weighs towards `BATCH_BYTES`: a jsonl line's bytes, a row's text in characters. Rows counted
    nothing once: 256 long documents of a parquet file made one batch of millions of tokens, held in memory many
    times over in flight, and no shard was written (nothing for an interrupted prepare to keep) until it was done."""
    if isinstance(item, bytes):
        return len(item)
    text = field_at(item, text_field) if isinstance(item, dict) else None
    return len(text) if isinstance(text, str) else 0


def _sized_batches(kind: str, src: str, rows: Iterable, text_field: str, first: int = 1) -> Iterator[RawBatch]:
    """`rows` in batches of at most `BATCH_RECORDS` records and about `BATCH_BYTES` of text, numbered from `first`."""
    batch, size = [], 0
    for row in rows:
        batch.append(row)
        size += _text_size(row, text_field)
        if len(batch) >= BATCH_RECORDS or size >= BATCH_BYTES:
            yield RawBatch(kind, src, first, batch)
            first += len(batch)
            batch, size = [], 0
    if batch:
        yield RawBatch(kind, src, first, batch)


def _json_array_batches(path: Path, text_field: str) -> Iterator[RawBatch]:
    """The elements of a `.json` file holding one JSON array, numbered from 1. Read and parsed whole: an array has no
    record boundaries to stream by, unlike JSON Lines."""
    with _open_binary(path) as f:
        try:
            data = f.read()
        except Exception as e:
            raise _read_error(path, e, "while reading the JSON array") from None
    try:
        records = json.loads(data)
    except (ValueError, RecursionError) as e:  # RecursionError: nesting deeper than the parser's stack
        raise UserError(
            f"{path}: not a valid JSON array ({type(e).__name__}: {e}); a .json file starting with '[' is read as "
            f"one array of records: repair or re-download it"
        ) from None
    del data
    problem = _array_problem(path, records)
    if problem:
        raise UserError(problem)
    yield from _sized_batches("rows", str(path), records, text_field)


def _parquet_batches(path: Path, fields: tuple[str, ...]) -> Iterator[RawBatch]:
    # only parquet inputs need pyarrow (start-up time)
    import pyarrow as pa
    import pyarrow.parquet as pq

    row = 1
    try:
        pf = pq.ParquetFile(path)
        names = set(pf.schema_arrow.names)
        # a dotted field (doc.body) is read from its top-level column
        tops = [f if f in names else f.split(".")[0] for f in fields]
        # without its text column every column is read: the first record's check then names them all
        columns = [c for c in dict.fromkeys(tops) if c in names] if tops[0] in names else None

        def rows() -> Iterator[dict]:
            nonlocal row
            for b in pf.iter_batches(batch_size=BATCH_RECORDS, columns=columns):
                records = b.to_pylist()
                yield from records
                row += len(records)

        yield from _sized_batches("rows", str(path), rows(), fields[0])
    except (OSError, pa.ArrowException) as e:
        raise UserError(
            f"{path}: unreadable as parquet at row {row} ({type(e).__name__}: {e}); re-download or remove the file"
        ) from None


def _file_batches(path: Path, fields: tuple[str, ...]) -> Iterator[RawBatch]:
    _check_compression(path)
    if _named(path, PARQUET_SUFFIXES):
        return _parquet_batches(path, fields)
    if _named(path, (".json", ".json.zst")) and _is_json_array(path):
        return _json_array_batches(path, fields[0])
    return _jsonl_batches(path)


def local_batches(files: list[Path], fields: tuple[str, ...] | None = None) -> Iterator[RawBatch]:
    """The records of local files (jsonl lines are passed whole). `fields`: with `data.sources`, the top-level fields
    a parquet file is read for (`mixed_batches` checks the text field); None for `data.path`: `text` and `meta`, and
    each file's first record is checked for `text` here."""
    batches = itertools.chain.from_iterable(_file_batches(f, fields or PATH_FIELDS) for f in files)
    return batches if fields is not None else _with_text_checked(batches)


def _with_text_checked(batches: Iterator[RawBatch]) -> Iterator[RawBatch]:
    """`data.path`'s batches, refused at the first JSON object of a file when it has fields but no `text` (`meta`
    aside) or its `text` is an object: the file keeps its text elsewhere, which only `data.sources` can name, and
    every record of it would be skipped. A record of `meta` alone is a record without text, for the workers to
    count."""
    checked = None  # the file whose first JSON object was checked
    for b in batches:
        for j, item in enumerate(b.items if b.source != checked else ()):
            record = _json_object(item)
            if record is None:
                continue
            checked = b.source
            _check_path_record(record, f"{b.source}: record {b.first + j}")
            break
        yield b


def _check_path_record(record: dict, where: str) -> None:
    others = {k: v for k, v in record.items() if k != "meta"}
    text = record.get("text")
    if not others or isinstance(text, str) or ("text" in record and not isinstance(text, dict)):
        return
    if "text" in record:
        found = _longest_string(text, "text.")
        what = f"{where}'s 'text' is an object (it has: {_field_names(text)}), not a string; data.path reads a string"
        other = "the one inside it"
    else:
        wrapped = _wrapped_list(others)
        if wrapped:
            raise UserError(_wrapped_message(f"{where} is", *wrapped))
        found = _longest_string(others)
        what = f"{where} has no 'text' field (it has: {_field_names(record)}); data.path reads the text"
        other = "another field"
    if found is None:
        raise UserError(f"{what} from 'text', and no field of this record holds a string: are these text records?")
    raise UserError(
        f"{what} from 'text': for {other} replace data.source and data.path with "
        f"data.sources=[{{name: corpus, path: <data.path>, text_field: {found[1]}}}]"
    )


def hub_batches(
    name: str, split: str, seed: int, subset: str | None = None, key: str = "data.hub_name", text_field: str = "text"
) -> Iterator[RawBatch]:
    """Stream a hub dataset (rows with `text_field` and optional `meta`) without downloading it whole. `key`: the
    config key that named it, for messages."""
    # only hub sources need datasets, which takes ~1 s to import (start-up time)
    from datasets import load_dataset

    try:
        ds = load_dataset(name, subset, split=split, streaming=True)
    except Exception as e:  # the hub client raises many types (connection, not found, gated, offline)
        what = f"subset '{subset}', split '{split}'" if subset else f"split '{split}'"
        raise UserError(
            f"{key} = '{name}' ({what}): cannot stream it ({type(e).__name__}); "
            f"check the name and network (HF_DATASETS_OFFLINE), or download it and read it from a local path"
        ) from None
    ds = ds.shuffle(seed=seed, buffer_size=1000)

    def rows() -> Iterator[dict]:
        stream, read = iter(ds), 0
        while True:
            try:
                record = next(stream)
            except StopIteration:
                return
            except Exception as e:  # a dropped connection mid-stream surfaces as whatever the transport raises
                raise UserError(
                    f"{key} = '{name}': streaming failed after {read} rows "
                    f"({type(e).__name__}: {e}); rerun, or download it and use data.source=local"
                ) from None
            read += 1
            yield record

    yield from _sized_batches("rows", name, rows(), text_field)


@dataclass
class SourceStream:
    """One source of `data.sources` as its batches, with what the workers need to read its records."""

    name: str
    text_field: str
    domain_field: str | None
    weight: float
    batches: Iterator[RawBatch]
    key: str  # data.sources[i], for messages


def _records(stream: SourceStream) -> Iterator[tuple[str, str, int, object]]:
    """(kind, file, line or row, raw record) of one source, in its own order."""
    for b in stream.batches:
        for j, item in enumerate(b.items):
            yield b.kind, b.source, b.first + j, item


def _json_object(item) -> dict | None:
    """A raw record (a jsonl line's bytes or a row) as a JSON object; None for anything else (malformed lines are the
    workers' to count)."""
    if isinstance(item, bytes):
        item, _ = parse_line(item)
    return item if isinstance(item, dict) else None


def _field_names(record: dict) -> str:
    return ", ".join(sorted(map(str, record))[:10]) or "none"


_ABSENT = object()


def _check_text_field(stream: SourceStream, file: str, line: int, item) -> bool:
    """Raises when the first JSON object of a source's file lacks the text field or holds an object there (a wrong
    text_field, not one bad record); True once a record has been checked."""
    record = _json_object(item)
    if record is None:
        return False
    key = f"{stream.key}.text_field = '{stream.text_field}'"
    value = field_at(record, stream.text_field, _ABSENT)
    if value is _ABSENT:
        wrapped = _wrapped_list(record)
        if wrapped:
            raise UserError(_wrapped_message(f"{key}: in {file}, record {line} is", *wrapped))
        found = _longest_string(record)
        why = f"source '{stream.name}' has no such field in {file} (record {line} has: {_field_names(record)})"
    elif isinstance(value, dict):
        found = _longest_string(value, f"{stream.text_field}.")
        why = f"in {file}, record {line} holds an object there (with: {_field_names(value)}), not text"
    else:
        return True
    hint = f", e.g. {found[1]} (its longest string)" if found else ""
    raise UserError(f"{key}: {why}; set text_field to the field that holds the text{hint}")


def mixed_batches(streams: list[SourceStream], seed: int) -> Iterator[RawBatch]:
    """The sources' records drawn one at a time with a seeded generator: source i with probability weight_i / the
    sum of the weights of the sources not yet exhausted (an exhausted source leaves the draw). Deterministic for a
    seed, whatever the number of workers, since the draw happens here, before them."""
    rng = np.random.default_rng(seed)
    records = [_records(s) for s in streams]
    checked: dict[int, str] = {}  # per source, the file whose first JSON object was checked
    alive = list(range(len(streams)))
    items, size, first = [], 0, 1
    params = {"sources": [(s.name, s.text_field, s.domain_field) for s in streams]}
    while alive:
        weights = np.array([streams[i].weight for i in alive])
        pick = alive[int(np.searchsorted(np.cumsum(weights), rng.random() * weights.sum(), side="right"))]
        record = next(records[pick], None)
        if record is None:
            alive.remove(pick)
            continue
        kind, file, line, item = record
        if checked.get(pick) != file and _check_text_field(streams[pick], file, line, item):
            checked[pick] = file
        items.append((pick, kind, file, line, item))
        size += _text_size(item, streams[pick].text_field)
        if len(items) >= BATCH_RECORDS or size >= BATCH_BYTES:
            yield RawBatch("mixed", "sources", first, items, params)
            first += len(items)
            items, size = [], 0
    if items:
        yield RawBatch("mixed", "sources", first, items, params)


def synthetic_batches(num_docs: int, params: dict, batch_docs: int = 64) -> Iterator[RawBatch]:
    for start in range(0, num_docs, batch_docs):
        yield RawBatch(
            "synthetic", "synthetic", start + 1, list(range(start, min(num_docs, start + batch_docs))), params
        )


def describe_source(data, files: LocalFiles | None) -> dict:
    """What the data came from, for the manifest: enough to tell two sources apart, and the input files skipped.
    `files`: the local source's files from `resolve_local_files` (a list, per source, with data.sources), None for
    the other sources."""
    if data.sources is not None:
        described, skipped = [], []
        for s, f in zip(data.sources, files):
            entry = {
                "name": s.name,
                "weight": s.weight,
                "token_share": s.token_share,
                "text_field": s.text_field,
                "domain_field": s.domain_field,
            }
            if f is None:
                entry.update(hub=s.hub, subset=s.subset, split=s.split)
            else:
                entry.update(path=s.path, **_file_sizes(f.files))
                skipped += [{"path": str(p), "reason": why} for p, why in f.skipped]
            described.append(entry)
        return {"kind": "sources", "sources": described, "skipped_files": skipped}
    if data.source == "synthetic":
        return {"kind": "synthetic", **data.synthetic.model_dump()}
    if data.source == "hub":
        return {"kind": "hub", "name": data.hub_name, "split": data.hub_split}
    skipped = [{"path": str(f), "reason": why} for f, why in files.skipped]
    return {"kind": "local", "path": data.path, **_file_sizes(files.files), "skipped_files": skipped}


def _file_sizes(files: list[Path]) -> dict:
    """The files' count and bytes, and the newest modification time among them (seconds since the epoch) with its
    file: an edit that keeps a file's size changes only that."""
    stats = [(f.stat(), f) for f in files]
    newest = max(stats, key=lambda s: s[0].st_mtime, default=None)
    return {
        "files": len(files),
        "bytes": sum(st.st_size for st, _ in stats),
        "newest_mtime": newest[0].st_mtime if newest else 0.0,
        "newest_file": str(newest[1]) if newest else None,
    }
