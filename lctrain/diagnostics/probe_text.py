"""Real text for the RoPE diagnostic: token sequences that each begin at a document start with its anchor (BOS), one
per document. The paper computes D "averaging over 50 text sequences, each with a length of T = 4096".

Two kinds of source:
- a prepared dataset (lctrain's packed store, docs/design.md §2): spans of `length` tokens taken from the windows as
  they are, starting at a segment that begins a document. Spans that stay inside one document come first; only when
  there are too few of them do spans that run on into the next documents of the window (each after its own anchor)
  fill up.
- local text: a `.txt`/`.md`/`.rst`/`.py` file (one document), a `.jsonl` file (one document per record, its `text`),
  or a folder of them (searched recursively, visited in a seeded order). Each document is tokenized as
  `[anchor] + tokens(text)` and cut to `length`; shorter documents are passed over.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lctrain.data.store import MANIFEST, open_packed
from lctrain.errors import UserError
from lctrain.tokenizer import resolve_anchor, text_encoder

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py")
JSONL_SUFFIX = ".jsonl"
# Characters tokenized per wanted token: a SentencePiece or BPE token spans at most a few dozen characters, so this
# prefix always yields `length` tokens when the whole document would, without tokenizing whole books.
_CHARS_PER_TOKEN_BOUND = 32


@dataclass
class ProbeText:
    sequences: list[np.ndarray]  # each exactly `length` token ids, starting with the anchor
    origins: list[str]  # where each sequence comes from: "file", "file:line" or "window W, token T"
    single_document: int  # how many of the sequences lie inside one document
    anchor: dict  # the token every sequence starts with: {"token", "id"}, as training records it

    def describe(self, path: Path) -> dict:
        return {
            "path": str(path),
            "sequences": len(self.sequences),
            "single_document": self.single_document,
            "anchor": self.anchor,
            "origins": self.origins,
        }


def packed_document_spans(
    windows: Iterable[tuple[np.ndarray, np.ndarray]], window_len: int, length: int
) -> Iterator[tuple[int, int, bool]]:
    """(window, offset, inside one document) for every segment of a packed dataset that begins a document and has
    `length` tokens of its window from its anchor on. Segments after the first of a window begin documents; the first
    segment of a window continues the previous window's last document, unless that one held only an anchor (and tag)
    because nothing else fitted, or it is the dataset's first window."""
    previous_only_header = True
    for w, (seg_lens, tag_lens) in enumerate(windows):
        offset = 0
        for k, n in enumerate(seg_lens):
            if (k > 0 or previous_only_header) and offset + length <= window_len:
                yield w, offset, n >= length
            offset += n
        previous_only_header = seg_lens[-1] == 1 + tag_lens[-1]


def _from_packed(path: Path, length: int, count: int, vocab_size: int) -> ProbeText:
    data = open_packed(path)
    if data.manifest.interleave_chunks:
        raise UserError(
            f"{path}: a dataset prepared with data.interleave_chunks does not record where documents "
            f"start; pass one prepared without it, or text files with --text"
        )
    window_len = data.manifest.seq_len
    columns = data.rows.select_columns(["seg_lens", "tag_lens"]).iter(batch_size=256)
    windows = (
        (np.asarray(s), np.asarray(t)) for batch in columns for s, t in zip(batch["seg_lens"], batch["tag_lens"])
    )
    whole, crossing = [], []
    for w, offset, inside in packed_document_spans(windows, window_len, length):
        (whole if inside else crossing).append((w, offset))
        if len(whole) >= count:
            break
    chosen = (whole + crossing)[:count]
    if len(chosen) < count:
        raise UserError(
            f"{path}: only {len(chosen)} document starts with {length:,} tokens of their window after "
            f"them ({window_len:,}-token windows), need {count}; lower --samples, --seq-len or "
            f"--max-len, or pass more text with --text"
        )
    sequences = [data[w]["input_ids"][offset : offset + length].astype(np.int64) for w, offset in chosen]
    top = max(int(s.max()) for s in sequences)
    if top >= vocab_size:
        raise UserError(
            f"{path}: token id {top} is outside the model's vocabulary of {vocab_size}; the dataset was "
            f"tokenized for another model ({data.manifest.tokenizer.name})"
        )
    return ProbeText(
        sequences,
        [f"window {w}, token {offset}" for w, offset in chosen],
        sum(1 for s in chosen if s in whole),
        data.manifest.anchor.model_dump(),
    )


def _documents(path: Path, seed: int) -> Iterator[tuple[str, str]]:
    """(origin, text) of each document under `path`, folders in a seeded order."""
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in (*TEXT_SUFFIXES, JSONL_SUFFIX))
        random.Random(seed).shuffle(files)
    else:
        files = [path]
    for f in files:
        if f.suffix.lower() == JSONL_SUFFIX:
            yield from _jsonl_documents(f)
        elif f.suffix.lower() in TEXT_SUFFIXES:
            yield str(f), f.read_text(encoding="utf-8", errors="replace")
        else:
            raise UserError(
                f"{f}: --text takes a prepared dataset directory, a {'/'.join(TEXT_SUFFIXES)} or "
                f"{JSONL_SUFFIX} file, or a folder of them"
            )


def _jsonl_documents(f: Path) -> Iterator[tuple[str, str]]:
    with f.open(encoding="utf-8", errors="replace") as lines:
        for i, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:
                record = None
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise UserError(f"{f}:{i}: not a JSON object with a 'text' string")
            yield f"{f}:{i}", record["text"]


def _from_local(path: Path, tokenizer, length: int, count: int, seed: int, anchor_spec: str) -> ProbeText:
    anchor = resolve_anchor(tokenizer, anchor_spec)
    encoder = text_encoder(tokenizer)
    sequences, origins, seen, taken = [], [], 0, set()
    repeats = 0  # a corpus can hold one text twice (the standard library has copies): a copy measures nothing new
    for origin, text in _documents(path, seed):
        seen += 1
        if len(text) < length - 1:  # every token covers at least one character
            continue
        ids = encoder.encode(text[: _CHARS_PER_TOKEN_BOUND * length])[: length - 1]
        if len(ids) == length - 1:
            key = bytes(np.asarray(ids, dtype=np.int64))
            if key in taken:
                repeats += 1
                continue
            taken.add(key)
            sequences.append(np.array([anchor.id, *ids], dtype=np.int64))
            origins.append(origin)
            if len(sequences) == count:
                return ProbeText(sequences, origins, count, anchor.record())
    repeated = f", not counting {repeats} that repeat an earlier one's" if repeats else ""
    raise UserError(
        f"{path}: {len(sequences)} of its {seen} documents have {length:,} tokens (with the anchor){repeated}, need "
        f"{count}; pass more or longer text, or lower --samples, --seq-len or --max-len"
    )


def probe_sequences(
    path: str | Path, tokenizer, length: int, count: int, vocab_size: int, seed: int = 0, anchor: str = "auto"
) -> ProbeText:
    """`count` sequences of `length` token ids from the prepared dataset or local text at `path`; local text starts
    with `anchor` (a `data.anchor` value or the token itself), as training segments do."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"--text {path}: no such file or directory")
    if path.is_dir() and (path / MANIFEST).exists():
        return _from_packed(path, length, count, vocab_size)
    return _from_local(path, tokenizer, length, count, seed, anchor)
