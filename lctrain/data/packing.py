"""Concatenate-and-cut packing into fixed windows (docs/design.md §2), plus the seeded shuffle buffer and interleaved
chunks.

Pure data layout: numpy arrays in, windows out; no files, no tokenizer.

Decisions the design leaves open:
- A document that does not fit continues in the next window after a fresh anchor *and its domain tag again*, so a
  document's first segment in every window has the same `[anchor] + [tag] + text` shape.
- When the room left in a window cannot hold the anchor, the tag and one document token, the window ends with a
  short segment holding the next document's anchor (and as much of its tag as fits); the document itself starts in
  the next window. Rows stay exactly `seq_len` long with no padding and no document token is lost.
- `seg_doc` numbers the documents of a window 0, 1, ... in order of first appearance; only interleaved chunks give
  two segments of a window the same number.

Interleaved chunks (paper §5.2, Fig. 5: "Documents are segmented into multiple chunks at random split points,
shuffled, and recombined into new sequences, with the original order of chunks within each document preserved"):
each full window is packed as above, then the text of each of its segments is split at random points into 2 or 3
chunks and all chunks of the window are shuffled, each document's chunks keeping their order (the paper's code does
this per packed window too). Only a document's first chunk carries the anchor and tag; its later chunks are bare
text with the same `seg_doc` and `tag_lens` 0, so no anchor or tag ever sits inside a document. When the window's
last document continues in the next window, its last chunk stays last: every other document ends in the window,
which is what the label rule of `lctrain.attention.modes` relies on. A window of documents a, b, c (tag T, c goes on
in the next window after a fresh anchor):

    packed        A T a1 a2 a3 a4 | A T b1 b2 b3 | A T c1 c2
    interleaved   A T a1 a2 | A T b1 | a3 a4 | A T c1 | b2 b3 | c2        seg_doc 0 1 0 2 1 2, tag_lens 1 1 0 1 0 0

What each mode then sees (docs/design.md §3), e.g. for a3: `full` every earlier token; `intra_doc` A T a1 a2 a3,
positions 0..L-1; `intra_doc_reset` the same, a's positions 0..5 running on across its chunks; `anchor` the same tokens
with every anchor at position 0, so each document sees one anchor, its own, at position 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from lctrain.data.store import Window


@dataclass
class PackedWindow:
    window: Window
    doc_starts: list[tuple[int, int]]  # (domain, document length) for each document that begins in this window
    source_tokens: dict[int, int]  # tokens (anchors and tags included) per data.sources index


class Packer:
    """Fills windows of `seq_len` tokens with segments `[anchor] + tag(domain) + tokens`; with `chunk_rng`, each
    full window's segments are then cut into interleaved chunks (module docstring)."""

    def __init__(
        self,
        seq_len: int,
        anchor_id: int,
        tags: dict[int, np.ndarray] | None = None,
        chunk_rng: np.random.Generator | None = None,
    ):
        self.seq_len = seq_len
        self._headers = {}
        self._anchor = np.array([anchor_id], dtype=np.int32)
        self._tags = {d: np.asarray(t, dtype=np.int32) for d, t in (tags or {}).items()}
        self._chunk_rng = chunk_rng
        self.placed = 0
        longest = max((len(t) for t in self._tags.values()), default=0)
        if seq_len < longest + 2:
            raise ValueError(f"seq_len {seq_len} cannot hold an anchor, a {longest}-token tag and one token")
        self._reset()

    def add_tag(self, domain: int, tag) -> None:
        """The tag of a domain first met while reading (a `data.sources` domain_field value)."""
        tag = np.asarray(tag, dtype=np.int32)
        if self.seq_len < len(tag) + 2:
            raise ValueError(f"seq_len {self.seq_len} cannot hold an anchor, a {len(tag)}-token tag and one token")
        self._tags[domain] = tag

    def _reset(self):
        self._segments: list[tuple[np.ndarray, np.ndarray, int, int]] = []  # (header, text, domain, source)
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

    @property
    def pending_documents(self) -> int:
        """Documents that begin in the window being filled."""
        return len(self._starts)

    def pending_by_domain(self) -> dict[int, int]:
        """`filled` per domain: the tokens (anchors and tags included) of the window being filled."""
        out: dict[int, int] = {}
        for header, text, domain, _ in self._segments:
            out[domain] = out.get(domain, 0) + len(header) + len(text)
        return out

    def _interleaved(self, open_end: bool) -> list[tuple[np.ndarray, np.ndarray, int, int]]:
        """The window's segments as shuffled chunks `(header or empty, text, domain, segment index)`."""
        rng = self._chunk_rng
        chunks = [split_into_chunks(text, rng) if len(text) else [text] for _, text, _, _ in self._segments]
        nothing = self._anchor[:0]
        taken = [0] * len(chunks)
        out = []
        for s in chunk_order([len(c) for c in chunks], rng, open_end):
            header, _, domain, _ = self._segments[s]
            j = taken[s]
            taken[s] += 1
            out.append((header if j == 0 else nothing, chunks[s][j], domain, s))
        return out

    def _emit(self, open_end: bool) -> PackedWindow:
        if self._chunk_rng is None:
            segs = [(h, t, dom, s) for s, (h, t, dom, _) in enumerate(self._segments)]
        else:
            segs = self._interleaved(open_end)
        relabel: dict[int, int] = {}
        w = Window(
            input_ids=np.concatenate([p for h, t, _, _ in segs for p in (h, t)]),
            seg_lens=np.array([len(h) + len(t) for h, t, _, _ in segs], dtype=np.int32),
            seg_doc=np.array([relabel.setdefault(s, len(relabel)) for _, _, _, s in segs], dtype=np.int32),
            seg_domain=np.array([dom for _, _, dom, _ in segs], dtype=np.int8),
            tag_lens=np.array([max(len(h) - 1, 0) for h, _, _, _ in segs], dtype=np.int32),
        )
        by_source: dict[int, int] = {}
        for h, t, _, src in self._segments:
            by_source[src] = by_source.get(src, 0) + len(h) + len(t)
        out = PackedWindow(w, self._starts, by_source)
        self._reset()
        return out

    def add(self, tokens: np.ndarray, domain: int, source: int = 0, length: int | None = None) -> list[PackedWindow]:
        """Pack one document (of `data.sources` index `source`); return the windows it completed (possibly none,
        possibly several). `placed` is then the tokens it took, its anchors and tags in every window included.
        `length`: the document's whole length where `tokens` is its start only (a token share's cut), which
        `doc_starts` records, as Figure 8 counts each document by its whole length."""
        out = []
        header = self._header(domain)
        pos, n = 0, len(tokens)
        self.placed = 0
        while pos < n:
            room = self.seq_len - self._filled
            take = max(0, min(room - len(header), n - pos))
            self._segments.append((header[:room], tokens[pos : pos + take], domain, source))
            self._filled += min(room, len(header)) + take
            self.placed += min(room, len(header)) + take
            if take and pos == 0:
                self._starts.append((domain, n if length is None else length))
            pos += take
            if self._filled == self.seq_len:
                out.append(self._emit(open_end=pos < n))
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

    def __len__(self) -> int:
        return len(self._items)

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


def chunk_order(chunk_counts: list[int], rng: np.random.Generator, open_end: bool) -> list[int]:
    """The document of each interleaved chunk of a window, in window order (Figure 5): the documents' chunks shuffled
    among each other, every document's own chunks in order. With `open_end` the last document goes on in the next
    window, so its last chunk keeps the window's end."""
    order = np.repeat(np.arange(len(chunk_counts)), chunk_counts)
    rng.shuffle(order[:-1] if open_end else order)
    return order.tolist()


def split_into_chunks(tokens: np.ndarray, rng: np.random.Generator) -> list[np.ndarray]:
    """Split a document at random points into 2 or 3 non-empty chunks (1 if it has a single token)."""
    n = len(tokens)
    k = min(int(rng.integers(2, 4)), n)
    if k <= 1:
        return [tokens]
    cuts = np.sort(rng.choice(np.arange(1, n), size=k - 1, replace=False))
    return np.split(tokens, cuts)
