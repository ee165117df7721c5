import os

import pytest
import torch

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models on a shared 2-core machine: one thread per process avoids OpenMP oversubscription (10x slower),
    and every process of a comparison computes with the same thread count."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
