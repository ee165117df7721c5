"""The attention modes inside real Hugging Face models (tiny Llama, Mistral, Qwen2), checked against the stock model.

The independent reference is the stock model (eager attention) run on each document alone: a document must not see
other documents, and in `anchor` mode it sees exactly one anchor at position 0 (the paper's Figure 2, right).
"""

from dataclasses import replace

import pytest
import torch

from lctrain.attention import make_batch
from lctrain.compat.transformers import attn_implementation_of
from lctrain.config import load_config
from lctrain.model import build_model

ARCH = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    initializer_range=0.2,
)
VOCAB = 1000
# Qwen has no BOS: its anchor is EOS.
ANCHOR = {"llama": 1, "mistral": 1, "qwen2": 2}


def tiny(model_type, mode, engine="sdpa", seq_len=64, **model_overrides):
    cfg = load_config(
        None, [f"data.seq_len={seq_len}", "model.dtype=float32", f"attention.mode={mode}", f"attention.engine={engine}"]
    )
    extra = {"bos_token_id": None, "eos_token_id": 2} if model_type == "qwen2" else {}
    cfg.model.arch = {"model_type": model_type, **ARCH, **extra}
    for key, value in model_overrides.items():
        setattr(cfg.model, key, value)
    return build_model(cfg, vocab_size=VOCAB).model.eval()


def window(seg_lens, anchor, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (1, sum(seg_lens)), generator=gen)
    starts = torch.cumsum(torch.tensor([0] + seg_lens[:-1]), 0)
    ids[0, starts] = anchor
    return ids, starts.tolist()


@torch.no_grad()
def stock(model, ids, positions):
    """The unmodified model (eager attention) on one sequence; an explicit all-ones mask keeps Hugging Face from
    reading the positions as packed sequences."""
    impl = attn_implementation_of(model.config)
    model.set_attn_implementation("eager")
    try:
        return model(
            input_ids=ids[None],
            position_ids=torch.as_tensor(positions)[None],
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        ).logits[0]
    finally:
        model.set_attn_implementation(impl)


@torch.no_grad()
def packed(model, batch):
    return model(**batch.model_kwargs(), use_cache=False).logits[0]


@pytest.mark.parametrize("engine", ["sdpa", "reference"])
@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2"])
def test_anchor_mode_is_one_shared_anchor_per_document(model_type, engine):
    model = tiny(model_type, "anchor", engine)
    seg_lens, tags = [8, 13, 6], [0, 2, 1]
    ids, starts = window(seg_lens, ANCHOR[model_type])
    got = packed(model, make_batch(ids, [seg_lens], "anchor", tag_lens=[tags], anchor_id=ANCHOR[model_type]))
    for s, n in zip(starts, seg_lens):
        # [A] d_i alone: the anchor at position 0, the document at its window positions
        want = stock(model, ids[0, s : s + n], [0] + list(range(s + 1, s + n)))
        torch.testing.assert_close(got[s : s + n], want, atol=1e-4, rtol=1e-4)


