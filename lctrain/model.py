"""Build the model a config asks for: a hub name or local directory, or a random init from an architecture dict.

Sets what long-context continual pretraining changes (docs/design.md §1): RoPE base (`rope_theta`, Table 1 defaults by
`data.seq_len`), RoPE scaling (static NTK-aware and YaRN: the paper's Table 2; any other Hugging Face type passes
through), `max_position_embeddings`, dtype, gradient checkpointing, fp32 rotary rotation, DeepSpeed's sequence-tiled
MLP, fused kernels (`lctrain.fused`), and the attention engine (`lctrain_<engine>`).
"""

from __future__ import annotations

import copy
import difflib
import json
import logging
import math
from pathlib import Path
from typing import Any, NamedTuple

import torch
from huggingface_hub import try_to_load_from_cache
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from lctrain import activation_checkpointing, fused
from lctrain.attention import ENGINES, Engine, resolve_engine
from lctrain.attention.class_probe import engines_refused
from lctrain.attention.engines.common import check_dropout
from lctrain.compat.deepspeed import tiled_mlp_apply
from lctrain.compat.transformers import (
    attn_implementation_of,
    nested_rope_keys,
    pin_longrope,
    sdpa_refused,
    set_attn_implementation,
)
from lctrain.compat.transformers import rotary_in_fp32 as compat_rotary_in_fp32
from lctrain.config import Config, data_dir
from lctrain.costmodel import ModelShape
from lctrain.errors import UserError
from lctrain.eval.ruler import select_task_set
from lctrain.parallel.groups import pick_backend
from lctrain.parallel.layout import ParallelLayout, kv_replication, layout_of
from lctrain.rundir import RunDir
from lctrain.shapes import HUB_NAMES, SHAPES
from lctrain.tokenizer import BUILTIN_PREFIX, check_matches_model, load_tokenizer, resolve_anchor
from lctrain.train.loss import logit_transform

log = logging.getLogger(__name__)

# Paper Table 1: RoPE base per training length.
_ROPE_THETA_BY_LENGTH = ((32_768, 1e6), (65_536, 5e6), (131_072, 1e7))
_ROPE_THETA_LONGEST = 5e7
# Scaled RoPE types that need the pretraining context length.
_ROPE_TYPES_WITH_ORIGINAL_LENGTH = ("yarn", "llama3", "longrope")
# lctrain's own type: static NTK-aware scaling, resolved into the base of plain RoPE (transformers has only the
# dynamic variant, which leaves every position up to max_position_embeddings unscaled).
NTK_ROPE_TYPE = "ntk"


def default_rope_theta(seq_len: int) -> float:
    """1e6 up to 32K, 5e6 at 64K, 1e7 at 128K, 5e7 beyond (the paper's Table 1)."""
    for limit, theta in _ROPE_THETA_BY_LENGTH:
        if seq_len <= limit:
            return theta
    return _ROPE_THETA_LONGEST


def ntk_rope_theta(base: float, factor: float, rotary_dim: int) -> float:
    """Static NTK-aware scaling (LocalLLaMA, 2023), the paper's "NTK-aware" of Table 2: plain RoPE at the base
    `base * s^(d / (d - 2))`, with d the rotary dimension and s the scale factor. The paper (section 4.3): "NTK-aware
    and YaRN depend on the relative scale s = T_new/T_origin, where T_origin is the original context size (4K
    context length) and T_new is the extended size (64K context length), so we set s = 16"."""
    return base * factor ** (rotary_dim / (rotary_dim - 2))


def _rotary_dim(hf_config, params: dict) -> int:
    # how transformers sizes the rotation: head_dim (or hidden/heads) times partial_rotary_factor
    from lctrain.costmodel import ModelShape

    return int(ModelShape.from_hf_config(hf_config).head_dim * params.get("partial_rotary_factor", 1.0))


# `rope_parameters` entries that describe the model's rotary layout, not its scaling: a `model.rope_scaling` keeps them
# (Phi and Phi-3 rotate only part of each head; without the entry Phi's attention fails, Phi-3's rotates all of it).
_ROTARY_LAYOUT_KEYS = ("partial_rotary_factor",)


def _rotary_layout(current: dict) -> dict[str, Any]:
    return {key: current[key] for key in _ROTARY_LAYOUT_KEYS if key in current}


def _ntk_parameters(hf_config, current: dict, scaling: dict, theta: float) -> dict[str, Any]:
    factor = scaling.pop("factor", None)
    if scaling:
        raise UserError(
            f"model.rope_scaling: rope_type 'ntk' takes only factor (s = new / original context length), "
            f"not {', '.join(sorted(scaling))}"
        )
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor >= 1:
        raise UserError(
            f"model.rope_scaling.factor = {factor!r}: rope_type 'ntk' needs a factor >= 1 (the paper's "
            f"s = 16 for 4K -> 64K)"
        )
    params = {"rope_type": "default", **_rotary_layout(current)}
    params["rope_theta"] = ntk_rope_theta(theta, factor, _rotary_dim(hf_config, params))
    log.info("RoPE: static NTK-aware x%s, base %s -> %s", factor, theta, params["rope_theta"])
    return params


def _dtype(name: str) -> torch.dtype:
    return {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}[name]


# Architecture sizes that must be positive integers; transformers accepts 0 or negatives and fails later.
_POSITIVE_ARCH_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
    "max_position_embeddings",
    "head_dim",
)
# Keys transformers 5 still accepts on input and moves elsewhere (into rope_parameters), so they are not in to_dict().
_LEGACY_ARCH_KEYS = ("rope_theta", "rope_scaling", "partial_rotary_factor")


