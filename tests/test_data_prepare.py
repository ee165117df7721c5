"""`prepare` end to end with the real 32K SentencePiece tokenizer, checked against plain tokenizations of the input
documents (round trip, no token lost or duplicated), the layout rules of docs/design.md §2 and the bad-input
contract."""

import json
import multiprocessing
import os
import random
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import sentencepiece as spm
import torch
import zstandard
from train_helpers import one_error_line, set_args
from typer.testing import CliRunner

import lctrain.data.prepare as prepare_module
from lctrain.attention.batch import make_batch
from lctrain.cli import app
from lctrain.config import DOMAINS, load_config
from lctrain.data.manifest import CHECKSUM_KEY, MANIFEST, manifest_checksum
from lctrain.data.mixture import UPSAMPLED_MIX_128K_TOKEN_SHARES
from lctrain.data.pool import WorkerDied, WorkerStartFailed
from lctrain.data.prepare import input_change, prepare
from lctrain.data.store import FORMAT_VERSION, ShardWriter, Window, open_packed, token_dtype
from lctrain.errors import UserError
from lctrain.tokenizer import builtin_model_file, load_tokenizer, save_tokenizer

TOKENIZER = "builtin:mistral-7b-v0.1"
# SlimPajama's spelling, in the order of DOMAINS
SET_NAMES = [
    "RedPajamaCommonCrawl",
    "RedPajamaC4",
    "RedPajamaGithub",
    "RedPajamaArXiv",
    "RedPajamaBook",
    "RedPajamaWikipedia",
    "RedPajamaStackExchange",
]
SET_DOMAIN = dict(zip(SET_NAMES, DOMAINS[:7]))


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(TOKENIZER)


@pytest.fixture(scope="module")
def words(tok):
    """Words that are single tokens of the real tokenizer: documents start with a word of their own, so any piece of
    a document can be traced back to it without ambiguity."""
    pieces = [p[1:] for p in tok.get_vocab() if p.startswith("\u2581") and p[1:].isalpha() and len(p) > 4]
    return sorted(w for w in pieces if len(tok(w, add_special_tokens=False)["input_ids"]) == 1)[:3000]


def make_docs(words, n, seed=0, lengths=(3, 400), domains=SET_NAMES):
    rng = random.Random(seed)
    docs = []
    for i in range(n):
        k = rng.randint(*lengths) if rng.random() > 0.05 else rng.randint(800, 1500)
        text = words[i] + " " + " ".join(rng.choice(words) for _ in range(k)) + "."
        docs.append({"text": text, "meta": {"redpajama_set_name": domains[i % len(domains)]}})
    return docs


def write_jsonl(path: Path, records, zst=False):
    path.parent.mkdir(parents=True, exist_ok=True)
    body = "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records).encode()
    path.write_bytes(zstandard.ZstdCompressor().compress(body) if zst else body)
    return path


def cfg_for(out, *overrides, source=None):
    base = [f"data.output_dir={out}", "data.seq_len=128", "data.token_budget=12800", f"data.tokenizer={TOKENIZER}"]
    if source is not None:
        base += ["data.source=local", f"data.path={source}"]
    return load_config(None, base + list(overrides))


def segments(row):
    """(tokens, tag length, domain, document, whether it is the document's first segment in the row)"""
    starts = np.concatenate([[0], np.cumsum(row["seg_lens"])[:-1]])
    seen = set()
    for s, n, t, dom, doc in zip(starts, row["seg_lens"], row["tag_lens"], row["seg_domain"], row["seg_doc"]):
        yield row["input_ids"][s : s + n], int(t), int(dom), int(doc), int(doc) not in seen
        seen.add(int(doc))


def check_layout(data, tok, tags=None):
    """Every row exactly seq_len, segments sum to it; a document's first segment in a row starts with the anchor and
    carries the right tag, its later chunks (interleaved) carry neither."""
    L = data.manifest.seq_len
    anchor = tok.bos_token_id
    assert data.manifest.tokenizer.anchor_id == anchor == 1
    for i in range(len(data)):
        row = data[i]
        assert row["input_ids"].shape == (L,) and row["input_ids"].dtype == np.int32
        assert row["seg_lens"].sum() == L and (row["seg_lens"] > 0).all()
        assert len(row["seg_lens"]) == len(row["seg_doc"]) == len(row["seg_domain"]) == len(row["tag_lens"])
        for seg, tag_len, dom, _, first in segments(row):
            if not first:
                assert tag_len == 0 and anchor not in seg.tolist()
                continue
            assert seg[0] == anchor
            expected_tag = tags[dom] if tags else []
            if len(seg) > len(expected_tag) + 1:
                assert tag_len == len(expected_tag)
            assert seg[1 : 1 + tag_len].tolist() == expected_tag[:tag_len]


def reconstruct(data, reference, interleaved=False):
    """Match every segment body to the plain tokenization of a source document: a new document must start with
    it, a started one must continue exactly where it stopped. Returns {doc index: tokens seen} and the order in
    which documents started."""
    by_prefix = {}
    for i, (ids, _) in enumerate(reference):
        by_prefix.setdefault(ids[0], []).append(i)
    pos, started = {}, []
    for w in range(len(data)):
        row = data[w]
        owner = {}
        for s, (seg, tag_len, dom, doc, first) in enumerate(segments(row)):
            body = seg[1 + tag_len :].tolist() if first else seg.tolist()
            if not body:
                continue
            unfinished = [k for k, p in pos.items() if p < len(reference[k][0])]
            live = [k for k in unfinished if reference[k][0][pos[k] : pos[k] + len(body)] == body]
            if not interleaved:  # one document at a time: nothing starts before the previous one is complete
                assert live == unfinished and len(live) <= 1, f"window {w} segment {s}: a document was cut short"
            if live:
                k = owner[doc] if owner.get(doc) in live else live[0]
                if not interleaved:
                    assert s == 0, "only a window's first segment may continue a document"
            else:
                cands = [k for k in by_prefix.get(body[0], []) if k not in pos and reference[k][0][: len(body)] == body]
                assert cands, f"window {w} segment {s}: not a piece of any source document"
                k = cands[0]
                pos[k] = 0
                started.append(k)
            assert DOMAINS[dom] == reference[k][1]
            assert owner.setdefault(doc, k) == k, "one seg_doc value, two documents"
            pos[k] += len(body)
    return pos, started


