"""An evaluation export's README.md: what was trained (the run's settings), the RoPE and dtype the export holds,
what lctrain changed in the base model's config (a sliding window removed among them), and how to prompt it as
lctrain's evaluation does: the anchor first, and its id among the stop tokens, since each training document was
followed by the next one's anchor. Another researcher loading the export with plain transformers reads this, not
lctrain's code."""

from __future__ import annotations

from lctrain import __version__
from lctrain.compat.transformers import attn_implementation_of
from lctrain.config import Config
from lctrain.errors import UserError
from lctrain.model import config_changes, load_hf_config
from lctrain.tokenizer import Anchor, special_affixes

_MODE_MEANS = {
    "full": "each token attended to every earlier token of its window",
    "intra_doc": "each token attended to the earlier tokens of its own document",
    "intra_doc_reset": "each token attended to the earlier tokens of its own document, positions restarting at 0",
    "anchor": "AnchorAttention: each token attended to the earlier tokens of its own document and to the window's "
    "first token, the shared anchor at position 0",
}


def model_card(cfg: Config, hf_config, tokenizer, anchor: Anchor, step: int, dtype: str) -> str:
    """The export's README.md: what was trained (from the run's config `cfg`), the RoPE and the
    dtype the export holds (`hf_config`, `dtype`), and how to prompt it as lctrain's evaluation does: the anchor
    first (`TextEncoder.prompted`: its id, then the text's ids without special tokens, special-token text split),
    and its id among the stop tokens, since each training document was followed by the next one's anchor."""
    rope = dict(getattr(hf_config, "rope_parameters", None) or {})
    eos = tokenizer.eos_token_id
    stops = [i for i in dict.fromkeys([eos, anchor.id]) if i is not None]
    stop_arg = str(stops[0]) if len(stops) == 1 else str(stops)
    a = f"`{anchor.token}` (id {anchor.id})"
    title = f"{cfg.name}, step {step}"
    rows = []
    if cfg.model.name_or_path:
        rows.append(f"base model: `{cfg.model.name_or_path}`")
    else:
        arch = cfg.model.arch or {}
        layers, hidden = getattr(hf_config, "num_hidden_layers", "?"), getattr(hf_config, "hidden_size", "?")
        rows.append(
            f"base model: none, random init from model.arch ({arch.get('model_type')}, {layers} layers, "
            f"hidden size {hidden})"
        )
    rows.append(f"attention in training: `{cfg.attention.mode}` ({_MODE_MEANS.get(cfg.attention.mode, '')})")
    fp32 = " (q and k rotated in fp32, model.rope_fp32; transformers rotates them in the model's dtype)"
    rows.append(f"RoPE as trained: {_rope_text(rope, cfg)}{fp32 if cfg.model.rope_fp32 else ''}")
    long_factors = _long_factors_text(rope, hf_config, cfg)
    if long_factors:
        rows.append(long_factors)
    batch, seq = cfg.train.global_batch, cfg.data.seq_len
    rows.append(
        f"training length: {seq:,} tokens (data.seq_len); max_position_embeddings "
        f"{getattr(hf_config, 'max_position_embeddings', '?')}"
    )
    rows.append(f"step: {step} of {cfg.train.steps} (train.steps)")
    steps = f"{step} step{'s' if step != 1 else ''}"
    rows.append(f"tokens seen: {cfg.tokens_read(step):,} ({steps} x {batch} windows x {seq:,} tokens)")
    master = "; the fp32 master weights of mixed precision are not exported" if dtype in ("bfloat16", "float16") else ""
    rows.append(f"weights: {dtype}, the model's training dtype (model.dtype){master}")
    rows.append(f"anchor: {a}")
    if cfg.data.domain_tags:
        rows.append(
            "domain tags (data.domain_tags, the paper's AnchorAttention + Tag): each document's anchor was followed by "
            "its domain's name as text, the tag, whose tokens were never trained as targets"
        )
    rows.append(f"exported by lctrain {__version__}")
    mode = cfg.attention.mode
    why = {
        "anchor": " In `anchor` mode the window's first token, this anchor at position 0, was visible to every "
        "document of the window (AnchorAttention's shared anchor), with positions continuing through the window.",
        "intra_doc_reset": " Positions restarted at 0 with it for every document.",
    }.get(mode, "")
    if cfg.data.domain_tags:
        why += (
            " Every document's anchor was followed by its domain tag (above); lctrain's evaluation puts none in its "
            "prompts, so every score it gives is of prompts without one."
        )
    own = special_affixes(tokenizer) == ([anchor.id], [])
    tokenizer_note = (
        f"This tokenizer puts `{anchor.token}` before a text itself, so `tok(text).input_ids` starts the same way."
        if own
        else f"`tok(text)` does not put `{anchor.token}` first: prepend its id yourself."
    )
    lines = [
        f"# {title}",
        "",
        "A causal language model after long-context continual pretraining with lctrain (AnchorAttention, "
        "arXiv 2411.13476). Files: Hugging Face `save_pretrained` weights and tokenizer, `anchor.json` (the anchor), "
        "`export.json` (the step and each file's checksum).",
        "",
        *[f"- {row}" for row in rows],
        "",
        *_changes_section(cfg, hf_config),
        "## Start every prompt with the anchor",
        "",
        f"Every training document, and so every training window, started with {a}.{why} lctrain's own evaluation "
        "starts every prompt "
        "with it: the anchor's id, then the text's ids without special tokens (text that spells a special token is "
        "encoded as text, as in the training data). A prompt without it is not what the model was trained on. "
        f"{tokenizer_note}",
        "",
        "```python",
        "import torch",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "",
        'tok = AutoTokenizer.from_pretrained("path/to/this/directory")',
        'model = AutoModelForCausalLM.from_pretrained("path/to/this/directory")',
        f"ids = [{anchor.id}] + tok(text, add_special_tokens=False, split_special_tokens=True).input_ids",
        f"out = model.generate(torch.tensor([ids]), max_new_tokens=100, eos_token_id={stop_arg})",
        "print(tok.decode(out[0, len(ids):], skip_special_tokens=True))",
        "```",
        "",
        "## Stopping at a document's end",
        "",
        _stop_text(anchor, eos, tokenizer, stop_arg),
        "",
    ]
    return "\n".join(lines)


