"""Packing, shuffle buffer, interleaved chunks and the upsampled mixture as pure functions (no tokenizer, no files)."""

import numpy as np
import pytest

from lctrain.config import DOMAINS
from lctrain.data.mixture import UPSAMPLED_MIX_128K_TOKEN_SHARES, Mixture
from lctrain.data.packing import Packer, ShuffleBuffer, split_into_chunks

ANCHOR = 1


def _docs(rng, n, lo=1, hi=300):
    # tokens >= 10 so they never collide with the anchor or tags used here
    return [rng.integers(10, 30000, size=int(rng.integers(lo, hi))).astype(np.int32) for _ in range(n)]


def _pack(docs, seq_len, tags=None, domains=None, chunk_rng=None):
    packer = Packer(seq_len, ANCHOR, tags, chunk_rng=chunk_rng)
    windows = []
    for k, t in enumerate(docs):
        windows += packer.add(t, domains[k] if domains else 0)
    return windows, packer


def _segments(w):
    starts = np.concatenate([[0], np.cumsum(w.seg_lens)[:-1]])
    return [w.input_ids[s : s + n] for s, n in zip(starts, w.seg_lens)]


@pytest.mark.parametrize("seq_len", [8, 37, 256])
def test_windows_are_full_and_concatenate_to_the_documents(seq_len):
    rng = np.random.default_rng(seq_len)
    docs = _docs(rng, 60)
    windows, packer = _pack(docs, seq_len)
    assert windows and all(len(pw.window.input_ids) == seq_len for pw in windows)
    body = []
    for pw in windows:
        w = pw.window
        assert w.seg_lens.sum() == seq_len and (w.seg_lens > 0).all()
        assert w.input_ids.dtype == np.int32 and w.seg_domain.dtype == np.int8
        for seg in _segments(w):
            assert seg[0] == ANCHOR
            body.append(seg[1:])
    # the independent expectation: all documents back to back; what is missing sits in the unfinished window
    stream = np.concatenate(docs)
    got = np.concatenate(body)
    assert np.array_equal(got, stream[: len(got)])
    assert len(stream) - len(got) < max(packer.filled, 1)


def test_document_spilling_over_continues_after_a_fresh_anchor_and_tag():
    tags = {0: np.array([5, 6], dtype=np.int32)}
    doc = np.arange(100, 130, dtype=np.int32)
    windows, _ = _pack([doc], 10, tags)
    # each window: anchor, the two tag tokens, then 7 document tokens
    assert len(windows) == 4
    for i, pw in enumerate(windows[:4]):
        w = pw.window
        assert w.seg_lens.tolist() == [10] and w.tag_lens.tolist() == [2]
        assert w.input_ids[:3].tolist() == [ANCHOR, 5, 6]
        assert w.input_ids[3:].tolist() == doc[7 * i : 7 * i + 7].tolist()
    assert [len(pw.doc_starts) for pw in windows] == [1, 0, 0, 0]


def test_tail_too_short_for_a_token_holds_only_the_next_documents_anchor_and_tag():
    tags = {0: np.array([5, 6], dtype=np.int32)}
    a, b = np.full(6, 40, np.int32), np.full(5, 50, np.int32)  # a's segment is 9 tokens, 1 left in the window
    windows, packer = _pack([a, b], 10, tags)
    w = windows[0].window
    assert w.seg_lens.tolist() == [9, 1] and w.tag_lens.tolist() == [2, 0] and w.input_ids[-1] == ANCHOR
    assert packer.filled == 8  # b starts whole in the next window: anchor, tag, 5 tokens
    assert windows[0].doc_starts == [(0, 6)]


def test_seg_doc_numbers_documents_within_each_window():
    windows, _ = _pack(_docs(np.random.default_rng(0), 40, 1, 20), 64)
    for pw in windows:
        assert pw.window.seg_doc.tolist() == list(range(len(pw.window.seg_lens)))


def test_packer_rejects_a_window_too_small_for_its_tag():
    with pytest.raises(ValueError):
        Packer(4, ANCHOR, {0: np.array([5, 6, 7], dtype=np.int32)})


def test_shuffle_buffer_releases_every_item_once_in_a_seeded_order():
    def run(seed):
        buf = ShuffleBuffer(50, np.random.default_rng(seed))
        out = []
        for i in range(200):
            out += buf.add(i, 7)
            assert buf._tokens <= 50
        return out + buf.drain()

    a, b, c = run(0), run(0), run(1)
    assert sorted(a) == list(range(200)) and a == b and a != c and a != list(range(200))


