"""`reference`: the dense mask of the mode and eager softmax attention. O(L²) memory; for tests and checks."""

from __future__ import annotations

import torch

from lctrain.attention.engines.common import expand_kv_heads, hf_attention
from lctrain.attention.modes import dense_mask


@hf_attention
def reference_attention(query, key, value, seg, scaling):
    mask = seg.cached(("reference", query.device), lambda: dense_mask(seg.layout, seg.mode, query.device)[:, None])
    key, value = expand_kv_heads(key, query.shape[1], dim=1), expand_kv_heads(value, query.shape[1], dim=1)
    scores = torch.matmul(query, key.transpose(-1, -2))
    scores = scores.to(torch.promote_types(scores.dtype, torch.float32)) * scaling
    scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1).to(value.dtype)
    return torch.matmul(weights, value).transpose(1, 2).contiguous()