REFERENCE = spm.SentencePieceProcessor(model_file=str(builtin_model_file(TOKENIZER.removeprefix("builtin:"))))


def reference_tokens(tok, docs):
    """Each document's ids from SentencePiece itself (the built-in's reference tokenizer) and its domain."""
    return [(REFERENCE.encode(d["text"]), SET_DOMAIN[d["meta"]["redpajama_set_name"]]) for d in docs]


def test_round_trip_no_token_lost_or_duplicated(tmp_path, tok, words, capsys):
    docs = make_docs(words, 120)
    src = write_jsonl(tmp_path / "corpus.jsonl", docs)
    src.write_text('{not json\n{"text": ""}\n' + src.read_text())  # skipped, and no document read ahead
    data = open_packed(prepare(cfg_for(tmp_path / "out", source=src)))
    m = data.manifest
    assert m.skipped["counts"] == {"malformed_json": 1, "empty_text": 1}
    assert len(data) == m.num_windows == 100 and m.num_tokens == 12800
    check_layout(data, tok)
    ref = reference_tokens(tok, docs)
    pos, started = reconstruct(data, ref)
    # every document that started is complete, except the one the budget cut
    incomplete = [k for k, p in pos.items() if p != len(ref[k][0])]
    assert incomplete in ([], [started[-1]])
    body_tokens = sum(len(seg) - 1 for w in range(len(data)) for seg, _, _, _, _ in segments(data[w]))
    assert body_tokens == sum(pos.values())
    assert m.stats["documents"] == len(started)
    assert sum(e["tokens"] for e in m.stats["domains"].values()) == 12800
    assert started != sorted(started)  # documents were shuffled
    # the documents read past the budget into the shuffle buffer are said, so "N docs read" adds up
    ahead = m.source["documents_read"] - len(started)
    assert (
        ahead > 0
        and (
            f"wrote 100 windows (12,800 tokens, {len(started):,} documents; {ahead:,} more documents read ahead were "
            f"not needed) to "
        )
        in capsys.readouterr().out
    )


def test_source_shorter_than_budget_finishes_with_what_there_is(tmp_path, tok, words, capsys):
    docs = make_docs(words, 30, seed=1)
    src = write_jsonl(tmp_path / "c.jsonl", docs)
    data = open_packed(prepare(cfg_for(tmp_path / "out", "data.token_budget=1000000", source=src)))
    assert "more documents read" not in capsys.readouterr().out  # the unfinished window is the tail, not read ahead
    m = data.manifest
    ref = reference_tokens(tok, docs)
    total = sum(len(ids) + 1 for ids, _ in ref)  # anchors included
    assert m.source_exhausted is True
    assert m.num_windows == len(data) > 0
    # everything went into full windows but the unfinished last one (a window's worth of anchors at most extra)
    assert m.num_tokens + m.dropped_tail_tokens >= total
    assert m.dropped_tail_tokens < 128
    pos, started = reconstruct(data, ref)
    assert len(started) >= len(docs) - 2


def test_real_tokenizer_and_synthetic_default(tmp_path, tok):
    cfg = load_config(None, [f"data.output_dir={tmp_path / 'syn'}", "data.seq_len=256", "data.token_budget=20000"])
    data = open_packed(prepare(cfg))
    m = data.manifest
    assert m.tokenizer.vocab_size == 32000 and m.tokenizer.bos_id == 1 and m.tokenizer.eos_id == 2
    assert m.domains == list(DOMAINS) and m.seq_len == 256 and len(data) == 78
    check_layout(data, tok)
    text = tok.decode(data[0]["input_ids"][1:60].tolist())
    assert len(text.split()) > 20  # words, not noise
    assert (Path(cfg.data.output_dir) / "config.yaml").is_file()
    assert load_config(str(Path(cfg.data.output_dir) / "config.yaml")).data == cfg.data


def test_tokenizer_without_bos_anchors_on_eos(tmp_path, tok, words):
    # a Qwen-like tokenizer (no BOS) saved to a directory, loaded from there as data.tokenizer
    from transformers import AutoTokenizer

    no_bos = AutoTokenizer.from_pretrained(tok.name_or_path, bos_token=None, add_bos_token=False)
    no_bos.save_pretrained(str(tmp_path / "tok"))
    docs = make_docs(words, 40, seed=10)
    src = write_jsonl(tmp_path / "c.jsonl", docs)
    cfg = cfg_for(tmp_path / "out", f"data.tokenizer={tmp_path / 'tok'}", source=src)
    data = open_packed(prepare(cfg))
    info = data.manifest.tokenizer
    assert info.bos_id is None and info.anchor_id == info.eos_id == 2
    for w in range(len(data)):
        assert all(seg[0] == 2 for seg, _, _, _, _ in segments(data[w]))
    _, started = reconstruct(data, reference_tokens(tok, docs))
    assert len(started) > 10


def test_same_config_same_bytes_with_one_or_two_workers(tmp_path):
    over = ["data.seq_len=256", "data.token_budget=30000", "data.synthetic.num_docs=300", "data.seed=7"]
    outs = []
    for name, workers in (("a", 1), ("b", 1), ("c", 2)):
        out = prepare(load_config(None, over + [f"data.output_dir={tmp_path / name}", f"data.num_workers={workers}"]))
        outs.append(out)
    files = sorted(p.relative_to(outs[0]) for p in (outs[0] / "data").iterdir())
    assert files
    for other in outs[1:]:
        for f in files:
            assert (outs[0] / f).read_bytes() == (other / f).read_bytes()
        m0, m1 = (json.loads((o / "manifest.json").read_text()) for o in (outs[0], other))
        for m in (m0, m1):
            del m["build"], m["config_fingerprint"], m["checksum"]  # the config differs in num_workers, timings
        assert m0 == m1
    different_seed = prepare(load_config(None, over[:-1] + ["data.seed=8", f"data.output_dir={tmp_path / 'd'}"]))
    assert (different_seed / files[0]).read_bytes() != (outs[0] / files[0]).read_bytes()


