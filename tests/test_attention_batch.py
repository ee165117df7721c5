"""make_batch: positions and labels against hand-written expectations; bad input -> UserError."""

import numpy as np
import pytest
import torch

from lctrain.attention import SEGMENTS_KEY, make_batch, resolve_engine
from lctrain.errors import UserError

# One row of 10 tokens: segments of 3 (doc 0: anchor, tag, text), 4 (doc 1: anchor, text), 3 (doc 0 again: an
# interleaved chunk, bare text).
IDS = torch.arange(100, 110)[None]
SEG = [[3, 4, 3]]
DOC = [[0, 1, 0]]
TAGS = [[1, 0, 0]]


@pytest.mark.parametrize(
    "mode,expected",
    [
        ("full", [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]),
        ("intra_doc", [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]),
        # positions continue across a document's chunks: the third segment is doc 0's 4th..6th tokens
        ("intra_doc_reset", [0, 1, 2, 0, 1, 2, 3, 3, 4, 5]),
        ("anchor", [0, 1, 2, 0, 4, 5, 6, 7, 8, 9]),
    ],
)
def test_positions_by_mode(mode, expected):
    batch = make_batch(IDS, SEG, mode, seg_doc=DOC, tag_lens=TAGS)
    assert batch.position_ids.tolist() == [expected]


def test_intra_doc_reset_without_chunks_restarts_each_segment():
    batch = make_batch(torch.zeros(1, 7, dtype=torch.long), [[2, 1, 4]], "intra_doc_reset")
    assert batch.position_ids.tolist() == [[0, 1, 0, 0, 1, 2, 3]]


def test_labels_shifted_with_tags_and_last_masked():
    batch = make_batch(IDS, SEG, "anchor", seg_doc=DOC, tag_lens=TAGS)
    # masked: the target at 0 (the tag at 1), at 2 (doc 1's anchor while doc 0 goes on), at 6 (doc 0's chunk), and
    # the last token
    assert batch.labels.tolist() == [[-100, 102, -100, 104, 105, 106, -100, 108, 109, -100]]
    kwargs = batch.model_kwargs(labels=True)  # the model's own loss must not shift the labels again
    assert kwargs["shift_labels"] is kwargs["labels"] is batch.labels
    assert set(batch.model_kwargs()) == {"input_ids", "position_ids", SEGMENTS_KEY}
    assert batch.input_ids.dtype == torch.long


def test_batch_rows_with_different_layouts_and_padded_arrays():
    ids = np.arange(12, dtype=np.int32).reshape(2, 6)
    seg_lens = np.array([[6, 0, 0], [1, 2, 3]], dtype=np.int32)  # zero-padded, as a datasets batch gives them
    seg_doc = np.array([[0, 0, 0], [0, 1, 2]], dtype=np.int32)
    tag_lens = np.array([[2, 0, 0], [0, 1, 0]], dtype=np.int32)
    batch = make_batch(ids, seg_lens, "anchor", seg_doc=seg_doc, tag_lens=tag_lens)
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 4, 5], [0, 0, 2, 0, 4, 5]]
    assert batch.labels.tolist() == [[-100, -100, 3, 4, 5, -100], [7, -100, 9, 10, 11, -100]]
    assert all(t.shape == (2, 6) for t in (batch.input_ids, batch.position_ids, batch.labels))
    assert batch.valid_labels() == 7


