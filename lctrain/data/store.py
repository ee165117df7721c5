"""The packed-store format (docs/design.md §2): `manifest.json` plus Arrow shards under `data/`, one row per window.

Written in bounded batches with `datasets`' ArrowWriter, read back memory-mapped with `datasets.Dataset.from_file`.
A directory counts as a dataset only when its manifest says `complete` and every shard it lists is present: prepare
writes the manifest last, inside a temporary directory that is renamed into place.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from lctrain.errors import UserError

# 3: a SentencePiece model's ids are SentencePiece's own (before, those of transformers' converted tokenizer), and an
# interleaved document's later chunks in a window carry no anchor or tag (before, both were repeated on every chunk).
FORMAT_VERSION = 3
MANIFEST = "manifest.json"
DATA_SUBDIR = "data"
_COLUMN_DTYPES = {
    "input_ids": np.int32,
    "seg_lens": np.int32,
    "seg_doc": np.int32,
    "seg_domain": np.int8,
    "tag_lens": np.int32,
}
COLUMNS = tuple(_COLUMN_DTYPES)


def features(seq_len: int):
    # datasets on use: it takes ~1 s to import, and reading packed data does not need it (start-up time)
    from datasets import Features, List, Value

    # input_ids is fixed-length (one window), the per-segment columns ragged
    return Features(
        {
            k: List(Value(np.dtype(t).name), length=seq_len if k == "input_ids" else -1)
            for k, t in _COLUMN_DTYPES.items()
        }
    )


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

    def __init__(self, directory: Path, seq_len: int, shard_windows: int, batch_windows: int = 64):
        self.dir = directory / DATA_SUBDIR
        self.dir.mkdir(parents=True, exist_ok=True)
        self.seq_len = seq_len
        self.features = features(seq_len)
        self.shard_windows = max(1, shard_windows)
        self.batch_windows = max(1, min(batch_windows, self.shard_windows))
        self.shards: list[dict] = []
        self._pending: list[Window] = []
        self._writer = None
        self._rows_in_shard = 0
        self.num_windows = 0

    def add(self, window: Window) -> None:
        self._pending.append(window)
        self.num_windows += 1
        if len(self._pending) >= self.batch_windows or self._rows_in_shard + len(self._pending) >= self.shard_windows:
            self._flush()

    def _open_shard(self):
        # datasets on use (start-up time), as above
        from datasets.arrow_writer import ArrowWriter

        name = f"shard-{len(self.shards):05d}.arrow"
        self.shards.append({"file": f"{DATA_SUBDIR}/{name}", "num_windows": 0})
        self._writer = ArrowWriter(features=self.features, path=str(self.dir / name))
        self._rows_in_shard = 0

    def _close_shard(self):
        self._writer.finalize()
        self._writer.close()
        self._writer = None
        shard = self.shards[-1]
        shard["bytes"] = (self.dir.parent / shard["file"]).stat().st_size  # what read_manifest verifies

    def _flush(self):
        if not self._pending:
            return
        if self._writer is None:
            self._open_shard()
        ws = self._pending
        ids = np.concatenate([w.input_ids for w in ws]).astype(np.int32, copy=False)
        table = pa.Table.from_arrays(
            [pa.FixedSizeListArray.from_arrays(pa.array(ids), self.seq_len)]
            + [_ragged([getattr(w, k) for w in ws], _COLUMN_DTYPES[k]) for k in COLUMNS[1:]],
            schema=self.features.arrow_schema,
        )
        self._writer.write_table(table)
        self._rows_in_shard += len(ws)
        self.shards[-1]["num_windows"] = self._rows_in_shard
        self._pending = []
        if self._rows_in_shard >= self.shard_windows:
            self._close_shard()

    def close(self) -> list[dict]:
        self._flush()
        if self._writer is not None:
            self._close_shard()
        return self.shards

    def abort(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def write_manifest(directory: Path, manifest: dict) -> None:
    tmp = directory / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=False) + "\n")
    os.replace(tmp, directory / MANIFEST)


def _complete_manifest(path: Path) -> dict | None:
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) and manifest.get("complete") else None


def damaged_shards(path: Path, manifest: dict) -> list[str]:
    """Shards that are missing or whose size differs from what prepare wrote (a truncated copy, a full disk)."""
    bad = []
    for s in manifest.get("shards", []):
        f = path / s["file"]
        if not f.is_file():
            bad.append(f"{s['file']} is missing")
        elif "bytes" in s and f.stat().st_size != s["bytes"]:
            bad.append(f"{s['file']} is {f.stat().st_size:,} bytes, not the {s['bytes']:,} prepare wrote")
    return bad


def outdated(manifest: dict) -> str | None:
    """Why this lctrain cannot read a dataset of the manifest's format version, or None when it can."""
    version = manifest.get("format_version")
    if version == FORMAT_VERSION:
        return None
    if isinstance(version, int) and version < FORMAT_VERSION:
        return (
            f"it is of dataset format {version}, whose token ids (SentencePiece tokenizers) or interleaved-chunk "
            f"layout this lctrain no longer trains on"
        )
    return f"dataset format version {version} is not {FORMAT_VERSION}"