def test_more_workers_than_cores_starts_one_per_core_and_says_so(tmp_path, monkeypatch, capsys):
    """A config written for a larger machine (or a typo: 100000) must not start that many processes."""
    monkeypatch.setattr(prepare_module, "usable_cpus", lambda: 2)
    over = ["data.seq_len=256", "data.token_budget=30000", "data.synthetic.num_docs=300", "data.num_workers=100000"]
    out = prepare(load_config(None, [*over, f"data.output_dir={tmp_path / 'o'}"]))
    assert json.loads((out / "manifest.json").read_text())["build"]["num_workers"] == 2
    captured = capsys.readouterr()
    said, warned = (" ".join(text.split()) for text in (captured.out, captured.err))
    warning = "data.num_workers = 100000 is more than the 2 CPU cores this process may use: 2 tokenizer processes"
    assert warning in warned and warning not in said
    assert "2 worker(s)" in said


@pytest.mark.parametrize(
    ("exitcode", "how"),
    [
        (
            -9,
            "was killed by SIGKILL (most likely the kernel's out-of-memory killer: the host ran out of memory): "
            "free memory or lower data.num_workers",
        ),
        (-11, "crashed with SIGSEGV in native code (a library aborted or faulted)"),
        (-15, "was killed by SIGTERM (stopped from outside: a scheduler or a user)"),
        (1, "exited with code 1 without reporting an error"),
    ],
)
def test_a_dead_tokenizer_worker_is_one_line_naming_how_it_ended(monkeypatch, exitcode, how):
    def dies(*args):
        raise WorkerDied(3, exitcode)
        yield

    monkeypatch.setattr(prepare_module, "imap_ordered", dies)
    with pytest.raises(UserError) as e:
        list(prepare_module._encoded(iter([]), None, workers=3))
    assert str(e.value) == (
        f"prepare: a tokenizer worker process (of 3, data.num_workers) {how}; run 'lctrain prepare' again: it "
        f"resumes from its last complete shard"
    )


def test_an_error_while_packing_ends_the_workers_before_it_leaves_prepare(tmp_path, monkeypatch):
    """The error's traceback holds the loop's frame, and with it the workers' iterator: they must not live as long."""
    calls = []

    def fails_on_the_tenth_record(self, *args):
        calls.append(1)
        if len(calls) == 10:
            raise RuntimeError("a shard could not be written")

    monkeypatch.setattr(prepare_module._Builder, "read", fails_on_the_tenth_record)
    over = ["data.seq_len=256", "data.token_budget=30000", "data.synthetic.num_docs=300", "data.num_workers=2"]
    try:
        prepare(load_config(None, [*over, f"data.output_dir={tmp_path / 'o'}"]))
    except RuntimeError as e:  # checked here, while the error (and its traceback) is alive: pytest.raises clears it
        assert str(e) == "a shard could not be written"
        assert not [p for p in multiprocessing.active_children() if p.name == "lctrain-worker"]
    else:
        pytest.fail("prepare did not raise")


def test_tokenizing_out_of_memory_is_one_line(monkeypatch):
    """A MemoryError a worker raised (the pool sends it back as it is)."""

    def runs_out(*args):
        raise MemoryError()
        yield

    monkeypatch.setattr(prepare_module, "imap_ordered", runs_out)
    with pytest.raises(UserError, match=r"^prepare: tokenizing ran out of memory \(2 tokenizer process\(es\)"):
        list(prepare_module._encoded(iter([]), None, workers=2))


@pytest.mark.parametrize(
    "error, line",
    [
        (
            ModuleNotFoundError("No module named 'custom_tokenizer'"),
            r"^prepare: the tokenizer could not be set up in a "
            r"worker process \(ModuleNotFoundError: No module named 'custom_tokenizer'\); set data.num_workers=1",
        ),
        (MemoryError(), r"^prepare: tokenizing ran out of memory \(2 tokenizer process\(es\)"),
    ],
)
def test_a_worker_that_cannot_set_up_the_tokenizer_is_one_line(monkeypatch, error, line):
    def cannot_start(*args):
        raise WorkerStartFailed(2, error) from error
        yield

    monkeypatch.setattr(prepare_module, "imap_ordered", cannot_start)
    with pytest.raises(UserError, match=line):
        list(prepare_module._encoded(iter([]), None, workers=2))


def test_zst_parquet_and_slimpajama_layout(tmp_path, tok, words):
    docs = make_docs(words, 90, seed=2)
    root = tmp_path / "SlimPajama-627B"
    write_jsonl(root / "train" / "chunk1" / "example_train_0.jsonl.zst", docs[:30], zst=True)
    write_jsonl(root / "train" / "chunk2" / "example_train_1.jsonl.zst", docs[30:60], zst=True)
    write_jsonl(root / "validation" / "chunk1" / "example_val_0.jsonl.zst", make_docs(words, 5, seed=99), zst=True)
    (root / "train" / "chunk3").mkdir()
    pq.write_table(pa.Table.from_pylist(docs[60:]), root / "train" / "chunk3" / "part.parquet")
    data = open_packed(prepare(cfg_for(tmp_path / "out", "data.token_budget=1000000", source=root)))
    assert data.manifest.source["files"] == 3  # validation/ is not read
    ref = reference_tokens(tok, docs)
    pos, started = reconstruct(data, ref)
    assert len(started) >= 88
    counts = {d: e["documents"] for d, e in data.manifest.stats["domains"].items()}
    assert counts["other"] == 0 and counts["C4"] > 0


def test_hub_streaming_path_on_a_local_dataset_directory(tmp_path, tok, words):
    docs = make_docs(words, 50, seed=8)
    root = tmp_path / "hub_copy"
    write_jsonl(root / "train" / "chunk1" / "example_train_0.jsonl.zst", docs, zst=True)
    cfg = cfg_for(tmp_path / "out", "data.source=hub", f"data.hub_name={root}", "data.token_budget=1000000")
    data = open_packed(prepare(cfg))
    assert data.manifest.source["kind"] == "hub" and data.manifest.source["records_read"] == 50
    pos, started = reconstruct(data, reference_tokens(tok, docs))
    assert len(started) >= 48


