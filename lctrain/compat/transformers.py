"""transformers API that differs across the 5.x releases lctrain supports (5.17, the GPU image's, through 5.23)."""

from __future__ import annotations

from typing import Any


def nested_rope_keys(hf_config) -> list[str]:
    """The keys `rope_parameters` is nested under (per-layer-type RoPE, e.g. Gemma-style sliding/full layers), or []
    for one flat dict. transformers >= 5.2x has `PreTrainedConfig.nested_rope_parameter_keys`; 5.17 decides the same
    inline in `standardize_rope_params`: keys that are among `_rope_type_labels` or `layer_types`."""
    params: dict[str, Any] = getattr(hf_config, "rope_parameters", None) or {}
    method = getattr(hf_config, "nested_rope_parameter_keys", None)
    if method is not None:
        return list(method(params))
    labels = getattr(hf_config, "_rope_type_labels", None) or getattr(hf_config, "layer_types", None) or ()
    return [key for key in params if key in labels]


def set_attn_implementation(hf_config, impl: str) -> None:
    """Name the attention implementation on a config before the model is built from it. `from_config` and
    `from_pretrained` take `attn_implementation=` too, but a config that is saved with the model must carry it."""
    hf_config._attn_implementation = impl


def attn_implementation(model_or_config) -> str:
    config = getattr(model_or_config, "config", model_or_config)
    return config._attn_implementation


def load_errors() -> tuple[type[BaseException], ...]:
    """What `from_pretrained` raises for a damaged or foreign model directory (transformers 5.17-5.23): a missing
    or unreadable file (OSError), a bad config value (ValueError, TypeError, or huggingface_hub's strict-dataclass
    validation), a truncated weights file (SafetensorError)."""
    from huggingface_hub.errors import StrictDataclassError
    from safetensors import SafetensorError

    return OSError, ValueError, TypeError, KeyError, StrictDataclassError, SafetensorError
