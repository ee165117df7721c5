"""Attention modes (docs/design.md §3), the engines that compute them, and their registration with Hugging Face.

Importing this package registers `lctrain_reference`, `lctrain_sdpa`, `lctrain_flex` and `lctrain_varlen` as
Hugging Face attention implementations. Typical use with any HF causal LM:

    model.set_attn_implementation(ENGINES["sdpa"].hf_name)
    loss = model(**make_batch(input_ids, seg_lens, "anchor").model_kwargs(labels=True), use_cache=False).loss
"""

from lctrain.attention.batch import Batch, make_batch
from lctrain.attention.modes import IGNORE_INDEX, MODES
from lctrain.attention.registry import ENGINES, Engine, register, register_all, resolve_engine
from lctrain.attention.segments import SEGMENTS_KEY, Segments

register_all()

__all__ = [
    "ENGINES",
    "IGNORE_INDEX",
    "MODES",
    "SEGMENTS_KEY",
    "Batch",
    "Engine",
    "Segments",
    "make_batch",
    "register",
    "resolve_engine",
]