def check_arch(arch: dict[str, Any]) -> None:
    """Refuse a `model.arch` that would build another model than asked (an unknown key is silently ignored by
    transformers, so a typo trains the default size) or none at all; one line each."""
    model_type = arch.get("model_type")
    if not model_type:
        raise UserError("model.arch needs a model_type (e.g. llama, mistral, qwen2)")
    if model_type not in CONFIG_MAPPING:
        close = difflib.get_close_matches(str(model_type), list(CONFIG_MAPPING.keys()), n=3)
        raise UserError(
            f"model.arch.model_type = {model_type!r} is not a transformers model type"
            + (f"; did you mean {', '.join(close)}?" if close else "; e.g. llama, mistral, qwen2")
        )
    known = set(CONFIG_MAPPING[model_type]().to_dict()) | set(_LEGACY_ARCH_KEYS)
    for key in arch:
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=1)
            raise UserError(
                f"model.arch.{key} is not a '{model_type}' configuration key"
                + (f"; did you mean {close[0]}?" if close else "")
            )
    for key in _POSITIVE_ARCH_KEYS:
        value = arch.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
            raise UserError(f"model.arch.{key} = {value!r} must be a positive integer")


def unloadable_because(source: str, e: BaseException) -> str:
    """Why `from_pretrained(source)` failed, in words a user acts on: a directory without config.json, a name that
    is neither a directory nor a hub model found (cached, or online), else the library's first sentence (its
    messages run on with links)."""
    path = Path(source)
    if path.is_dir() and not (path / "config.json").is_file():
        return f"the directory {source} has no config.json"
    if not path.exists() and isinstance(e, OSError):
        return "not a local directory, nor a hub model in the cache or on a reachable hub (a typo, or offline?)"
    first = " ".join(str(e).split()).split(". ")[0]
    return f"{type(e).__name__}: {first[:160]}"


def load_hf_config(cfg: Config):
    """The Hugging Face config of the model a config asks for (`model.arch` checked first), before lctrain's
    long-context settings are applied."""
    from huggingface_hub.errors import StrictDataclassError  # transformers 5 validates config fields with these
    from transformers import AutoConfig

    if cfg.model.arch is not None:
        arch = dict(cfg.model.arch)
        check_arch(arch)
        model_type = arch.pop("model_type")
        try:
            hf = AutoConfig.for_model(model_type, **arch)
        except (ValueError, TypeError, ZeroDivisionError, StrictDataclassError) as e:
            raise UserError(f"model.arch: cannot build a '{model_type}' config ({' '.join(str(e).split())})") from None
        require_rope(hf, "model.arch")
        return hf
    source = cfg.resolve_source(cfg.model.name_or_path)
    try:
        hf = AutoConfig.from_pretrained(source)
    except (OSError, ValueError, StrictDataclassError) as e:
        raise UserError(
            f"model.name_or_path = '{cfg.model.name_or_path}' cannot be loaded as a Hugging Face model "
            f"directory or hub name ({unloadable_because(source, e)}); download it first or point to a local "
            f"directory"
        ) from None
    require_rope(hf, f"model.name_or_path = '{cfg.model.name_or_path}'")
    return hf


def require_rope(hf_config, what: str) -> None:
    """lctrain extends the context of RoPE models: one with other positions (GPT-2's learned ones, ALiBi) is refused
    in one line wherever its config is read, before anything is built."""
    if not getattr(hf_config, "rope_parameters", None):
        raise UserError(
            f"{what}: model type '{hf_config.model_type}' has no RoPE (rope_parameters); lctrain extends RoPE models "
            f"(Llama, Mistral, Qwen, ...)"
        )


def require_engines(hf_config, what: str) -> None:
    """A model class lctrain's engines cannot train (`class_probe`) is refused where a run's model config is first
    read (`lctrain init`, `prepare`, `train` before it launches), not at the first step, after the data is prepared
    and the weights loaded, or never (a class with attention of its own)."""
    why = engines_refused(hf_config)
    if why is not None:
        raise UserError(f"{what}: model type '{hf_config.model_type}': {why}")


def check_model_class(cfg: Config) -> None:
    """`check_rope_scaling`, and `require_engines` for the model a config trains where its config is here without a
    download: `model.arch`, a local directory, or a hub name in the Hugging Face cache."""
    check_rope_scaling(cfg.model.rope_scaling)
    if cfg.model.arch is not None or Path(cfg.resolve_source(cfg.model.name_or_path)).is_dir():
        hf_config = load_hf_config(cfg)
    else:
        try:
            hf_config = AutoConfig.from_pretrained(cfg.model.name_or_path, local_files_only=True)
        except (OSError, ValueError):
            return  # not here without a download: the first step is the check
    what = "model.arch" if cfg.model.arch is not None else f"model.name_or_path = '{cfg.model.name_or_path}'"
    require_engines(hf_config, what)


def check_heads_split(cfg: Config) -> None:
    """The model's attention heads split over `parallel.sequence_parallel` (`kv_replication`), checked where its
    shape is known without a download (`shape_without_download`): `train`, `plan` and `show-config` alike."""
    if cfg.parallel.sequence_parallel > 1 and shape_without_download(cfg):
        shape = model_shape(cfg)
        source = cfg.origin("parallel.sequence_parallel", "model")
        kv_replication(shape.heads, shape.kv_heads, cfg.parallel.sequence_parallel, source)


