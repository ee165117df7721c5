"""`data.sources`: several corpora drawn document by document by weight with a seeded generator, each with its text
field and its domains (the source's name or a metadata field), checked against a plain re-implementation of the
draw; byte-identical whatever the number of workers; bad input refused in one line naming the key."""

import hashlib
import json
import re

import datasets
import huggingface_hub
import numpy as np
import pytest
from train_helpers import one_error_line, show_config_refusal
from typer.testing import CliRunner

from lctrain.cli import app
from lctrain.config import DOMAINS, config_fingerprint, data_fingerprint, load_config
from lctrain.data import encode
from lctrain.data.prepare import SOURCES_DRAW_SEED, prepare
from lctrain.data.progress import Partial
from lctrain.data.store import open_packed
from lctrain.errors import UserError
from lctrain.tokenizer import load_tokenizer


def write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture
def corpora(tmp_path):
    # each document's first word names it, so the order of the packed documents can be read back
    a = write(
        tmp_path / "a.jsonl",
        [{"content": f"alpha{i} " + "apple " * 40, "meta": {"lang": "fr" if i % 3 else "en"}} for i in range(200)],
    )
    b = write(tmp_path / "b.jsonl", [{"text": f"beta{i} " + "banana " * 40} for i in range(200)])
    return a, b


def sources_cfg(tmp_path, a, b, *extra, out="out", domain_field=None):
    alpha = f"{{name: alpha, path: '{a}', text_field: content, weight: 3"
    alpha += f", domain_field: {domain_field}}}" if domain_field else "}"
    over = [
        f"data.sources=[{alpha}, {{name: beta, path: '{b}', weight: 1}}]",
        "data.seq_len=64",
        "data.token_budget=6400",
        "data.shuffle_buffer_tokens=0",  # documents in the order drawn
        f"data.output_dir={tmp_path / out}",
    ]
    return load_config(None, [*over, *extra])


def reference_draw(names_by_source, weights, seed):
    """The seeded weighted draw, written out as a plain loop: pick source i with probability w_i / the sum of the
    weights of the sources not yet exhausted, take its next document."""
    rng = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(SOURCES_DRAW_SEED,)))
    position = [0] * len(names_by_source)
    alive = list(range(len(names_by_source)))
    out = []
    while alive:
        total = sum(weights[i] for i in alive)
        u = rng.random() * total
        acc = 0.0
        for i in alive:
            acc += weights[i]
            if u < acc:
                break
        if position[i] == len(names_by_source[i]):
            alive.remove(i)
            continue
        out.append(names_by_source[i][position[i]])
        position[i] += 1
    return out


def packed_documents(path):
    """The documents' first words in packed order (from all windows' text, decoded at once: a document may start
    at a window's end), and (first word, domain name) of each segment that starts with one."""
    data = open_packed(path)
    tok = load_tokenizer(data.manifest.tokenizer.spec)
    starts, text = [], []
    for i in range(len(data)):
        row = data[i]
        offsets = np.concatenate([[0], np.cumsum(row["seg_lens"])[:-1]])
        for s, n, t, dom in zip(offsets, row["seg_lens"], row["tag_lens"], row["seg_domain"]):
            body = row["input_ids"][s + 1 + t : s + n].tolist()  # after the anchor and the tag
            first = tok.decode(body).split()
            if first and re.fullmatch(r"(alpha|beta)\d+", first[0]):
                starts.append((first[0], data.manifest.domains[int(dom)]))
            text += body
    return re.findall(r"(?:alpha|beta)\d+", tok.decode(text)), starts, data


def test_documents_come_from_both_sources_in_the_seeded_weighted_order(tmp_path, corpora):
    a, b = corpora
    path = prepare(sources_cfg(tmp_path, a, b))
    got, starts, data = packed_documents(path)
    names = [[f"alpha{i}" for i in range(200)], [f"beta{i}" for i in range(200)]]
    want = reference_draw(names, [3.0, 1.0], seed=0)
    assert len(got) > 60 and got == want[: len(got)]
    # about 3:1 documents drawn, and each document's domain is its source's name
    alpha = sum(w.startswith("alpha") for w in got)
    assert 0.65 < alpha / len(got) < 0.85
    assert all(dom == ("alpha" if w.startswith("alpha") else "beta") for w, dom in starts)
    m = data.manifest
    assert m.domains == ["alpha", "beta"]
    assert m.stats["domains"]["alpha"]["documents"] + m.stats["domains"]["beta"]["documents"] == len(got)
    assert [s["name"] for s in m.source["sources"]] == ["alpha", "beta"]


