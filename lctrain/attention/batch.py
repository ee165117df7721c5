"""`Batch`, the one typed joint between packed rows and the model, and `make_batch`, which builds it.

A `Batch` holds the per-token tensors (input ids, positions, pre-shifted labels) and the `Segments` of its windows. It
is the only place that knows how they travel: `model_kwargs()` is what a Hugging Face model takes (the segments under
their forward keyword, `SEGMENTS_KEY`), `shard(sp, rank)` is a rank's slice under sequence parallelism, `to(device)`
moves the tensors. Everything downstream (the trainer, the loss, `check sp`, the benchmarks) takes a `Batch`, never a
dict of keys.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from lctrain.attention.modes import IGNORE_INDEX, MODES, build_layout, position_ids, shifted_labels
from lctrain.attention.segments import SEGMENTS_KEY, Segments
from lctrain.errors import UserError


@dataclass(frozen=True)
class Batch:
    """`[B, S]` input ids, position ids and labels, and the segment layout of the whole `[B, L]` windows.

    `labels[:, t]` is the target of token t (already shifted, see `lctrain.attention.modes.shifted_labels`), so a
    sequence-parallel slice holds its own targets. `segments` always describes the whole windows: under sequence
    parallelism every rank keeps the full layout, since after Ulysses' all-to-all each rank attends over all L
    tokens."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor
    segments: Segments

    @property
    def mode(self) -> str:
        return self.segments.mode

    def valid_labels(self) -> int:
        """Targets the loss counts (labels other than IGNORE_INDEX)."""
        return int((self.labels != IGNORE_INDEX).sum())

    def shard(self, sp: int, rank: int) -> Batch:
        """Sequence-parallel rank `rank`'s contiguous `S / sp` slice of the per-token tensors; the segments are
        shared. Labels were shifted before slicing, so a slice's last label is the next slice's first token."""
        if sp == 1:
            return self
        length = self.input_ids.shape[1]
        if length % sp or not 0 <= rank < sp:
            raise ValueError(f"cannot cut {length} tokens into {sp} slices and take slice {rank}")
        step = length // sp
        return replace(self, **{f: getattr(self, f)[:, rank * step : (rank + 1) * step] for f in _PER_TOKEN})

    def to(self, device, non_blocking: bool = True) -> Batch:
        """The tensors on `device`; the segments stay on the CPU (each engine moves what it derives, once)."""
        return replace(self, **{f: getattr(self, f).to(device, non_blocking=non_blocking) for f in _PER_TOKEN})

    def attention_kwargs(self) -> dict:
        """What an engine's attention function reads from the keyword arguments the model passes down to it."""
        return {SEGMENTS_KEY: self.segments}

    def model_kwargs(self, *, labels: bool = False) -> dict:
        """Keyword arguments of a Hugging Face causal LM's forward. With `labels`, also the labels for the model's own
        loss, passed as `shift_labels` too so that it does not shift them a second time."""
        kwargs = {"input_ids": self.input_ids, "position_ids": self.position_ids, **self.attention_kwargs()}
        if labels:
            kwargs.update(labels=self.labels, shift_labels=self.labels)
        return kwargs


# The fields that run along the sequence: sharded under sequence parallelism, moved to the device.
_PER_TOKEN = ("input_ids", "position_ids", "labels")

Ragged = torch.Tensor | np.ndarray | Sequence[Sequence[int]]


def _rows(value: Ragged, batch: int, name: str) -> list[torch.Tensor]:
    """A ragged list of B 1-D sequences or a zero-padded `[B, n]` array -> list of B 1-D long tensors (unpadded
    later, against seg_lens)."""
    if isinstance(value, (torch.Tensor, np.ndarray)):
        if value.ndim != 2:
            raise UserError(
                f"make_batch: {name} must be a list of {batch} sequences or a [B, n] array, "
                f"got shape {tuple(value.shape)}"
            )
        rows = list(torch.as_tensor(value))
    else:
        rows = [torch.as_tensor(np.asarray(r, dtype=np.int64)) for r in value]
    if len(rows) != batch:
        raise UserError(f"make_batch: {name} has {len(rows)} rows but input_ids has {batch}")
    return [r.long().reshape(-1) for r in rows]