def test_anchor_mode_interleaved_chunk_sees_its_document_and_one_anchor():
    model = tiny("llama", "anchor")
    seg_lens, docs = [6, 5, 7], [0, 1, 0]  # the third segment continues document 0: bare text (paper Fig. 5, right)
    ids, starts = window(seg_lens, 1)
    ids[0, 11] = 42
    got = packed(model, make_batch(ids, [seg_lens], "anchor", seg_doc=[docs], anchor_id=1))
    # document 0 alone, both chunks: its one anchor at position 0, its text at its window positions
    doc0 = torch.cat([ids[0, :6], ids[0, 11:18]])
    want = stock(model, doc0, [0] + list(range(1, 6)) + list(range(11, 18)))
    torch.testing.assert_close(got[:6], want[:6], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got[11:18], want[6:], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got[6:11], stock(model, ids[0, 6:11], [0, 7, 8, 9, 10]), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_intra_doc_modes_are_documents_alone_and_differ_only_in_positions(model_type):
    seg_lens = [9, 1, 14, 8]
    ids, starts = window(seg_lens, ANCHOR[model_type], seed=1)
    model = tiny(model_type, "intra_doc")
    intra = packed(model, make_batch(ids, [seg_lens], "intra_doc"))
    reset_batch = make_batch(ids, [seg_lens], "intra_doc_reset")
    reset = packed(model, reset_batch)
    for s, n in zip(starts, seg_lens):
        doc = ids[0, s : s + n]
        torch.testing.assert_close(intra[s : s + n], stock(model, doc, list(range(s, s + n))), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(reset[s : s + n], stock(model, doc, list(range(n))), atol=1e-4, rtol=1e-4)
    # the two modes share the mask: intra_doc with reset positions is intra_doc_reset
    intra_with_reset_positions = replace(
        make_batch(ids, [seg_lens], "intra_doc"), position_ids=reset_batch.position_ids
    )
    torch.testing.assert_close(packed(model, intra_with_reset_positions), reset, atol=1e-5, rtol=1e-5)


def test_intra_doc_reset_positions_continue_across_chunks():
    model = tiny("llama", "intra_doc_reset")
    seg_lens, docs = [5, 6, 4], [0, 1, 0]
    ids, _ = window(seg_lens, 1, seed=2)
    ids[0, 11] = 42  # a later chunk is bare text
    got = packed(model, make_batch(ids, [seg_lens], "intra_doc_reset", seg_doc=[docs]))
    doc0 = torch.cat([ids[0, :5], ids[0, 11:15]])  # both chunks, one anchor, positions 0..8
    torch.testing.assert_close(got[11:15], stock(model, doc0, list(range(9)))[5:], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2"])
def test_full_mode_equals_stock_causal_attention(model_type):
    model = tiny(model_type, "full")
    ids, _ = window([20, 12], ANCHOR[model_type], seed=3)
    got = packed(model, make_batch(ids, [[20, 12]], "full"))
    for impl in ("eager", "sdpa"):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            want = model(input_ids=ids).logits[0]
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_batched_rows_with_different_layouts_and_loss_uses_preshifted_labels():
    model = tiny("llama", "anchor").train()
    ids = torch.cat([window([10, 22], 1, seed=4)[0], window([3, 4, 25], 1, seed=5)[0]])
    batch = make_batch(ids, [[10, 22], [3, 4, 25]], "anchor", tag_lens=[[1, 0], [0, 2, 0]])
    out = model(**batch.model_kwargs(labels=True), use_cache=False)
    # the loss is the mean cross-entropy of logits[t] against labels[t], no second shift
    want = torch.nn.functional.cross_entropy(out.logits.reshape(-1, VOCAB), batch.labels.reshape(-1))
    torch.testing.assert_close(out.loss, want)
    for b, seg_lens in enumerate([[10, 22], [3, 4, 25]]):
        single = make_batch(ids[b : b + 1], [seg_lens], "anchor")
        with torch.no_grad():
            torch.testing.assert_close(
                model(**single.model_kwargs(), use_cache=False).logits[0], out.logits[b].detach(), atol=1e-5, rtol=1e-5
            )
    out.loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize("mode", ["anchor", "full"])
def test_a_model_class_that_drops_attention_kwargs_fails_closed(mode):
    """Training calls the decoder with the batch's segments; a decoder class that does not pass its keyword
    arguments down would leave the engines without a mask. They refuse in one line instead of computing plain causal
    attention, which would train an `anchor` run as `full` without a word."""
    from lctrain.errors import UserError
    from lctrain.train.loss import CausalLMLossSum

    model = tiny("llama", mode).train()
    decoder = model.get_decoder()

    class DropsKwargs(type(decoder)):
        def forward(self, input_ids=None, position_ids=None, use_cache=None, **kwargs):
            return super().forward(input_ids=input_ids, position_ids=position_ids, use_cache=use_cache)

    decoder.__class__ = DropsKwargs
    ids, _ = window([20, 12], 1)
    batch = make_batch(ids, [[20, 12]], mode)
    with pytest.raises(UserError, match="got no segment metadata .* from LlamaAttention") as err:
        CausalLMLossSum(model)(batch)
    assert "\n" not in str(err.value)