def test_statistics_match_the_rows(tmp_path, tok, words):
    docs = make_docs(words, 150, seed=9)
    src = write_jsonl(tmp_path / "c.jsonl", docs)
    data = open_packed(prepare(cfg_for(tmp_path / "out", "data.token_budget=1000000", source=src)))
    st = data.manifest.stats
    tokens = np.zeros(len(DOMAINS), dtype=np.int64)
    for w in range(len(data)):
        np.add.at(tokens, data[w]["seg_domain"].astype(int), data[w]["seg_lens"])
    assert [st["domains"][d]["tokens"] for d in DOMAINS] == tokens.tolist()
    assert abs(sum(e["documents_share"] for e in st["domains"].values()) - 1) < 1e-9
    assert abs(sum(e["tokens_share"] for e in st["domains"].values()) - 1) < 1e-9
    ref = reference_tokens(tok, docs)
    _, started = reconstruct(data, ref)
    lengths = np.array([len(ref[k][0]) for k in started])
    expected = [
        int(((lengths >= lo) & (lengths < hi)).sum()) for lo, hi in zip([0, 1024, 2048, 4096], [1024, 2048, 4096, 8192])
    ]
    hist = st["length_histogram"]
    assert hist["labels"][:4] == ["<1K", "1K-2K", "2K-4K", "4K-8K"]
    assert hist["counts"][:4] == expected and sum(hist["counts"]) == st["documents"] == len(started)
    assert expected[1] > 0  # the corpus has a few documents over 1K tokens


def test_upsampled_mixture_hits_domain_shares(tmp_path, tok, words):
    # per domain: many short documents and enough long ones to fill any domain's share
    rng = random.Random(3)
    docs = []
    for i in range(2800):
        dom = SET_NAMES[i % 7]
        k = rng.randint(5, 20) if i % 2 else rng.randint(80, 160)
        text = words[i] + " " + " ".join(rng.choice(words) for _ in range(k))
        docs.append({"text": text, "meta": {"redpajama_set_name": dom}})
    src = write_jsonl(tmp_path / "c.jsonl", docs)
    cfg = cfg_for(
        tmp_path / "up",
        "data.mixture=upsampled",
        "data.short_doc_tokens=64",
        "data.seq_len=256",
        "data.token_budget=40960",
        source=src,
    )
    data = open_packed(prepare(cfg))
    assert len(data) == 160
    tokens = np.zeros(len(DOMAINS))
    short = long_ = 0
    for w in range(len(data)):
        row = data[w]
        np.add.at(tokens, row["seg_domain"].astype(int), row["seg_lens"])
    shares = tokens / tokens.sum()
    for i, name in enumerate(DOMAINS):
        assert abs(shares[i] - UPSAMPLED_MIX_128K_TOKEN_SHARES[name]) < 0.03, (name, shares[i])
    ref = reference_tokens(tok, docs)
    pos, started = reconstruct(data, ref)
    for k in started:
        if len(ref[k][0]) < 64:
            short += 1
        else:
            long_ += 1
    # the source alternates short and long documents; kept short ones are about 10% of the long ones
    assert 0.04 < short / long_ < 0.2
    assert data.manifest.mixture_dropped["short_doc_downsampled"] > 0


def test_domain_tags(tmp_path, tok, words):
    docs = make_docs(words, 60, seed=4)
    src = write_jsonl(tmp_path / "c.jsonl", docs)
    data = open_packed(prepare(cfg_for(tmp_path / "t", "data.domain_tags=true", source=src)))
    tags = {i: tok(name, add_special_tokens=False)["input_ids"] for i, name in enumerate(DOMAINS)}
    assert data.manifest.tags["Wikipedia"] == tags[DOMAINS.index("Wikipedia")]
    check_layout(data, tok, tags)
    assert any(row_tag > 0 for w in range(len(data)) for row_tag in data[w]["tag_lens"])
    pos, started = reconstruct(data, reference_tokens(tok, docs))
    assert len(started) > 10


def test_a_tail_too_short_for_a_text_token_holds_the_anchor_and_what_fits_of_the_tag(tmp_path, tok, words):
    """docs/data.md: with domain tags, a window's tail too short for one text token holds the next document's anchor
    and as much of its tag as fits (`tag_lens` counts it), the document starting whole in the next window; the labels
    mask that tag token's target as every tag's, and the row's last."""
    L = 64
    tag = tok("StackExchange", add_special_tokens=False)["input_ids"]
    assert len(tag) == 3  # '▁Stack' 'Ex' 'change'
    first = " ".join(words[: L - 3 - len(tag)])  # anchor, tag and text leave 2 tokens: an anchor and 1 tag token
    second = " ".join(words[100:200])
    docs = [{"text": t, "meta": {"redpajama_set_name": "RedPajamaStackExchange"}} for t in (first, second)]
    ids = [tok(d["text"], add_special_tokens=False)["input_ids"] for d in docs]
    src = write_jsonl(tmp_path / "c.jsonl", docs)
    over = ["data.domain_tags=true", f"data.seq_len={L}", f"data.token_budget={2 * L}", "data.shuffle_buffer_tokens=0"]
    data = open_packed(prepare(cfg_for(tmp_path / "out", *over, source=src)))
    anchor = tok.bos_token_id
    rows = [data[i] for i in range(len(data))]
    assert rows[0]["input_ids"].tolist() == [anchor, *tag, *ids[0], anchor, tag[0]]
    assert rows[0]["seg_lens"].tolist() == [L - 2, 2] and rows[0]["tag_lens"].tolist() == [len(tag), 1]
    assert rows[1]["input_ids"].tolist() == [anchor, *tag, *ids[1][: L - 1 - len(tag)]]
    assert rows[1]["tag_lens"].tolist() == [len(tag)]

    row = rows[0]
    batch = make_batch(
        torch.tensor(row["input_ids"][None]),
        [row["seg_lens"]],
        "full",
        seg_doc=[row["seg_doc"]],
        tag_lens=[row["tag_lens"]],
    )
    labels = batch.labels[0].tolist()
    assert labels[L - 3] == anchor  # the anchor after the first document's last token is learned
    assert labels[L - 2] == labels[L - 1] == -100  # the tail's tag token, and nothing after the row


