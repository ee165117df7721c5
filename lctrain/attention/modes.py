"""Attention modes as pure tensor functions of a packed window's segment layout (DESIGN §3).

A window is a sequence of segments `[anchor] [tag tokens] document tokens`; segments that share a document index are
chunks of one document (interleaved chunks). Everything here works on the whole batch at once, flattened to `B*L`
tokens, with vectorised tensor ops: no Python loop over tokens.

Semantics beyond the DESIGN table, decided here:
- Tags belong to their document: a document's tokens see its tag tokens (and positions count them); only the labels
  that would predict a tag token are masked.
- `intra_doc_reset` with interleaved chunks: positions continue across a document's chunks, i.e. a token's position is
  the number of tokens of its document that come before it in the window (the second chunk's anchor included).
- `anchor`: every anchor copy sees only itself at position 0. Any other token sees the earlier non-anchor tokens of
  its document plus exactly one anchor, its own segment's copy. Without interleaving this is the `intra_doc` mask
  (with anchor positions); with interleaving a later chunk does not see the anchors of the earlier chunks, so each
  document always sees a single anchor at position 0, as AnchorAttention prescribes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MODES = ("full", "intra_doc", "intra_doc_reset", "anchor")
IGNORE_INDEX = -100


@dataclass(frozen=True)
class Layout:
    """The segment layout of a batch of packed windows, flattened over the batch (token t of row b is b*L + t).

    Per segment (all rows' segments concatenated in order): `seg_len`, `seg_start` (flat token index), `seg_row`,
    `seg_doc` (document id unique across the batch), `seg_tags`. Per token: `tok_seg`, `tok_doc`, `tok_anchor`,
    `tok_tag`.
    """

    batch: int
    length: int
    seg_len: torch.Tensor
    seg_start: torch.Tensor
    seg_row: torch.Tensor
    seg_doc: torch.Tensor
    seg_tags: torch.Tensor
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
    seg_start = torch.cumsum(seg_len, 0) - seg_len
    # Documents are numbered across the batch so that rows never share one.
    doc_key = seg_row * (int(seg_doc.max()) + 1 if seg_doc.numel() else 1) + seg_doc.long()
    doc = torch.unique(doc_key, return_inverse=True)[1]
    tok_seg = torch.repeat_interleave(torch.arange(seg_len.numel()), seg_len)
    offset = torch.arange(batch * length) - seg_start[tok_seg]
    return Layout(
        batch=batch,
        length=length,
        seg_len=seg_len,
        seg_start=seg_start,
        seg_row=seg_row,
        seg_doc=doc,
        seg_tags=seg_tags.long(),
        tok_seg=tok_seg,
        tok_doc=doc[tok_seg],
        tok_anchor=offset == 0,
        tok_tag=(offset >= 1) & (offset <= seg_tags.long()[tok_seg]),
    )


def earlier_tokens_of_same_doc(layout: Layout, seg_count: torch.Tensor | None = None) -> torch.Tensor:
    """Per segment: how many tokens of its document come before it in the window, i.e. the sum of `seg_count`
    (default `seg_len`) over the document's earlier segments."""
    order = torch.argsort(layout.seg_doc, stable=True)
    lens = (layout.seg_len if seg_count is None else seg_count)[order]
    exclusive = torch.cumsum(lens, 0) - lens
    _, counts = torch.unique_consecutive(layout.seg_doc[order], return_counts=True)
    group_first = torch.cumsum(counts, 0) - counts
    group = torch.repeat_interleave(torch.arange(counts.numel()), counts)
    out = torch.empty_like(exclusive)
    out[order] = exclusive - exclusive[group_first][group]
    return out


def position_ids(layout: Layout, mode: str) -> torch.Tensor:
    """Position ids `[B, L]` for a mode (DESIGN §3 table)."""
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


def shifted_labels(input_ids: torch.Tensor, layout: Layout) -> torch.Tensor:
    """`labels[:, t] = input_ids[:, t+1]`, -100 at each row's last token and wherever the target is a tag token."""
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    labels[:, :-1] = input_ids[:, 1:]
    is_tag = layout.tok_tag.view(input_ids.shape)
    labels[:, :-1].masked_fill_(is_tag[:, 1:], IGNORE_INDEX)
    return labels


def mask_mod(layout: Layout, mode: str, device=None):
    """The mode's visibility rule as `visible(b, h, q, k)` over `[B, L]` id tensors: FlexAttention's `mask_mod`, and
    evaluated on broadcast index grids, the dense mask."""
    B, L = layout.batch, layout.length
    doc = layout.tok_doc.view(B, L).to(device)
    seg = layout.tok_seg.view(B, L).to(device)
    anc = layout.tok_anchor.view(B, L).to(device)

    if mode == "full":
        def visible(b, h, q, k):
            return q >= k
    elif mode in ("intra_doc", "intra_doc_reset"):
        def visible(b, h, q, k):
            return (q >= k) & (doc[b, q] == doc[b, k])
    elif mode == "anchor":
        def visible(b, h, q, k):
            own_anchor = anc[b, k] & (seg[b, q] == seg[b, k])
            body = ~anc[b, k] & ~anc[b, q] & (doc[b, q] == doc[b, k])
            return (q >= k) & (own_anchor | body)
    else:
        raise ValueError(f"unknown mode {mode!r}")
    return visible


def dense_mask(layout: Layout, mode: str, device=None) -> torch.Tensor:
    """Boolean visibility `[B, L(query), L(key)]` of a mode; O(L²) memory, for the reference engine and small L."""
    B, L = layout.batch, layout.length
    idx = torch.arange(L, device=device)
    b = torch.arange(B, device=device)[:, None, None]
    return mask_mod(layout, mode, device)(b, None, idx[None, :, None], idx[None, None, :]).expand(B, L, L)