def test_anchor_id_check():
    ids = torch.tensor([[1, 5, 6, 1, 7]])
    make_batch(ids, [[3, 2]], "anchor", anchor_id=1)
    with pytest.raises(UserError, match="token 3 starts with token id 9"):
        make_batch(torch.tensor([[1, 5, 6, 9, 7]]), [[3, 2]], "anchor", anchor_id=1)
    # a document's later chunk has no anchor
    make_batch(torch.tensor([[1, 5, 6, 9, 7]]), [[3, 2]], "anchor", seg_doc=[[0, 0]], anchor_id=1)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(seg_lens=[[3, 4]]), "sum to 7 but the row has 10"),
        (dict(seg_lens=[[10, 0]]), "at least one token"),
        (dict(seg_lens=[[3, 7], [10]]), "2 rows but input_ids has 1"),
        (dict(seg_lens=[[3, 7]], mode="sliding"), "unknown"),
        (dict(seg_lens=[[3, 7]], tag_lens=[[3, 0]]), "tag_lens must be in"),
        (dict(seg_lens=[[3, 7]], seg_doc=[[0]]), "seg_doc has 1 entries for 2 segments"),
        (dict(seg_lens=[[3, 7]], seg_doc=[[0, -1]]), "seg_doc must be >= 0"),
        (dict(seg_lens=[[3, 4, 3]], seg_doc=[[0, 1, 0]], tag_lens=[[1, 0, 2]]), "token 7 continues a document"),
    ],
)
def test_bad_input(kwargs, match):
    args = dict(mode="intra_doc") | kwargs
    with pytest.raises(UserError, match=match):
        make_batch(IDS, **args)


def test_engine_resolution():
    assert resolve_engine("auto", "anchor", "cpu", dtype="float32").name == "sdpa"
    assert resolve_engine("auto", "anchor", "cuda", dtype="bfloat16").name == "varlen"
    assert resolve_engine("reference", "anchor", "cpu", dtype="float32").name == "reference"
    assert resolve_engine("auto", "anchor", "cuda", dtype="float32").name == "flex"
    with pytest.raises(UserError, match="bfloat16 or float16"):
        resolve_engine("varlen", "anchor", "cuda", dtype=torch.float32)
    with pytest.raises(UserError, match="needs a CUDA GPU"):
        resolve_engine("varlen", "anchor", "cpu", dtype="bfloat16")
    with pytest.raises(UserError, match="no CPU backward"):
        resolve_engine("flex", "anchor", "cpu", dtype="float32")
    with pytest.raises(UserError, match="unknown"):
        resolve_engine("xformers", "anchor", "cpu", dtype="float32")


def test_varlen_plan_joins_interleaved_chunks():
    from lctrain.attention.engines.varlen import build_varlen_plan

    seg = make_batch(IDS, SEG, "anchor", seg_doc=DOC).segments
    plan = build_varlen_plan(seg.layout, "anchor", "cpu")
    # written by hand from SEG and DOC: each document's tokens in window order, documents by first appearance
    docs: dict[int, list[int]] = {}
    start = 0
    for n, d in zip(SEG[0], DOC[0]):
        docs.setdefault(d, []).extend(range(start, start + n))
        start += n
    want = [t for d in sorted(docs) for t in docs[d]]
    assert plan.order.tolist() == want and plan.order[plan.inverse].tolist() == list(range(10))
    lens = [len(docs[d]) for d in sorted(docs)]
    assert plan.cu_seqlens.tolist() == [sum(lens[:i]) for i in range(len(lens) + 1)] and plan.max_seqlen == max(lens)
    assert build_varlen_plan(seg.layout, "full", "cpu").cu_seqlens.tolist() == [0, 10]
    plain = build_varlen_plan(make_batch(IDS, SEG, "anchor").segments.layout, "anchor", "cpu")
    assert plain.cu_seqlens.tolist() == [0, 3, 7, 10] and plain.max_seqlen == 4 and plain.order is None


# Paper Fig. 5, written document by document: two rows of 16 tokens. A document has a tag length and a text length
# in the row; a row is its chunks in window order, (document, text tokens). A document's first chunk in the row is
# its anchor A, its tag and text; later chunks are bare text. `open`: the document goes on in the next window (it
# is the row's last chunk, as the packer guarantees). Row 1 is interleaved; row 2 has a chunk right after its own
# document's first chunk and ends in an anchor and tag whose text starts in the next window.
A, TAG = 1, 7
FIG5 = [
    dict(tags={0: 1, 1: 0, 2: 1}, open=2, chunks=[(0, 2), (1, 1), (0, 2), (2, 1), (1, 2), (0, 1), (2, 2)]),
    dict(tags={0: 2, 1: 0, 2: 1}, open=2, chunks=[(0, 3), (0, 2), (1, 5), (2, 0)]),
]


