"""Tokenizer loading: the built-in SentencePiece models, the on-disk cache of their conversion, bad specs."""

from pathlib import Path

import pytest
import sentencepiece as spm

from lctrain.errors import UserError
from lctrain.tokenizer import _builtin_model_file, anchor_token_id, load_tokenizer

TEXT = "AnchorAttention keeps one shared anchor; bf16 RoPE drifts.\nThe 12345 ünïcödé words: f(x) = x ** 2.\n\tDone."
# Runs of spaces and a leading space: transformers 5's SentencePiece->fast conversion splits them differently from
# SentencePiece itself (e.g. "x    y": spm '▁x' '▁▁▁' '▁y', converted '▁x' '▁▁▁▁' 'y').
SPACES = ["x    y", " leading space", "\n  def f(x):"]


@pytest.fixture()
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LCTRAIN_CACHE", str(tmp_path / "cache"))
    load_tokenizer.cache_clear()
    yield tmp_path / "cache" / "tokenizers"
    load_tokenizer.cache_clear()


def test_builtin_matches_sentencepiece_itself_and_survives_the_cache(private_cache):
    reference = spm.SentencePieceProcessor(model_file=str(_builtin_model_file("mistral-7b-v0.1")))
    converted = load_tokenizer("builtin:mistral-7b-v0.1")  # the first load converts (a fresh machine's path)
    assert converted.encode(TEXT, add_special_tokens=False) == reference.encode(TEXT)
    assert Path(converted.name_or_path).is_dir()
    assert len(converted) == reference.vocab_size() == 32000
    assert anchor_token_id(converted) == reference.bos_id() == 1

    entries = [p.name for p in private_cache.iterdir()]
    assert entries == ["builtin-mistral-7b-v0.1"]  # no staging directory left behind
    load_tokenizer.cache_clear()
    cached = load_tokenizer("builtin:mistral-7b-v0.1")
    assert cached.encode(TEXT, add_special_tokens=False) == reference.encode(TEXT)
    assert Path(cached.name_or_path) == private_cache / "builtin-mistral-7b-v0.1"  # a directory that exists

    entry = private_cache / "builtin-mistral-7b-v0.1" / "tokenizer.json"  # damaged (a full disk, a hand edit)
    entry.write_bytes(entry.read_bytes()[:1000])
    load_tokenizer.cache_clear()
    rebuilt = load_tokenizer("builtin:mistral-7b-v0.1")
    assert rebuilt.encode(TEXT, add_special_tokens=False) == reference.encode(TEXT)
    assert len(entry.read_bytes()) > 1000


@pytest.mark.xfail(strict=True, reason="transformers' converted fast tokenizer splits runs of spaces unlike "
                                       "SentencePiece; known, not yet fixed")
@pytest.mark.parametrize("text", SPACES)
def test_runs_of_spaces_match_sentencepiece(private_cache, text):
    reference = spm.SentencePieceProcessor(model_file=str(_builtin_model_file("mistral-7b-v0.1")))
    assert load_tokenizer("builtin:mistral-7b-v0.1").encode(text, add_special_tokens=False) == reference.encode(text)


def test_sentencepiece_file_path(private_cache, tmp_path):
    model = tmp_path / "my.model"
    model.write_bytes(_builtin_model_file("mistral-7b-v0.1").read_bytes())
    tok = load_tokenizer(str(model))
    assert tok.encode("hello world", add_special_tokens=False) == spm.SentencePieceProcessor(
        model_file=str(model)).encode("hello world")


def test_bad_specs_are_user_errors(private_cache, tmp_path):
    with pytest.raises(UserError, match="built-in tokenizers: builtin:mistral-7b-v0.1"):
        load_tokenizer("builtin:nope")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(UserError, match="could not be loaded as a directory"):
        load_tokenizer(str(empty))


def test_anchor_is_eos_without_bos():
    class NoBos:
        bos_token_id, eos_token_id, name_or_path = None, 151643, "qwen-like"

    class Neither:
        bos_token_id = eos_token_id = None
        name_or_path = "broken"

    assert anchor_token_id(NoBos()) == 151643
    with pytest.raises(UserError, match="neither a BOS nor an EOS"):
        anchor_token_id(Neither())


def test_unreadable_cache_dir_still_loads(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("LCTRAIN_CACHE", str(blocker))
    load_tokenizer.cache_clear()
    try:
        assert load_tokenizer("builtin:mistral-7b-v0.1").encode("hi", add_special_tokens=False)
    finally:
        load_tokenizer.cache_clear()
    assert Path(blocker).read_text() == "not a directory"
