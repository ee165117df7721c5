"""Tokenizer loading and the exact text -> ids encoder: every SentencePiece-model tokenizer (the built-ins, a `.model`
file, a directory that carries `tokenizer.model`) gives exactly `sentencepiece.SentencePieceProcessor.encode`'s ids, on
real text that ships with Python and the installed packages; other tokenizers give their `tokenizers` pipeline's ids;
the on-disk cache of the conversion; bad specs; the digest of what decides the ids, with which `prepare` refuses to call
a dataset prepared once its tokenizer changed in place."""

import json
import os
import pickle
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import sentencepiece as spm
from tokenizers import Tokenizer, models, pre_tokenizers
from train_helpers import one_error_line, set_args
from transformers import AutoTokenizer, PreTrainedTokenizerFast
from typer.testing import CliRunner

from lctrain.cli import app
from lctrain.config import load_config
from lctrain.data import prepare as prepare_mod
from lctrain.data.manifest import CHECKSUM_KEY, MANIFEST, manifest_checksum
from lctrain.data.sources import RawBatch
from lctrain.data.store import FORMAT_VERSION, open_packed, read_manifest
from lctrain.errors import UserError
from lctrain.tokenizer import (
    SPM_FILE,
    Anchor,
    anchor_token_id,
    builtin_model_file,
    load_encoder,
    load_tokenizer,
    recorded_anchor,
    resolve_anchor,
    save_tokenizer,
    text_encoder,
    tokenizer_fingerprint,
    write_anchor,
)

TEXT = "AnchorAttention keeps one shared anchor; bf16 RoPE drifts.\nThe 12345 ünïcödé words: f(x) = x ** 2.\n\tDone."
# Runs of spaces and a leading space: transformers 5's SentencePiece->fast conversion splits them differently from
# SentencePiece itself (e.g. "x    y": spm '▁x' '▁▁▁' '▁y', converted '▁x' '▁▁▁▁' 'y'); the encoder must not.
SPACES = ["x    y", " leading space", "\n  def f(x):", "  ", "a\u3000b  \t c", "trailing   "]
BUILTINS = ["mistral-7b-v0.1", "mistral-7b-v0.3"]
SAMPLE_CHARS = 400_000
MAX_DOC = 20_000  # many short documents rather than a few long ones: each starts fresh (leading space, first line)