def fig5_reference(row):
    """Per token, from the description alone: input id, document, is-anchor, is-tag, index in its document, and
    whether the document ends in this row."""
    toks, seen, text_index = [], set(), {}
    for d, n in row["chunks"]:
        head = [] if d in seen else [(A, "anchor")] + [(TAG, "tag")] * row["tags"][d]
        seen.add(d)
        for tid, kind in head:
            toks.append(dict(id=tid, doc=d, anchor=kind == "anchor", tag=kind == "tag"))
        for _ in range(n):
            j = text_index[d] = text_index.get(d, -1) + 1
            toks.append(dict(id=100 * (d + 1) + j, doc=d, anchor=False, tag=False))
    for i, t in enumerate(toks):
        t["index"] = sum(u["doc"] == t["doc"] for u in toks[:i])
        t["ends"] = t["doc"] != row["open"]
    return toks


def fig5_batch(mode):
    rows = [fig5_reference(r) for r in FIG5]
    ids = torch.tensor([[t["id"] for t in r] for r in rows])
    seg_lens = [
        [(0 if d in [c for c, _ in r["chunks"][:i]] else 1 + r["tags"][d]) + n for i, (d, n) in enumerate(r["chunks"])]
        for r in FIG5
    ]
    seg_doc = [[d for d, _ in r["chunks"]] for r in FIG5]
    tag_lens = [
        [0 if d in [c for c, _ in r["chunks"][:i]] else r["tags"][d] for i, (d, _) in enumerate(r["chunks"])]
        for r in FIG5
    ]
    return rows, make_batch(ids, seg_lens, mode, seg_doc=seg_doc, tag_lens=tag_lens, anchor_id=A)


@pytest.mark.parametrize("mode", ["full", "intra_doc", "intra_doc_reset", "anchor"])
def test_interleaved_window_is_figure_5_in_every_mode(mode):
    from lctrain.attention.modes import dense_mask

    rows, batch = fig5_batch(mode)
    assert all(len(r) == 16 for r in rows)
    mask = dense_mask(batch.segments.layout, mode)
    for b, toks in enumerate(rows):
        for q, tq in enumerate(toks):
            seen = [tk for k, tk in enumerate(toks) if mask[b, q, k]]
            if mode == "full":
                assert seen == toks[: q + 1]
            else:
                # its document's tokens up to itself, earlier chunks included, and no other document's
                assert seen == [tk for tk in toks[: q + 1] if tk["doc"] == tq["doc"]]
                # one anchor, its document's own, the document's first token
                anchors = [tk for tk in seen if tk["id"] == A]
                assert len(anchors) == 1 and anchors[0]["index"] == 0
            want_pos = {"full": q, "intra_doc": q, "intra_doc_reset": tq["index"], "anchor": 0 if tq["anchor"] else q}[
                mode
            ]
            assert batch.position_ids[b, q] == want_pos, (b, q)
            # the label: the document's next token; after a finished document, the next one's anchor; else none
            nxt = toks[q + 1] if q + 1 < len(toks) else None
            if nxt is None or nxt["tag"]:
                want = -100
            elif nxt["doc"] == tq["doc"]:
                want = nxt["id"]
                assert want == tq["id"] + 1 or tq["anchor"] or tq["tag"]  # the document's text in order
            elif nxt["anchor"] and tq["ends"] and not any(tk["doc"] == tq["doc"] for tk in toks[q + 1 :]):
                want = A
            else:
                want = -100
            assert batch.labels[b, q] == want, (b, q)
    # the anchor mode's positions: every anchor at 0, so each document sees its one anchor at position 0
    if mode == "anchor":
        is_anchor = torch.tensor([[t["anchor"] for t in r] for r in rows])
        assert (batch.position_ids[is_anchor] == 0).all() and int(is_anchor.sum()) == 6