def shape_without_download(cfg: Config) -> bool:
    """Whether the model's shape is known here: `model.arch`, a local directory or a known base model."""
    name = cfg.model.name_or_path
    return cfg.model.arch is not None or Path(cfg.resolve_source(name)).is_dir() or name in HUB_NAMES


def model_shape(cfg: Config):
    """The `costmodel.ModelShape` of the model a config trains: a known base model's without any download, else
    read from its Hugging Face config, with the vocabulary `build_model` gives a `model.arch`."""
    name = cfg.model.name_or_path
    if name in HUB_NAMES and not cfg.resolve_path(name).exists():
        return SHAPES[HUB_NAMES[name]]
    hf = load_hf_config(cfg)
    if cfg.model.arch is not None:
        hf.vocab_size = _arch_vocab_size(cfg, None)
    return ModelShape.from_hf_config(hf)


def _rope_theta(cfg: Config, current: dict) -> tuple[float, str]:
    """The RoPE base and why: the config's, else a pretrained model's own (and a `model.arch` that names one), else
    the paper's Table 1 base for `data.seq_len`."""
    if cfg.model.rope_theta is not None:
        return cfg.model.rope_theta, "model.rope_theta"
    own = current.get("rope_theta")
    arch = cfg.model.arch
    if own is not None and (arch is None or "rope_theta" in arch or "rope_parameters" in arch):
        return own, "the model's own"
    return default_rope_theta(cfg.data.seq_len), f"the paper's Table 1 base for data.seq_len = {cfg.data.seq_len}"


def _warn_dynamic(hf_config, cfg: Config, which: str) -> None:
    """`dynamic` NTK, `which` (in words), does nothing in training when max_position_embeddings covers the window."""
    if max_position_embeddings(hf_config, cfg) >= cfg.data.seq_len:
        log.warning(
            f"{which}: 'dynamic' NTK rescales only past max_position_embeddings, so training at data.seq_len uses "
            "plain RoPE at rope_theta; the paper's NTK-aware scaling is model.rope_scaling: {rope_type: ntk}"
        )


def check_rope_scaling(scaling: dict[str, Any] | None) -> None:
    """`model.rope_scaling`'s type and factor, refused in one line without the model's config: `prepare`, `train` and
    `show-config` check them first, for a hub model not downloaded too."""
    if scaling is None:
        return
    rope_type = scaling.get("rope_type") or scaling.get("type")
    known = ["default", NTK_ROPE_TYPE, *ROPE_INIT_FUNCTIONS]
    if rope_type is None:
        raise UserError(
            f"model.rope_scaling = {scaling} names no rope_type; give one of {', '.join(known)} (a rope_scaling "
            f"mapping replaces its base config's whole, rope_type included)"
        )
    if rope_type not in known:
        raise UserError(f"model.rope_scaling.rope_type = {rope_type!r} is unknown; expected one of {', '.join(known)}")
    factor = scaling.get("factor")
    if "factor" in scaling and (isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor >= 1):
        # transformers only logs it: a factor below 1 compresses the positions instead of extending the context
        raise UserError(
            f"model.rope_scaling.factor = {factor!r}: rope_type {rope_type!r} needs a factor >= 1 (new / original "
            f"context length)"
        )


def rope_parameters(hf_config, cfg: Config) -> dict[str, Any]:
    """The `rope_parameters` dict (transformers 5) for this config: theta (`_rope_theta`), and the scaling passed
    through, except lctrain's `ntk`, which becomes plain RoPE at the NTK-aware base. Without `model.rope_scaling` the
    model's own scaling stays."""
    current = dict(getattr(hf_config, "rope_parameters", None) or {})
    theta, _ = _rope_theta(cfg, current)
    if cfg.model.rope_scaling is None:
        params = {**current, "rope_theta": theta}
        params.setdefault("rope_type", "default")
        if params["rope_type"] == "dynamic":
            _warn_dynamic(hf_config, cfg, "the model's own rope_type 'dynamic' scaling (kept)")
        return params
    check_rope_scaling(cfg.model.rope_scaling)
    scaling = dict(cfg.model.rope_scaling)
    rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None)
    if rope_type == NTK_ROPE_TYPE:
        return _ntk_parameters(hf_config, current, scaling, theta)
    if rope_type == "dynamic":
        _warn_dynamic(hf_config, cfg, "model.rope_scaling: 'dynamic'")
    params = {"rope_type": rope_type, **_rotary_layout(current), **scaling, "rope_theta": theta}
    if rope_type in _ROPE_TYPES_WITH_ORIGINAL_LENGTH and "original_max_position_embeddings" not in params:
        params["original_max_position_embeddings"] = _original_length(hf_config, cfg, rope_type)
    return params


def _original_length(hf_config, cfg: Config, rope_type: str) -> int:
    """The context length a scaling extends from: the model's own before we raise max_position_embeddings to the
    training length (Phi-3 keeps its pretraining length apart, and transformers gives that one priority). A
    `model.arch` has one only where it names it: its config class's default (Llama's 2048, Phi-3's 4096) is no
    model's, and a 256-token model would be scaled as if extended from 2048."""
    arch = cfg.model.arch
    if arch is None:
        return getattr(hf_config, "original_max_position_embeddings", None) or hf_config.max_position_embeddings
    for key in ("original_max_position_embeddings", "max_position_embeddings"):
        if arch.get(key) is not None:
            return arch[key]
    raise UserError(
        f"model.rope_scaling: rope_type {rope_type!r} extends the model's context from its original length, and "
        f"model.arch names none; set model.rope_scaling.original_max_position_embeddings (or "
        f"max_position_embeddings in model.arch)"
    )