def real_text(limit: int = SAMPLE_CHARS) -> list[str]:
    """Documents that ship with every Python install and with the installed packages (no download): standard-library
    modules (code: indentation, runs of spaces) and the packages' license files (prose, ASCII art), files under
    `MAX_DOC` characters in a fixed order, about `limit` characters in all."""
    stdlib = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    site = Path(sysconfig.get_paths()["purelib"])
    licenses = sorted(
        p for pat in ("*.dist-info/LICENSE*", "*.dist-info/licenses/*") for p in site.glob(pat) if p.is_file()
    )
    docs, size = [], 0
    for group, share in ((stdlib, 3 * limit // 4), (licenses, limit)):
        for path in group:
            if size >= share:
                break
            try:
                text = path.read_text(encoding="utf-8")
            except UnicodeDecodeError:
                continue
            if len(text) > MAX_DOC:
                continue
            docs.append(text)
            size += len(text)
    return docs


@pytest.fixture(scope="module")
def corpus():
    docs = real_text()
    assert len(docs) > 20 and sum(map(len, docs)) > SAMPLE_CHARS // 2  # enough to mean something on any machine
    return docs


@pytest.fixture()
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LCTRAIN_CACHE", str(tmp_path / "cache"))
    load_tokenizer.cache_clear()
    load_encoder.cache_clear()
    yield tmp_path / "cache" / "tokenizers"
    load_tokenizer.cache_clear()
    load_encoder.cache_clear()


def test_builtin_matches_sentencepiece_itself_and_survives_the_cache(private_cache):
    reference = spm.SentencePieceProcessor(model_file=str(builtin_model_file("mistral-7b-v0.1")))
    converted = load_tokenizer("builtin:mistral-7b-v0.1")  # the first load converts (a fresh machine's path)
    assert load_encoder("builtin:mistral-7b-v0.1").encode(TEXT) == reference.encode(TEXT)
    assert Path(converted.name_or_path).is_dir()
    assert len(converted) == reference.vocab_size() == 32000
    assert anchor_token_id(converted) == reference.bos_id() == 1
    assert converted("hi")["input_ids"] == [1] + reference.encode("hi")  # inputs start with BOS, as on the hub

    entries = [p.name for p in private_cache.iterdir()]
    assert entries == ["builtin-mistral-7b-v0.1"]  # no staging directory left behind
    entry = private_cache / "builtin-mistral-7b-v0.1"
    assert (entry / SPM_FILE).read_bytes() == builtin_model_file("mistral-7b-v0.1").read_bytes()
    for damage in ("truncate", "drop the model"):  # a full disk, a hand edit, an entry of an older lctrain
        load_tokenizer.cache_clear()
        load_encoder.cache_clear()
        cached = load_tokenizer("builtin:mistral-7b-v0.1")
        assert Path(cached.name_or_path) == entry  # a directory that exists
        assert load_encoder("builtin:mistral-7b-v0.1").encode(TEXT) == reference.encode(TEXT)
        if damage == "truncate":
            (entry / "tokenizer.json").write_bytes((entry / "tokenizer.json").read_bytes()[:1000])
        else:
            (entry / SPM_FILE).unlink()
        load_tokenizer.cache_clear()
        load_encoder.cache_clear()
        assert load_encoder("builtin:mistral-7b-v0.1").encode(TEXT) == reference.encode(TEXT)
        assert len((entry / "tokenizer.json").read_bytes()) > 1000 and (entry / SPM_FILE).is_file()


@pytest.mark.parametrize("name", BUILTINS)
def test_runs_of_spaces_match_sentencepiece(private_cache, name):
    reference = spm.SentencePieceProcessor(model_file=str(builtin_model_file(name)))
    encoder = load_encoder(f"builtin:{name}")
    for text in SPACES:
        assert encoder.encode(text) == reference.encode(text), text
        assert encoder.encode(text, specials=True) == reference.encode(text, add_bos=True), text


@pytest.mark.parametrize("name", BUILTINS)
def test_builtins_match_sentencepiece_on_real_text(corpus, name):
    reference = spm.SentencePieceProcessor(model_file=str(builtin_model_file(name)))
    got = load_encoder(f"builtin:{name}").encode_batch(corpus)
    differ = [i for i, (ids, text) in enumerate(zip(got, corpus)) if ids.tolist() != reference.encode(text)]
    assert differ == [], f"{len(differ)} of {len(corpus)} documents differ from SentencePiece"


def test_sentencepiece_file_path(private_cache, tmp_path, corpus):
    model = tmp_path / "my.model"
    model.write_bytes(builtin_model_file("mistral-7b-v0.3").read_bytes())
    reference = spm.SentencePieceProcessor(model_file=str(model))
    encoder = load_encoder(str(model))
    assert encoder.kind == "sentencepiece"
    assert [ids.tolist() for ids in encoder.encode_batch(corpus)] == reference.encode(corpus)
    assert len(load_tokenizer(str(model))) == reference.vocab_size() == 32768


def test_not_a_sentencepiece_file_is_one_line(private_cache, tmp_path):
    bogus = tmp_path / "tokenizer.model"
    bogus.write_text("this is not a SentencePiece model\n")
    with pytest.raises(UserError, match=r"tokenizer '.*tokenizer.model' is a file but not a SentencePiece model"):
        load_encoder(str(bogus))
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"base: tiny_anchor\ndata:\n  tokenizer: {bogus}\n  output_dir: {tmp_path / 'out'}\n")
    assert "not a SentencePiece model" in one_error_line(CliRunner().invoke(app, ["prepare", "-c", str(cfg)]))


def test_saved_directory_keeps_sentencepiece(private_cache, tmp_path):
    """An evaluation checkpoint (`hf/step_N/`) or a hub-style directory: with `tokenizer.model` beside
    `tokenizer.json` it encodes with SentencePiece; without it (a plain `save_pretrained`) it is the converted
    tokenizer, which is what this project fixes."""
    tok = load_tokenizer("builtin:mistral-7b-v0.1")
    reference = spm.SentencePieceProcessor(model_file=str(builtin_model_file("mistral-7b-v0.1")))
    save_tokenizer(tok, tmp_path / "ckpt")
    tok.save_pretrained(str(tmp_path / "plain"))
    assert {p.name for p in (tmp_path / "ckpt").iterdir()} == {SPM_FILE, "tokenizer.json", "tokenizer_config.json"}
    saved = load_encoder(str(tmp_path / "ckpt"))
    assert saved.kind == "sentencepiece"
    assert [saved.encode(t, specials=True) for t in SPACES] == [reference.encode(t, add_bos=True) for t in SPACES]
    assert text_encoder(AutoTokenizer.from_pretrained(str(tmp_path / "plain"))).kind == "tokenizers"


def test_tokenizer_without_sentencepiece_keeps_its_own_pipeline(tmp_path):
    """A hub tokenizer that is not SentencePiece-based (Llama-3, Qwen: byte-level BPE) is encoded by its own
    `tokenizers` pipeline, checked against the `tokenizers` library reading the saved tokenizer.json directly."""
    vocab = {"<eos>": 0, "hello": 1, "world": 2, "[UNK]": 3}
    core = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<eos>", unk_token="[UNK]").save_pretrained(
        str(tmp_path / "wl")
    )
    load_tokenizer.cache_clear()
    encoder = load_encoder(str(tmp_path / "wl"))
    reference = Tokenizer.from_file(str(tmp_path / "wl" / "tokenizer.json"))
    assert encoder.kind == "tokenizers" and encoder.prefix == encoder.suffix == []
    for text in ["hello world", "world  hello  other"]:
        assert encoder.encode(text) == reference.encode(text, add_special_tokens=False).ids
    assert anchor_token_id(load_tokenizer(str(tmp_path / "wl"))) == 0


