"""Shared by the memory tests: what autograd keeps of one decoder layer, measured."""

import weakref

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

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


class PeakBytes(TorchDispatchMode):
    """The most bytes of tensor storage that the operations run under it hold alive at once (the tensors made before
    it do not count), on any device: each new storage counts until it is freed."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self._alive: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key, size = storage.data_ptr(), storage.nbytes()
            if key in self._alive or size == 0:
                continue
            self._alive.add(key)
            self.live += size
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._freed, key, size)
        return out

    def _freed(self, key: int, size: int) -> None:
        self.live -= size
        self._alive.discard(key)
