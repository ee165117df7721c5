"""`sdpa`: per-document `scaled_dot_product_attention` (the CPU training engine; also runs on GPU).

A batch's attention is split into jobs whose masks are plain causal (queries and keys are the same tokens) or
lower-right causal (the queries are the last keys). The tokens are permuted once so that every causal job is a
contiguous slice, and jobs of equal length are one batched SDPA call: the number of kernel calls is the number of
distinct document lengths, and the gather/scatter cost is one permutation of q, k, v and the output, whatever the
number of documents. The plan is built once per batch and device and cached on the `Segments` object.

Jobs per mode:
- `full`: one causal SDPA over each row.
- `intra_doc`, `intra_doc_reset`, and `anchor` without interleaved chunks: one causal job per document over its
  tokens in window order (the anchor mask equals the intra-document one when a document is one segment).
- `anchor` with interleaved chunks: the first chunk of a document is a causal job; a later chunk's non-anchor tokens
  are queries over [its own anchor] + the document's earlier non-anchor tokens + its own (lower-right causal); a later
  chunk's anchor sees only itself, so its output is its value vector.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lctrain.attention.engines.common import (expand_kv_heads, hf_attention, plain_causal, sdpa,
                                              sdpa_lower_right)
from lctrain.attention.modes import Layout, earlier_tokens_of_same_doc


@dataclass
class SdpaPlan:
    """`order` permutes the B*L tokens into: the causal jobs (`causal`: (count, length) per group, back to back),
    then the queries of the lower-right jobs (`lower_right`: (count, query length, key index [count, key length])),
    then the tokens that only see themselves (`copies`). `inverse` undoes `order`."""

    order: torch.Tensor
    inverse: torch.Tensor
    causal: list[tuple[int, int]] = field(default_factory=list)
    lower_right: list[tuple[int, int, torch.Tensor]] = field(default_factory=list)
    copies: int = 0

    def to(self, device) -> "SdpaPlan":
        return SdpaPlan(self.order.to(device), self.inverse.to(device), self.causal,
                        [(g, nq, k.to(device)) for g, nq, k in self.lower_right], self.copies)


def _runs_by_length(tokens: torch.Tensor, first: torch.Tensor, length: torch.Tensor):
    """Runs `tokens[first[i] : first[i] + length[i]]` grouped by length -> (token order, [(count, length)])."""
    parts, groups = [], []
    for n in torch.unique(length).tolist():
        starts = first[length == n]
        parts.append(tokens[starts[:, None] + torch.arange(n)].reshape(-1))
        groups.append((starts.numel(), n))
    return parts, groups


def build_sdpa_plan(layout: Layout, mode: str) -> SdpaPlan:
    if mode == "anchor" and layout.multi_segment_docs:
        parts, causal, lower_right, copies = _anchor_interleaved_jobs(layout)
    else:
        tokens = torch.argsort(layout.tok_doc, stable=True)
        doc_len = torch.bincount(layout.tok_doc, minlength=layout.num_docs)
        parts, causal = _runs_by_length(tokens, torch.cumsum(doc_len, 0) - doc_len, doc_len)
        lower_right, copies = [], torch.zeros(0, dtype=torch.long)
    order = torch.cat(parts + [copies])
    return SdpaPlan(order, torch.argsort(order), causal, lower_right, copies.numel())


def _anchor_interleaved_jobs(layout: Layout):
    # Segments in document order; the first segment of each document is an ordinary causal job.
    order = torch.argsort(layout.seg_doc, stable=True)
    docs_in_order = layout.seg_doc[order]
    first = torch.ones_like(layout.seg_len, dtype=torch.bool)
    first[order[1:]] = docs_in_order[1:] != docs_in_order[:-1]
    parts, causal = _runs_by_length(torch.arange(layout.tok_doc.numel()), layout.seg_start[first],
                                    layout.seg_len[first])

    # The non-anchor tokens of each document in window order: a later chunk's keys are a prefix of its document's.
    body = torch.nonzero(~layout.tok_anchor).squeeze(1)
    body_sorted = body[torch.argsort(layout.tok_doc[body], stable=True)]
    body_len = torch.bincount(layout.tok_doc[body], minlength=layout.num_docs)
    body_first = torch.cumsum(body_len, 0) - body_len

    later = torch.nonzero(~first).squeeze(1)
    prev = earlier_tokens_of_same_doc(layout, layout.seg_len - 1)[later]  # earlier non-anchor tokens of the doc
    q_len = layout.seg_len[later] - 1
    doc_body_first = body_first[layout.seg_doc[later]]
    anchors = layout.seg_start[later]
    keep = q_len > 0
    lower_right = []
    for nq, np_ in torch.unique(torch.stack([q_len[keep], prev[keep]], 1), dim=0).tolist():
        sel = (q_len == nq) & (prev == np_) & keep
        keys_body = body_sorted[doc_body_first[sel][:, None] + torch.arange(np_ + nq)]
        parts.append(keys_body[:, np_:].reshape(-1))
        lower_right.append((int(sel.sum()), nq, torch.cat([anchors[sel][:, None], keys_body], 1)))
    return parts, causal, lower_right, anchors


@hf_attention
def sdpa_attention(query, key, value, seg, scaling):
    if seg.mode == "full":
        return plain_causal(query, key, value, scaling)
    plan = seg.cached(("sdpa", query.device), lambda: build_sdpa_plan(seg.layout, seg.mode).to(query.device))
    B, H, L, D = query.shape
    k = key.transpose(1, 2).reshape(B * L, key.shape[1], D)
    v = value.transpose(1, 2).reshape(B * L, value.shape[1], D)
    if query.device.type == "cpu" and key.shape[1] != H:
        k, v = expand_kv_heads(k, H), expand_kv_heads(v, H)  # once per layer, not once per job (see common.sdpa)
    Hkv = k.shape[1]
    # One gather per tensor and `split` (whose backward is one concatenation) instead of per-job indexing.
    sizes = [G * n for G, n in plan.causal] + [G * nq for G, nq, _ in plan.lower_right] + [plan.copies]
    qs = torch.split(query.transpose(1, 2).reshape(B * L, H, D)[plan.order], sizes)
    ks = torch.split(k[plan.order], sizes)
    vs = torch.split(v[plan.order], sizes)
    outs = []
    for i, (G, n) in enumerate(plan.causal):
        qg, kg, vg = (t[i].view(G, n, -1, D).transpose(1, 2) for t in (qs, ks, vs))
        outs.append(sdpa(qg, kg, vg, is_causal=True, scale=scaling).transpose(1, 2).reshape(G * n, H, D))
    for j, (G, nq, k_idx) in enumerate(plan.lower_right, start=len(plan.causal)):
        qg = qs[j].view(G, nq, H, D).transpose(1, 2)
        nk = k_idx.shape[1]
        kg, vg = (t[k_idx.reshape(-1)].view(G, nk, Hkv, D).transpose(1, 2) for t in (k, v))
        o = sdpa_lower_right(qg, kg, vg, scaling)
        outs.append(o.transpose(1, 2).reshape(G * nq, H, D))
    if plan.copies:
        outs.append(expand_kv_heads(vs[-1], H))
    return torch.cat(outs)[plan.inverse].view(B, L, H, D)
