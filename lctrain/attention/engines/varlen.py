"""`varlen`: variable-length FlashAttention over the documents of the flattened batch (GPU only).

flash-attn's `flash_attn_varlen_func` when installed, else PyTorch's `torch.nn.attention.varlen.varlen_attn`. The
kernel attends causally within contiguous sequences, and every document mode's mask is causal attention within each
document (its anchor leads it), so one call serves all three document modes: the sequences are the segments, or,
when interleaved chunks split a document, the documents after one permutation of the tokens that joins their chunks
(`lctrain.attention.modes.document_order`, as `sdpa` does). `full` uses one sequence per row.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import torch
from torch.nn.attention import varlen

from lctrain.attention.engines.common import expand_kv_heads, hf_attention
from lctrain.attention.modes import Layout, document_order
from lctrain.errors import UserError


@dataclass
class VarlenPlan:
    cu_seqlens: torch.Tensor  # int32 [N + 1]
    max_seqlen: int  # a Python int: no device sync per layer
    order: torch.Tensor | None = None  # with interleaved chunks: the tokens document by document
    inverse: torch.Tensor | None = None  # undoes `order`


def build_varlen_plan(layout: Layout, mode: str, device) -> VarlenPlan:
    order = inverse = None
    if mode == "full":
        lens = torch.full((layout.batch,), layout.length, dtype=torch.long)
    elif layout.multi_segment_docs:
        order, lens = document_order(layout)
        order, inverse = order.to(device), torch.argsort(order).to(device)
    else:
        lens = layout.seg_len
    cu = torch.zeros(lens.numel() + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(lens, 0)
    return VarlenPlan(cu.to(device), int(lens.max()), order, inverse)


# Cached: a failed import is not memoised by Python and would search sys.path again in every layer's call.
@functools.cache
def flash_attn_available() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def torch_varlen_available() -> bool:
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def torch_varlen_takes_gqa() -> bool:
    """`varlen_attn` gained `enable_gqa` after PyTorch 2.11; before it, K/V must have as many heads as Q."""
    return "enable_gqa" in inspect.signature(varlen.varlen_attn).parameters


@hf_attention
def varlen_engine(query, key, value, seg, scaling):
    if not query.is_cuda:
        raise UserError("attention engine 'varlen' needs a CUDA GPU; set attention.engine to 'sdpa' on CPU")
    if value.dtype not in (torch.bfloat16, torch.float16):
        raise UserError(
            f"attention engine 'varlen' (FlashAttention) runs in bfloat16 or float16, not {value.dtype}; "
            f"set model.dtype to bfloat16 or attention.engine to 'flex' or 'sdpa'"
        )
    plan = seg.cached(("varlen", query.device), lambda: build_varlen_plan(seg.layout, seg.mode, query.device))
    return varlen_from_plan(query, key, value, plan, scaling)


def varlen_from_plan(query, key, value, plan: VarlenPlan, scaling: float) -> torch.Tensor:
    """Causal attention within each sequence of the plan, over the batch flattened to one row of B*L tokens:
    [B, H, L, D] inputs -> [B, L, H, D]. Device-agnostic, so the plan is tested on CPU with a stand-in kernel."""
    B, H, L, D = query.shape
    if value.shape[-1] != D:
        raise UserError(
            f"attention.engine = varlen: value heads of {value.shape[-1]} beside query and key heads of {D} "
            f"(multi-head latent attention, e.g. DeepSeek-V3) are not taken by the varlen kernels; set "
            f"attention.engine=sdpa or flex"
        )
    q = query.transpose(1, 2).reshape(B * L, H, D)
    k = key.transpose(1, 2).reshape(B * L, key.shape[1], D)
    v = value.transpose(1, 2).reshape(B * L, value.shape[1], D)
    if plan.order is not None:
        q, k, v = q[plan.order], k[plan.order], v[plan.order]
    cu, n = plan.cu_seqlens, plan.max_seqlen
    if flash_attn_available():
        # optional dependency: flash-attn, where installed, replaces torch's varlen kernel
        from flash_attn import flash_attn_varlen_func

        # its backward's atomics sum in a varying order unless asked not to; PyTorch's own kernel follows the switch
        deterministic = torch.are_deterministic_algorithms_enabled()
        out = flash_attn_varlen_func(
            q, k, v, cu, cu, n, n, dropout_p=0.0, softmax_scale=scaling, causal=True, deterministic=deterministic
        )
    else:
        gqa = {}
        if k.shape[1] != H:
            if torch_varlen_takes_gqa():
                gqa = {"enable_gqa": True}
            else:
                k, v = expand_kv_heads(k, H), expand_kv_heads(v, H)
        out = varlen.varlen_attn(q, k, v, cu, cu, n, n, scale=scaling, window_size=(-1, 0), **gqa)
    if plan.order is not None:
        out = out[plan.inverse]
    return out.view(B, L, H, D)