def test_prepare_workers_encode_exactly(corpus):
    """The prepare path: the encoder pickled into two spawned worker processes (one SentencePiece thread each),
    documents read as JSON lines; every document's ids are SentencePiece's."""
    encoder = load_encoder("builtin:mistral-7b-v0.1")
    assert pickle.loads(pickle.dumps(encoder)).encode(TEXT) == encoder.encode(TEXT)
    lines = [json.dumps({"text": t}).encode() for t in corpus]
    batches = [RawBatch("jsonl", "real.jsonl", i + 1, lines[i : i + 16]) for i in range(0, len(lines), 16)]
    got = [ids.tolist() for recs in prepare_mod._encoded(iter(batches), encoder, workers=2) for _, _, _, ids, _ in recs]
    reference = spm.SentencePieceProcessor(model_file=str(builtin_model_file("mistral-7b-v0.1")))
    assert got == reference.encode(corpus)


def test_prepared_windows_hold_sentencepiece_ids(tmp_path, corpus):
    """End to end: real documents through `prepare` (JSON lines, two worker processes, no shuffle so the documents
    keep their order): the windows' text tokens, anchors removed, are SentencePiece's ids of the documents one after
    another. A dataset of format 2 (the converted tokenizer's ids) is rebuilt, not reused."""
    src = tmp_path / "real.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in corpus))
    cfg = load_config(
        None,
        [
            "data.source=local",
            f"data.path={src}",
            "data.seq_len=1024",
            "data.token_budget=40960",
            "data.shuffle_buffer_tokens=0",
            "data.num_workers=2",
            f"data.output_dir={tmp_path / 'out'}",
        ],
    )
    out = prepare_mod.prepare(cfg)
    data = open_packed(out)
    assert data.manifest.tokenizer.encoder == "sentencepiece" and len(data) == 40
    body = []
    for w in range(len(data)):
        row = data[w]
        for start, n in zip([0, *row["seg_lens"].cumsum()[:-1]], row["seg_lens"]):
            assert row["input_ids"][start] == 1  # every segment opens with the anchor (BOS)
            body += row["input_ids"][start + 1 : start + n].tolist()
    reference = spm.SentencePieceProcessor(model_file=str(builtin_model_file("mistral-7b-v0.1")))
    expected = [i for ids in reference.encode(corpus) for i in ids]
    assert body == expected[: len(body)] and len(body) > 35 * 1024

    manifest = out / "manifest.json"
    old = json.loads(manifest.read_text()) | {"format_version": 2, "stale": 1}  # the converted tokenizer's ids
    manifest.write_text(json.dumps(old))
    assert read_manifest(out) is None
    prepare_mod.prepare(cfg)
    rebuilt = json.loads(manifest.read_text())
    assert "stale" not in rebuilt and rebuilt["format_version"] == FORMAT_VERSION and read_manifest(out) is not None