def max_position_embeddings(hf_config, cfg: Config) -> int:
    """The config's context length, else the model's own raised to `data.seq_len` (never lowered); a `model.arch`
    that names none gets `data.seq_len`."""
    if cfg.model.max_position_embeddings is not None:
        return cfg.model.max_position_embeddings
    arch = cfg.model.arch
    if arch is not None and "max_position_embeddings" not in arch:
        return cfg.data.seq_len
    return max(hf_config.max_position_embeddings, cfg.data.seq_len)


class ConfigChange(NamedTuple):
    """One value lctrain sets on the model's Hugging Face config: `key` (a `rope_parameters` entry as
    `rope_parameters.NAME`), the model's value (`old`, None when absent), the value trained with (`new`) and why."""

    key: str
    old: Any
    new: Any
    why: str

    def describe(self) -> str:
        return f"{self.key}: {self.old!r} -> {self.new!r} ({self.why})"


_ROPE_PREFIX = "rope_parameters."


def _dtype_name(value) -> str | None:
    return None if value is None else str(value).removeprefix("torch.")


def _longrope_scaling_note(hf_config, params: dict, max_pos: int) -> str:
    """What raising a `longrope` model's max_position_embeddings to `max_pos` does besides: without a `factor` of its
    own, transformers derives it from max_position_embeddings / original_max_position_embeddings, and from that the
    attention scaling that multiplies every rotated q and k (transformers' own formula, asked of it)."""
    if params.get("rope_type") != "longrope":
        return ""
    raised = copy.deepcopy(hf_config)
    raised.max_position_embeddings, raised.rope_parameters = max_pos, params
    longrope = ROPE_INIT_FUNCTIONS["longrope"]
    before, after = longrope(hf_config, None)[1], longrope(raised, None)[1]
    if math.isclose(before, after):
        return ""
    return f"; longrope's attention scaling follows it: {before:.4f} -> {after:.4f}, at every position"


def config_changes(hf_config, cfg: Config, *, vocab_size: int | None, attn_implementation: str) -> list[ConfigChange]:
    """Every change lctrain makes to the model's config `hf_config` (not modified) for training `cfg`: RoPE base and
    scaling, context length, sliding window, vocabulary (`model.arch`, `vocab_size`: the tokenizer's), dtype, KV
    cache and attention implementation. The one place that decides them; `build_model` applies them, the trainer
    prints and records them, `show-config` shows them."""
    changes = []
    current = dict(getattr(hf_config, "rope_parameters", None) or {})
    params = rope_parameters(hf_config, cfg)
    _, theta_why = _rope_theta(cfg, current)
    scaling = cfg.model.rope_scaling or {}
    scaling_type = scaling.get("rope_type") or scaling.get("type")
    for key in sorted(set(current) | set(params)):
        old, new = current.get(key), params.get(key)
        if old == new:
            continue
        if key == "rope_theta":
            why = theta_why
            if scaling_type == NTK_ROPE_TYPE:
                why = f"static NTK-aware x{scaling.get('factor')} of the base from {theta_why}"
        else:
            why = f"model.rope_scaling (rope_type {scaling_type})"
        changes.append(ConfigChange(_ROPE_PREFIX + key, old, new, why))
    original = getattr(hf_config, "original_max_position_embeddings", None)
    if original is not None and params.get("original_max_position_embeddings", original) != original:
        # transformers copies this top-level value over the RoPE one (`standardize_rope_params`)
        new = params["original_max_position_embeddings"]
        changes.append(ConfigChange("original_max_position_embeddings", original, new, "model.rope_scaling"))
    max_pos = max_position_embeddings(hf_config, cfg)
    if max_pos != hf_config.max_position_embeddings:
        if cfg.model.max_position_embeddings is not None:
            why = "model.max_position_embeddings"
        elif cfg.model.arch is not None and "max_position_embeddings" not in cfg.model.arch:
            why = "data.seq_len (model.arch names no context length)"
        else:
            why = f"raised to data.seq_len = {cfg.data.seq_len}"
        why += _longrope_scaling_note(hf_config, params, max_pos)
        changes.append(ConfigChange("max_position_embeddings", hf_config.max_position_embeddings, max_pos, why))
    if _window_removed(hf_config, cfg):
        # The lctrain engines compute full-window attention masks; long-context continual pretraining of Mistral-style
        # models trains without the sliding window (Mistral-7B-v0.2/0.3 ship without one).
        changes += _full_attention_changes(hf_config, cfg.data.seq_len, max_pos)
    if vocab_size is not None and cfg.model.arch is not None and vocab_size != hf_config.vocab_size:
        changes.append(ConfigChange("vocab_size", hf_config.vocab_size, vocab_size, "the tokenizer's vocabulary"))
    if _dtype_name(getattr(hf_config, "dtype", None)) != cfg.model.dtype:
        changes.append(
            ConfigChange("dtype", _dtype_name(getattr(hf_config, "dtype", None)), cfg.model.dtype, "model.dtype")
        )
    if getattr(hf_config, "use_cache", False):
        changes.append(ConfigChange("use_cache", True, False, "training keeps no KV cache"))
    old_impl = attn_implementation_of(hf_config)
    if old_impl != attn_implementation:
        why = f"attention.mode = {cfg.attention.mode}, attention.engine = {cfg.attention.engine}"
        changes.append(ConfigChange("attn_implementation", old_impl, attn_implementation, why))
    return changes