def test_interleaved_chunks_keep_order_and_share_seg_doc(tmp_path, tok, words):
    docs = make_docs(words, 80, seed=5, lengths=(3, 60))
    src = write_jsonl(tmp_path / "c.jsonl", docs)
    data = open_packed(prepare(cfg_for(tmp_path / "i", "data.interleave_chunks=true", source=src)))
    check_layout(data, tok)
    ref = reference_tokens(tok, docs)
    pos, started = reconstruct(data, ref, interleaved=True)  # asserts in-order chunks and seg_doc consistency
    assert sum(1 for k, p in pos.items() if p == len(ref[k][0])) >= len(started) - 3
    shared = sum(len(set(data[w]["seg_doc"].tolist())) < len(data[w]["seg_doc"]) for w in range(len(data)))
    assert shared > len(data) // 4


def test_older_format_is_refused_in_one_line_and_rebuilt(tmp_path, tok, words):
    src = write_jsonl(tmp_path / "c.jsonl", make_docs(words, 40, seed=8, lengths=(3, 60)))
    for interleaved in (False, True):
        cfg = cfg_for(
            tmp_path / str(interleaved), f"data.interleave_chunks={interleaved}", "data.token_budget=1280", source=src
        )
        out = prepare(cfg)
        manifest = json.loads((out / "manifest.json").read_text())
        assert manifest["format_version"] == FORMAT_VERSION
        # other ids (SentencePiece), another chunk layout, no shard checksums: never trained on (format 4's
        # SentencePiece ids are this lctrain's: tests/test_special_token_text.py)
        for old in (1, 2, 3):
            (out / "manifest.json").write_text(json.dumps(manifest | {"format_version": old}))
            with pytest.raises(UserError, match=f"dataset format {old},.* run 'lctrain prepare' with the same config"):
                open_packed(out)
        prepare(cfg)  # rebuilds it
        assert open_packed(out).manifest.format_version == FORMAT_VERSION


def test_a_dataset_of_a_newer_lctrain_is_named_so_and_kept(tmp_path, words):
    """After a downgrade: a later format, or fields this lctrain does not know under a checksum that covers them, is
    the newer lctrain's dataset, not damage: reading it says to upgrade, and prepare does not replace it unless
    --force. An unknown field the checksum does not cover is an edit: damage, as before."""
    src = write_jsonl(tmp_path / "c.jsonl", make_docs(words, 40, seed=8, lengths=(3, 60)))
    cfg = cfg_for(tmp_path / "data", "data.token_budget=1280", source=src)
    out = prepare(cfg)
    written = json.loads((out / MANIFEST).read_text())

    def rewrite(raw: dict, checksum: bool = True) -> None:
        raw = {k: v for k, v in raw.items() if k != CHECKSUM_KEY}
        raw[CHECKSUM_KEY] = manifest_checksum(raw) if checksum else written[CHECKSUM_KEY]
        (out / MANIFEST).write_text(json.dumps(raw))

    for raw, said in (
        (written | {"format_version": FORMAT_VERSION + 1}, f"dataset format {FORMAT_VERSION + 1}; lctrain .* reads"),
        (written | {"shard_order": "by length", "zstd": True}, "fields shard_order, zstd, which lctrain .* does not"),
    ):
        rewrite(raw)
        with pytest.raises(UserError, match=f"written by a newer lctrain \\({said}.*; upgrade lctrain to read it$"):
            open_packed(out)
        before = (out / MANIFEST).read_bytes()
        with pytest.raises(
            UserError, match="rebuilding it here would replace it; upgrade lctrain, or rerun with --force"
        ):
            prepare(cfg)
        assert (out / MANIFEST).read_bytes() == before
    rewrite(written | {"zstd": True}, checksum=False)
    with pytest.raises(UserError, match="the prepared dataset is damaged"):
        open_packed(out)
    rewrite(written | {"format_version": FORMAT_VERSION + 1})
    prepare(cfg, force=True)  # rebuilt by this lctrain
    assert open_packed(out).manifest.format_version == FORMAT_VERSION


def test_bad_records_are_skipped_counted_and_strict_stops(tmp_path, words):
    good = make_docs(words, 40, seed=6)
    lines = (
        [json.dumps(d) for d in good[:20]]
        + [
            "{not json",
            json.dumps({"meta": {}}),
            json.dumps({"text": "   "}),
            json.dumps({"text": 5}),
            json.dumps({"text": "unknown domain doc", "meta": {"redpajama_set_name": "RedPajamaNews"}}),
        ]
        + [json.dumps(d) for d in good[20:]]
    )
    src = tmp_path / "c.jsonl"
    src.write_bytes("\n".join(lines).encode() + b"\n\xff\xfe broken utf8\n")
    data = open_packed(prepare(cfg_for(tmp_path / "out", "data.token_budget=100000", source=src)))
    sk = data.manifest.skipped
    assert sk["counts"] == {"malformed_json": 1, "no_text": 2, "empty_text": 1, "undecodable": 1}
    assert sk["examples"][0] == {"reason": "malformed_json", "source": str(src), "line": 21}
    assert data.manifest.stats["domains"]["other"]["documents"] == 1

    r = CliRunner().invoke(
        app,
        [
            "prepare",
            "--strict",
            "--set",
            f"data.output_dir={tmp_path / 's'}",
            "--set",
            "data.source=local",
            "--set",
            f"data.path={src}",
            "--set",
            "data.seq_len=128",
        ],
    )
    line = one_error_line(r)
    assert r.stderr.strip().splitlines()[-1] == line and f"{src}:21" in line and "not a JSON object" in line
    assert not (tmp_path / "s").exists()


