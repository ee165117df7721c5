"""`data.sources` with a `token_share` per source: the written tokens of each source (loop-counted from the output's
records, anchors and tags included) against the asked shares, on a corpus whose sources have very different
document lengths; the shares prepare reports are the counted ones; bad input is one line naming the key."""

import json
import re

import numpy as np
import pytest
from train_helpers import show_config_refusal

from lctrain.config import load_config
from lctrain.data.prepare import prepare
from lctrain.data.store import open_packed
from lctrain.errors import UserError

SHARES = {"short": 0.5, "medium": 0.3, "long": 0.2}
WORDS = {"short": 12, "medium": 50, "long": 120}  # words per document: each source's documents are a different size
DOCS = {"short": 1000, "medium": 400, "long": 400}  # more than each source's share of the budget needs


@pytest.fixture
def corpus(tmp_path):
    paths = {}
    for name, words in WORDS.items():
        paths[name] = tmp_path / f"{name}.jsonl"
        paths[name].write_text(
            "".join(json.dumps({"text": f"{name}{i} " + "word " * words}) + "\n" for i in range(DOCS[name]))
        )
    return paths


def cfg_of(tmp_path, paths, key, shares, out, *extra):
    listed = ", ".join(f"{{name: {n}, path: '{paths[n]}', {key}: {s}}}" for n, s in shares.items())
    return load_config(
        None,
        [
            f"data.sources=[{listed}]",
            "data.seq_len=256",
            "data.token_budget=16384",
            "data.shuffle_buffer_tokens=4096",
            f"data.output_dir={tmp_path / out}",
            *extra,
        ],
    )


def counted_shares(path) -> dict[str, float]:
    """Tokens per source over every segment of every window, each source being its own domain."""
    data = open_packed(path)
    tokens = dict.fromkeys(data.manifest.domains, 0)
    for i in range(len(data)):
        row = data[i]
        for n, dom in zip(row["seg_lens"], row["seg_domain"]):
            tokens[data.manifest.domains[int(dom)]] += int(n)
    total = sum(tokens.values())
    assert total == len(data) * 256
    return {name: n / total for name, n in tokens.items()}


def test_written_tokens_follow_the_asked_shares(tmp_path, corpus, capsys):
    path = prepare(cfg_of(tmp_path, corpus, "token_share", SHARES, "shares", "data.domain_tags=true"))
    got = counted_shares(path)
    for name, share in SHARES.items():
        assert got[name] == pytest.approx(share, abs=0.01), got
    manifest = open_packed(path).manifest
    reported = {e["name"]: e["achieved_token_share"] for e in manifest.source["sources"]}
    assert reported == pytest.approx(got, abs=1e-12)
    # the long source's share fills first: its later documents are skipped, and counted
    dropped = manifest.mixture_dropped["source_share_full"]
    assert 0 < dropped <= manifest.source["documents_read"] - manifest.stats["documents"]
    said = " ".join(capsys.readouterr().out.split())
    assert "per source (asked -> achieved): short token_share 0.5000 -> " in said


def test_a_document_cut_to_its_share_is_counted_by_its_whole_length(tmp_path, corpus, capsys):
    """Figure 8 counts documents by their whole length: a long document the share cuts short is no short one. The
    last line's documents read ahead are those read and neither packed nor left out by the shares."""
    book = tmp_path / "book.jsonl"  # ~1,500 tokens a document, 1-2K in the histogram: its share takes ~2.2 of them
    book.write_text("".join(json.dumps({"text": f"book{i} " + "word " * 1500}) + "\n" for i in range(20)))
    shares = {"short": 0.8, "book": 0.2}
    path = prepare(cfg_of(tmp_path, {**corpus, "book": book}, "token_share", shares, "cut"))
    m = open_packed(path).manifest
    assert m.mixture_dropped["source_share_cut_tokens"] > 0  # a book was cut to fit its share
    books = m.stats["domains"]["book"]["documents"]
    assert m.stats["length_histogram"]["per_domain"]["book"] == [0, books, 0, 0, 0, 0, 0, 0, 0]
    ahead = m.source["documents_read"] - m.stats["documents"] - m.mixture_dropped["source_share_full"]
    said = " ".join(capsys.readouterr().out.split())
    assert ahead > 0 and f"{m.stats['documents']:,} documents; {ahead:,} more documents read ahead were not" in said


@pytest.mark.slow  # a second prepare
def test_weights_alone_do_not_give_token_shares(tmp_path, corpus):
    """The same proportions as draw weights give the long documents far more than their share of the tokens."""
    drawn = counted_shares(prepare(cfg_of(tmp_path, corpus, "weight", SHARES, "weights")))
    assert drawn["long"] > 0.35 and drawn["short"] < 0.25, drawn


@pytest.mark.slow  # two worker processes start: over 5 s on 2 cores
def test_shares_are_the_same_bytes_with_one_or_two_workers(tmp_path, corpus):
    one = prepare(cfg_of(tmp_path, corpus, "token_share", SHARES, "one", "data.num_workers=1"))
    two = prepare(cfg_of(tmp_path, corpus, "token_share", SHARES, "two", "data.num_workers=2"))
    shards = sorted(p.relative_to(one) for p in (one / "data").iterdir())
    assert shards and all((one / s).read_bytes() == (two / s).read_bytes() for s in shards)


@pytest.mark.parametrize(
    ("sources", "extra", "needle"),
    [
        ("[{name: a, path: A, weight: 2, token_share: 1}]", [], "source 'a': set weight or token_share, not both"),
        (
            "[{name: a, path: A, token_share: 0.5}, {name: b, path: B}]",
            [],
            "token_share is given on some sources but not on b; give it on every source",
        ),
        (
            "[{name: a, path: A, token_share: 0.5}, {name: b, path: B, token_share: 0.3}]",
            [],
            "the token shares sum to 0.8; they must sum to 1 (within 0.01 for 2 shares)",
        ),
        ("[{name: a, path: A, token_share: 0}]", [], "data.sources[0].token_share = 0: Input should be greater than 0"),
        ("[{name: a, path: A, token_share: 1.5}]", [], "data.sources[0].token_share = 1.5"),
        (
            "[{name: a, path: A, token_share: 1}]",
            ["data.mixture=upsampled", "data.domain_shares={a: 1}"],
            "token_share and data.mixture=upsampled both set token shares",
        ),
    ],
)
def test_bad_token_shares_are_one_line_naming_the_key(sources, extra, needle):
    assert needle in show_config_refusal([f"data.sources={sources}", *extra])


def test_shares_within_rounding_are_accepted():
    cfg = load_config(
        None, ["data.sources=[{name: a, path: A, token_share: 0.333}, {name: b, path: B, token_share: 0.66}]"]
    )
    assert np.isclose(sum(s.token_share for s in cfg.data.sources), 0.993)


def test_a_malformed_record_is_named_by_its_file_and_line(tmp_path, corpus):
    """The source's index travels with each record (for the shares) beside the file and line that messages name."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine words here"}\n{not json\n')
    cfg = cfg_of(tmp_path, {**corpus, "bad": bad}, "weight", {"short": 1, "bad": 1}, "bad", "data.strict=true")
    with pytest.raises(UserError, match=rf"^{re.escape(str(bad))}:2: malformed JSON or not a JSON object"):
        prepare(cfg)
