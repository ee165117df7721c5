"""The packed-store format (docs/design.md §2): `manifest.json` plus Arrow shards under `data/`, one row per window.

Written in bounded batches with `datasets`' ArrowWriter, read back memory-mapped with `datasets.Dataset.from_file`.
A directory counts as a dataset only when its manifest (`lctrain.data.manifest`) is whole and every shard it lists
is there with the size, content checksum, row count and schema prepare wrote: prepare writes the manifest last,
inside a hidden directory that is renamed into place.

What opening a dataset verifies (`verify_shards`, with `lctrain.checksums`): every shard's size and the checksum of
its first and last `EDGE_BYTES` always (a missing, truncated, zeroed or swapped shard is caught there: an Arrow file's
tail is its last record batch and footer), and the checksum of every byte when the shards total at most
`FULL_VERIFY_BYTES` or when asked (`lctrain inspect`, a resumed `prepare`). A full check of a large dataset costs
what reading it from disk costs (seconds per 10 GB, on every rank's start), which a training start should not pay
for data it reads anyway; damage inside a large shard's middle is then caught by `lctrain inspect`.

A shard changed on disk after that check, while a run reads it (truncated by a `prepare` elsewhere, replaced,
rewritten), is caught by `PackedData.__getitem__`, which stats the shard of every window it reads (`_changed`).
"""

from __future__ import annotations

import bisect
import os
import stat
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
from datasets import Dataset, Features, List, Value, concatenate_datasets
from datasets.arrow_writer import ArrowWriter

from lctrain import checksums
from lctrain.checksums import file_checksums
from lctrain.data.manifest import (
    DATA_SUBDIR,
    FORMAT_VERSION,
    MANIFEST,
    Damaged,
    Manifest,
    Newer,
    Outdated,
    load_manifest,
    shard_file,
    write_manifest,
)
from lctrain.errors import UserError, writing

__all__ = ["FORMAT_VERSION", "MANIFEST", "Manifest", "write_manifest", "open_packed", "read_manifest"]

# What a window read gives (`PackedData[i]`); the stored `input_ids` may be narrower (`token_dtype`).
_COLUMN_DTYPES = {
    "input_ids": np.int32,
    "seg_lens": np.int32,
    "seg_doc": np.int32,
    "seg_domain": np.int8,
    "tag_lens": np.int32,
}
COLUMNS = tuple(_COLUMN_DTYPES)


TOKEN_DTYPES = ("uint16", "int32")


def token_dtype(vocab_size: int) -> str:
    """How `input_ids` are stored for a tokenizer whose ids are below `vocab_size` (added tokens included): in 2
    bytes when every id fits (Llama-2 and Mistral-7B-v0.1: 32,000; SmolLM2: 49,152), which halves a dataset's disk
    and page cache, else in 4 (Llama-3: 128,256)."""
    return "uint16" if vocab_size <= np.iinfo(np.uint16).max + 1 else "int32"


def features(seq_len: int, ids_dtype: str):
    # input_ids is fixed-length (one window), the per-segment columns ragged
    dtypes = {**{k: np.dtype(t).name for k, t in _COLUMN_DTYPES.items()}, "input_ids": ids_dtype}
    return Features({k: List(Value(t), length=seq_len if k == "input_ids" else -1) for k, t in dtypes.items()})


@dataclass
class Window:
    """One packed row: exactly seq_len tokens and per-segment metadata."""

    input_ids: np.ndarray
    seg_lens: np.ndarray
    seg_doc: np.ndarray
    seg_domain: np.ndarray
    tag_lens: np.ndarray


def _ragged(arrays: list[np.ndarray], dtype) -> pa.Array:
    lengths = np.fromiter((len(a) for a in arrays), dtype=np.int64, count=len(arrays))
    offsets = np.zeros(len(arrays) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    values = np.concatenate(arrays).astype(dtype, copy=False) if arrays else np.zeros(0, dtype)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))