def read_manifest(path: Path) -> dict | None:
    """The manifest of a complete, undamaged dataset at `path` that this lctrain reads, or None (none, incomplete,
    damaged, or of an outdated format: `prepare` rebuilds all of these)."""
    manifest = _complete_manifest(path)
    if manifest is None or damaged_shards(path, manifest) or outdated(manifest):
        return None
    return manifest


class PackedData:
    """A prepared dataset: `.manifest` (dict), `.rows` (a memory-mapped `datasets.Dataset`), `len()`, and
    `obj[i]` -> dict of numpy arrays with the column dtypes of docs/design.md §2."""

    def __init__(self, path: Path, manifest: dict):
        # datasets on use (start-up time), as above
        from datasets import Dataset, concatenate_datasets

        self.path = path
        self.manifest = manifest
        parts = [Dataset.from_file(str(path / s["file"])) for s in manifest["shards"]]
        self.rows = concatenate_datasets(parts) if len(parts) > 1 else parts[0]
        self._np = self.rows.with_format("numpy")

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        if not -len(self) <= i < len(self):
            raise IndexError(f"window {i} out of range for a dataset of {len(self)} windows")
        row = self._np[int(i)]
        return {k: np.asarray(row[k], dtype=_COLUMN_DTYPES[k]) for k in COLUMNS}

    def __repr__(self) -> str:
        m = self.manifest
        return f"PackedData({str(self.path)!r}, windows={len(self)}, seq_len={m['seq_len']})"


def open_packed(path) -> PackedData:
    """Open a prepared dataset directory; a missing or incomplete one is a UserError saying how to build it."""
    path = Path(path)
    if not path.is_dir():
        raise UserError(f"{path}: no prepared dataset here; run 'lctrain prepare' with the same config first")
    manifest = _complete_manifest(path)
    if manifest is None:
        raise UserError(
            f"{path}: incomplete or not a prepared dataset (no complete {MANIFEST}); "
            f"run 'lctrain prepare --force' with the same config to rebuild it"
        )
    bad = damaged_shards(path, manifest)
    if bad:
        raise UserError(
            f"{path}: the prepared dataset is damaged ({bad[0]}{f' and {len(bad) - 1} more' if len(bad) > 1 else ''}); "
            f"run 'lctrain prepare' with the same config to rebuild it"
        )
    reason = outdated(manifest)
    if reason:
        raise UserError(f"{path}: {reason}; run 'lctrain prepare' with the same config to rebuild it")
    if manifest["num_windows"] == 0 or not manifest.get("shards"):
        raise UserError(
            f"{path}: the prepared dataset holds no windows; use a larger corpus or a smaller "
            f"data.seq_len and run 'lctrain prepare --force'"
        )
    return PackedData(path, manifest)