def test_bad_specs_are_user_errors(private_cache, tmp_path):
    with pytest.raises(UserError, match="built-in tokenizers: builtin:mistral-7b-v0.1"):
        load_tokenizer("builtin:nope")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(UserError, match="could not be loaded as a directory"):
        load_tokenizer(str(empty))


def _word_tokenizer(vocab: list[str], **specials) -> PreTrainedTokenizerFast:
    core = Tokenizer(models.WordLevel({t: i for i, t in enumerate(vocab)}, unk_token=vocab[-1]))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=core, unk_token=vocab[-1], **specials)


CHAT_VOCAB = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "hello", "[UNK]"]


def test_anchor_rule():
    """auto: a BOS the tokenizer puts before text (Llama/Mistral); else <|endoftext|> (byte-level BPE base models:
    Qwen, SmolLM2, even when BOS/EOS are declared as chat markers); else EOS; explicit bos / eos / a token."""
    llama = load_tokenizer("builtin:mistral-7b-v0.1")
    assert resolve_anchor(llama) == Anchor("<s>", 1, resolve_anchor(llama).why) and llama("a").input_ids[0] == 1
    smollm = _word_tokenizer(CHAT_VOCAB, bos_token="<|im_start|>", eos_token="<|im_end|>")
    assert smollm("hello").input_ids == [3]  # the declared BOS is not put before text
    auto = resolve_anchor(smollm)
    assert (auto.token, auto.id) == ("<|endoftext|>", 0) and "<|im_start|> is not put before text" in auto.why
    assert anchor_token_id(smollm, "bos") == 1 and anchor_token_id(smollm, "eos") == 2
    assert anchor_token_id(smollm, "<|im_end|>") == 2
    qwen = _word_tokenizer(CHAT_VOCAB, eos_token="<|im_end|>")
    assert anchor_token_id(qwen) == 0
    with pytest.raises(UserError, match="data.anchor = bos: tokenizer .* has no BOS token"):
        resolve_anchor(qwen, "bos")
    no_separator = _word_tokenizer(["<eos>", "hello", "[UNK]"], eos_token="<eos>")
    assert resolve_anchor(no_separator).token == "<eos>"
    with pytest.raises(UserError, match="data.anchor = 'nope' is not a token of tokenizer"):
        resolve_anchor(no_separator, "nope")
    # the example it gives is one of this tokenizer's (a fixed <|endoftext|> was the token refused: docs explorer)
    with pytest.raises(UserError) as refused:
        resolve_anchor(no_separator, "<|endoftext|>")
    suggested = re.search(r"\(e\.g\. (\S+), one of its special tokens\)$", str(refused.value)).group(1)
    assert resolve_anchor(no_separator, suggested).token == suggested == "<eos>"
    with pytest.raises(UserError, match="neither a BOS nor an EOS"):
        resolve_anchor(_word_tokenizer(["hello", "[UNK]"]))
    # a named token is taken as it is, with a warning when it is an ordinary word text contains too
    assert resolve_anchor(llama, "</s>").why == "data.anchor"
    word = resolve_anchor(llama, "none")
    assert word.id == llama.convert_tokens_to_ids("none") and "warning: an ordinary vocabulary token" in word.why


def test_anchor_record_round_trip(tmp_path):
    anchor = Anchor("<|endoftext|>", 0, "auto")
    write_anchor(tmp_path, anchor)
    assert recorded_anchor(tmp_path).record() == {"token": "<|endoftext|>", "id": 0}
    assert recorded_anchor(tmp_path / "absent") is None
    (tmp_path / "anchor.json").write_text("[1]")
    with pytest.raises(UserError, match="not an anchor record"):
        recorded_anchor(tmp_path)


def test_prompted_encoder_starts_with_the_anchor():
    smollm = _word_tokenizer(CHAT_VOCAB, bos_token="<|im_start|>", eos_token="<|im_end|>")
    encoder = text_encoder(smollm)
    assert encoder.encode("hello hello", specials=True) == [3, 3]  # the tokenizer's own: no special token
    assert encoder.prompted(resolve_anchor(smollm)).encode("hello hello", specials=True) == [0, 3, 3]
    llama = text_encoder(load_tokenizer("builtin:mistral-7b-v0.1"))
    anchored = llama.prompted(resolve_anchor(load_tokenizer("builtin:mistral-7b-v0.1")))
    assert anchored.encode(TEXT, specials=True) == llama.encode(TEXT, specials=True)  # BOS: unchanged


