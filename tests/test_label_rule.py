"""Perplexity's targets follow training's label rule minus the anchors: checked against a loop over the segments."""

import numpy as np

from lctrain.eval.perplexity import target_mask


def loop_reference(seg_lens, seg_doc, tag_lens) -> np.ndarray:
    """Token t keeps its target t+1 when both are in one document and t+1 is plain text of it (not an anchor, not a
    tag). A document's first segment in the window starts with its anchor and tags; later chunks are bare text."""
    doc, kind = [], []
    seen = set()
    for n, d, tags in zip(seg_lens, seg_doc, tag_lens):
        first = d not in seen
        seen.add(d)
        for i in range(n):
            doc.append(d)
            kind.append("anchor" if first and i == 0 else "tag" if first and 1 <= i <= tags else "text")
    L = len(doc)
    return np.array([t < L - 1 and doc[t] == doc[t + 1] and kind[t + 1] == "text" for t in range(L)])


def window(seg_lens, seg_doc, tag_lens):
    L = sum(seg_lens)
    return {
        "input_ids": np.arange(3, 3 + L),
        "seg_lens": np.array(seg_lens),
        "seg_doc": np.array(seg_doc),
        "tag_lens": np.array(tag_lens),
    }


def test_plain_packing_leaves_out_anchors_and_tags():
    w = window([6, 5, 4], [0, 1, 2], [2, 1, 0])
    want = loop_reference([6, 5, 4], [0, 1, 2], [2, 1, 0])
    assert np.array_equal(target_mask(w), want)
    assert not want[5] and not want[6] and want[7]  # doc end -> anchor, anchor -> tag, tag -> text


def test_interleaved_chunks_keep_only_targets_inside_a_document():
    seg_lens, seg_doc, tag_lens = [4, 3, 3, 2, 4], [0, 1, 0, 1, 2], [1, 0, 0, 0, 0]
    got = target_mask(window(seg_lens, seg_doc, tag_lens))
    assert np.array_equal(got, loop_reference(seg_lens, seg_doc, tag_lens))
    assert not got[3] and not got[6]  # a chunk's last token before another document's chunk
