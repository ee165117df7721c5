"""make_batch: positions and labels against hand-written expectations; bad input -> UserError."""

import numpy as np
import pytest
import torch

from lctrain.attention import PER_TOKEN_KEYS, SEGMENTS_KEY, make_batch, resolve_engine
from lctrain.errors import UserError

# One row of 10 tokens: segments of 3 (doc 0), 4 (doc 1), 3 (doc 0 again: an interleaved chunk); tags of 1, 0, 1.
IDS = torch.arange(100, 110)[None]
SEG = [[3, 4, 3]]
DOC = [[0, 1, 0]]
TAGS = [[1, 0, 1]]


@pytest.mark.parametrize("mode,expected", [
    ("full", [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]),
    ("intra_doc", [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]),
    # positions continue across a document's chunks: the third segment is doc 0's 4th..6th tokens
    ("intra_doc_reset", [0, 1, 2, 0, 1, 2, 3, 3, 4, 5]),
    ("anchor", [0, 1, 2, 0, 4, 5, 6, 0, 8, 9]),
])
def test_positions_by_mode(mode, expected):
    batch = make_batch(IDS, SEG, mode, seg_doc=DOC, tag_lens=TAGS)
    assert batch["position_ids"].tolist() == [expected]


def test_intra_doc_reset_without_chunks_restarts_each_segment():
    batch = make_batch(torch.zeros(1, 7, dtype=torch.long), [[2, 1, 4]], "intra_doc_reset")
    assert batch["position_ids"].tolist() == [[0, 1, 0, 0, 1, 2, 3]]


def test_labels_shifted_with_tags_and_last_masked():
    batch = make_batch(IDS, SEG, "anchor", seg_doc=DOC, tag_lens=TAGS)
    # tag tokens sit at 1 and 8; the targets at 0 (-> 1) and 7 (-> 8) are masked, and the last token
    assert batch["labels"].tolist() == [[-100, 102, 103, 104, 105, 106, 107, -100, 109, -100]]
    assert batch["shift_labels"] is batch["labels"]
    assert batch["input_ids"].dtype == torch.long


def test_batch_rows_with_different_layouts_and_padded_arrays():
    ids = np.arange(12, dtype=np.int32).reshape(2, 6)
    seg_lens = np.array([[6, 0, 0], [1, 2, 3]], dtype=np.int32)  # zero-padded, as a datasets batch gives them
    seg_doc = np.array([[0, 0, 0], [0, 1, 2]], dtype=np.int32)
    tag_lens = np.array([[2, 0, 0], [0, 1, 0]], dtype=np.int32)
    batch = make_batch(ids, seg_lens, "anchor", seg_doc=seg_doc, tag_lens=tag_lens)
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 4, 5], [0, 0, 2, 0, 4, 5]]
    assert batch["labels"].tolist() == [[-100, -100, 3, 4, 5, -100], [7, -100, 9, 10, 11, -100]]
    assert set(PER_TOKEN_KEYS) <= set(batch) and SEGMENTS_KEY in batch
    assert all(batch[k].shape == (2, 6) for k in PER_TOKEN_KEYS)


def test_anchor_id_check():
    ids = torch.tensor([[1, 5, 6, 1, 7]])
    make_batch(ids, [[3, 2]], "anchor", anchor_id=1)
    with pytest.raises(UserError, match="token 3 starts with token id 9"):
        make_batch(torch.tensor([[1, 5, 6, 9, 7]]), [[3, 2]], "anchor", anchor_id=1)


@pytest.mark.parametrize("kwargs,match", [
    (dict(seg_lens=[[3, 4]]), "sum to 7 but the row has 10"),
    (dict(seg_lens=[[10, 0]]), "at least one token"),
    (dict(seg_lens=[[3, 7], [10]]), "2 rows but input_ids has 1"),
    (dict(seg_lens=[[3, 7]], mode="sliding"), "unknown"),
    (dict(seg_lens=[[3, 7]], tag_lens=[[3, 0]]), "tag_lens must be in"),
    (dict(seg_lens=[[3, 7]], seg_doc=[[0]]), "seg_doc has 1 entries for 2 segments"),
    (dict(seg_lens=[[3, 7]], seg_doc=[[0, -1]]), "seg_doc must be >= 0"),
])
def test_bad_input(kwargs, match):
    args = dict(mode="intra_doc") | kwargs
    with pytest.raises(UserError, match=match):
        make_batch(IDS, **args)


def test_engine_resolution():
    assert resolve_engine("auto", "anchor", "cpu", dtype="float32") == "sdpa"
    assert resolve_engine("auto", "anchor", "cuda", dtype="bfloat16") == "varlen"
    assert resolve_engine("auto", "anchor", "cuda", dtype="bfloat16", interleaved=True) == "flex"
    assert resolve_engine("varlen", "full", "cuda", dtype="bfloat16", interleaved=True) == "varlen"
    assert resolve_engine("reference", "anchor", "cpu", dtype="float32") == "reference"
    assert resolve_engine("auto", "anchor", "cuda", dtype="float32") == "flex"
    with pytest.raises(UserError, match="bfloat16 or float16"):
        resolve_engine("varlen", "anchor", "cuda", dtype=torch.float32)
    with pytest.raises(UserError, match="interleaved"):
        resolve_engine("varlen", "intra_doc", "cuda", dtype="bfloat16", interleaved=True)
    with pytest.raises(UserError, match="needs a CUDA GPU"):
        resolve_engine("varlen", "anchor", "cpu", dtype="bfloat16")
    with pytest.raises(UserError, match="no CPU backward"):
        resolve_engine("flex", "anchor", "cpu", dtype="float32")
    with pytest.raises(UserError, match="unknown"):
        resolve_engine("xformers", "anchor", "cpu", dtype="float32")


def test_varlen_refuses_interleaved_chunks_at_run_time():
    from lctrain.attention.engines.varlen import build_varlen_plan

    seg = make_batch(IDS, SEG, "anchor", seg_doc=DOC)[SEGMENTS_KEY]
    with pytest.raises(UserError, match="'flex' or 'sdpa'"):
        build_varlen_plan(seg.layout, "anchor", "cpu")
    assert build_varlen_plan(seg.layout, "full", "cpu").cu_seqlens.tolist() == [0, 10]
    plain = make_batch(IDS, SEG, "anchor")[SEGMENTS_KEY]
    plan = build_varlen_plan(plain.layout, "anchor", "cpu")
    assert plan.cu_seqlens.tolist() == [0, 3, 7, 10] and plan.max_seqlen == 4
