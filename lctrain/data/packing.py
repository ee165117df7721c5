"""Concatenate-and-cut packing into fixed windows (DESIGN §2), plus the seeded shuffle buffer and interleaved chunks.

Pure data layout: numpy arrays in, windows out; no files, no tokenizer.

Decisions the design leaves open:
- A document that does not fit continues in the next window after a fresh anchor *and its domain tag again*, so
  every segment has the same `[anchor] + [tag] + text` shape and `tag_lens` is the tag length everywhere.
- When the room left in a window cannot hold the anchor, the tag and one document token, the window ends with a
  short segment holding the next document's anchor (and as much of its tag as fits); the document itself starts in
  the next window. Rows stay exactly `seq_len` long with no padding and no document token is lost.
- `seg_doc` numbers the documents of a window 0, 1, ... in order of first appearance; only interleaved chunks give
  two segments of a window the same number.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from lctrain.data.store import Window


@dataclass
class Piece:
    """A run of one document's tokens to be packed as one segment (several segments if it crosses windows)."""

    tokens: np.ndarray
    doc_key: int  # global document number; the chunks of one document share it
    domain: int
    doc_start: bool = True  # whether `tokens` begins the document (for document counts)
    doc_len: int = -1  # the whole document's length, for statistics (-1: the piece's own)


@dataclass
class PackedWindow:
    window: Window
    doc_starts: list[tuple[int, int]]  # (domain, document length) for each document that begins in this window


class Packer:
    """Fills windows of `seq_len` tokens with segments `[anchor] + tag(domain) + tokens`."""

    def __init__(self, seq_len: int, anchor_id: int, tags: dict[int, np.ndarray] | None = None):
        self.seq_len = seq_len
        self._headers = {}
        self._anchor = np.array([anchor_id], dtype=np.int32)
        self._tags = {d: np.asarray(t, dtype=np.int32) for d, t in (tags or {}).items()}
        longest = max((len(t) for t in self._tags.values()), default=0)
        if seq_len < longest + 2:
            raise ValueError(f"seq_len {seq_len} cannot hold an anchor, a {longest}-token tag and one token")
        self._reset()

    def _reset(self):
        self._parts: list[np.ndarray] = []
        self._seg_lens: list[int] = []
        self._seg_keys: list[int] = []
        self._seg_domain: list[int] = []
        self._tag_lens: list[int] = []
        self._starts: list[tuple[int, int]] = []
        self._filled = 0

    def _header(self, domain: int) -> np.ndarray:
        h = self._headers.get(domain)
        if h is None:
            tag = self._tags.get(domain)
            h = self._headers[domain] = self._anchor if tag is None else np.concatenate([self._anchor, tag])
        return h

    @property
    def filled(self) -> int:
        """Tokens in the window being filled (lost if the stream ends before it is full)."""
        return self._filled

    def _segment(self, header: np.ndarray, body: np.ndarray | None, key: int, domain: int):
        self._parts.append(header)
        n = len(header)
        if body is not None and len(body):
            self._parts.append(body)
            n += len(body)
        self._seg_lens.append(n)
        self._seg_keys.append(key)
        self._seg_domain.append(domain)
        self._tag_lens.append(len(header) - 1)
        self._filled += n

    def _emit(self) -> PackedWindow:
        ids = np.concatenate(self._parts)
        relabel: dict[int, int] = {}
        seg_doc = [relabel.setdefault(k, len(relabel)) for k in self._seg_keys]
        w = Window(
            input_ids=ids,
            seg_lens=np.array(self._seg_lens, dtype=np.int32),
            seg_doc=np.array(seg_doc, dtype=np.int32),
            seg_domain=np.array(self._seg_domain, dtype=np.int8),
            tag_lens=np.array(self._tag_lens, dtype=np.int32),
        )
        out = PackedWindow(w, self._starts)
        self._reset()
        return out

    def add(self, piece: Piece) -> list[PackedWindow]:
        """Pack one piece; return the windows it completed (possibly none, possibly several)."""
        out = []
        header = self._header(piece.domain)
        tokens = piece.tokens
        pos, n = 0, len(tokens)
        started = not piece.doc_start
        while pos < n:
            room = self.seq_len - self._filled
            if room < len(header) + 1:
                self._segment(header[:room], None, piece.doc_key, piece.domain)
            else:
                take = min(room - len(header), n - pos)
                self._segment(header, tokens[pos:pos + take], piece.doc_key, piece.domain)
                if not started:
                    self._starts.append((piece.domain, piece.doc_len if piece.doc_len >= 0 else n))
                    started = True
                pos += take
            if self._filled == self.seq_len:
                out.append(self._emit())
        return out


class ShuffleBuffer:
    """A seeded shuffle of a stream too large for memory: hold up to `max_tokens` tokens of items and release a
    uniformly chosen one whenever the buffer is over the cap; `drain()` releases the rest in random order."""

    def __init__(self, max_tokens: int, rng: np.random.Generator):
        self.max_tokens = max_tokens
        self.rng = rng
        self._items: list = []
        self._sizes: list[int] = []
        self._tokens = 0

    def _pop_random(self):
        i = int(self.rng.integers(len(self._items)))
        self._items[i], self._items[-1] = self._items[-1], self._items[i]
        self._sizes[i], self._sizes[-1] = self._sizes[-1], self._sizes[i]
        self._tokens -= self._sizes.pop()
        return self._items.pop()

    def add(self, item, size: int) -> list:
        self._items.append(item)
        self._sizes.append(size)
        self._tokens += size
        out = []
        while self._tokens > self.max_tokens and self._items:
            out.append(self._pop_random())
        return out

    def drain(self) -> list:
        out = []
        while self._items:
            out.append(self._pop_random())
        return out


def split_into_chunks(tokens: np.ndarray, rng: np.random.Generator) -> list[np.ndarray]:
    """Split a document at random points into 2 or 3 non-empty chunks (1 if it has a single token)."""
    n = len(tokens)
    k = min(int(rng.integers(2, 4)), n)
    if k <= 1:
        return [tokens]
    cuts = np.sort(rng.choice(np.arange(1, n), size=k - 1, replace=False))
    return np.split(tokens, cuts)


def interleave(docs: list[tuple[np.ndarray, int, int]], rng: np.random.Generator) -> list[Piece]:
    """Paper Fig. 5: split each `(tokens, domain, doc_key)` into chunks and shuffle all chunks of the group, keeping
    each document's chunks in their original order."""
    chunked = [split_into_chunks(t, rng) for t, _, _ in docs]
    order = np.repeat(np.arange(len(docs)), [len(c) for c in chunked])
    rng.shuffle(order)
    next_chunk = [0] * len(docs)
    pieces = []
    for d in order.tolist():
        tokens, domain, key = docs[d]
        j = next_chunk[d]
        next_chunk[d] += 1
        pieces.append(Piece(chunked[d][j], key, domain, doc_start=(j == 0), doc_len=len(tokens)))
    return pieces
