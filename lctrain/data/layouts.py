"""Seeded segment layouts of SlimPajama-like packed windows, for the benchmarks (no tokenizer, no corpus).

Document lengths are drawn per domain from SlimPajama's token shares (docs/design.md §2) with a log-normal length per
domain (most documents short, a few book-length), and packed concatenate-and-cut as `prepare` packs: every segment
starts with an anchor, and a document that does not fit continues in the next window after a fresh anchor.
"""

from __future__ import annotations

import numpy as np

from lctrain.data.mixture import SLIMPAJAMA_TOKEN_SHARES

# domain -> (median document length in tokens, log-normal sigma); the domains' token shares are SlimPajama's
DOMAIN_LENGTHS = {
    "CommonCrawl": (700, 1.2),
    "C4": (400, 0.9),
    "GitHub": (900, 1.4),
    "ArXiv": (9000, 0.7),
    "Book": (90000, 0.8),
    "Wikipedia": (600, 1.2),
    "StackExchange": (500, 1.0),
}


def slimpajama_like_layouts(seq_len: int, windows: int, seed: int) -> list[list[int]]:
    """Segment lengths of `windows` consecutive windows of `seq_len` tokens; each sums to `seq_len`."""
    rng = np.random.default_rng(seed)
    names = list(DOMAIN_LENGTHS)
    token_share = np.array([SLIMPAJAMA_TOKEN_SHARES[n] for n in names])
    mean_len = np.array([DOMAIN_LENGTHS[n][0] * np.exp(DOMAIN_LENGTHS[n][1] ** 2 / 2) for n in names])
    doc_prob = token_share / mean_len  # documents drawn in proportion to token share / mean length
    doc_prob /= doc_prob.sum()
    out, carry = [], 0
    for _ in range(windows):
        lens, room = [], seq_len
        while room:
            if not carry:
                d = rng.choice(len(names), p=doc_prob)
                median, sigma = DOMAIN_LENGTHS[names[d]]
                carry = max(2, int(rng.lognormal(np.log(median), sigma)))
            take = min(carry + 1, room)  # +1: the anchor that starts every segment
            lens.append(take)
            room -= take
            carry = max(0, carry - (take - 1))
        out.append(lens)
    return out


def window_ids(seg_lens: list[list[int]], vocab: int, anchor: int, seed: int) -> np.ndarray:
    """Random token ids `[windows, seq_len]` for the layouts, with `anchor` at every segment start."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(anchor + 2, vocab, size=(len(seg_lens), sum(seg_lens[0])))
    for b, lens in enumerate(seg_lens):
        ids[b, np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64)] = anchor
    return ids