def _window_removed(hf_config, cfg: Config) -> bool:
    window = getattr(hf_config, "sliding_window", None)
    return window is not None and window < cfg.data.seq_len


def _full_attention_changes(hf_config, seq_len: int, max_pos: int) -> list[ConfigChange]:
    """Every layer to full attention, consistently: a config left with `use_sliding_window: true` or
    "sliding_attention" layers but no window is one transformers cannot run (the cache and masks of those layers need
    the window), so the exported model could not generate. The window's value goes where it is the switch (Mistral:
    no layer types; Qwen2: `use_sliding_window`). Where layer types alone decide (Gemma-2), those model classes build
    a sliding-window mask whatever their layers, so the value stays, widened to the model's context (`max_pos`): the
    releases before `layer_types` (transformers < 4.53, and the servers built on them) slide every other layer by it
    and would otherwise run the export with the window it trained without."""
    window = hf_config.sliding_window
    why = f"sliding_window {window} shorter than data.seq_len = {seq_len}"
    layer_types = getattr(hf_config, "layer_types", None) or []
    switch = getattr(hf_config, "use_sliding_window", None)
    changes = []
    if switch or "sliding_attention" not in layer_types:
        changes.append(ConfigChange("sliding_window", window, None, f"shorter than data.seq_len = {seq_len}"))
    else:  # the window is shorter than data.seq_len, and so than max_pos
        widened = f"shorter than data.seq_len = {seq_len}; no layer slides (layer_types), for releases before them"
        changes.append(ConfigChange("sliding_window", window, max_pos, widened))
    if switch:
        changes.append(ConfigChange("use_sliding_window", True, False, why))
    if "sliding_attention" in layer_types:
        full = ["full_attention" if t == "sliding_attention" else t for t in layer_types]
        changes.append(ConfigChange("layer_types", list(layer_types), full, why))
    return changes


def changes_text(changes: list[ConfigChange]) -> str:
    """What a run prints at start: every change to the model's config, one a line."""
    if not changes:
        return "model config: as given, no changes"
    return "model config changes:\n" + "\n".join(f"  {c.describe()}" for c in changes)


def write_model_changes(out: Path, changes: list[ConfigChange]) -> Path:
    """The changes as `[{key, from, to, why}]` in the file `out` (`RunDir.model_changes_file`)."""
    rows = [{"key": c.key, "from": c.old, "to": c.new, "why": c.why} for c in changes]
    out.write_text(json.dumps(rows, indent=2) + "\n")
    return out


def apply_changes(hf_config, changes: list[ConfigChange]) -> None:
    """Set `config_changes` on `hf_config`."""
    rope = dict(getattr(hf_config, "rope_parameters", None) or {})
    for change in changes:
        if change.key.startswith(_ROPE_PREFIX):
            name = change.key.removeprefix(_ROPE_PREFIX)
            if change.new is None:
                rope.pop(name, None)
            else:
                rope[name] = change.new
        elif change.key == "attn_implementation":
            set_attn_implementation(hf_config, change.new)
        else:
            setattr(hf_config, change.key, change.new)
    hf_config.rope_parameters = rope


def _check_rope(hf_config) -> None:
    if getattr(hf_config, "rope_parameters", None) is None:
        raise UserError(
            f"model type '{hf_config.model_type}' has no rotary position embedding; lctrain trains "
            f"RoPE models (Llama, Mistral, Qwen2, ...)"
        )
    nested = nested_rope_keys(hf_config)
    if nested:
        raise UserError(
            f"model type '{hf_config.model_type}' uses per-layer RoPE parameters ({', '.join(nested)}), "
            f"which lctrain does not set"
        )


def _check_attention_softcap(hf_config) -> None:
    """Gemma-2's attention soft-capping bounds every attention logit before the softmax; the lctrain engines' kernels
    (SDPA, FlexAttention, FlashAttention masks by segment) have no such step, so it would be dropped without a word."""
    cap = getattr(hf_config, "attn_logit_softcapping", None)
    if cap is not None:
        raise UserError(
            f"model attn_logit_softcapping = {cap}: the lctrain attention engines do not soft-cap attention logits; "
            f"to train without it (another model than the one given), set attn_logit_softcapping: null in "
            f"model.arch or in the model's config.json"
        )


def _configure(hf_config, cfg: Config, vocab_size: int | None, engine: Engine) -> list[ConfigChange]:
    """Apply `config_changes` to `hf_config` after checking the model can be trained with `engine`; returns the
    changes."""
    impl = engine.hf_name
    if sdpa_refused(hf_config, impl):
        raise _no_sdpa(cfg.attention.engine, engine, hf_config)
    _check_rope(hf_config)
    _check_attention_softcap(hf_config)
    logit_transform(hf_config)  # refuses a logit scale the loss cannot apply
    if _window_removed(hf_config, cfg):
        log.warning(
            "model sliding_window=%s < data.seq_len=%s: training without a sliding window",
            hf_config.sliding_window,
            cfg.data.seq_len,
        )
    changes = config_changes(hf_config, cfg, vocab_size=vocab_size, attn_implementation=impl)
    apply_changes(hf_config, changes)
    if cfg.model.arch is not None:
        _check_pad_token(hf_config, cfg, changes)
    hf_config.standardize_rope_params()
    try:
        hf_config.validate_rope()
    except (ValueError, KeyError, TypeError) as e:
        raise UserError(f"model.rope_scaling = {cfg.model.rope_scaling}: {e}") from None
    heads, kv_heads = getattr(hf_config, "num_attention_heads", None), getattr(hf_config, "num_key_value_heads", None)
    if heads and kv_heads and heads % kv_heads:  # transformers accepts it; the first attention call would fail
        raise UserError(f"model num_attention_heads = {heads} is not a multiple of num_key_value_heads = {kv_heads}")
    check_dropout(getattr(hf_config, "attention_dropout", 0.0))  # at build time, not at the first forward
    return changes