class ShardWriter:
    """Streams windows into `data/shard-NNNNN.arrow` files: at most `batch_windows` rows held in memory, a new shard
    every `shard_windows` rows, so memory stays flat whatever the token budget."""

    def __init__(self, directory: Path, seq_len: int, shard_windows: int, ids_dtype: str, batch_windows: int = 64):
        self.dir = directory / DATA_SUBDIR
        self.dir.mkdir(parents=True, exist_ok=True)
        self.seq_len = seq_len
        self.ids_dtype = np.dtype(ids_dtype)
        self.features = features(seq_len, ids_dtype)
        self.shard_windows = max(1, shard_windows)
        self.batch_windows = max(1, min(batch_windows, self.shard_windows))
        self.shards: list[dict] = []
        self._pending: list[Window] = []
        self._writer = None
        self._rows_in_shard = 0
        self.num_windows = 0

    def add(self, window: Window) -> bool:
        """Queue one window; True when this completed a shard (written, synced to disk and checksummed)."""
        self._pending.append(window)
        self.num_windows += 1
        if len(self._pending) >= self.batch_windows or self._rows_in_shard + len(self._pending) >= self.shard_windows:
            return self._flush()
        return False

    def resume(self, shards: list[dict], num_windows: int) -> None:
        """Go on after the complete `shards` of an interrupted run (`lctrain.data.progress`)."""
        self.shards = [dict(s) for s in shards]
        self.num_windows = num_windows

    def _open_shard(self):
        file = shard_file(len(self.shards))
        self.shards.append({"file": file, "num_windows": 0})
        with writing(self.dir.parent / file, "a dataset shard"):
            self._writer = ArrowWriter(features=self.features, path=str(self.dir.parent / file))
        self._rows_in_shard = 0

    def _close_shard(self):
        shard = self.shards[-1]
        path = self.dir.parent / shard["file"]
        with writing(path, "a dataset shard"):
            self._writer.finalize()
            self._writer.close()
            self._writer = None
            with open(path, "rb") as f:
                os.fsync(f.fileno())  # a resumed prepare trusts every shard its progress file lists
        self._rows_in_shard = 0  # the next shard's first batch is a full one, as after a resume
        shard["bytes"] = path.stat().st_size
        shard["checksum"], shard["edge_checksum"] = file_checksums(path)

    def _flush(self) -> bool:
        if not self._pending:
            return False
        if self._writer is None:
            self._open_shard()
        ws = self._pending
        ids = np.concatenate([w.input_ids for w in ws])
        if ids.size and (ids.min() < 0 or ids.max() > np.iinfo(self.ids_dtype).max):  # a cast would wrap it silently
            raise ValueError(f"token id {ids.max() if ids.max() > 0 else ids.min()} does not fit {self.ids_dtype}")
        ids = ids.astype(self.ids_dtype, copy=False)
        table = pa.Table.from_arrays(
            [pa.FixedSizeListArray.from_arrays(pa.array(ids), self.seq_len)]
            + [_ragged([getattr(w, k) for w in ws], _COLUMN_DTYPES[k]) for k in COLUMNS[1:]],
            schema=self.features.arrow_schema,
        )
        with writing(self.dir.parent / self.shards[-1]["file"], "a dataset shard"):
            self._writer.write_table(table)
        self._rows_in_shard += len(ws)
        self.shards[-1]["num_windows"] = self._rows_in_shard
        self._pending = []
        if self._rows_in_shard >= self.shard_windows:
            self._close_shard()
            return True
        return False

    def close(self) -> list[dict]:
        self._flush()
        if self._writer is not None:
            self._close_shard()
        return self.shards

    def abort(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def verify_shards(path: Path, manifest: Manifest, full: bool | None = None) -> list[os.stat_result]:
    """Raise `Damaged` naming the first shard that is not what prepare wrote (module docstring); `full`: check every
    byte (None: when the shards total at most FULL_VERIFY_BYTES). Returns each shard's stat, taken before its
    checksum: a change after it shows in a later stat, one before it in the checksum."""
    if full is None:
        full = sum(s.bytes for s in manifest.shards) <= checksums.FULL_VERIFY_BYTES
    seen = []
    for s in manifest.shards:
        f = path / s.file
        try:
            st = os.stat(f)
        except OSError as e:
            raise Damaged(f"{s.file} is missing ({e.strerror})") from None
        if not stat.S_ISREG(st.st_mode):
            raise Damaged(f"{s.file} is not a regular file")
        if st.st_size != s.bytes:
            raise Damaged(f"{s.file} is {st.st_size:,} bytes, not the {s.bytes:,} prepare wrote")
        try:
            whole, edges = file_checksums(f, full)
        except OSError as e:
            raise Damaged(f"{s.file} cannot be read ({e.strerror or e})") from None
        if edges != s.edge_checksum or (whole is not None and whole != s.checksum):
            raise Damaged(
                f"{s.file}: its content is not what prepare wrote (checksum differs: overwritten, zeroed or swapped)"
            )
        seen.append(st)
    return seen


def dataset_problem(path: Path, full: bool | None = None) -> tuple[Manifest | None, Damaged | None]:
    """(the manifest, None) for a whole dataset at `path`, else (None, what is wrong: its message is one line naming
    the file at fault; a `Newer` is a newer lctrain's dataset, not damage)."""
    try:
        manifest = load_manifest(path)
        verify_shards(path, manifest, full)
    except Damaged as e:
        return None, e
    return manifest, None


def read_manifest(path: Path) -> Manifest | None:
    """The manifest of a whole dataset at `path` that this lctrain reads, or None (none, incomplete, damaged, or of
    an outdated format: `prepare` rebuilds all of these)."""
    return dataset_problem(path)[0]


class PackedData:
    """A prepared dataset: `.manifest` (a `Manifest`), `.rows` (a memory-mapped `datasets.Dataset`, read as it is),
    `len()`, and `obj[i]` -> dict of numpy arrays with the column dtypes of docs/design.md §2, read only while the
    window's shard is unchanged since it was checked (`_changed`)."""

    def __init__(self, path: Path, manifest: Manifest, parts: list, seen: list[os.stat_result], rebuild: str):
        self.path = path
        self.manifest = manifest
        self.rows = concatenate_datasets(parts) if len(parts) > 1 else parts[0]
        self._np = self.rows.with_format("numpy")
        self._rebuild = rebuild
        self._files = [str(path / s.file) for s in manifest.shards]
        self._seen = [(st.st_dev, st.st_ino, st.st_mtime_ns) for st in seen]
        self._ends = np.cumsum([s.num_windows for s in manifest.shards]).tolist()  # _read_shards checked each count

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        if not -len(self) <= i < len(self):
            raise IndexError(f"window {i} out of range for a dataset of {len(self)} windows")
        i = int(i) % len(self)
        shard = bisect.bisect_right(self._ends, i)
        self._raise_if_changed(shard)
        try:
            row = self._np[i]
        except Exception:
            self._raise_if_changed(shard)  # changed between the stat and the read: say that, not the library's error
            raise
        return {k: np.asarray(row[k], dtype=_COLUMN_DTYPES[k]) for k in COLUMNS}

    def _changed(self, shard: int) -> str | None:
        """How shard `shard` changed on disk since `open_packed` checked it, by one stat (microseconds, beside the
        hundreds a window's read costs): None when it did not. Reading a truncated shard through the memory map is
        a SIGBUS, not an exception, and a replaced or rewritten one gives other windows than the run's (the map
        keeps a deleted or replaced file's old inode alive, so its number is never reused while we read).
        What a stat cannot see: a same-size rewrite that keeps the inode and restores the mtime (`cp -p`,
        `rsync -t`, `touch -r`) or lands in the same tick of the filesystem's clock as the shard's last write
        before the open (milliseconds on ext4, 2 s on FAT); bad sectors;
        a change between this stat and the read (a truncation then is still a SIGBUS); and on NFS a change made on
        another host until the client's attribute cache expires. The ctime is not compared: a `chmod` of the data
        (making it read-only) changes it and no content."""
        file = self.manifest.shards[shard].file
        try:
            st = os.stat(self._files[shard])
        except OSError as e:
            return f"{file} is missing ({e.strerror})"
        dev, ino, mtime = self._seen[shard]
        if (st.st_dev, st.st_ino) != (dev, ino):
            return f"{file} was replaced by another file"
        if st.st_size != self.manifest.shards[shard].bytes:
            return f"{file} is now {st.st_size:,} bytes, not the {self.manifest.shards[shard].bytes:,} prepare wrote"
        if st.st_mtime_ns != mtime:
            return f"{file} was written to"
        return None

    def _raise_if_changed(self, shard: int) -> None:
        what = self._changed(shard)
        if what is not None:
            raise UserError(
                f"{self.path}: the prepared dataset changed on disk while it was being read: {what}; "
                f"{self._rebuild}, then run the command again (a training run: 'lctrain resume RUN_DIR' continues "
                f"from its last checkpoint)"
            )

    def __repr__(self) -> str:
        return f"PackedData({str(self.path)!r}, windows={len(self)}, seq_len={self.manifest.seq_len})"


def _read_shards(path: Path, manifest: Manifest) -> list:
    expected = features(manifest.seq_len, manifest.token_dtype)
    parts = []
    for s in manifest.shards:
        try:
            part = Dataset.from_file(str(path / s.file))
        except (pa.ArrowException, OSError, ValueError) as e:
            raise Damaged(f"{s.file} is not a readable Arrow shard ({type(e).__name__}: {e})") from None
        if part.features != expected:
            raise Damaged(f"{s.file} does not hold {manifest.seq_len}-token windows in this lctrain's columns")
        if len(part) != s.num_windows:
            raise Damaged(f"{s.file} holds {len(part):,} windows, not the {s.num_windows:,} prepare wrote")
        parts.append(part)
    return parts


REBUILD = "run 'lctrain prepare' with the same config to rebuild it"


def open_packed(path, verify: bool | None = None, rebuild: str = REBUILD) -> PackedData:
    """Open a prepared dataset directory, checked as the module docstring says (`verify`: True checks every byte);
    anything missing, incomplete or damaged is a UserError naming the file and ending in `rebuild`."""
    path = Path(path)
    # a directory with neither the manifest nor the shards' folder was never a dataset (`inspect .`): not "damaged"
    if not path.is_dir() or not ((path / MANIFEST).exists() or (path / DATA_SUBDIR).exists()):
        raise UserError(f"{path}: no prepared dataset here; {rebuild.replace('rebuild', 'build')}")
    try:
        manifest = load_manifest(path)
        seen = verify_shards(path, manifest, verify)
        parts = _read_shards(path, manifest)
    except Newer as e:
        raise UserError(f"{path}: {e}; upgrade lctrain to read it") from None
    except Outdated as e:
        raise UserError(f"{path}: {e}; {rebuild}") from None
    except Damaged as e:
        raise UserError(f"{path}: the prepared dataset is damaged ({e}); {rebuild}") from None
    return PackedData(path, manifest, parts, seen, rebuild)
