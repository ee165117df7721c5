"""Fused kernels for the memory-bound work of the decoder layers: `model.fused_kernels` none, liger or compile.

Eager transformers runs each decoder layer's RMSNorm as an fp32 upcast plus four elementwise kernels, RoPE as
`rotate_half` copies, SwiGLU as a SiLU and a separate multiply, and all of it again in a checkpointed layer's
recomputation (issue 20: ~10% of the full-attention step, ~26% of the anchor step on one H100 at 64K).

- `liger`: Liger-Kernel's Triton kernels (RMSNorm, SwiGLU, RoPE, and the fused linear cross-entropy for the loss),
  bound on this model instance's modules, never by replacing transformers' classes or module functions: another
  model in the process keeps transformers' own code. Llama models only (RoPE is bound through a copy of
  `LlamaAttention.forward` in `compat/transformers.py`), on CUDA with triton and liger-kernel installed.
- `compile`: `torch.compile` of each decoder layer's two norms and MLP and of the final norm (`nn.Module.compile`:
  this instance only). Attention, lctrain's engines with their per-batch `Segments`, stays eager, so the compiled
  regions see plain tensors of one shape and compile once. Runs on CPU (inductor with a C++ compiler) and CUDA.

Both compute the same function: losses and gradients equal the eager run's up to rounding (tests/test_fused.py).
"""

from __future__ import annotations

import importlib.util
import types
from collections.abc import Callable

import torch

from lctrain.attention import IGNORE_INDEX
from lctrain.compat.transformers import is_llama_attention, llama_attention_forward
from lctrain.errors import UserError

MODES = ("none", "liger", "compile")
# Liger's Python packages: liger-kernel (pure Python) and triton (CUDA builds of torch ship it).
LIGER_PACKAGES = {"liger_kernel": "liger-kernel", "triton": "triton"}
# The norms of a Llama-style decoder layer, each `weight * normalize(x.float()).to(x.dtype)`.
_LAYER_NORMS = ("input_layernorm", "post_attention_layernorm")


def require_liger(device: str | torch.device) -> None:
    """Refuse `liger` in one line where its kernels cannot run: no CUDA device, or triton / liger-kernel missing."""
    if torch.device(device).type != "cuda":
        raise UserError(
            f"model.fused_kernels=liger runs Triton kernels on CUDA, not on {torch.device(device).type}; set "
            f"model.fused_kernels=compile or none"
        )
    missing = [dist for module, dist in LIGER_PACKAGES.items() if importlib.util.find_spec(module) is None]
    if missing:
        raise UserError(
            f"model.fused_kernels=liger needs {' and '.join(missing)} (pip install liger-kernel); set "
            f"model.fused_kernels=compile or none"
        )


def _decoder_layers(model, mode: str) -> list:
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers = list(getattr(decoder, "layers", None) or ())
    parts = (*_LAYER_NORMS, "mlp", "self_attn")
    if not layers or not all(hasattr(layer, part) for layer in layers for part in parts):
        raise UserError(
            f"model.fused_kernels={mode}: {type(model).__name__} has no Llama-style decoder layers "
            f"(input_layernorm, self_attn, post_attention_layernorm, mlp); set model.fused_kernels=none"
        )
    return layers


def apply(model, mode: str, device: str | torch.device) -> int:
    """Fuse this model instance's decoder layers under `mode`; returns the number of layers changed (0 for none)."""
    if mode == "none":
        return 0
    layers = _decoder_layers(model, mode)
    if mode == "compile":
        for layer in layers:
            for name in (*_LAYER_NORMS, "mlp"):
                getattr(layer, name).compile()
        model.get_decoder().norm.compile()
        return len(layers)
    require_liger(device)
    return _apply_liger(model, layers)


def _apply_liger(model, layers: list) -> int:
    # liger-kernel is optional and imports triton: loaded only when asked for
    from liger_kernel.transformers import LigerRMSNorm, LigerSwiGLUMLP, liger_rotary_pos_emb

    config = model.config
    if config.model_type != "llama" or not all(is_llama_attention(layer.self_attn) for layer in layers):
        raise UserError(
            f"model.fused_kernels=liger binds RoPE through Llama's attention; {config.model_type} is not a Llama "
            f"model: set model.fused_kernels=compile or none"
        )
    if config.hidden_act not in ("silu", "swish"):
        raise UserError(f"model.fused_kernels=liger fuses SwiGLU, not hidden_act {config.hidden_act}")
    rotary_forward = llama_attention_forward(liger_rotary_pos_emb)
    for norm in [getattr(layer, name) for layer in layers for name in _LAYER_NORMS] + [model.get_decoder().norm]:
        # LigerRMSNorm's own attributes, with Llama's rounding ("llama": normalise in fp32, cast, then weight)
        norm.offset, norm.casting_mode, norm.in_place, norm.row_mode = 0.0, "llama", True, None
        norm.forward = types.MethodType(LigerRMSNorm.forward, norm)
    for layer in layers:
        layer.mlp.forward = types.MethodType(LigerSwiGLUMLP.forward, layer.mlp)
        layer.self_attn.forward = types.MethodType(rotary_forward, layer.self_attn)
    return len(layers)


def liger_loss_sum(lm_head: torch.nn.Module, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The token-loss sum of `train.loss.chunked_loss_sum` through Liger's fused linear cross-entropy: logits in
    chunks inside one kernel, never all at once. `reduction="sum"`, and its backward multiplies by the incoming
    gradient, so the trainer's `(loss * grad_divisor / n_valid).backward()` normalises it as the chunked loss."""
    # liger-kernel is optional: loaded only when asked for
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    loss = LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE_INDEX, reduction="sum", accum_dtype=torch.float32)
    return loss(lm_head.weight, hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1), lm_head.bias).float()


def loss_sum(mode: str) -> Callable | None:
    """The loss-sum function `mode` replaces the chunked loss with (liger's fused one), or None to keep it."""
    return liger_loss_sum if mode == "liger" else None
