"""What every engine does before and around its kernel."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from lctrain.attention.segments import SEGMENTS_KEY, Segments
from lctrain.errors import UserError


def unify_dtypes(query, key, value):
    """With `model.rope_fp32` the rotary rotation returns fp32 q/k; the kernels run in the value dtype."""
    return query.to(value.dtype), key.to(value.dtype), value


def check_dropout(dropout: float) -> None:
    if dropout:
        raise UserError(
            f"attention dropout {dropout} is not supported by the lctrain engines; "
            f"set attention_dropout: 0.0 in model.arch"
        )


def segments_of(kwargs: dict, query: torch.Tensor) -> Segments | None:
    seg = kwargs.get(SEGMENTS_KEY)
    if seg is None:
        return None
    B, _, S, _ = query.shape
    if (seg.batch, seg.length) != (B, S):
        raise ValueError(
            f"{SEGMENTS_KEY} describes a [{seg.batch}, {seg.length}] batch but the attention input is "
            f"[{B}, {S}]; pass the make_batch output of this very batch"
        )
    return seg


def expand_kv_heads(x: torch.Tensor, heads: int, dim: int = -2) -> torch.Tensor:
    """Repeat each KV head for its query-head group (query head h reads KV head h // group, as HF's repeat_kv)."""
    groups = heads // x.shape[dim]
    return x if groups == 1 else x.repeat_interleave(groups, dim=dim)


def sdpa(query, key, value, **kwargs):
    """`scaled_dot_product_attention` on [B, H, S, D] with grouped-query K/V. On CPU the backward of `enable_gqa`
    takes a path ~5x slower than expanding the K/V heads first (PyTorch 2.13), so there the heads are expanded."""
    if query.device.type == "cpu":
        key, value = expand_kv_heads(key, query.shape[1], dim=1), expand_kv_heads(value, query.shape[1], dim=1)
    return F.scaled_dot_product_attention(query, key, value, enable_gqa=key.shape[1] != query.shape[1], **kwargs)


def sdpa_lower_right(query, key, value, scale):
    """Causal attention where the S queries are the last S of the K keys. On CUDA the kernels take the lower-right
    mask directly; on CPU a lower-right mask falls back to the unfused math path, so the queries are left-padded to a
    square causal problem (the padding rows are dropped) and the fused CPU kernel runs instead."""
    S, K = query.shape[-2], key.shape[-2]
    if query.device.type != "cpu":
        return sdpa(query, key, value, attn_mask=causal_lower_right(S, K), scale=scale)
    pad = query.new_zeros(*query.shape[:-2], K - S, query.shape[-1])
    return sdpa(torch.cat([pad, query], dim=-2), key, value, is_causal=True, scale=scale)[..., K - S :, :]


def plain_causal(query, key, value, scaling):
    """Without segment metadata (generation, evaluation) the engines compute ordinary causal attention; the
    queries are the last `S` of the `K` cached positions."""
    S, K = query.shape[2], key.shape[2]
    if S == K:
        out = sdpa(query, key, value, is_causal=True, scale=scaling)
    elif S == 1:
        out = sdpa(query, key, value, scale=scaling)
    else:
        out = sdpa_lower_right(query, key, value, scaling)
    return out.transpose(1, 2).contiguous()


def hf_attention(kernel):
    """Give a kernel `(query, key, value, seg, scaling) -> out [B, S, H, D]` Hugging Face's attention signature,
    with what every engine shares: the dropout check, the rope_fp32 dtype cast, the default scale, and plain causal
    attention when no segment metadata is passed (generation, evaluation)."""

    @functools.wraps(kernel)
    def attention(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0, **kwargs):
        check_dropout(dropout)
        query, key, value = unify_dtypes(query, key, value)
        scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
        seg = segments_of(kwargs, query)
        if seg is None:
            return plain_causal(query, key, value, scaling), None
        return kernel(query, key, value, seg, scaling), None

    return attention