def test_strict_on_a_dataset_that_skipped_bad_records_is_refused_not_a_noop(tmp_path, words):
    """`strict` is not a data setting, so --strict finds the dataset a build without it made: when that build skipped
    bad records, "nothing to do" would tell someone validating the corpus that it is clean. Refused, naming the
    counts by reason and where they are recorded; --strict --force rebuilds and stops at the first. A dataset whose
    build skipped nothing --strict stops at (a blank line is no bad record) is nothing to do."""
    good = [json.dumps(d) for d in make_docs(words, 30, seed=7)]
    # text all whitespace as str.isspace counts it, the separators \x1c-\x1f included, is empty (docs/data.md)
    blank = "\u00a0\u3000\x1c\x1f"
    assert blank.isspace()
    bad = ["{not json", json.dumps({"meta": {}}), json.dumps({"text": 7}), json.dumps({"text": blank})]
    src = tmp_path / "bad.jsonl"
    src.write_text("\n".join(good[:10] + bad + good[10:]) + "\n")
    clean = tmp_path / "clean.jsonl"
    clean.write_text("\n".join(good[:10] + [""] + good[10:]) + "\n")

    def run(path, out, *flags):
        over = ["data.source=local", f"data.path={path}", "data.seq_len=128", f"data.output_dir={tmp_path / out}"]
        return CliRunner().invoke(app, ["prepare", *flags, *set_args(over)])

    assert run(src, "bad").exit_code == 0
    assert open_packed(tmp_path / "bad").manifest.skipped["counts"] == {
        "empty_text": 1,
        "malformed_json": 1,
        "no_text": 2,
    }
    line = one_error_line(run(src, "bad", "--strict"))
    assert line == (
        f"error: {tmp_path / 'bad'}: already prepared, but its build skipped 4 bad records without --strict "
        f"(1 empty_text, 1 malformed_json, 2 no_text; manifest.json: skipped.counts); run prepare again with --strict "
        f"--force to rebuild it, stopping at the first one"
    )
    line = one_error_line(run(src, "bad", "--strict", "--force"))
    assert f"{src}:11: malformed JSON or not a JSON object (--strict stops at the first bad record" in line

    assert run(clean, "clean").exit_code == 0
    assert open_packed(tmp_path / "clean").manifest.skipped["counts"] == {"blank_line": 1}
    r = run(clean, "clean", "--strict")
    assert r.exit_code == 0 and "nothing to do" in r.output, r.output


@pytest.mark.parametrize(
    "overrides,needle",
    [
        (["data.source=local", "data.path=/nonexistent/corpus.jsonl"], "no such file"),
        (["data.source=local", "data.path={tmp}/empty"], "no .jsonl"),
        (["data.source=local", "data.path={tmp}/corrupt.jsonl.zst"], "corrupt.jsonl.zst: unreadable"),
        (["data.source=local", "data.path={tmp}/corrupt.parquet"], "corrupt.parquet: unreadable as parquet"),
        (["data.tokenizer=/nonexistent/tokenizer_dir"], "tokenizer '/nonexistent/tokenizer_dir' could not be loaded"),
        (["data.token_budget=100"], "smaller than one window"),
        (["data.synthetic.num_docs=1", "data.synthetic.max_words=20"], "not enough for one 128-token window"),
        (
            ["data.source=local", "data.path={tmp}/bad.jsonl"],
            "0 usable documents (skipped: 2 malformed_json, 1 no_text)",
        ),
        (["data.output_dir={tmp}/a_file/out"], "cannot write the dataset to"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, overrides, needle):
    (tmp_path / "in" / "empty").mkdir(parents=True)
    (tmp_path / "in" / "corrupt.jsonl.zst").write_bytes(b"\x28\xb5\x2f\xfd garbage garbage")
    (tmp_path / "in" / "a_file").write_text("not a directory")
    (tmp_path / "in" / "corrupt.parquet").write_bytes(b"PAR1 not really parquet")
    (tmp_path / "in" / "bad.jsonl").write_text('{not json\n[1]\n{"meta": {}}\n')
    args = ["prepare", "--set", f"data.output_dir={tmp_path / 'out'}", "--set", "data.seq_len=128"]
    for o in overrides:
        args += ["--set", o.replace("{tmp}", str(tmp_path / "in"))]
    r = CliRunner().invoke(app, args)
    line = one_error_line(r)
    assert r.stderr.strip().splitlines()[-1] == line and needle in line
    assert not (tmp_path / "out").exists()


def test_a_rerun_after_the_input_grew_is_refused_not_a_noop(tmp_path, words):
    """The data fingerprint holds the settings, not the files: records appended to the corpus since it was prepared
    are named (count and bytes then and now) instead of being left unread; --force rebuilds from them. An input
    that is gone leaves the dataset prepared."""
    src = write_jsonl(tmp_path / "c.jsonl", make_docs(words, 20, seed=3))
    cfg = cfg_for(tmp_path / "out", "data.token_budget=1280000", source=src)
    prepared_windows = len(open_packed(prepare(cfg)))
    size = src.stat().st_size
    with src.open("a") as f:
        f.write("".join(json.dumps(d) + "\n" for d in make_docs(words, 20, seed=4)))
    with pytest.raises(
        UserError,
        match=rf"the input files changed since \(it was prepared from 1 file, {size:,} "
        rf"bytes, the input is now 1 file, {src.stat().st_size:,} bytes\); .* --force",
    ):
        prepare(cfg)
    assert len(open_packed(prepare(cfg, force=True))) > prepared_windows
    src.unlink()
    assert prepare(cfg) == tmp_path / "out"


def test_token_ids_are_stored_in_two_bytes_when_the_vocabulary_fits(tmp_path, tok, monkeypatch):
    """32,000 ids fit uint16: the shards hold half the bytes of int32 ones, and a window reads back the same int32 ids
    either way; a dataset prepared before (int32 shards, a manifest that names no token_dtype) still opens."""
    narrow = open_packed(prepare(cfg_for(tmp_path / "narrow")))
    assert narrow.manifest.token_dtype == "uint16" and len(tok) == 32000
    assert narrow.rows.features["input_ids"].feature.dtype == "uint16"
    monkeypatch.setattr(prepare_module, "token_dtype", lambda vocab_size: "int32")  # as prepare wrote before
    wide_dir = prepare(cfg_for(tmp_path / "wide"))
    raw = json.loads((wide_dir / MANIFEST).read_text())
    del raw["token_dtype"], raw[CHECKSUM_KEY]
    raw[CHECKSUM_KEY] = manifest_checksum(raw)
    (wide_dir / MANIFEST).write_text(json.dumps(raw))
    wide = open_packed(wide_dir)
    assert wide.manifest.token_dtype == "int32" and wide.rows.features["input_ids"].feature.dtype == "int32"
    assert len(narrow) == len(wide) > 0
    for i in range(len(narrow)):
        a, b = narrow[i], wide[i]
        assert all(a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]) for k in a)
    ids_bytes = len(narrow) * narrow.manifest.seq_len * 2  # what the narrower ids save
    saved = sum(s.bytes for s in wide.manifest.shards) - sum(s.bytes for s in narrow.manifest.shards)
    assert ids_bytes <= saved < ids_bytes * 1.1


