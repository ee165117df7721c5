"""Whether lctrain's engines can train a model class, found before any weights are loaded or data prepared: the
class is built on the meta device (no memory, no weights) with a probe attention that records the keyword arguments
it gets, and run once on a few token ids. Two kinds of class cannot be trained: one whose decoder layers do not pass
the forward's `lctrain_segments` on to attention (the engines refuse it at the first step), and one that computes
attention with classes of its own instead of the attention functions transformers lets a library register (Falcon):
the engines are never called, so nothing would mask a document mode."""

from __future__ import annotations

import copy

import torch
from transformers import AttentionInterface, AutoModelForCausalLM

from lctrain.attention.engines.common import NO_SEGMENTS
from lctrain.attention.segments import SEGMENTS_KEY

PROBE = "lctrain_probe"
_PROBE_TOKENS = 8
OWN_ATTENTION = (
    "this model class computes attention with classes of its own, not through the attention functions transformers "
    "lets a library register (as lctrain's engines are), so no engine could carry the documents' boundaries to it "
    "and lctrain cannot train it (Llama, Mistral, Qwen2/3, Phi-3, Gemma-2 and most others can be)"
)


def engines_refused(hf_config) -> str | None:
    """Why lctrain's engines cannot train the causal LM of `hf_config`, in words; None when they can, and when the
    class cannot be built or run on the meta device (remote code, a class that reads its weights' values while
    building): training's first step is then what tells."""
    calls: list[bool] = []
    without: list[str] = []

    def probe(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        calls.append(True)
        if SEGMENTS_KEY not in kwargs:
            without.append(type(module).__name__)
        return torch.zeros_like(query).transpose(1, 2).contiguous(), None

    AttentionInterface.register(PROBE, probe)
    try:
        with torch.device("meta"):
            # a copy: building sets the attention implementation on the config it is given
            model = AutoModelForCausalLM.from_config(copy.deepcopy(hf_config), attn_implementation=PROBE)
            model(input_ids=torch.zeros(1, _PROBE_TOKENS, dtype=torch.long), use_cache=False, **{SEGMENTS_KEY: 0})
    except KeyError as e:  # a class that looks its attention class up by the implementation's name (Falcon)
        return OWN_ATTENTION if e.args == (PROBE,) else None
    except Exception:  # whatever else the class cannot do on the meta device, the real first step is the check
        return None
    if not calls:
        return OWN_ATTENTION
    if without:
        return f"its attention ({without[0]}) gets no document boundaries: {NO_SEGMENTS}"
    return None
