"""The cost model against loops over the dense mask: visible pairs, and FLOPs counted multiply-add by multiply-add."""

import pytest
import torch

from lctrain.attention import make_batch
from lctrain.attention.modes import MODES, dense_mask
from lctrain.costmodel import (
    ModelShape,
    attention_flops,
    dense_flops,
    full_square_pairs,
    step_flops,
    visible_pairs,
    window_pairs,
)

SEG_LENS = [5, 3, 4, 4]
SEG_DOC = [0, 1, 0, 2]  # document 0 in two interleaved chunks


def loop_forward_flops(mask: torch.Tensor, width: int) -> int:
    """Per visible (q, k) pair: a width-long dot product for the score and a width-long axpy for PV, 2 FLOPs per
    multiply-add each."""
    flops = 0
    for q in range(mask.shape[0]):
        for k in range(mask.shape[1]):
            if mask[q, k]:
                flops += 2 * width + 2 * width
    return flops


@pytest.mark.parametrize("mode", MODES)
def test_pairs_and_attention_flops_follow_the_dense_mask(mode):
    batch = make_batch(torch.zeros(1, 16, dtype=torch.long), [SEG_LENS], mode, seg_doc=[SEG_DOC])
    layout = batch.segments.layout
    mask = dense_mask(layout, mode)[0]
    assert visible_pairs(SEG_LENS, SEG_DOC, mode, 16) == int(mask.sum())
    assert window_pairs(16, SEG_LENS, SEG_DOC)[mode] == int(mask.sum())
    width = 6
    forward = loop_forward_flops(mask, width)
    assert attention_flops(int(mask.sum()), width, passes=1) == forward
    assert attention_flops(int(mask.sum()), width) == 3 * forward  # backward = 2 forwards (MFU convention)


def test_dense_and_step_flops():
    params, tokens = 1000, 7
    assert dense_flops(params, tokens) == 6 * params * tokens
    assert step_flops(params, 2, 8, tokens, 20) == 6 * params * tokens + 2 * 3 * 4 * 8 * 20


def test_model_shape_counts_the_weights_of_a_real_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    hf = LlamaConfig(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=100,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(hf)
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert ModelShape.from_hf_config(hf).linear_params() == linear


def test_unknown_mode():
    with pytest.raises(ValueError, match="unknown mode"):
        visible_pairs([4], [0], "sliding", 4)


def test_full_square_pairs_count_every_query_key_pair():
    for L in (1, 5, 16):
        square = sum(1 for q in range(L) for k in range(L))
        assert full_square_pairs(L) == square
        assert full_square_pairs(L) == 2 * visible_pairs([L], [0], "full", L) - L  # the causal half and the diagonal


def test_a_config_without_a_llama_shape_is_refused_in_one_line():
    """Falcon's config has no intermediate_size (its MLP is ffn_hidden_size wide, ungated): init, plan and estimate
    ended in an AttributeError traceback."""
    from transformers import FalconConfig

    from lctrain.errors import UserError

    with pytest.raises(UserError, match=r"^model type 'falcon' has no intermediate_size in its config: lctrain plans"):
        ModelShape.from_hf_config(FalconConfig())
