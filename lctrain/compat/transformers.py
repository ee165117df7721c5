"""transformers API that differs across the 5.x releases lctrain supports (5.17, the GPU image's, through 5.23)."""

from __future__ import annotations

import contextlib
import functools
from typing import Any

# The first and the last minor release each entry here was checked against; pyproject.toml admits exactly these.
TRANSFORMERS_RELEASES = ("5.17", "5.23")


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
    `from_pretrained` take `attn_implementation=` too, but a config that is saved with the model must carry it.
    transformers 5.17-5.23 keep it in the private `PreTrainedConfig._attn_implementation` (no public setter on a
    config; `model.set_attn_implementation` exists only once the model is built)."""
    hf_config._attn_implementation = impl


def attn_implementation_of(hf_config) -> str | None:
    """The attention implementation a config names (None: transformers picks one when the model is built), read
    where `set_attn_implementation` writes it."""
    return hf_config._attn_implementation


def sdpa_refused(hf_config, impl: str) -> bool:
    """Whether transformers refuses to build the causal LM of `hf_config` with the attention implementation `impl`:
    any name holding "sdpa" is checked against the model class's private `_supports_sdpa` (False for Gemma-2 in
    5.17-5.23). False for a config type without a registered causal LM class (remote code): its build decides."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    if "sdpa" not in impl:
        return False
    try:
        model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(hf_config)]
    except KeyError:
        return False
    return not model_class._supports_sdpa


def enable_activation_checkpointing(model, checkpoint_kwargs: dict[str, Any]) -> None:
    """Checkpoint every decoder layer of `model` (this instance), `checkpoint_kwargs` going to
    `torch.utils.checkpoint.checkpoint`. transformers 5.17 and 5.18 have only `gradient_checkpointing_enable`; 5.23
    names it `activation_checkpointing_enable` and keeps the old name as an alias that warns (FutureWarning)."""
    method = getattr(model, "activation_checkpointing_enable", None)
    if method is not None:
        method(activation_checkpointing_kwargs=checkpoint_kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpoint_kwargs)


def _fp32_rotary_inputs(module, args, kwargs):
    # torch on use: this module loads without it (start-up time of the light commands)
    import torch

    x = args[0] if args else kwargs["x"]
    probe = torch.empty(0, dtype=torch.float32, device=x.device)
    if args:
        return (probe, *args[1:]), kwargs
    return args, {**kwargs, "x": probe}


# Our own marker on a hooked rotary module, so that hooking a model twice adds no second hook.
_FP32_MARK = "_lctrain_rope_fp32"


def rotary_in_fp32(model) -> int:
    """Make every rotary-embedding module of `model` return fp32 cos/sin; returns the number hooked. transformers
    5.17-5.23: the rotary modules are the `*RotaryEmbedding` classes, whose `forward(x, position_ids)` reads only the
    device and dtype of `x` (cos/sin are computed in fp32 and cast to `x.dtype`), so a forward pre-hook that passes
    a 0-element fp32 tensor for `x` makes them return fp32 without copying the hidden states."""
    hooked = 0
    for module in model.modules():
        if type(module).__name__.endswith("RotaryEmbedding") and not getattr(module, _FP32_MARK, False):
            module.register_forward_pre_hook(_fp32_rotary_inputs, with_kwargs=True)
            setattr(module, _FP32_MARK, True)
            hooked += 1
    return hooked


