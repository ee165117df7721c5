"""`sdpa`: per-document `scaled_dot_product_attention` (the CPU training engine; also runs on GPU).

Every document mode's mask is causal attention within each document (`intra_doc`, `intra_doc_reset` and `anchor`
differ only in positions; see `lctrain.attention.modes`), interleaved chunks included: a document's tokens are
gathered in window order into one causal job. The tokens are permuted once so that every job is a contiguous slice,
and jobs of equal length are one batched SDPA call: the number of kernel calls is the number of distinct document
lengths, and the gather/scatter cost is one permutation of q, k, v and the output, whatever the number of documents.
`full` is one causal SDPA over each row. The plan is built once per batch and device and cached on the `Segments`
object.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lctrain.attention.engines.common import causal_rows, expand_kv_heads, hf_attention, sdpa
from lctrain.attention.modes import Layout, document_order


@dataclass
class SdpaPlan:
    """`order` permutes the B*L tokens into the documents' causal jobs, back to back (`causal`: (count, length) per
    group of equal-length documents); `inverse` undoes `order`."""

    order: torch.Tensor
    inverse: torch.Tensor
    causal: list[tuple[int, int]]

    def to(self, device) -> SdpaPlan:
        return SdpaPlan(self.order.to(device), self.inverse.to(device), self.causal)


def build_sdpa_plan(layout: Layout) -> SdpaPlan:
    tokens, doc_len = document_order(layout)
    first = torch.cumsum(doc_len, 0) - doc_len
    parts, causal = [], []
    for n in torch.unique(doc_len).tolist():
        starts = first[doc_len == n]
        parts.append(tokens[starts[:, None] + torch.arange(n)].reshape(-1))
        causal.append((starts.numel(), n))
    order = torch.cat(parts)
    return SdpaPlan(order, torch.argsort(order), causal)


@hf_attention
def sdpa_attention(query, key, value, seg, scaling):
    if seg.mode == "full":
        return causal_rows(query, key, value, scaling)
    plan = seg.cached(("sdpa", query.device), lambda: build_sdpa_plan(seg.layout).to(query.device))
    B, H, L, D = query.shape
    Dv = value.shape[-1]  # the query's head size but for multi-head latent attention (DeepSeek-V3's 128 vs 192)
    k = key.transpose(1, 2).reshape(B * L, key.shape[1], D)
    v = value.transpose(1, 2).reshape(B * L, value.shape[1], Dv)
    if query.device.type == "cpu" and key.shape[1] != H:
        k, v = expand_kv_heads(k, H), expand_kv_heads(v, H)  # once per layer, not once per job (see common.sdpa)
    # One gather per tensor and `split` (whose backward is one concatenation) instead of per-job indexing.
    sizes = [G * n for G, n in plan.causal]
    qs = torch.split(query.transpose(1, 2).reshape(B * L, H, D)[plan.order], sizes)
    ks = torch.split(k[plan.order], sizes)
    vs = torch.split(v[plan.order], sizes)
    outs = []
    for i, (G, n) in enumerate(plan.causal):
        qg, kg, vg = (t[i].view(G, n, -1, t[i].shape[-1]).transpose(1, 2) for t in (qs, ks, vs))
        outs.append(sdpa(qg, kg, vg, is_causal=True, scale=scaling).transpose(1, 2).reshape(G * n, H, Dv))
    return torch.cat(outs)[plan.inverse].view(B, L, H, Dv)
