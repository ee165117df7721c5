"""PyTorch's underscored API that lctrain uses (written against PyTorch 2.11 to 2.13).

The CUDA caching allocator's history is what pytorch.org/memory_viz reads; PyTorch documents it ("Understanding
CUDA Memory Usage") under these underscored names only.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.utils import _python_dispatch

# The base class of a mode that sees every ATen op as it dispatches, below autograd and checkpointing (the tests count
# the kernels a checkpointed layer reruns through one); no public module of PyTorch 2.11-2.13 exports it.
TorchDispatchMode = _python_dispatch.TorchDispatchMode

# Allocation and free events kept: enough for a few 64K-token training steps of a 32-layer model.
MEMORY_HISTORY_ENTRIES = 1_000_000


def record_memory_history() -> None:
    """Start recording every CUDA allocation and free, with the Python and C++ stack that made it."""
    torch.cuda.memory._record_memory_history(max_entries=MEMORY_HISTORY_ENTRIES)


def dump_memory_history(path: Path) -> None:
    torch.cuda.memory._dump_snapshot(str(path))


def stop_memory_history() -> None:
    torch.cuda.memory._record_memory_history(enabled=None)
