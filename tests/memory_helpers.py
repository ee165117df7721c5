"""Shared by the memory tests: what autograd keeps of one decoder layer, measured."""

import numpy as np
import torch

from lctrain.attention import make_batch


def saved_bytes_of_one_layer(layer, hf, dtype, tokens: int, vocab: int) -> int:
    """Bytes of every distinct storage autograd saves in one forward of `layer` over a 2-document anchor window of
    `tokens` tokens, the weights and the layer's input (the caller's tensor) excluded."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    batch = make_batch(
        torch.randint(0, vocab, (1, tokens)),
        [np.array([400, tokens - 400])],
        "anchor",
        seg_doc=[np.arange(2)],
        tag_lens=[np.zeros(2, dtype=np.int64)],
    )
    x = torch.randn(1, tokens, hf.hidden_size, dtype=dtype, requires_grad=True)
    with torch.no_grad():
        cos_sin = LlamaRotaryEmbedding(hf)(x, batch.position_ids)
    weights = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    saved = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in weights and ptr != x.untyped_storage().data_ptr() and t.numel() > 2 * tokens:
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x, position_embeddings=cos_sin, position_ids=batch.position_ids, **batch.attention_kwargs())
    return sum(saved.values())