def test_domains_from_a_metadata_field(tmp_path, corpora):
    a, b = corpora
    path = prepare(sources_cfg(tmp_path, a, b, domain_field="meta.lang"))
    _, starts, data = packed_documents(path)
    assert len(starts) > 60
    for word, dom in starts:
        i = int(word.removeprefix("alpha").removeprefix("beta"))
        assert dom == ("beta" if word.startswith("beta") else "fr" if i % 3 else "en"), (word, dom)
    assert set(data.manifest.domains) == {"beta", "fr", "en"}


def test_slimpajama_set_names_read_as_the_domains_of_a_single_source():
    """A `domain_field` naming SlimPajama's `meta.redpajama_set_name` gives the domains `data.domain_shares` and
    the single-source path use (`ArXiv`, not `RedPajamaArXiv`), also from a JSON-encoded `meta` (SlimPajama's
    parquet); other values are kept as they are, and a record without one takes its source's name."""
    field = "meta.redpajama_set_name"
    records = [
        ({"text": "x", "meta": {"redpajama_set_name": "RedPajamaArXiv"}}, "ArXiv"),
        ({"text": "x", "meta": json.dumps({"redpajama_set_name": "RedPajamaStackExchange"})}, "StackExchange"),
        ({"text": "x", "meta": {"redpajama_set_name": "MyCorpus"}}, "MyCorpus"),
        ({"text": "x", "meta": {}}, "web"),
    ]
    assert [encode._source_record(r, "web", "text", field)[1] for r, _ in records] == [d for _, d in records]
    assert set(encode.REDPAJAMA_SET_NAMES.values()) <= set(DOMAINS)


def test_domain_shares_keyed_by_the_sources_domains(tmp_path, corpora):
    a, b = corpora
    cfg = sources_cfg(
        tmp_path,
        a,
        b,
        "data.mixture=upsampled",
        "data.domain_shares={alpha: 0.5, beta: 0.5}",
        "data.short_doc_tokens=1",
    )
    m = open_packed(prepare(cfg)).manifest
    shares = {d: e["tokens_share"] for d, e in m.stats["domains"].items()}
    assert shares["alpha"] == pytest.approx(0.5, abs=0.05) and shares["beta"] == pytest.approx(0.5, abs=0.05)
    with pytest.raises(UserError, match=r"data.domain_shares: unknown domain 'code'; known domains: alpha, beta"):
        sources_cfg(tmp_path, a, b, "data.mixture=upsampled", "data.domain_shares={code: 0.5, beta: 0.5}")
    # with a domain_field the names cannot be known before reading: accepted
    sources_cfg(tmp_path, a, b, "data.mixture=upsampled", "data.domain_shares={en: 1}", domain_field="meta.lang")


def test_same_bytes_with_one_or_two_workers(tmp_path, corpora):
    a, b = corpora
    one = prepare(sources_cfg(tmp_path, a, b, "data.num_workers=1", out="one"))
    two = prepare(sources_cfg(tmp_path, a, b, "data.num_workers=2", out="two"))
    shards = sorted(p.relative_to(one) for p in (one / "data").iterdir())
    assert shards and all((one / s).read_bytes() == (two / s).read_bytes() for s in shards)


