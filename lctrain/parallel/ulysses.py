"""DeepSpeed-Ulysses around our attention engines, registered as a Hugging Face attention implementation.

Each rank holds a contiguous L/P slice of every token. DeepSpeed's `DistributedAttention` all-to-alls q, k, v from
[B, L/P, H, D] to [B, L, H/P, D]; the engine then attends over the whole window for its heads, reading the segment
metadata that every rank holds in full, and a second all-to-all returns [B, L/P, H, D]. RoPE was already applied to
the local slice with its true positions, so nothing about the modes changes under sequence parallelism.
"""

from __future__ import annotations

import deepspeed.comm as dist
from deepspeed.sequence.layer import DistributedAttention

from lctrain.attention import Engine, register
from lctrain.costmodel import ModelShape
from lctrain.parallel.layout import kv_replication

ULYSSES_PREFIX = "ulysses_"


def register_ulysses(engine: Engine, sp_group, num_heads: int, num_kv_heads: int) -> Engine:
    """`engine` inside DeepSpeed-Ulysses for this process's sequence-parallel group, registered as
    `lctrain_ulysses_<engine>`."""
    sp = dist.get_world_size(group=sp_group)
    rep = kv_replication(num_heads, num_kv_heads, sp)
    local_engine = engine.attention

    def local_attention(query, key, value, module, attention_mask, scaling, dropout, kwargs):
        out, _ = local_engine(
            module,
            query.transpose(1, 2),
            key.transpose(1, 2),
            value.transpose(1, 2),
            attention_mask,
            scaling=scaling,
            dropout=dropout,
            **kwargs,
        )
        return out.contiguous()

    dist_attn = DistributedAttention(
        local_attention, sp_group, scatter_idx=2, gather_idx=1, num_kv_heads=num_kv_heads * rep
    )

    def ulysses_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        q = query.transpose(1, 2).contiguous()
        k = key.transpose(1, 2)
        v = value.transpose(1, 2)
        if rep > 1:
            # Copies sit next to their original, so query head h still meets KV head h // (H / KV) after the split.
            k = k.repeat_interleave(rep, dim=2)
            v = v.repeat_interleave(rep, dim=2)
        out = dist_attn(q, k.contiguous(), v.contiguous(), 0, None, module, attention_mask, scaling, dropout, kwargs)
        return out, None

    return register(Engine(ULYSSES_PREFIX + engine.name, ulysses_attention))


def wrap_model(lm, engine: Engine, sp_group) -> Engine:
    """Switch `lm` (built with `engine`) to `engine` inside DeepSpeed-Ulysses; returns the wrapped engine."""
    shape = ModelShape.from_hf_config(lm.config)
    ulysses = register_ulysses(engine, sp_group, shape.heads, shape.kv_heads)
    lm.set_attn_implementation(ulysses.hf_name)
    return ulysses