def test_interleaved_windows_are_the_packed_windows_cut_into_chunks_and_shuffled():
    # document k's text is 1000(k+1), 1000(k+1)+1, ...; tags are 2..3 and the anchor 1
    rng = np.random.default_rng(7)
    docs = [np.arange(1000 * (k + 1), 1000 * (k + 1) + int(rng.integers(1, 60)), dtype=np.int32) for k in range(80)]
    domains = [k % 7 for k in range(80)]
    tags = {d: np.arange(2, 2 + d % 3, dtype=np.int32) for d in range(7)}  # tags of 0, 1 and 2 tokens
    plain, _ = _pack(docs, 64, tags, domains)
    mixed, _ = _pack(docs, 64, tags, domains, chunk_rng=np.random.default_rng(8))
    assert len(mixed) == len(plain) > 10
    shuffled = open_ends = 0
    for p, m in zip(plain, mixed):
        pw, mw = p.window, m.window
        assert m.doc_starts == p.doc_starts and mw.seg_lens.sum() == 64 and (mw.seg_lens > 0).all()
        # reference: the packed window's segments, each one document's part of the window with its anchor and tag
        want = sorted(
            (int(dom), int(tl), tuple(seg.tolist())) for seg, dom, tl in zip(_segments(pw), pw.seg_domain, pw.tag_lens)
        )
        # the interleaved window: a document's first chunk starts with the anchor and tag, later ones are bare text
        # with tag_lens 0; its chunks in window order join up to its packed segment
        docs_seen: dict[int, list] = {}
        for seg, doc, dom, tl in zip(_segments(mw), mw.seg_doc.tolist(), mw.seg_domain, mw.tag_lens):
            first = doc not in docs_seen
            assert (seg[0] == ANCHOR) == first and (first or tl == 0)
            assert ANCHOR not in seg[1:].tolist()
            entry = docs_seen.setdefault(doc, [int(dom), int(tl), []])
            assert entry[0] == dom
            entry[2] += seg.tolist()
        assert list(docs_seen) == list(range(len(docs_seen)))  # seg_doc numbered by first appearance
        assert sorted((d, t, tuple(ids)) for d, t, ids in docs_seen.values()) == want
        shuffled += mw.seg_doc.tolist() != sorted(mw.seg_doc.tolist())
        # a document that goes on in the next window (or an anchor-and-tag tail) keeps the window's end
        last = int(pw.input_ids[-1])
        k = last // 1000 - 1
        if last < 1000 or last - 1000 * (k + 1) + 1 < len(docs[k]):
            open_ends += 1
            assert mw.input_ids[-1] == last
    assert shuffled > len(plain) // 2 and open_ends > 3


def test_interleaving_is_seeded():
    docs = _docs(np.random.default_rng(9), 40, 1, 50)
    runs = [_pack(docs, 48, chunk_rng=np.random.default_rng(s))[0] for s in (1, 1, 2)]
    ids = [[pw.window.input_ids.tolist() for pw in r] for r in runs]
    assert ids[0] == ids[1] != ids[2]


def test_split_into_chunks():
    rng = np.random.default_rng(0)
    for n in (1, 2, 3, 50):
        t = np.arange(n)
        parts = split_into_chunks(t, rng)
        assert np.array_equal(np.concatenate(parts), t) and all(len(p) for p in parts)
        assert len(parts) == 1 if n == 1 else 2 <= len(parts) <= min(n, 3)


def test_upsampled_mixture_keeps_long_documents_and_thins_short_ones():
    m = Mixture("upsampled", 10**9, 100, 0.1, np.random.default_rng(0))
    wiki = DOMAINS.index("Wikipedia")
    short = sum(m.admit(wiki, 50, 51) for _ in range(5000))
    long_ = sum(m.admit(wiki, 500, 501) for _ in range(500))
    assert long_ == 500
    assert 0.08 < short / 5000 < 0.12
    assert not m.admit(DOMAINS.index("other"), 500, 501)


def test_upsampled_mixture_stops_each_domain_at_its_share():
    budget = 100_000
    m = Mixture("upsampled", budget, 10, 1.0, np.random.default_rng(0))
    cc = DOMAINS.index("CommonCrawl")
    while m.admit(cc, 99, 100):
        pass
    target = UPSAMPLED_MIX_128K_TOKEN_SHARES["CommonCrawl"] * budget
    assert target <= m.admitted[cc] < target + 100
    assert m.dropped["domain_share_full"] == 1
    # once every share is full the shares grow together, so the proportions hold past the budget
    for _ in range(3000):
        for d in range(7):
            m.admit(d, 99, 100)
    assert m.admitted.sum() > budget
    for d, name in enumerate(DOMAINS[:7]):
        assert abs(m.admitted[d] / m.admitted.sum() - UPSAMPLED_MIX_128K_TOKEN_SHARES[name]) < 0.005


def test_natural_mixture_admits_everything():
    m = Mixture("slimpajama", 10, 4096, 0.1, np.random.default_rng(0))
    assert all(m.admit(d, 1, 2) for d in range(8)) and not m.all_full()