def test_unreadable_cache_dir_still_loads(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("LCTRAIN_CACHE", str(blocker))
    load_tokenizer.cache_clear()
    try:
        assert load_encoder("builtin:mistral-7b-v0.1").encode(TEXT) == spm.SentencePieceProcessor(
            model_file=str(builtin_model_file("mistral-7b-v0.1"))
        ).encode(TEXT)
    finally:
        load_tokenizer.cache_clear()
        load_encoder.cache_clear()
    assert Path(blocker).read_text() == "not a directory"


def bpe_without_a_class():
    """A byte-level BPE with no tokenizer class of its own (as SmolLM2's): transformers 5 saves it as
    `TokenizersBackend`, with its additional special tokens as a list under `extra_special_tokens`."""
    vocab = {"<|endoftext|>": 0, "<|im_start|>": 1, "a": 2, "b": 3, "ab": 4, "Ġ": 5}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[("a", "b")]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|endoftext|>", additional_special_tokens=["<|im_start|>"]
    )


@pytest.mark.parametrize("kind", ["llama", "bpe"])
def test_a_saved_tokenizer_is_in_the_form_transformers_4_loads_and_5_loads_unchanged(tmp_path, kind):
    """transformers 4.57 failed on both files as 5 writes them (checked by hand: `'list' object has no attribute
    'keys'`; `Tokenizer class TokenizersBackend does not exist`) and loads the rewritten ones to the same ids."""
    tok = load_tokenizer("builtin:mistral-7b-v0.1") if kind == "llama" else bpe_without_a_class()
    save_tokenizer(tok, tmp_path / "saved")
    written = json.loads((tmp_path / "saved" / "tokenizer_config.json").read_text())
    assert not isinstance(written.get("extra_special_tokens"), list)
    assert written["tokenizer_class"] != "TokenizersBackend" and written["additional_special_tokens"]
    again = AutoTokenizer.from_pretrained(str(tmp_path / "saved"))
    text = "ab ba <|endoftext|> <s> a\n"
    assert type(again) is type(tok) and again(text).input_ids == tok(text).input_ids
    assert again.all_special_tokens == tok.all_special_tokens and again.all_special_ids == tok.all_special_ids
    assert tokenizer_fingerprint(again) == tokenizer_fingerprint(tok)
    # transformers 5 saves what it loaded from the rewritten file as it saves what it loads from its own
    tok.save_pretrained(str(tmp_path / "original"))
    for source, out in ((again, "resaved"), (AutoTokenizer.from_pretrained(str(tmp_path / "original")), "own")):
        source.save_pretrained(str(tmp_path / out))
    assert json.loads((tmp_path / "resaved" / "tokenizer_config.json").read_text()) == json.loads(
        (tmp_path / "own" / "tokenizer_config.json").read_text()
    )


@pytest.fixture()
def reloaded():
    """Loads that see a tokenizer edited on disk: the CLI runs in a fresh process, these tests in one."""
    load_tokenizer.cache_clear()
    load_encoder.cache_clear()
    yield load_tokenizer.cache_clear
    load_tokenizer.cache_clear()
    load_encoder.cache_clear()


def _word_level_dir(path: Path) -> Path:
    vocab = {"<eos>": 0, "[UNK]": 1, "hello": 2, "world": 3, "again": 4}
    core = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<eos>", unk_token="[UNK]").save_pretrained(str(path))
    return path


def _edit_tokenizer_json(directory: Path, **changes) -> None:
    path = directory / "tokenizer.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | changes))


