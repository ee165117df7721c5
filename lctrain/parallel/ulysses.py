"""DeepSpeed-Ulysses around our attention engines, registered as a Hugging Face attention implementation.

Each rank holds a contiguous L/P slice of every token. DeepSpeed's `DistributedAttention` all-to-alls q, k, v from
[B, L/P, H, D] to [B, L, H/P, D]; the engine then attends over the whole window for its heads, reading the segment
metadata that every rank holds in full, and a second all-to-all returns [B, L/P, H, D]. RoPE was already applied to
the local slice with its true positions, so nothing about the modes changes under sequence parallelism.
"""

from __future__ import annotations

import math

from lctrain.errors import UserError

PREFIX = "lctrain_ulysses_"


def kv_replication(num_heads: int, num_kv_heads: int, sp: int, source: str = "config") -> int:
    """How many copies of each KV head make the KV heads split evenly over `sp` ranks (grouped-query attention with
    fewer KV heads than ranks); 1 when they already do. Raises UserError when the query heads cannot be split."""
    if num_heads % sp:
        raise UserError(
            f"{source}: the model's {num_heads} attention heads are not divisible by "
            f"parallel.sequence_parallel = {sp}; use a sequence-parallel size that divides {num_heads}"
        )
    if num_heads % num_kv_heads:
        raise UserError(f"{source}: {num_heads} attention heads are not a multiple of {num_kv_heads} KV heads")
    if num_kv_heads % sp == 0:
        return 1
    # Smallest r with (kv*r) % sp == 0; kv*r = lcm(kv, sp) divides the query-head count as kv and sp both do.
    return sp // math.gcd(num_kv_heads, sp)


def register_ulysses(engine: str, sp_group, num_heads: int, num_kv_heads: int) -> str:
    """Register `lctrain_ulysses_<engine>` for this process's sequence-parallel group and return its name."""
    import deepspeed.comm as dist
    from deepspeed.sequence.layer import DistributedAttention
    from transformers import AttentionInterface

    from lctrain.attention import engine_fn

    sp = dist.get_world_size(group=sp_group)
    rep = kv_replication(num_heads, num_kv_heads, sp)
    local_engine = engine_fn(engine)

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

    name = PREFIX + engine
    AttentionInterface.register(name, ulysses_attention)
    return name