def make_batch(
    input_ids,
    seg_lens: Ragged,
    mode: str,
    seg_doc: Ragged | None = None,
    tag_lens: Ragged | None = None,
    *,
    anchor_id: int | None = None,
) -> Batch:
    """The `Batch` of packed windows: `input_ids`, `position_ids`, `labels` (pre-shifted; -100 at each row's last
    token, before tag tokens and wherever the next token is not the document's own, see `lctrain.attention.modes`),
    all `[B, L]`, and the `Segments` of the mode. A segment whose `seg_doc` appeared earlier in its row is a later
    chunk of that document (interleaved chunks) and has no anchor or tag. With `anchor_id`, checks that every
    document's first segment in a row starts with it."""
    if mode not in MODES:
        raise UserError(f"attention mode '{mode}' is unknown; expected one of {', '.join(MODES)}")
    ids = torch.as_tensor(np.asarray(input_ids) if not isinstance(input_ids, torch.Tensor) else input_ids)
    if ids.ndim != 2 or ids.shape[1] < 1:
        raise UserError(f"make_batch: input_ids must be [batch, seq_len], got shape {tuple(ids.shape)}")
    ids = ids.long()
    B, L = ids.shape

    lens_rows = _rows(seg_lens, B, "seg_lens")
    doc_rows = _rows(seg_doc, B, "seg_doc") if seg_doc is not None else None
    tag_rows = _rows(tag_lens, B, "tag_lens") if tag_lens is not None else None

    padded = isinstance(seg_lens, (torch.Tensor, np.ndarray))
    seg_len, seg_row, seg_docs, seg_tags = [], [], [], []
    for b, lens in enumerate(lens_rows):
        n = int((lens > 0).sum()) if padded else lens.numel()
        if padded and bool((lens[:n] <= 0).any()):
            raise UserError(f"make_batch: row {b}: seg_lens has zero padding before its last segment: {lens.tolist()}")
        lens = lens[:n]
        if n == 0 or bool((lens <= 0).any()):
            raise UserError(
                f"make_batch: row {b}: every segment needs at least one token (its anchor); seg_lens = {lens.tolist()}"
            )
        if int(lens.sum()) != L:
            raise UserError(f"make_batch: row {b}: seg_lens sum to {int(lens.sum())} but the row has {L} tokens")
        docs = _segment_values(doc_rows, b, n, "seg_doc", default=torch.arange(n))
        tags = _segment_values(tag_rows, b, n, "tag_lens", default=torch.zeros(n, dtype=torch.long))
        if bool((docs < 0).any()):
            raise UserError(f"make_batch: row {b}: seg_doc must be >= 0, got {docs.tolist()}")
        if bool((tags < 0).any()) or bool((tags >= lens).any()):
            raise UserError(
                f"make_batch: row {b}: tag_lens must be in [0, segment length - 1] (the anchor comes "
                f"first); tag_lens = {tags.tolist()}, seg_lens = {lens.tolist()}"
            )
        seg_len.append(lens)
        seg_row.append(torch.full((n,), b, dtype=torch.long))
        seg_docs.append(docs)
        seg_tags.append(tags)

    layout = build_layout(B, L, torch.cat(seg_len), torch.cat(seg_row), torch.cat(seg_docs), torch.cat(seg_tags))
    chunk_tags = torch.nonzero(~layout.seg_head & (layout.seg_tags != 0))
    if chunk_tags.numel():
        s = int(chunk_tags[0])
        raise UserError(
            f"make_batch: row {int(layout.seg_row[s])}: the segment at token {_column(layout, s, L)} "
            f"continues a document of the window (a later chunk: no anchor, no tag) but has tag_lens "
            f"{int(layout.seg_tags[s])}; only a document's first segment in a window carries a tag"
        )
    if anchor_id is not None:
        starts = ids.view(-1)[layout.seg_start]
        bad = torch.nonzero(layout.seg_head & (starts != anchor_id))
        if bad.numel():
            s = int(bad[0])
            raise UserError(
                f"make_batch: row {int(layout.seg_row[s])}: the segment at token {_column(layout, s, L)} "
                f"starts with token id {int(starts[s])}, not the anchor id {anchor_id}; re-run "
                f"`lctrain prepare` with the tokenizer the model uses"
            )
    return Batch(ids, position_ids(layout, mode), shifted_labels(ids, layout), Segments(layout, mode))


def _column(layout, s: int, L: int) -> int:
    return int(layout.seg_start[s]) - int(layout.seg_row[s]) * L


def _segment_values(rows, b: int, n: int, name: str, default: torch.Tensor) -> torch.Tensor:
    if rows is None:
        return default
    row = rows[b]
    if row.numel() < n or bool((row[n:] != 0).any()):
        raise UserError(f"make_batch: row {b}: {name} has {row.numel()} entries for {n} segments")
    return row[:n]