def test_the_digest_changes_exactly_when_the_ids_do(tmp_path, reloaded):
    """The digest a dataset records covers what decides the ids: the same SentencePiece model as a built-in, a `.model`
    file or a saved directory is one digest (one set of ids, SentencePiece's); another model is another. A fast
    tokenizer's normalizer added to tokenizer.json changes the ids (the `tokenizers` library reading the file says
    so) and the digest, though not the vocabulary fingerprint; its decoder changes neither."""
    model = builtin_model_file("mistral-7b-v0.1")
    save_tokenizer(load_tokenizer("builtin:mistral-7b-v0.1"), tmp_path / "ckpt")
    same = [load_encoder(spec) for spec in ("builtin:mistral-7b-v0.1", str(model), str(tmp_path / "ckpt"))]
    reference = spm.SentencePieceProcessor(model_file=str(model)).encode(TEXT)
    assert [e.encode(TEXT) for e in same] == [reference] * 3
    assert len({e.digest() for e in same}) == 1
    assert load_encoder("builtin:mistral-7b-v0.3").digest() != same[0].digest()

    words = _word_level_dir(tmp_path / "wl")
    text = "Hello world again"

    def state():
        reloaded()
        tok = load_tokenizer(str(words))
        ids = Tokenizer.from_file(str(words / "tokenizer.json")).encode(text, add_special_tokens=False).ids
        return ids, text_encoder(tok).digest(), tokenizer_fingerprint(tok)

    ids, digest, fingerprint = state()
    _edit_tokenizer_json(words, decoder={"type": "WordPiece", "prefix": "##", "cleanup": True})
    assert state() == (ids, digest, fingerprint)
    _edit_tokenizer_json(words, normalizer={"type": "Lowercase"})
    lowered, new_digest, new_fingerprint = state()
    assert ids == [1, 3, 4] and lowered == [2, 3, 4]
    assert new_digest != digest and new_fingerprint == fingerprint


def test_a_tokenizer_without_a_serialized_pipeline_is_digested_by_class_and_vocabulary():
    """A pure-Python tokenizer (ByT5's) travels pickled, and its pickle differs between processes (sets of strings
    in it follow the hash seed): its digest is its class and vocabulary, the same in a process of another hash seed,
    and another once a token is added."""
    from transformers import ByT5Tokenizer

    encoder = text_encoder(ByT5Tokenizer())
    assert encoder.kind == "pickled"
    script = "from transformers import ByT5Tokenizer; from lctrain.tokenizer import text_encoder; "
    script += "print(text_encoder(ByT5Tokenizer()).digest())"
    other = subprocess.run(
        [sys.executable, "-c", script], env={**os.environ, "PYTHONHASHSEED": "12345"}, capture_output=True, text=True
    )
    assert other.stdout.split()[-1] == encoder.digest(), other.stderr
    extended = ByT5Tokenizer()
    extended.add_tokens(["<doc>"])
    assert text_encoder(extended).digest() != encoder.digest()


def _windows(out: Path) -> list[list[int]]:
    data = open_packed(out)
    return [data[i]["input_ids"].tolist() for i in range(len(data))]


def test_a_tokenizer_edited_in_place_is_refused_not_called_prepared(tmp_path, reloaded, capsys):
    """The data fingerprint names the tokenizer, not its files. An untouched tokenizer: nothing to do. A normalizer
    added to its tokenizer.json (vocabulary unchanged): one line naming the dataset and the tokenizer, and --force
    rebuilds with the ids the `tokenizers` library gives reading the edited file. A dataset prepared before the
    digest was recorded is not compared."""
    words = _word_level_dir(tmp_path / "tok")
    texts = [" ".join(["Hello", "world", "again"] * (3 + i)) for i in range(12)]
    src = tmp_path / "c.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    out = tmp_path / "out"
    over = [
        "data.source=local",
        f"data.path={src}",
        f"data.tokenizer={words}",
        "data.seq_len=16",
        "data.token_budget=160",
        "data.shuffle_buffer_tokens=0",  # the documents in file order, to compare with the reference
        f"data.output_dir={out}",
    ]

    def run(*more):
        return CliRunner().invoke(app, ["prepare", *more, *set_args(over)])

    def expected_body():
        reference = Tokenizer.from_file(str(words / "tokenizer.json"))
        return [i for t in texts for i in reference.encode(t, add_special_tokens=False).ids]

    def body(windows):  # every segment's anchor (the EOS, id 0: no text token) left out
        return [i for w in windows for i in w if i != 0]

    r = run()
    assert r.exit_code == 0, r.output
    before = _windows(out)
    assert body(before) == expected_body()[: len(body(before))] and 1 in body(before)  # "Hello" is unknown
    r = run()
    assert r.exit_code == 0 and "nothing to do" in r.output, r.output

    _edit_tokenizer_json(words, normalizer={"type": "Lowercase"})
    reloaded()
    line = one_error_line(run())
    assert line.startswith(f"error: {out}: already prepared, but data.tokenizer = '{words}' changed since: ")
    assert "run prepare again with --force" in line
    assert _windows(out) == before
    # a training of the dataset as it is trains, said: its exports would carry the edited tokenizer
    from lctrain.train.command import preflight

    preflight(load_config(None, [*over, "train.steps=1", "train.global_batch=2", "eval.ppl_windows=0"]))
    said = capsys.readouterr().err
    assert f"warning: {out} was prepared before data.tokenizer = '{words}' changed: it encodes text otherwise" in said

    r = run("--force")
    assert r.exit_code == 0, r.output
    after = _windows(out)
    assert body(after) == expected_body()[: len(body(after))] and 1 not in body(after)
    r = run()
    assert r.exit_code == 0 and "nothing to do" in r.output, r.output

    # a manifest from before the digest: accepted as it is, whatever the tokenizer now
    manifest = out / MANIFEST
    raw = json.loads(manifest.read_text())
    del raw["tokenizer_digest"], raw[CHECKSUM_KEY]
    manifest.write_text(json.dumps(raw | {CHECKSUM_KEY: manifest_checksum(raw)}))
    assert open_packed(out).manifest.tokenizer_digest is None
    _edit_tokenizer_json(words, normalizer=None)
    reloaded()
    r = run()
    assert r.exit_code == 0 and "nothing to do" in r.output, r.output


