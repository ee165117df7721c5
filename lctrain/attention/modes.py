"""Attention modes as pure tensor functions of a packed window's segment layout (docs/design.md §3).

A window is a sequence of segments. A segment that opens its document in the window is `[anchor] [tag tokens]
document tokens`; segments that share a document index are chunks of one document (interleaved chunks, paper
Fig. 5), and a document's later chunks in the window are bare document tokens, with no anchor or tag (the packing
module's docstring draws the layout). Everything here works on the whole batch at once, flattened to `B*L` tokens,
with vectorised tensor ops: no Python loop over tokens.

Semantics beyond the docs/design.md table, decided here:
- Tags belong to their document: a document's tokens see its tag tokens (and positions count them).
- A document's tokens in the window are its anchor, tag and text in their original order, chunks included, so in
  every document mode a token sees its document's earlier chunks and exactly one anchor, the document's own.
  `anchor`'s mask is therefore the intra-document one; only its positions differ (each document's anchor at 0).
  Paper §3.3: "the anchor token A serves as the common starting point for all documents"; each copy sees only
  itself at position 0, so every copy has the same keys and values: one shared anchor.
- `intra_doc_reset` positions count a document's tokens in the window, so they continue across its chunks.
- Labels: `labels[t] = input_ids[t+1]` where that is the real next token of token t's document, else -100. It is
  when t and t+1 belong to the same document (consecutive tokens of one segment, or one chunk's last token and the
  same document's next chunk right after it), or when t+1 is a document's anchor and t's segment is its document's
  last in the window: the document ended there (the packer leaves only a window's final segment unfinished, and
  its last token has no target), and the anchor is what follows a document, as in non-interleaved packing. Tag
  targets, the row's last token, and any target in another document's chunk or after an unfinished chunk are -100.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lctrain.errors import UserError

MODES = ("full", "intra_doc", "intra_doc_reset", "anchor")
IGNORE_INDEX = -100


@dataclass(frozen=True)
class Layout:
    """The segment layout of a batch of packed windows, flattened over the batch (token t of row b is b*L + t).

    Per segment (all rows' segments concatenated in order): `seg_len`, `seg_start` (flat token index), `seg_row`,
    `seg_doc` (document id unique across the batch), `seg_tags`, `seg_head` (the document's first segment in its
    row, the one that carries the anchor and tag), `seg_last` (the document's last segment in its row). Per token:
    `tok_seg`, `tok_doc`, `tok_anchor`, `tok_tag`.
    """

    batch: int
    length: int
    seg_len: torch.Tensor
    seg_start: torch.Tensor
    seg_row: torch.Tensor
    seg_doc: torch.Tensor
    seg_tags: torch.Tensor
    seg_head: torch.Tensor
    seg_last: torch.Tensor
    tok_seg: torch.Tensor
    tok_doc: torch.Tensor
    tok_anchor: torch.Tensor
    tok_tag: torch.Tensor

    @property
    def num_docs(self) -> int:
        return int(self.seg_doc.max()) + 1 if self.seg_doc.numel() else 0

    @property
    def multi_segment_docs(self) -> bool:
        """True when some document has more than one segment in a window (interleaved chunks)."""
        return self.num_docs < self.seg_doc.numel()


def build_layout(batch: int, length: int, seg_len, seg_row, seg_doc, seg_tags) -> Layout:
    """Per-token layout from flat per-segment tensors (`seg_doc` is the document index within its row)."""
    seg_len = seg_len.long()
    seg_row = seg_row.long()
    seg_tags = seg_tags.long()
    seg_start = torch.cumsum(seg_len, 0) - seg_len
    # Documents are numbered across the batch so that rows never share one.
    doc_key = seg_row * (int(seg_doc.max()) + 1 if seg_doc.numel() else 1) + seg_doc.long()
    doc = torch.unique(doc_key, return_inverse=True)[1]
    order = torch.argsort(doc, stable=True)
    boundary = doc[order][1:] != doc[order][:-1]
    seg_head = torch.ones_like(doc, dtype=torch.bool)
    seg_head[order[1:]] = boundary
    seg_last = torch.ones_like(doc, dtype=torch.bool)
    seg_last[order[:-1]] = boundary
    tok_seg = torch.repeat_interleave(torch.arange(seg_len.numel()), seg_len)
    offset = torch.arange(batch * length) - seg_start[tok_seg]
    head = seg_head[tok_seg]
    return Layout(
        batch=batch,
        length=length,
        seg_len=seg_len,
        seg_start=seg_start,
        seg_row=seg_row,
        seg_doc=doc,
        seg_tags=seg_tags,
        seg_head=seg_head,
        seg_last=seg_last,
        tok_seg=tok_seg,
        tok_doc=doc[tok_seg],
        tok_anchor=head & (offset == 0),
        tok_tag=head & (offset >= 1) & (offset <= seg_tags[tok_seg]),
    )


def document_order(layout: Layout) -> tuple[torch.Tensor, torch.Tensor]:
    """(order, doc_len): `order` lists the B*L tokens document by document, each document's tokens in window order
    (its chunks joined, its anchor first), and `doc_len[d]` is document d's token count. Causal attention within
    each run of `order` is the mask of every document mode, so an engine that only knows contiguous sequences runs
    interleaved chunks after this one permutation."""
    return torch.argsort(layout.tok_doc, stable=True), torch.bincount(layout.tok_doc, minlength=layout.num_docs)


def earlier_tokens_of_same_doc(layout: Layout) -> torch.Tensor:
    """Per segment: how many tokens of its document come before it in the window (its earlier chunks' lengths)."""
    order = torch.argsort(layout.seg_doc, stable=True)
    lens = layout.seg_len[order]
    exclusive = torch.cumsum(lens, 0) - lens
    _, counts = torch.unique_consecutive(layout.seg_doc[order], return_counts=True)
    group_first = torch.cumsum(counts, 0) - counts
    group = torch.repeat_interleave(torch.arange(counts.numel()), counts)
    out = torch.empty_like(exclusive)
    out[order] = exclusive - exclusive[group_first][group]
    return out


def position_ids(layout: Layout, mode: str) -> torch.Tensor:
    """Position ids `[B, L]` for a mode (docs/design.md §3 table)."""
    B, L = layout.batch, layout.length
    window_pos = torch.arange(L).repeat(B)
    if mode in ("full", "intra_doc"):
        pos = window_pos
    elif mode == "intra_doc_reset":
        flat = torch.arange(B * L)
        pos = earlier_tokens_of_same_doc(layout)[layout.tok_seg] + flat - layout.seg_start[layout.tok_seg]
    elif mode == "anchor":
        pos = torch.where(layout.tok_anchor, 0, window_pos)
    else:
        raise ValueError(f"unknown mode {mode!r}")
    return pos.view(B, L)


def shifted_labels(input_ids: torch.Tensor, layout: Layout, anchor_targets: bool = True) -> torch.Tensor:
    """`labels[:, t] = input_ids[:, t+1]` where that is the real next token of t's document (module docstring),
    -100 elsewhere: at each row's last token, before tag tokens, and across documents except a document's end.
    The one label rule of training and evaluation: perplexity passes `anchor_targets=False`, leaving out the anchor
    after a document's end too, so that it scores only text predictable from text."""
    B, L = input_ids.shape
    doc = layout.tok_doc.view(B, L)
    same_doc = doc[:, 1:] == doc[:, :-1]
    if anchor_targets:
        ends_doc = layout.seg_last[layout.tok_seg].view(B, L)[:, :-1]
        same_doc = same_doc | (layout.tok_anchor.view(B, L)[:, 1:] & ends_doc)
    keep = ~layout.tok_tag.view(B, L)[:, 1:] & same_doc
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    labels[:, :-1] = torch.where(keep, input_ids[:, 1:], IGNORE_INDEX)
    return labels


def mask_mod(layout: Layout, mode: str, device=None):
    """The mode's visibility rule as `visible(b, h, q, k)` over `[B, L]` id tensors: FlexAttention's `mask_mod`, and
    evaluated on broadcast index grids, the dense mask. The three document modes share one mask (module docstring)."""
    if mode == "full":

        def visible(b, h, q, k):
            return q >= k
    elif mode in ("intra_doc", "intra_doc_reset", "anchor"):
        doc = layout.tok_doc.view(layout.batch, layout.length).to(device)

        def visible(b, h, q, k):
            return (q >= k) & (doc[b, q] == doc[b, k])
    else:
        raise ValueError(f"unknown mode {mode!r}")
    return visible


def dense_mask(layout: Layout, mode: str, device=None) -> torch.Tensor:
    """Boolean visibility `[B, L(query), L(key)]` of a mode; O(L²) memory, for the reference engine and small L."""
    B, L = layout.batch, layout.length
    idx = torch.arange(L, device=device)
    b = torch.arange(B, device=device)[:, None, None]
    return mask_mod(layout, mode, device)(b, None, idx[None, :, None], idx[None, None, :]).expand(B, L, L)


def parse_modes(modes: str | None) -> list[str]:
    """`--modes full,anchor` -> the modes (default all four), refusing unknown ones in one line."""
    if modes is None:
        return list(MODES)
    chosen = [m.strip() for m in modes.split(",") if m.strip()]
    unknown = [m for m in chosen if m not in MODES]
    if unknown or not chosen:
        raise UserError(
            f"--modes {modes!r}: unknown mode {', '.join(unknown) or '(none given)'}; choose from {', '.join(MODES)}"
        )
    return list(dict.fromkeys(chosen))
