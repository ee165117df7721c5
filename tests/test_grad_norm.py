"""The gradient norm train reports where it measures it itself (fp32 without ZeRO), against float64 numpy."""

import numpy as np
import pytest
import torch

from lctrain.train.trainer import _grad_norm


def test_grad_norm_of_an_embedding_sized_gradient_matches_float64():
    """A 32K x 128 embedding gradient: torch's fp32 norm of it on a CPU is off by ~1e-4 relative (its one long
    vectorised sum), enough to show in the logged grad_norm's fourth digit."""
    torch.manual_seed(0)
    module = torch.nn.ModuleDict({"emb": torch.nn.Embedding(32000, 128), "head": torch.nn.Linear(128, 7)})
    for p in module.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    module["head"].bias.grad = None  # a parameter without a gradient (frozen, or unused this step) is left out
    grads = [p.grad.double().numpy().ravel() for p in module.parameters() if p.grad is not None]
    expected = np.sqrt(sum(np.sum(g * g) for g in grads))
    assert _grad_norm(module) == pytest.approx(expected, rel=1e-12)
