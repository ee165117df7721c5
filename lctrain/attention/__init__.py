"""Attention modes (DESIGN §3), the engines that compute them, and their registration with Hugging Face.

Importing this package registers `lctrain_reference`, `lctrain_sdpa`, `lctrain_flex` and `lctrain_varlen` as
Hugging Face attention implementations. Typical use with any HF causal LM:

    model.set_attn_implementation("lctrain_sdpa")
    loss = model(**make_batch(input_ids, seg_lens, "anchor"), use_cache=False).loss
"""

from lctrain.attention.batch import PER_TOKEN_KEYS, make_batch
from lctrain.attention.modes import MODES
from lctrain.attention.registry import ENGINES, engine_fn, hf_name, register_all, resolve_engine
from lctrain.attention.segments import SEGMENTS_KEY, Segments

register_all()

__all__ = [
    "ENGINES",
    "MODES",
    "PER_TOKEN_KEYS",
    "SEGMENTS_KEY",
    "Segments",
    "engine_fn",
    "hf_name",
    "make_batch",
    "resolve_engine",
]
