"""The segment metadata that travels with a batch into every attention call.

One `Segments` object is made per batch by `make_batch` and passed to the model as the forward kwarg
`lctrain_segments`; Hugging Face hands it unchanged to every layer's attention function. It holds the layout on the
CPU and caches what each engine derives from it (index plans, block masks, cu_seqlens) per engine and device, so that
work is done once per batch, not once per layer, and gradient-checkpoint recomputation reuses it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lctrain.attention.modes import Layout

SEGMENTS_KEY = "lctrain_segments"


class Segments:
    def __init__(self, layout: Layout, mode: str):
        self.layout = layout
        self.mode = mode
        self._cache: dict[tuple, Any] = {}

    @property
    def batch(self) -> int:
        return self.layout.batch

    @property
    def length(self) -> int:
        return self.layout.length

    @property
    def multi_segment_docs(self) -> bool:
        return self.layout.multi_segment_docs

    def cached(self, key: tuple, build: Callable[[], Any]) -> Any:
        if key not in self._cache:
            self._cache[key] = build()
        return self._cache[key]

    def to(self, *args, **kwargs) -> Segments:
        """Device-agnostic: engines move what they need, once per device, so moving the batch leaves this as is."""
        return self

    def __repr__(self) -> str:
        return (
            f"Segments(mode={self.mode!r}, batch={self.batch}, length={self.length}, "
            f"segments={self.layout.seg_len.numel()}, documents={self.layout.num_docs})"
        )