def test_configs_without_sources_keep_their_fingerprint():
    cfg = load_config(None, [])
    assert cfg.data.sources is None
    dumped = cfg.data.model_dump(mode="json")
    assert "sources" in dumped
    # the fingerprint of a config without data.sources is the one it had before the key existed
    before = cfg.data.model_dump(
        mode="json", exclude={"num_workers", "output_dir", "strict", "shard_tokens", "sources"}
    )
    digest = hashlib.sha256(json.dumps(before, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    assert data_fingerprint(cfg.data) == digest
    assert config_fingerprint(cfg)


@pytest.mark.parametrize(
    ("sources", "extra", "needle"),
    [
        (
            "[{name: a, path: A, wieght: 3}]",
            [],
            "unknown key 'data.sources[0].wieght'; did you mean 'weight'? allowed keys here: name, path",
        ),
        ("[{name: a, path: A, weight: 0}]", [], "data.sources[0].weight = 0: Input should be greater than 0"),
        ("[{name: a, path: A, weight: -1}]", [], "data.sources[0].weight = -1"),
        ("[{name: a, path: A, weight: .inf}]", [], "data.sources[0].weight = inf: not a finite number"),
        ("[{name: a, path: A}, {name: a, path: B}]", [], "duplicate source name(s) a"),
        ("[{name: a}]", [], "source 'a': set exactly one of path and hub"),
        ("[{name: a, path: A}]", ["data.source=local", "data.path=x"], "data.sources replaces data.source"),
        ("[{name: a, path: A}]", ["data.source=hub"], "data.sources replaces data.source"),
        ("[{name: a, path: A}]", ["data.mixture=upsampled"], "needs data.domain_shares keyed by their domains"),
    ],
)
def test_bad_sources_config_is_one_line_naming_the_key(tmp_path, sources, extra, needle):
    assert needle in show_config_refusal([f"data.sources={sources}", *extra])


def test_a_missing_text_field_names_the_source_and_the_file(tmp_path, corpora):
    a, b = corpora
    cfg = load_config(
        None,
        [
            f"data.sources=[{{name: alpha, path: '{a}'}}, {{name: beta, path: '{b}'}}]",
            "data.seq_len=64",
            "data.token_budget=640",
            f"data.output_dir={tmp_path / 'out'}",
        ],
    )
    with pytest.raises(UserError) as e:
        prepare(cfg)
    msg = str(e.value)
    assert "\n" not in msg
    assert f"data.sources[0].text_field = 'text': source 'alpha' has no such field in {a}" in msg
    assert "content, meta" in msg
    assert not (tmp_path / "out").exists()


def test_an_unreachable_hub_dataset_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # the hub client reads the variable once, at import (an earlier test may have imported it): without this it
    # tries the network and waits ~23 s in its retries before the same refusal
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    args = ["prepare", "--set", "data.sources=[{name: web, hub: nobody/no-such-dataset, subset: en}]"]
    r = CliRunner().invoke(app, [*args, "--set", f"data.output_dir={tmp_path / 'out'}"])
    line = one_error_line(r)  # after the progress bar's line
    assert r.exit_code == 2 and r.stderr.strip().splitlines()[-1] == line, r.output
    assert "data.sources[0].hub = 'nobody/no-such-dataset' (subset 'en', split 'train'): cannot stream it" in line


def test_a_missing_source_path_names_the_source(tmp_path):
    args = ["prepare", "--set", f"data.sources=[{{name: web, path: '{tmp_path / 'nope.jsonl'}'}}]"]
    r = CliRunner().invoke(app, [*args, "--set", f"data.output_dir={tmp_path / 'out'}"])
    line = r.stderr.strip()
    assert r.exit_code == 2 and "\n" not in line, r.output
    assert f"data.sources[0] (web): path = '{tmp_path / 'nope.jsonl'}': no such file or directory" in line


def test_an_interrupted_prepare_resumes_to_the_same_bytes(tmp_path, corpora, monkeypatch):
    """Domains met while reading (a domain_field) and their tags are part of the state a resumed run continues."""
    a, b = corpora
    extra = ["data.domain_tags=true", "data.shard_tokens=640", "data.token_budget=12800"]
    reference = prepare(sources_cfg(tmp_path, a, b, *extra, out="reference", domain_field="meta.lang"))
    saves = []
    real_save = Partial.save

    def save_then_stop(self, key, state):
        real_save(self, key, state)
        saves.append(state["num_windows"])
        if len(saves) == 3:
            raise KeyboardInterrupt

    monkeypatch.setattr(Partial, "save", save_then_stop)
    with pytest.raises(KeyboardInterrupt):
        prepare(sources_cfg(tmp_path, a, b, *extra, domain_field="meta.lang"))
    monkeypatch.setattr(Partial, "save", real_save)
    out = prepare(sources_cfg(tmp_path, a, b, *extra, domain_field="meta.lang"))
    resumed = json.loads((out / "manifest.json").read_text())
    build = resumed["build"]
    assert build["resumed_after_shards"] == 3 and build["resumed_after_windows"] == saves[2]
    # this session's rate: the windows written before the interruption are not counted again
    written_now = (resumed["num_windows"] - saves[2]) * resumed["seq_len"]
    assert build["packed_tokens_per_s"] == pytest.approx(written_now / build["seconds"], rel=0.05)
    shards = sorted(p.relative_to(out) for p in (out / "data").iterdir())
    assert len(shards) == 20 and all((out / s).read_bytes() == (reference / s).read_bytes() for s in shards)
    want = json.loads((reference / "manifest.json").read_text())
    for key in ("domains", "tags", "stats", "source"):
        assert resumed[key] == want[key], key
    assert set(want["tags"]) == {"beta", "fr", "en"}
