"""What every engine does before and around its kernel."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from lctrain.attention.segments import SEGMENTS_KEY, Segments
from lctrain.errors import UserError


def unify_dtypes(query, key, value):
    """With `model.rope_fp32` the rotary rotation returns fp32 q/k; the kernels run in the value dtype."""
    return query.to(value.dtype), key.to(value.dtype), value


# why a model class whose attention gets no segments cannot be trained (here, and where `lctrain init`, `prepare`
# and `train` find it out before the first step: `lctrain.attention.class_probe`)
NO_SEGMENTS = (
    "this model class's decoder layers do not pass their keyword arguments on to attention, so they cannot carry the "
    "documents' boundaries to it and lctrain cannot train it (Llama, Mistral, Qwen2/3, Phi-3, Gemma-2 and most "
    "others do)"
)


def check_dropout(dropout: float) -> None:
    if dropout:
        raise UserError(
            f"attention dropout {dropout} is not supported by the lctrain engines; "
            f"set attention_dropout: 0.0 in model.arch"
        )


def segments_of(module, kwargs: dict, query: torch.Tensor) -> Segments:
    """The batch's `Segments`, which every call must carry: the engines never guess the mask. A model class that
    does not pass its forward keyword arguments down to attention would otherwise train plain causal attention in a
    run configured for a document mode, without a word."""
    seg = kwargs.get(SEGMENTS_KEY)
    if seg is None:
        caller = type(module).__name__ if module is not None else "its caller"
        raise UserError(
            f"the lctrain attention engine got no segment metadata ({SEGMENTS_KEY}) from {caller}: "
            f"{NO_SEGMENTS}; calling a model yourself, pass it `batch.model_kwargs()`"
        )
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


def causal_rows(query, key, value, scaling):
    """Causal attention over each whole row: `full` mode."""
    return sdpa(query, key, value, is_causal=True, scale=scaling).transpose(1, 2).contiguous()


def check_unapplied(softcap, sliding_window, keys: int, sinks=None) -> None:
    """Refuse what a model class asks of attention that no engine kernel computes: soft-capped logits (Gemma-2's
    `attn_logit_softcapping`), a sliding window shorter than the keys (a window of at least `keys` positions masks
    nothing), and attention sinks (gpt-oss's per-head logit `s_aux` in every softmax's denominator). `lctrain.model`
    refuses or removes the first two before a model is built; this stops any other path from training another
    attention than the model's."""
    if sinks is not None:
        raise UserError(
            "the model's attention has sinks (a learned logit per head in every softmax, gpt-oss's s_aux), which the "
            "lctrain attention engines do not compute: training would drop them and their gradients"
        )
    if softcap is not None:
        raise UserError(
            f"attention soft-capping (softcap = {softcap}, the model's attn_logit_softcapping) is not computed by the "
            f"lctrain attention engines; set attn_logit_softcapping: null in the model's config"
        )
    if sliding_window is not None and sliding_window < keys:
        raise UserError(
            f"a sliding window of {sliding_window} over {keys} keys is not computed by the lctrain attention engines; "
            f"set sliding_window: null in the model's config"
        )


def hf_attention(kernel):
    """Give a kernel `(query, key, value, seg, scaling) -> out [B, S, H, D]` Hugging Face's attention signature,
    with what every engine shares: the dropout check, the refusal of soft-capping and a sliding window, the rope_fp32
    dtype cast, the default scale, and the batch's segments, without which it refuses to run."""

    @functools.wraps(kernel)
    def attention(
        module,
        query,
        key,
        value,
        attention_mask=None,
        scaling=None,
        dropout=0.0,
        softcap=None,
        sliding_window=None,
        **kwargs,
    ):
        check_dropout(dropout)
        check_unapplied(softcap, sliding_window, key.shape[-2], kwargs.get("s_aux"))
        query, key, value = unify_dtypes(query, key, value)
        scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
        return kernel(query, key, value, segments_of(module, kwargs, query), scaling), None

    return attention