def _check_pad_token(hf_config, cfg: Config, changes: list[ConfigChange]) -> None:
    """A random init builds its embedding with `padding_idx = pad_token_id`, which torch asserts is in the vocabulary,
    mid-build; a model type's default can miss the vocabulary `model.arch` gets from the tokenizer (phi3's 32000 with
    a 32,000-token tokenizer). bos/eos ids are not checked: nothing is built from them, and lctrain trains and
    generates with the tokenizer's."""
    pad, vocab = getattr(hf_config, "pad_token_id", None), hf_config.vocab_size
    if pad is None or 0 <= pad < vocab:
        return
    arch = cfg.model.arch
    named = "" if "pad_token_id" in arch else f" (the '{arch['model_type']}' default)"
    if any(c.key == "vocab_size" for c in changes):
        source = f"data.tokenizer '{cfg.data.tokenizer}'"
    else:
        source = "model.arch.vocab_size" if "vocab_size" in arch else f"the '{arch['model_type']}' default"
    raise UserError(
        f"model.arch.pad_token_id = {pad}{named} is outside the model's vocabulary of {vocab} tokens ({source}); "
        f"set model.arch.pad_token_id to a token id below {vocab}, or null"
    )


def _check_anchor(cfg: Config, vocab: int) -> None:
    anchor = resolve_anchor(load_tokenizer(cfg.resolve_source(cfg.data.tokenizer)), cfg.data.anchor, cfg.data.tokenizer)
    if not 0 <= anchor.id < vocab:
        raise UserError(
            f"the anchor token id {anchor.id} of data.tokenizer '{cfg.data.tokenizer}' is outside the "
            f"model's vocabulary of {vocab}; use the tokenizer that belongs to the model"
        )


class BuiltModel(NamedTuple):
    """A model configured for training, the attention engine it runs (resolved once, here) and the changes made
    to its config (`config_changes`)."""

    model: torch.nn.Module
    engine: Engine
    changes: list[ConfigChange]


def _arch_vocab_size(cfg: Config, vocab_size: int | None) -> int | None:
    """The vocabulary a `model.arch` is built with: `model.arch.vocab_size` where it names one (e.g. the tokenizer's
    rounded up to a multiple of 64 for the matmuls), else the tokenizer's (`vocab_size`, the dataset's when the trainer
    gives it, else data.tokenizer's). Every command sizes it so: show-config, plan and estimate show what train builds.
    A named one smaller than the tokenizer's is refused: ids past it would have no embedding row."""
    if cfg.model.arch is None:
        return vocab_size
    tokens = vocab_size if vocab_size is not None else len(load_tokenizer(cfg.resolve_source(cfg.data.tokenizer)))
    named = cfg.model.arch.get("vocab_size")
    if named is None:
        return tokens
    if named < tokens:
        raise UserError(
            f"{cfg.origin('model.arch.vocab_size')}: model.arch.vocab_size = {named} is smaller than the vocabulary of "
            f"data.tokenizer '{cfg.data.tokenizer}' ({tokens} tokens), whose ids up to {tokens - 1} would have no "
            f"embedding row; set model.arch.vocab_size to {tokens} or more, or remove it (the tokenizer's is used)"
        )
    return named


def _local_copy(name: str, probe: str, prefix: str | None = None) -> str | None:
    """`name` when it is a local path (or starts with `prefix`), the directory of its hub-cache copy when the cache
    holds its `probe` file, else None: `show-config` resolves without going to the hub."""
    if Path(name).exists() or (prefix and name.startswith(prefix)):
        return name
    try:
        cached = try_to_load_from_cache(name, probe)
    except ValueError:  # not a repository id
        return None
    return str(Path(cached).parent) if isinstance(cached, str) else None


class _NotHere(UserError):
    """A value resolved on the machine that trains, not on this one: a hub model or tokenizer not in this cache, an
    engine this device cannot run."""


