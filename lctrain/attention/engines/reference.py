"""`reference`: the dense mask of the mode and eager softmax attention. O(L²) memory; for tests and checks."""

from __future__ import annotations

import torch

from lctrain.attention.engines.common import check_dropout, plain_causal, segments_of, unify_dtypes
from lctrain.attention.modes import dense_mask


def reference_attention(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0, **kwargs):
    check_dropout(dropout)
    query, key, value = unify_dtypes(query, key, value)
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    seg = segments_of(kwargs, query)
    if seg is None:
        return plain_causal(query, key, value, scaling), None
    mask = seg.cached(("reference", query.device), lambda: dense_mask(seg.layout, seg.mode, query.device)[:, None])
    groups = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(groups, dim=1)
    value = value.repeat_interleave(groups, dim=1)
    scores = torch.matmul(query, key.transpose(-1, -2))
    scores = scores.to(torch.promote_types(scores.dtype, torch.float32)) * scaling
    scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1).to(value.dtype)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), None