def test_the_storage_width_follows_the_vocabulary_and_never_wraps_an_id(tmp_path):
    assert [token_dtype(v) for v in (32000, 65536, 65537, 128256)] == ["uint16", "uint16", "int32", "int32"]
    writer = ShardWriter(tmp_path, 4, shard_windows=8, ids_dtype="uint16", batch_windows=1)
    window = Window(*(np.array(v, dtype=np.int32) for v in ([1, 2, 65535, 65536], [4], [0], [0], [0])))
    with pytest.raises(ValueError, match="token id 65536 does not fit uint16"):
        writer.add(window)
    writer.abort()


def test_a_same_size_edit_of_the_input_is_said_not_refused(tmp_path, words, capsys):
    """Only the modification time tells an edit that keeps the size (a corrected character), and a copy without its
    times or a `touch` looks the same: prepare says it and keeps the dataset; a manifest from before the times were
    kept says nothing."""
    src = write_jsonl(tmp_path / "c.jsonl", make_docs(words, 20, seed=3))
    cfg = cfg_for(tmp_path / "out", source=src)
    out = prepare(cfg)
    manifest = open_packed(out).manifest
    text = src.read_text()
    src.write_text(text.replace("a", "b", 1))
    later = manifest.source["newest_mtime"] + 60
    os.utime(src, (later, later))
    capsys.readouterr()
    assert prepare(cfg) == out
    out_text, err_text = capsys.readouterr()
    said = " ".join(err_text.split())
    assert "was modified after" not in out_text
    assert f"warning: {src} was modified after the dataset was prepared (" in said
    assert "though the files' count and sizes agree: if its text changed, run prepare again with --force" in said
    assert input_change(cfg, manifest).sizes is False
    before_times = {k: v for k, v in manifest.source.items() if k not in ("newest_mtime", "newest_file")}
    assert input_change(cfg, manifest.model_copy(update={"source": before_times})) is None


def test_an_input_shorter_than_the_budget_says_so_and_what_training_would_re_read(tmp_path, words, capsys):
    src = write_jsonl(tmp_path / "c.jsonl", make_docs(words, 10, seed=5))
    cfg = cfg_for(tmp_path / "out", "data.token_budget=1280000", "train.steps=1000", source=src)
    windows = len(open_packed(prepare(cfg)))
    captured = capsys.readouterr()
    ran_out = f"the source ran out before the budget: {windows:,} of 10,000 windows"
    assert ran_out in captured.err and ran_out not in captured.out
    fits = (windows - cfg.eval.ppl_windows) // cfg.train.global_batch  # the held-out windows stay unread
    advice = f"add input data (and prepare again) or set train.steps={fits}"
    assert advice in " ".join(captured.err.split()) and advice not in " ".join(captured.out.split())
    assert "shuffled through a buffer" not in captured.err  # every document was read


def test_a_budget_below_the_input_says_it_sampled_the_inputs_head(tmp_path, tok, words, capsys):
    """The shuffle buffer is at most the budget: the windows come from the first documents read, which is said."""
    src = write_jsonl(tmp_path / "c.jsonl", make_docs(words, 1200, seed=5))
    manifest = open_packed(prepare(cfg_for(tmp_path / "out", source=src))).manifest
    said = " ".join(capsys.readouterr().err.split())
    assert not manifest.source_exhausted and manifest.shuffle["buffer_tokens"] == 12800
    read = manifest.source["tokens_read"]
    total = sum(len(tok(d["text"], add_special_tokens=False)["input_ids"]) for d in make_docs(words, 1200, seed=5))
    assert read < total / 2
    assert "shuffled through a buffer of 12,800 tokens (data.shuffle_buffer_tokens, at most the budget): the " in said
    assert f"windows hold documents of the first {read:,} tokens read" in said
    prepare(cfg_for(tmp_path / "plain", "data.shuffle_buffer_tokens=0", source=src))  # file order, as asked
    assert "shuffled through a buffer" not in capsys.readouterr().err


def test_rerun_is_a_noop_and_other_fingerprint_needs_force(tmp_path):
    out = tmp_path / "out"
    over = ["data.seq_len=128", "data.token_budget=2560", f"data.output_dir={out}"]
    prepare(load_config(None, over))
    manifest = (out / "manifest.json").stat().st_mtime_ns
    r = CliRunner().invoke(app, ["prepare"] + [x for o in over for x in ("--set", o)])
    assert r.exit_code == 0 and "already prepared" in r.output
    assert (out / "manifest.json").stat().st_mtime_ns == manifest
    with pytest.raises(UserError, match="another data fingerprint.*--force"):
        prepare(load_config(None, over + ["data.seed=1"]))
    prepare(load_config(None, over + ["data.seed=1"]), force=True)
    assert open_packed(out).manifest.seed == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_an_already_prepared_dataset_is_refused_for_a_model_of_another_tokenizer(tmp_path):
    """The model is not in the data fingerprint, so its dataset is already there: `prepare` still refuses a tokenizer
    whose ids mean other tokens to the model, in the line a fresh `prepare` (another output_dir) refuses it with. The
    check reads only the tokenizer saved beside the model."""
    model = tmp_path / "model"
    save_tokenizer(load_tokenizer("builtin:mistral-7b-v0.3"), model)
    over = ["data.seq_len=128", "data.token_budget=2560", f"data.output_dir={tmp_path / 'out'}"]
    prepare(load_config(None, over))
    with_model = [*over, f"model.name_or_path={model}", "model.arch=null"]
    line = one_error_line(CliRunner().invoke(app, ["prepare", *set_args(with_model)]))
    fresh = [*with_model, f"data.output_dir={tmp_path / 'fresh'}"]
    assert line == one_error_line(CliRunner().invoke(app, ["prepare", *set_args(fresh)]))
    assert f"data.tokenizer = '{TOKENIZER}' is not the tokenizer of model.name_or_path = '{model}'" in line