def used_values(cfg: Config, device: str) -> tuple[dict[str, Any], list[str]]:
    """What `prepare`, `train` and `eval` use where `cfg` leaves a value null or auto, by dotted key, each from the
    function they call: the prepared dataset's and the run's directories, the evaluated tasks, the parallel backend and
    attention engine of a run on `device` (this machine), and the model's and tokenizer's values
    (`model.rope_theta`, `model.rope_scaling`, `model.max_position_embeddings`, `model.tiled_mlp`, `data.anchor`).
    Also comment lines: the changes to the model's config, which values this machine decides, or why a value cannot
    be resolved here (a hub model not downloaded). A model or tokenizer that `prepare` and `train` would refuse (an
    architecture that cannot be built, a pad token outside the vocabulary, a missing anchor token, a tokenizer whose
    ids are not the model's) raises their UserError."""
    used: dict[str, Any] = {}
    notes: list[str] = []
    if cfg.model.checkpointing is None:
        used["model.checkpointing"] = cfg.model.checkpointing_mode
    else:
        notes.append(f"model.checkpointing: {cfg.model.checkpointing} (model.gradient_checkpointing is not read)")
    if cfg.data.output_dir is None:
        used["data.output_dir"] = str(data_dir(cfg))
    if cfg.train.run_dir is None:
        used["train.run_dir"] = str(RunDir.of(cfg).path)
    if cfg.eval.tasks is None:
        used["eval.tasks"], _ = select_task_set(None, list(cfg.eval.exclude))
    if cfg.parallel.backend == "auto":
        used["parallel.backend"] = pick_backend(cfg)
        notes.append(
            f"parallel.backend: auto is {used['parallel.backend']} on this machine (nccl with CUDA, else gloo)"
        )
    try:
        engine = resolve_engine(cfg.attention.engine, cfg.attention.mode, device, dtype=cfg.model.dtype)
    except UserError as e:
        engine, refused = None, e
        if device != "cuda":
            # a config for a GPU, read on a laptop: the model is still checked as train on a GPU checks it
            try:
                engine = resolve_engine(cfg.attention.engine, cfg.attention.mode, "cuda", dtype=cfg.model.dtype)
            except UserError:
                pass
            else:
                notes.append(f"attention.engine: {engine.name} does not run here ({e}); checked as on a GPU")
    if cfg.attention.engine == "auto":
        used["attention.engine"] = engine.name
        notes.append(
            f"attention.engine: auto is {engine.name} on this machine (device {device}, model.dtype "
            f"{cfg.model.dtype}, attention.mode {cfg.attention.mode})"
        )
    tokenizer = _local_copy(cfg.resolve_source(cfg.data.tokenizer), "tokenizer_config.json", BUILTIN_PREFIX)
    if tokenizer is None:
        notes.append(
            f"data.anchor = {cfg.data.anchor}: resolved when the tokenizer is loaded ('{cfg.data.tokenizer}' "
            f"is not downloaded here)"
        )
    else:
        loaded = load_tokenizer(tokenizer)
        anchor = resolve_anchor(loaded, cfg.data.anchor, cfg.data.tokenizer)
        used["data.anchor"] = anchor.token
        notes.append(f"data.anchor: {anchor.token} (id {anchor.id}; {anchor.why})")
    try:
        local = cfg
        if cfg.model.name_or_path is not None:
            path = _local_copy(cfg.resolve_source(cfg.model.name_or_path), "config.json")
            if path is None:
                raise _NotHere(f"'{cfg.model.name_or_path}' is not downloaded here")
            local = cfg.model_copy(update={"model": cfg.model.model_copy(update={"name_or_path": path})})
        hf_config = load_hf_config(local)
        if tokenizer is not None:  # prepare's and train's refusal of a tokenizer with other ids than the model's
            check_matches_model(local, loaded)
        shape = ModelShape.from_hf_config(hf_config)
        kv_replication(
            shape.heads,
            shape.kv_heads,
            cfg.parallel.sequence_parallel,
            cfg.origin("parallel.sequence_parallel", "model"),
        )
        if cfg.model.tiled_mlp == "auto":
            used["model.tiled_mlp"] = auto_mlp_shards(
                training_mlp_rows(cfg), ModelShape.from_hf_config(hf_config).hidden
            )
        if engine is None:
            raise _NotHere(f"on this machine: {refused}")
        # train's checks and changes, on a copy: the values below are read from the model's own config
        changes = _configure(copy.deepcopy(hf_config), cfg, _arch_vocab_size(cfg, None), engine)
    except _NotHere as e:
        notes.append(f"model settings left null: resolved when the model is loaded ({e})")
        if "model.tiled_mlp" not in used and cfg.model.tiled_mlp == "auto":
            notes.append("model.tiled_mlp: auto is resolved from the model's hidden_size when the model is loaded")
        return used, notes
    params = rope_parameters(hf_config, cfg)
    if cfg.model.rope_theta is None:
        used["model.rope_theta"] = params["rope_theta"]
    if cfg.model.rope_scaling is None:
        used["model.rope_scaling"] = {k: v for k, v in params.items() if k != "rope_theta"}
    if cfg.model.max_position_embeddings is None:
        used["model.max_position_embeddings"] = max_position_embeddings(hf_config, cfg)
    notes += changes_text(changes).splitlines()
    return used, notes


def _no_sdpa(asked: str, engine: Engine, hf_config) -> UserError:
    others = ", ".join(name for name in ENGINES if "sdpa" not in name)
    return UserError(
        f"attention.engine = {asked} ({engine.name}): transformers runs no implementation named *sdpa* for "
        f"model type '{hf_config.model_type}'; set attention.engine to one of {others} (reference on CPU)"
    )