def pin_longrope(model, seq_len: int) -> int:
    """Give every `longrope` rotary module of `model` its long factors for good when training windows of `seq_len`
    tokens pass the module's `original_max_position_embeddings`; returns the number pinned. transformers 5.17-5.23
    choose the long or the short factors at each forward by its largest position (`dynamic_rope_update`), so the
    same window got the short ones on a sequence-parallel rank whose slice ends within the original length (rank 0
    trained on other rotations than the others), and in an `intra_doc_reset` window of short documents; one process
    computing a whole window of `seq_len` picks the long ones, and now every forward does. The choice is in two
    non-persistent buffers (`inv_freq`, which the forward overwrites from `original_inv_freq` or the plain attribute
    `long_inv_freq`), hence here."""
    # transformers and torch on use (start-up time)
    import torch
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    pinned = 0
    for module in model.modules():
        rope_types = getattr(module, "rope_type", None)
        if not type(module).__name__.endswith("RotaryEmbedding") or rope_types is None:
            continue
        per_layer = rope_types if isinstance(rope_types, dict) else {None: rope_types}
        for layer_type, rope_type in per_layer.items():
            params = module.config.rope_parameters if layer_type is None else module.config.rope_parameters[layer_type]
            original = params.get("original_max_position_embeddings") if rope_type == "longrope" else None
            if original is None or seq_len <= original:
                continue  # no window reaches past it: every forward picks the short factors, as one process does
            prefix = "" if layer_type is None else f"{layer_type}_"
            buffer = getattr(module, f"{prefix}inv_freq")
            kind = {} if layer_type is None else {"layer_type": layer_type}
            long, _ = ROPE_INIT_FUNCTIONS["longrope"](module.config, buffer.device, seq_len=original + 1, **kind)
            with torch.no_grad():
                for name in ("inv_freq", "original_inv_freq"):
                    getattr(module, f"{prefix}{name}").copy_(long)
            setattr(module, f"{prefix}long_inv_freq", long)
            pinned += 1
    return pinned


def load_errors() -> tuple[type[BaseException], ...]:
    """What `from_pretrained` raises for a damaged or foreign model directory (transformers 5.17-5.23): a missing
    or unreadable file (OSError), a bad config value (ValueError, TypeError, or huggingface_hub's strict-dataclass
    validation), a truncated weights file (SafetensorError)."""
    # huggingface_hub and safetensors on use, as torch (start-up time)
    from huggingface_hub.errors import StrictDataclassError
    from safetensors import SafetensorError

    return OSError, ValueError, TypeError, KeyError, StrictDataclassError, SafetensorError


def is_llama_attention(module) -> bool:
    """Whether `module` runs transformers' `LlamaAttention.forward` (its class or a subclass that keeps it)."""
    # transformers on use, as torch (start-up time)
    from transformers.models.llama.modeling_llama import LlamaAttention

    return type(module).forward is LlamaAttention.forward


def llama_attention_forward(rotary):
    """`LlamaAttention.forward` of transformers 5.17-5.23 with `rotary(q, k, cos, sin) -> (q, k)` in place of the
    module-level `apply_rotary_pos_emb` it calls, to bind on one attention instance (a fused RoPE for one model,
    never for every Llama in the process). The rest is the release's own body: projections to [B, heads, S, d], the
    cache update and the configured attention function (`_attn_implementation`, private, hence here)."""
    # transformers on use, as torch (start-up time)
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.models.llama.modeling_llama import eager_attention_forward

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None, **kwargs):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        query_states, key_states = rotary(query_states, key_states, cos, sin)
        if past_key_values is not None:
            key_states, value_states = past_key_values.update(key_states, value_states, self.layer_idx)
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)
        attn_output, attn_weights = attention(
            self,
            query_states,
            key_states,
            value_states,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            **kwargs,
        )
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        return self.o_proj(attn_output), attn_weights

    return forward


@contextlib.contextmanager
def quiet_gguf_conversion():
    """transformers' GGUF reader shows its own tqdm bar ("Converting and de-quantizing GGUF tensors...", 5.17 to
    5.23: `modeling_gguf_pytorch_utils.tqdm`, tqdm's own, outside transformers' progress-bar switch): in a log file,
    a line of carriage returns. Off while a GGUF file is read."""
    # transformers' GGUF reader on use: only `example-model` reads GGUF (start-up time)
    from transformers import modeling_gguf_pytorch_utils as gguf_reader

    bar = gguf_reader.tqdm
    gguf_reader.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        gguf_reader.tqdm = bar


# What transformers 5 nests in `rope_parameters` beside the scaling: the base, and the rotary layout (Phi's part of
# each head). transformers 4.x reads both from the top level of config.json, and the scaling from `rope_scaling`.
_ROPE_TOP_LEVEL_KEYS = ("rope_theta", "partial_rotary_factor")
# 4.x's GPT-NeoX configs (Pythia) read their own names, and set `rope_theta` from them over a top-level one (4.57's
# GPTNeoXConfig: `self.rope_theta = rotary_emb_base`, default 10000; `partial_rotary_factor = rotary_pct`, 0.25).
_NEOX_NAMES = {"rope_theta": "rotary_emb_base", "partial_rotary_factor": "rotary_pct"}
_ROPE_4X_NAMES = {"gpt_neox": _NEOX_NAMES, "gpt_neox_japanese": _NEOX_NAMES}
_BASE_KEYS = ("rope_theta", "rotary_emb_base")


