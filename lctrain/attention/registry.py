"""Registration of the engines as Hugging Face attention implementations, and engine selection.

Registering a name with `transformers.AttentionInterface` is the library's public extension point: a model switched
to `lctrain_<engine>` calls our function in every attention layer, with the forward kwargs (our `lctrain_segments`)
passed through. No mask interface is registered, so Hugging Face builds no dense mask for these names.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import AttentionInterface

from lctrain.attention.engines.flex import flex_engine
from lctrain.attention.engines.reference import reference_attention
from lctrain.attention.engines.sdpa import sdpa_attention
from lctrain.attention.engines.varlen import flash_attn_available, torch_varlen_available, varlen_engine
from lctrain.errors import UserError

HF_PREFIX = "lctrain_"


@dataclass(frozen=True)
class Engine:
    """An attention engine: `attention` has Hugging Face's attention-function signature and is registered under
    `hf_name`. `build_model` returns the one it resolved, and whatever wraps or reports the engine (Ulysses, `check
    sp`, the benchmarks) takes this object rather than reading a name back from the model's config."""

    name: str
    attention: Callable

    @property
    def hf_name(self) -> str:
        return HF_PREFIX + self.name


ENGINES: dict[str, Engine] = {
    e.name: e
    for e in (
        Engine("reference", reference_attention),
        Engine("sdpa", sdpa_attention),
        Engine("flex", flex_engine),
        Engine("varlen", varlen_engine),
    )
}


def register(engine: Engine) -> Engine:
    """Make `engine` a Hugging Face attention implementation (idempotent: a name registered again is replaced)."""
    AttentionInterface.register(engine.hf_name, engine.attention)
    return engine


def register_all() -> None:
    for engine in ENGINES.values():
        register(engine)


# the CPU engine of a model transformers runs no sdpa for: `auto` and `sdpa` are refused for it, and init writes flex
_CPU_WITHOUT_SDPA = "'reference' for a model transformers runs no sdpa for, such as Gemma-2"


def resolve_engine(engine: str, mode: str, device, *, dtype) -> Engine:
    """`auto` -> the fastest engine for this mode, device and dtype; a named engine is checked to be able to run it.
    Called once per model (`lctrain.model.build_model`, which hands the result to whoever needs it).

    `dtype`: the model's dtype (a name such as "float32" or a torch dtype): FlashAttention runs in 16 bits only."""
    return ENGINES[_engine_name(engine, mode, device, dtype)]


def _engine_name(engine: str, mode: str, device, dtype) -> str:
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
                f"attention.engine = 'varlen' needs a CUDA GPU (device is {device_type}); use 'sdpa' or 'auto' "
                f"({_CPU_WITHOUT_SDPA})"
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
            f"backward; use 'sdpa' or 'auto' ({_CPU_WITHOUT_SDPA})"
        )
    return engine