def dataset_bytes(out: Path) -> dict:
    """Every file of a prepared dataset, the manifest without what differs between runs (timings, its checksum)."""
    files = {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}
    manifest = json.loads(files.pop("manifest.json"))
    del manifest["build"], manifest["checksum"]
    return files | {"manifest.json": manifest}


def test_interrupted_run_resumes_from_its_last_complete_shard(tmp_path, monkeypatch):
    out = tmp_path / "out"
    over = ["data.seq_len=128", "data.token_budget=6400", "data.shard_tokens=1024"]  # 8 windows a shard
    over = [*over, f"data.output_dir={out}"]
    reference = dataset_bytes(prepare(load_config(None, over)).rename(tmp_path / "ref"))
    original = ShardWriter.add

    def failing_add(self, window):
        if self.num_windows == 20:
            raise RuntimeError("injected failure")
        return original(self, window)

    monkeypatch.setattr(ShardWriter, "add", failing_add)
    with pytest.raises(RuntimeError, match="injected"):
        prepare(load_config(None, over))
    assert sorted(p.name for p in tmp_path.iterdir()) == [".out.partial", "ref"]  # nothing that looks complete
    with pytest.raises(UserError, match="run 'lctrain prepare"):
        open_packed(out)
    # what killed runs of older versions left behind is removed by the next run
    for dead in (tmp_path / ".out.old-999999999", tmp_path / ".out.partial-999999999"):
        (dead / "data").mkdir(parents=True)
    monkeypatch.setattr(ShardWriter, "add", original)
    data = open_packed(prepare(load_config(None, over)))
    assert len(data) == 50 and len(data.manifest.shards) == 7
    assert data.manifest.build["resumed_after_shards"] == 2  # 16 of the 20 windows written were in complete shards
    assert dataset_bytes(out) == reference
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "ref"]


def test_progress_of_other_settings_is_not_resumed(tmp_path, monkeypatch):
    over = ["data.seq_len=128", "data.token_budget=6400", "data.shard_tokens=1024", f"data.output_dir={tmp_path / 'o'}"]
    original = ShardWriter.add

    def failing_add(self, window):
        if self.num_windows == 20:
            raise RuntimeError("injected failure")
        return original(self, window)

    monkeypatch.setattr(ShardWriter, "add", failing_add)
    with pytest.raises(RuntimeError, match="injected"):
        prepare(load_config(None, over))
    monkeypatch.setattr(ShardWriter, "add", original)
    data = open_packed(prepare(load_config(None, over + ["data.seed=1"])))
    assert "resumed_after_shards" not in data.manifest.build
    got = dataset_bytes(tmp_path / "o")
    assert dataset_bytes(prepare(load_config(None, over + ["data.seed=1"]), force=True)) == got  # built afresh


def test_open_packed_rejects_incomplete_directories(tmp_path):
    with pytest.raises(UserError, match="run 'lctrain prepare"):
        open_packed(tmp_path / "missing")
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "manifest.json").write_text(json.dumps({"complete": False}))
    with pytest.raises(UserError, match="incomplete"):
        open_packed(tmp_path / "half")


def test_domains_from_slimpajama_meta():
    from lctrain.data.encode import domain_of

    for set_name, domain in SET_DOMAIN.items():
        assert DOMAINS[domain_of({"redpajama_set_name": set_name})] == domain
        assert DOMAINS[domain_of(json.dumps({"redpajama_set_name": set_name}))] == domain  # meta stored as a string
    for meta in (None, {}, {"redpajama_set_name": "RedPajamaNews"}, "not json", 3):
        assert DOMAINS[domain_of(meta)] == "other"


def test_explicit_anchor_is_used_recorded_and_checked_at_train(tmp_path, tok, words):
    """data.anchor=eos: every segment opens with </s> (id 2), the manifest records it, and training refuses the
    dataset once its recorded anchor differs from what the config's resolves to."""
    from lctrain.data.manifest import AnchorRecord
    from lctrain.data.store import read_manifest, write_manifest
    from lctrain.train.data import open_checked

    src = write_jsonl(tmp_path / "c.jsonl", make_docs(words, 40, seed=11))
    cfg = cfg_for(tmp_path / "out", "data.anchor=eos", source=src)
    data = open_packed(prepare(cfg))
    assert data.manifest.anchor.model_dump() == {"token": "</s>", "id": 2} and tok.eos_token_id == 2
    for w in range(len(data)):
        assert all(seg[0] == 2 for seg, _, _, _, _ in segments(data[w]))
    assert len(open_checked(cfg)) == len(data)
    m = read_manifest(tmp_path / "out")
    other = {"anchor": AnchorRecord(token="<s>", id=1), "tokenizer": m.tokenizer.model_copy(update={"anchor_id": 1})}
    write_manifest(tmp_path / "out", m.model_copy(update=other))
    with pytest.raises(UserError, match=r"segments start with anchor <s> \(id 1\), data.anchor = eos is </s> \(id 2\)"):
        open_checked(cfg)
    write_manifest(tmp_path / "out", m.model_copy(update={**other, "data_fingerprint": "0" * 64}))
    with pytest.raises(
        UserError, match=r"prepared with other data settings \(data.anchor <s> -> </s>\); run '.* --force'"
    ):
        open_checked(cfg)
    bad = cfg_for(tmp_path / "other", "data.anchor=nope", source=src)
    # named as the config names it (a built-in tokenizer's own name is the cache directory it was written to)
    with pytest.raises(UserError, match=rf"data.anchor = 'nope' is not a token of tokenizer '{bad.data.tokenizer}';"):
        prepare(bad)
