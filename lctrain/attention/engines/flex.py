"""`flex`: FlexAttention with a block mask built from per-token document, segment and anchor ids (GPU).

The block mask is built once per batch and device and cached on the `Segments` object; every layer (and every
gradient-checkpoint recomputation) reuses it. On CUDA both the mask construction and the kernel are compiled, which
is what makes FlexAttention sparse and fused; on CPU it runs eagerly, forward only (no CPU backward in PyTorch).
Interleaved chunks are just another mask here, so this is the GPU engine for them.
"""

from __future__ import annotations

from functools import cache

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from lctrain.attention.engines.common import hf_attention
from lctrain.attention.modes import Layout, mask_mod


@cache
def _compiled(fn):
    return torch.compile(fn)


def build_block_mask(layout: Layout, mode: str, device):
    device = torch.device(device)
    make = _compiled(create_block_mask) if device.type == "cuda" else create_block_mask
    return make(mask_mod(layout, mode, device), layout.batch, None, layout.length, layout.length, device=device)


@hf_attention
def flex_engine(query, key, value, seg, scaling):
    block_mask = seg.cached(("flex", query.device), lambda: build_block_mask(seg.layout, seg.mode, query.device))
    attend = _compiled(flex_attention) if query.is_cuda else flex_attention
    out = attend(query, key, value, block_mask=block_mask, scale=scaling, enable_gqa=key.shape[1] != query.shape[1])
    return out.transpose(1, 2).contiguous()
