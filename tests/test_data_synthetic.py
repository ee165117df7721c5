"""The synthetic SlimPajama-like corpus against SlimPajama's published statistics and a real tokenizer."""

from collections import Counter

import numpy as np
import pytest

from lctrain.data.mixture import SLIMPAJAMA_TOKEN_SHARES
from lctrain.data.synthetic import SYNTHETIC_DOMAINS, document_shape, generate
from lctrain.tokenizer import load_tokenizer

DEFAULTS = dict(median_words=300, max_words=200_000, long_doc_fraction=0.01)  # SyntheticConfig defaults


def test_documents_depend_only_on_seed_and_index():
    a = [generate(3, i, **DEFAULTS) for i in (0, 7, 7)]
    assert a[1] == a[2] and a[0] != a[1]
    assert generate(4, 7, **DEFAULTS) != a[1]
    assert document_shape(3, 7, **DEFAULTS)[0] == a[1][1]


def test_domain_mix_and_lengths_look_like_slimpajama():
    n = 60_000
    shapes = [document_shape(0, i, **DEFAULTS) for i in range(n)]
    docs = Counter(d for d, _ in shapes)
    words = Counter()
    for d, w in shapes:
        words[d] += w
    total = sum(words.values())
    assert set(docs) == set(SYNTHETIC_DOMAINS)
    # SlimPajama: C4 and CommonCrawl are ~88% of the documents, C4 the most numerous
    assert docs.most_common(1)[0][0] == "C4" and (docs["C4"] + docs["CommonCrawl"]) / n > 0.85
    for d in SYNTHETIC_DOMAINS:  # length volume per domain tracks SlimPajama's token shares
        assert abs(words[d] / total - SLIMPAJAMA_TOKEN_SHARES[d]) < 0.04, d
    lengths = np.array([w for _, w in shapes])
    assert np.median(lengths) < 600 and (lengths > 100_000).sum() >= 5  # long-tailed


def test_text_is_words_and_long_documents_pass_128k_tokens():
    tok = load_tokenizer("builtin:mistral-7b-v0.1")
    for i in range(20):
        text, domain = generate(0, i, 200, 2000, 0.0)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert 1.0 < len(ids) / len(text.split()) < 3.5, domain
    long_index = next(i for i in range(10_000) if document_shape(0, i, **DEFAULTS)[1] > 120_000)
    words = generate(0, long_index, **DEFAULTS)[0].split(" ")
    # tokenizing all of it takes seconds: measure tokens per word on a slice
    head = " ".join(words[:5000])
    assert len(words) * len(tok(head, add_special_tokens=False)["input_ids"]) / 5000 > 131_072


@pytest.mark.parametrize("domain", SYNTHETIC_DOMAINS)
def test_each_domain_has_its_own_style(domain):
    i = next(i for i in range(20_000) if document_shape(1, i, 100, 3000, 0.0)[0] == domain)
    text, _ = generate(1, i, 100, 3000, 0.0)
    marker = {
        "GitHub": "def ",
        "ArXiv": "\\section{",
        "Book": "CHAPTER",
        "Wikipedia": "\n\n",
        "StackExchange": "Q: ",
        "CommonCrawl": ". ",
        "C4": ". ",
    }[domain]
    assert marker in text
