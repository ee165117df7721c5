"""Registration of the engines as Hugging Face attention implementations, and engine selection.

Registering a name with `transformers.AttentionInterface` is the library's public extension point: a model switched
to `lctrain_<engine>` calls our function in every attention layer, with the forward kwargs (our `lctrain_segments`)
passed through. No mask interface is registered, so Hugging Face builds no dense mask for these names.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from lctrain.attention.engines.flex import flex_engine
from lctrain.attention.engines.reference import reference_attention
from lctrain.attention.engines.sdpa import sdpa_attention
from lctrain.attention.engines.varlen import flash_attn_available, torch_varlen_available, varlen_engine
from lctrain.errors import UserError

ENGINES: dict[str, Callable] = {
    "reference": reference_attention,
    "sdpa": sdpa_attention,
    "flex": flex_engine,
    "varlen": varlen_engine,
}
HF_PREFIX = "lctrain_"


def hf_name(engine: str) -> str:
    return HF_PREFIX + engine


def register_all() -> None:
    """Idempotent: registering a name again replaces it with the same function."""
    from transformers import AttentionInterface

    for name, fn in ENGINES.items():
        AttentionInterface.register(hf_name(name), fn)


def engine_fn(name: str) -> Callable:
    """The engine as a plain function with the HF attention signature (for wrappers such as Ulysses)."""
    name = name.removeprefix(HF_PREFIX)
    if name not in ENGINES:
        raise UserError(f"attention engine '{name}' is unknown; expected one of {', '.join(ENGINES)}")
    return ENGINES[name]


def resolve_engine(engine: str, mode: str, device, *, dtype) -> str:
    """`auto` -> the fastest engine for this mode, device and dtype; a named engine is checked to be able to run it.
    Called once per model (`lctrain.model.attn_implementation`); everything else reads the engine off the model.

    `dtype`: the model's dtype (a name such as "float32" or a torch dtype): FlashAttention runs in 16 bits only."""
    device_type = torch.device(device).type
    gpu = device_type == "cuda"
    half = str(dtype).removeprefix("torch.") in ("bfloat16", "float16")
    if engine == "auto":
        if not gpu:
            return "sdpa"
        if mode == "full":
            return "sdpa"
        if half and (flash_attn_available() or torch_varlen_available()):
            return "varlen"
        return "flex"
    if engine not in ENGINES:
        raise UserError(f"attention.engine = '{engine}' is unknown; expected auto or one of {', '.join(ENGINES)}")
    if engine == "varlen":
        if not gpu:
            raise UserError(
                f"attention.engine = 'varlen' needs a CUDA GPU (device is {device_type}); use 'sdpa' or 'auto'"
            )
        if not half:
            raise UserError(
                f"attention.engine = 'varlen' (FlashAttention) runs in bfloat16 or float16, not {dtype}; "
                f"set model.dtype or use 'flex' or 'sdpa'"
            )
        if not (flash_attn_available() or torch_varlen_available()):
            raise UserError(
                "attention.engine = 'varlen' needs flash-attn (pip install flash-attn) or a PyTorch "
                "with torch.nn.attention.varlen; use 'flex' or 'sdpa'"
            )
    if engine == "flex" and not gpu:
        raise UserError(
            f"attention.engine = 'flex' cannot train on {device_type}: FlexAttention has no CPU "
            f"backward; use 'sdpa' or 'auto'"
        )
    return engine