def build_model(cfg: Config, *, vocab_size: int | None = None, device: str | torch.device = "cpu") -> BuiltModel:
    """Random init from `cfg.model.arch` (vocabulary `vocab_size`, normally the tokenizer's) or
    `from_pretrained(cfg.model.name_or_path)`, configured for long-context training with the engine resolved for
    `device` (returned with it)."""
    engine = resolve_engine(cfg.attention.engine, cfg.attention.mode, device, dtype=cfg.model.dtype)
    impl = engine.hf_name
    hf_config = load_hf_config(cfg)
    changes = _configure(hf_config, cfg, _arch_vocab_size(cfg, vocab_size), engine)
    dtype = _dtype(cfg.model.dtype)
    if cfg.model.arch is not None:
        # A seeded init that leaves the caller's RNG streams untouched: every rank builds the same weights. It runs
        # on the training device: a random Llama-2-7B takes minutes to initialise on a host's cores, milliseconds
        # on a GPU.
        device = torch.device(device)
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), device:
            torch.manual_seed(cfg.seed)
            model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype, attn_implementation=impl)
    else:
        try:
            model = AutoModelForCausalLM.from_pretrained(
                cfg.resolve_source(cfg.model.name_or_path), config=hf_config, dtype=dtype, attn_implementation=impl
            )
        except OSError as e:  # a directory with a config.json but no (complete) weights
            raise UserError(f"model.name_or_path = '{cfg.model.name_or_path}': cannot load the weights ({e})") from None
    # from_pretrained returns the model in eval mode, where transformers skips gradient checkpointing (its layers
    # checkpoint only when `self.training`): a pretrained model trained with checkpointing kept every layer's
    # activations (measured on SmolLM2-135M at 2K tokens: 5.9 GB of tensors with and without). Evaluation
    # callers set eval() themselves.
    model.train()
    if cfg.attention.mode == "anchor":
        _check_anchor(cfg, model.get_input_embeddings().num_embeddings)
    checkpointing = cfg.model.checkpointing_mode
    activation_checkpointing.enable(model, checkpointing)
    if checkpointing.startswith("selective") and not activation_checkpointing.keeps_attention(engine.name):
        log.warning(
            f"model.checkpointing={checkpointing} keeps nothing of the {engine.name} engine's attention "
            "(no kernel output its policy can see): the backward reruns it, as under full; the varlen and sdpa "
            "engines keep it"
        )
    if pin_longrope(model, cfg.data.seq_len):
        log.warning(
            "note: longrope takes its long factors in every forward (data.seq_len passes its "
            "original_max_position_embeddings), as one process computing a whole window picks them, also on "
            "sequence-parallel slices and in intra_doc_reset windows, whose largest position would pick the short ones"
        )
    if cfg.model.rope_fp32:
        rotary_in_fp32(model)
    if cfg.model.tiled_mlp:
        tile_mlps(model, cfg.model.tiled_mlp)
    fused.apply(model, cfg.model.fused_kernels, device)
    # Under ZeRO-3 (`HfDeepSpeedConfig`) the weights are already partitioned onto the device: leave them there.
    if any(p.device != torch.device(device) for p in model.parameters()):
        model = model.to(device)
    return BuiltModel(model, engine, changes)


def rotary_in_fp32(model) -> int:
    """Make every rotary-embedding module of `model` return fp32 cos/sin, so `q*cos + rotate_half(q)*sin` runs in
    fp32 (the paper's diagnosis: bf16 RoPE breaks relative positions); the lctrain engines cast q/k back to the value
    dtype after the rotation. Returns the number of rotary modules."""
    hooked = compat_rotary_in_fp32(model)
    if not hooked:
        raise UserError(f"model.rope_fp32: no rotary-embedding module found in {type(model).__name__}")
    return hooked


# The parts of a Llama-style gated MLP, `down_proj(act_fn(gate_proj(x)) * up_proj(x))`: position-wise, so computing
# it on slices of the sequence gives the same rows.
_GATED_MLP_PARTS = ("gate_proj", "up_proj", "down_proj", "act_fn")


def training_mlp_rows(cfg: Config, layout: ParallelLayout | None = None) -> int:
    """The rows every rank's MLP sees in a training forward on `layout` (default: `cfg`'s): `train.micro_batch`
    windows, each sharded over the sequence-parallel group (`ParallelLayout` makes data.seq_len divisible)."""
    return cfg.train.micro_batch * cfg.data.seq_len // (layout or layout_of(cfg)).sp


def auto_mlp_shards(tokens: int, hidden: int) -> int:
    """`model.tiled_mlp: auto`: ceil(tokens / hidden_size) shards, DeepSpeed's own choice in its TiledMLP example, so
    each shard's [tokens / shards, intermediate_size] intermediate is at most hidden x intermediate."""
    return max(1, math.ceil(tokens / hidden))


def tile_mlps(model, shards: int | str) -> int:
    """Run every decoder layer's MLP through DeepSpeed's `TiledMLP` (deepspeed.runtime.sequence_parallel.ulysses_sp):
    the forward runs `shards` slices of the sequence without keeping the [tokens, intermediate_size] activations,
    the backward recomputes slice by slice. The same function, so the same losses and gradients up to fp32 rounding,
    for one more MLP forward per layer in the backward. Each layer's `mlp` instance gets its own forward; the
    transformers class is untouched. `shards` is a count, or "auto" (`auto_mlp_shards` of the MLP's rows). Under ZeRO-3
    every slice's forward gathers the weights, a collective, so all ranks must run as many slices: they do, since every
    rank's MLP sees as many rows (`training_mlp_rows`), so the automatic count needs no per-call all-reduce.
    Returns the number of MLPs wrapped."""
    layers = getattr(model.get_decoder(), "layers", None)
    mlps = [getattr(layer, "mlp", None) for layer in layers or ()]
    if not mlps or any(mlp is None or not all(hasattr(mlp, part) for part in _GATED_MLP_PARTS) for mlp in mlps):
        raise UserError(
            f"model.tiled_mlp: {type(model).__name__} has no Llama-style gated MLP "
            f"(gate_proj, up_proj, down_proj, act_fn) in every decoder layer; set model.tiled_mlp=0"
        )
    for mlp in mlps:
        untiled = type(mlp).forward
        params = list(mlp.parameters())

        def tiled_forward(x, mlp=mlp, untiled=untiled, params=params):
            rows, hidden = x.numel() // x.shape[-1], x.shape[-1]
            return tiled_mlp_apply(
                untiled, mlp, x, auto_mlp_shards(rows, hidden) if shards == "auto" else shards, params
            )

        mlp.forward = tiled_forward
    return len(mlps)
