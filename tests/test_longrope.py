"""`longrope` (Phi-3's scaling) rotates a window the same on every sequence-parallel slice: transformers picks its long
or short factors at each forward by the largest position it is given, so a slice ending within the model's original
context got the short ones while one process computing the whole window, and the other slices, got the long ones
(`compat.transformers.pin_longrope`). Checked against transformers' own rotary module on the whole window."""

import torch

from lctrain.compat.transformers import pin_longrope
from lctrain.config import load_config
from lctrain.model import build_model

WINDOW, ORIGINAL = 256, 64
PHI3 = {
    "model_type": "phi3",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": WINDOW,
    "original_max_position_embeddings": ORIGINAL,
    "partial_rotary_factor": 0.5,
    "rope_scaling": {"rope_type": "longrope", "long_factor": [1.0, 4.0, 16.0, 64.0], "short_factor": [1.0] * 4},
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def built(seq_len: int):
    cfg = load_config(
        None,
        [f"data.seq_len={seq_len}", "model.dtype=float32", "model.rope_theta=null", "attention.engine=reference"],
    )
    cfg.model.arch = dict(PHI3)
    return build_model(cfg, vocab_size=128).model


def rotations(rotary, positions: range) -> torch.Tensor:
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), torch.tensor([list(positions)]))
    return torch.cat([cos, sin], dim=-1)


def test_every_slice_of_a_window_is_rotated_as_the_whole_window_is():
    model = built(WINDOW)
    hf = type(model.model.rotary_emb)(model.config)  # the same config's module as transformers builds it: unpinned
    whole = rotations(hf, range(WINDOW))
    assert torch.equal(rotations(model.model.rotary_emb, range(WINDOW)), whole)  # one process: unchanged
    for rank in range(WINDOW // ORIGINAL):  # sequence parallel over 4: slices of 64 positions
        part = range(rank * ORIGINAL, (rank + 1) * ORIGINAL)
        assert torch.equal(rotations(model.model.rotary_emb, part), whole[:, part.start : part.stop])
    # transformers itself rotates the first slice with the short factors
    assert not torch.allclose(rotations(hf, range(ORIGINAL)), whole[:, :ORIGINAL])


def test_windows_within_the_original_context_keep_transformers_choice():
    model = built(ORIGINAL)
    hf = type(model.model.rotary_emb)(model.config)
    assert pin_longrope(model, ORIGINAL) == 0
    for part in (range(ORIGINAL), range(ORIGINAL // 2)):
        assert torch.equal(rotations(model.model.rotary_emb, part), rotations(hf, part))


def test_raising_the_context_of_a_longrope_model_says_what_it_does_to_its_attention_scaling():
    """transformers derives longrope's scale s from max_position_embeddings / original and scales q and k by
    sqrt(1 + ln s / ln original) (Phi-3's rule): raising the context to the window changes it, and says so."""
    import math

    from transformers import AutoConfig

    from lctrain.model import config_changes

    hf_config = AutoConfig.for_model(**PHI3 | {"max_position_embeddings": 2 * ORIGINAL})
    cfg = load_config(None, [f"data.seq_len={WINDOW}", "model.rope_theta=null"])
    [change] = [
        c
        for c in config_changes(hf_config, cfg, vocab_size=None, attn_implementation="sdpa")
        if c.key == "max_position_embeddings"
    ]
    scaling = [math.sqrt(1 + math.log(s) / math.log(ORIGINAL)) for s in (2, WINDOW / ORIGINAL)]
    assert (change.old, change.new) == (2 * ORIGINAL, WINDOW)
    assert change.why.endswith(
        f"longrope's attention scaling follows it: {scaling[0]:.4f} -> {scaling[1]:.4f}, at every position"
    )


def test_the_model_card_of_a_longrope_export_says_short_prompts_run_on_other_factors():
    """Training took the long factors at every position; transformers, reading the export, takes the short ones for a
    sequence within the original context (as `test_every_slice...` shows of its module): the card says so, and says
    nothing of it for windows within the original context, where training kept transformers' own choice."""
    from transformers import AutoConfig

    from lctrain.tokenizer import load_tokenizer, resolve_anchor
    from lctrain.train.model_card import model_card

    tok = load_tokenizer("builtin:mistral-7b-v0.1")
    hf_config = AutoConfig.for_model(**PHI3)
    cards = {
        seq_len: model_card(load_config(None, [f"data.seq_len={seq_len}"]), hf_config, tok, resolve_anchor(tok), 2, "x")
        for seq_len in (WINDOW, ORIGINAL)
    }
    assert (
        f"longrope: trained with the long factors at every position ({WINDOW}-token windows, past "
        f"original_max_position_embeddings {ORIGINAL}); transformers takes the short factors for a sequence of at most "
        f"{ORIGINAL} tokens, so a prompt that short runs on rotations this training did not use"
    ) in cards[WINDOW]
    assert "short factors" not in cards[ORIGINAL]