def legacy_rope_keys(config: dict[str, Any]) -> dict[str, Any]:
    """The top-level RoPE keys transformers 4.x reads, for a config.json as 5.17-5.23 save it (`config`: its JSON
    object), which keeps them only in `rope_parameters`: `rope_theta`; `partial_rotary_factor` where the parameters
    hold one; `rope_scaling`, the parameters without those two, where the type is not `default`; GPT-NeoX's
    `rotary_emb_base` and `rotary_pct` besides. Without them 4.46 to 4.57 load the model with the class default, e.g.
    base 10000, silently. Only keys `config` lacks, and a base key it holds with another value than the parameters'
    (a stale top-level base, e.g. the pretrained one a config class kept as an extra attribute: 4.x would read it);
    none for per-layer-type parameters (nested dicts, which 4.x spells per model type) or a config without RoPE.

    transformers 5 loads such a config to the same `rope_parameters` (tests/test_export.py, on the installed release):
    `RotaryEmbeddingConfigMixin.convert_rope_params_to_dict` (5.17 and 5.23 alike) takes `rope_scaling`, when
    present, for the parameters and fills `rope_theta` and `partial_rotary_factor` into them from the top level with
    `setdefault`; a `rope_scaling` is therefore written only whole (every entry but those two). 5.23 pops both
    top-level keys, so the loaded config is the one saved; 5.17 pops `rope_theta` but keeps a top-level
    `partial_rotary_factor` as an attribute too, beside the same value in the parameters."""
    params = config.get("rope_parameters")
    if not isinstance(params, dict) or not params or any(isinstance(v, dict) for v in params.values()):
        return {}
    legacy = {key: params[key] for key in _ROPE_TOP_LEVEL_KEYS if key in params}
    legacy |= {
        name: legacy[key] for key, name in _ROPE_4X_NAMES.get(config.get("model_type"), {}).items() if key in legacy
    }
    if params.get("rope_type", "default") != "default":
        legacy["rope_scaling"] = {k: v for k, v in params.items() if k not in _ROPE_TOP_LEVEL_KEYS}
    return {k: v for k, v in legacy.items() if k not in config or (k in _BASE_KEYS and config[k] != v)}


def legacy_tokenizer_config(config: dict[str, Any]) -> dict[str, Any]:
    """tokenizer_config.json's object as 5.17-5.23 save it, rewritten so that transformers 4.46-4.57 load it too, to
    the tokenizer 5 loads from either (same class, ids and special tokens; resaved by 5, the original file):
    `extra_special_tokens` as a list, 5's name for the additional special tokens, is 4.x's dict of named tokens (a list
    fails its loading with an AttributeError): written as `additional_special_tokens`, which both read; a
    `tokenizer_class` of `TokenizersBackend` (5's class of a tokenizer with no class of its own, e.g. SmolLM2's BPE),
    which 4.x cannot import, as `PreTrainedTokenizerFast`, which 5 loads as that class."""
    config = dict(config)
    if isinstance(config.get("extra_special_tokens"), list) and "additional_special_tokens" not in config:
        config["additional_special_tokens"] = config.pop("extra_special_tokens")
    if config.get("tokenizer_class") == "TokenizersBackend":
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
    return config


def config_json_text(config: dict[str, Any]) -> str:
    """config.json's text as transformers 5.17-5.23 write it (`PreTrainedConfig.to_json_string`): sorted keys,
    indent 2, a final newline."""
    import json

    return json.dumps(config, indent=2, sort_keys=True) + "\n"


def pretrained_generation_config(source: str):
    """The generation config `AutoModelForCausalLM.from_pretrained(source)` gives its model (transformers 5.17 to
    5.23: `GenerationMixin.adjust_generation_fn`): the source's generation_config.json, else one made from its
    config.json (a model saved without one). `from_config` makes it from the config alone, so a model built without
    its weights takes this one to save what a loaded one saves."""
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(source)
    except OSError:
        return GenerationConfig.from_pretrained(source, config_file_name="config.json", _from_model_config=True)