@pytest.mark.slow  # 3-7 s in CI: slow-marked to keep `make test` under its 5 minutes
def test_a_sentencepiece_directory_is_compared_by_its_model_and_its_anchor(tmp_path, reloaded):
    """A directory with tokenizer.model encodes with SentencePiece, so an edit of its tokenizer.json's normalizer
    changes no id and leaves the dataset prepared; one that stops the tokenizer putting BOS before text makes the
    auto anchor its EOS: refused, and --force rebuilds on that anchor."""
    tok_dir = tmp_path / "tok"
    save_tokenizer(load_tokenizer("builtin:mistral-7b-v0.1"), tok_dir)
    out = tmp_path / "out"
    over = [f"data.tokenizer={tok_dir}", "data.seq_len=128", "data.token_budget=1280", f"data.output_dir={out}"]

    def run(*more):
        return CliRunner().invoke(app, ["prepare", *more, *set_args(over)])

    assert run().exit_code == 0
    assert {w[0] for w in _windows(out)} == {1}

    _edit_tokenizer_json(tok_dir, normalizer={"type": "Lowercase"})
    reloaded()
    assert load_encoder(str(tok_dir)).encode(TEXT) == load_encoder("builtin:mistral-7b-v0.1").encode(TEXT)
    r = run()
    assert r.exit_code == 0 and "nothing to do" in r.output, r.output

    _edit_tokenizer_json(tok_dir, post_processor=None)
    reloaded()
    line = one_error_line(run())
    said = f"data.tokenizer = '{tok_dir}' changed since: its anchor is now </s> (id 2), the dataset's <s> (id 1);"
    assert said in line and "--force" in line
    assert run("--force").exit_code == 0
    assert {w[0] for w in _windows(out)} == {2}


def test_the_digest_reads_a_pipeline_as_any_tokenizers_release_writes_it(reloaded):
    """A tokenizers upgrade writes the same pipeline otherwise: merges as ["a", "b"] pairs where older releases wrote
    "a b", fields it added as their default (false, null) where older files lack them. Neither changes the ids, so
    neither changes the digest; a changed value (the normalizer) does, and so does a field turned on."""
    from lctrain.tokenizer import TextEncoder

    bpe = Tokenizer(models.BPE({"a": 0, "b": 1, "ab": 2}, [("a", "b")]))
    newer = json.loads(bpe.to_str())
    assert newer["model"]["merges"] == [["a", "b"]] and newer["model"]["ignore_merges"] is False
    older_model = {k: v for k, v in newer["model"].items() if k not in ("ignore_merges", "byte_fallback")}
    older = {k: v for k, v in newer.items() if k not in ("truncation", "padding")} | {
        "model": older_model | {"merges": ["a b"]}
    }

    def digest(p: dict) -> str:
        return TextEncoder("tokenizers", json.dumps(p), [], []).digest()

    assert Tokenizer.from_str(json.dumps(older)).encode("ab").ids == bpe.encode("ab").ids == [2]
    assert digest(older) == digest(newer)
    assert digest(newer | {"normalizer": {"type": "Lowercase"}}) != digest(newer)
    assert digest(newer | {"model": newer["model"] | {"ignore_merges": True}}) != digest(newer)