# the keys of `config_changes` that remove a sliding window (lctrain.model._full_attention_changes)
_WINDOW_KEYS = ("sliding_window", "use_sliding_window", "layer_types")
# the changes an export does not hold: its config.json is saved with the KV cache on (checkpoint._with_kv_cache) and
# no attention implementation
_NOT_EXPORTED = ("use_cache", "attn_implementation")


def _changes_section(cfg: Config, hf_config) -> list[str]:
    """The card's lines on what lctrain changed in the base model's config (`lctrain.model.config_changes`, the list
    show-config, the train banner and model_changes.json show), as this export's config.json holds them."""
    try:
        base = load_hf_config(cfg)
        changes = config_changes(
            base,
            cfg,
            vocab_size=getattr(hf_config, "vocab_size", None),
            attn_implementation=attn_implementation_of(base),
        )
    except UserError:  # the base model's config unreadable now (it was read when the run started)
        return [
            "## Changes to the base model's config",
            "",
            "The base model's config could not be read at export: the run's `model_changes.json` lists lctrain's "
            "changes to it.",
            "",
        ]
    changes = [c for c in changes if c.key not in _NOT_EXPORTED]
    if not changes:
        return ["## Changes to the base model's config", "", "None: config.json is the base model's.", ""]
    origin = "base model's" if cfg.model.name_or_path else "model.arch"
    lines = [
        "## Changes to the base model's config",
        "",
        f"lctrain trained with these changes to the {origin} config, and this export's config.json holds them "
        "(the run's `model_changes.json` records them too):",
        "",
        *[f"- {c.describe()}" for c in changes],
        "",
    ]
    if any(c.key in _WINDOW_KEYS for c in changes):
        lines[-1:-1] = [
            "",
            "The base model's sliding window was removed: every layer attended to all earlier tokens of its "
            f"{cfg.data.seq_len:,}-token training window, and this export's layers attend to the whole prompt too.",
        ]
    return lines


def _rope_text(rope: dict, cfg: Config) -> str:
    theta = rope.get("rope_theta")
    kind = rope.get("rope_type", "default")
    scaling = {k: v for k, v in rope.items() if k not in ("rope_theta", "rope_type")}
    parts = ", ".join(f"{k} {v}" for k, v in scaling.items())
    base = f"{theta:,.0f}" if isinstance(theta, (int, float)) and theta == int(theta) else str(theta)
    if kind == "default":
        text = f"base (rope_theta) {base}, no scaling" + (f" ({parts})" if parts else "")
    else:
        text = f"base (rope_theta) {base}, scaling {kind} ({parts})"
    asked = cfg.model.rope_scaling or {}
    if (asked.get("rope_type") or asked.get("type")) == "ntk":
        text += f"; static NTK-aware x{asked.get('factor')} (model.rope_scaling), saved as plain RoPE at that base"
    return (
        text
        + "; config.json holds it as `rope_parameters` (transformers 5) and as the top-level `rope_theta`"
        + (" and `rope_scaling`" if kind != "default" else "")
        + " transformers 4.x reads"
    )


def _long_factors_text(rope: dict, hf_config, cfg: Config) -> str | None:
    """What a `longrope` export does to short prompts: training took the long factors at every position (its windows
    pass the original length: `compat.transformers.pin_longrope`), transformers takes the short ones for a sequence
    within `original_max_position_embeddings`, so such a prompt runs on rotations the run never trained on."""
    original = rope.get("original_max_position_embeddings") or getattr(
        hf_config, "original_max_position_embeddings", None
    )
    if rope.get("rope_type") != "longrope" or not original or cfg.data.seq_len <= original:
        return None
    return (
        f"longrope: trained with the long factors at every position ({cfg.data.seq_len:,}-token windows, past "
        f"original_max_position_embeddings {original:,}); transformers takes the short factors for a sequence of at "
        f"most {original:,} tokens, so a prompt that short runs on rotations this training did not use"
    )


def _stop_text(anchor: Anchor, eos: int | None, tokenizer, stop_arg: str) -> str:
    if eos is None or eos == anchor.id:
        return (
            f"Each training document was followed by the next one's anchor, `{anchor.token}`, which the model learned "
            f"to predict at a document's end: `eos_token_id={stop_arg}` stops generation there."
        )
    return (
        f"Each training document was followed by the next one's anchor, `{anchor.token}`, which the model learned "
        f"to predict at a document's end; no EOS (`{tokenizer.eos_token}`) was added. `eos_token_id={stop_arg}` (EOS "
        f"and anchor) stops generation there; with the EOS alone it may run on into a new document."
    )
