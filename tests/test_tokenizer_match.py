"""A pretrained model and the tokenizer its data is prepared with: `prepare` and `train` refuse, before any work, data
whose ids mean other tokens to the model (checked against SentencePiece's own pieces of the two built-in Mistral
vocabularies), or run past its embedding rows; the model's own tokenizer, or one that only extends it, passes."""

import copy

import pytest
import sentencepiece as spm
from train_helpers import one_error_line, set_args
from typer.testing import CliRunner

from lctrain.cli import app
from lctrain.config import load_config
from lctrain.errors import UserError
from lctrain.model import build_model
from lctrain.tokenizer import builtin_model_file, check_matches_model, foreign_ids, load_tokenizer, save_tokenizer

V1, V3 = "builtin:mistral-7b-v0.1", "builtin:mistral-7b-v0.3"
ARCH = (
    "{model_type: llama, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 1, num_attention_heads: 2, "
    "num_key_value_heads: 1}"
)


def pretrained(path, vocab_size: int, tokenizer: str | None):
    """A saved tiny Llama with `vocab_size` embedding rows, and `tokenizer` saved beside it (or none)."""
    build_model(load_config(None, [f"model.arch={ARCH}"]), vocab_size=vocab_size).model.save_pretrained(path)
    if tokenizer is not None:
        save_tokenizer(load_tokenizer(tokenizer), path)
    return path


def config(model_dir, tokenizer: str, tmp_path):
    return load_config(
        None,
        [
            f"model.name_or_path={model_dir}",
            "model.arch=null",
            f"data.tokenizer={tokenizer}",
            f"data.output_dir={tmp_path / 'data'}",
            f"train.run_dir={tmp_path / 'run'}",
        ],
    )


def test_foreign_ids_against_sentencepiece_pieces():
    v1, v3 = (spm.SentencePieceProcessor(model_file=str(builtin_model_file(n.split(":")[1]))) for n in (V1, V3))
    expected = [i for i in range(v1.get_piece_size()) if v3.piece_to_id(v1.id_to_piece(i)) != i]
    got = foreign_ids(load_tokenizer(V1).get_vocab(), load_tokenizer(V3).get_vocab())
    assert [i for i, _, _ in got] == expected and len(expected) > 30000
    assert all(theirs == v3.id_to_piece(i) for i, _, theirs in got)
    assert foreign_ids(load_tokenizer(V1).get_vocab(), load_tokenizer(V1).get_vocab()) == []


def test_a_vocabulary_the_model_extends_or_lacks():
    data = {"<s>": 0, "a": 1, "b": 2}
    assert foreign_ids(data, {**data, "<pad>": 3}) == []
    assert foreign_ids(data, {"<s>": 0, "a": 1}) == [(2, "b", None)]
    assert foreign_ids(data, {"<s>": 0, "b": 1, "a": 2}) == [(1, "a", "b"), (2, "b", "a")]


def test_prepare_and_train_refuse_data_of_another_tokenizer_before_any_work(tmp_path):
    model = pretrained(tmp_path / "model", 32768, V3)
    sets = set_args(
        [
            f"model.name_or_path={model}",
            "model.arch=null",
            f"data.tokenizer={V1}",
            f"data.output_dir={tmp_path / 'data'}",
            f"train.run_dir={tmp_path / 'run'}",
        ]
    )
    for command in ("prepare", "train"):
        line = one_error_line(CliRunner().invoke(app, [command, *sets]))
        assert f"data.tokenizer = '{V1}' is not the tokenizer of model.name_or_path = '{model}'" in line
        assert "ids mean other tokens to the model (id 3 is '<0x00>' in the data, '[INST]' to the model)" in line
        assert f"set data.tokenizer to the model's ({model}) and run 'lctrain prepare' again" in line
    assert not (tmp_path / "data").exists() and not (tmp_path / "run").exists()


def test_ids_past_the_embedding_rows_are_refused_when_the_model_has_no_tokenizer(tmp_path):
    model = pretrained(tmp_path / "model", 1000, None)
    with pytest.raises(UserError, match="its ids reach 31,999, past the model's 1,000 embedding rows"):
        check_matches_model(config(model, V1, tmp_path))


def test_the_models_own_tokenizer_passes(tmp_path):
    check_matches_model(config(pretrained(tmp_path / "same", 32000, V1), V1, tmp_path))
    check_matches_model(config(pretrained(tmp_path / "bigger", 32768, None), V1, tmp_path))


def test_a_data_token_the_model_lacks_is_named_as_none_of_its_tokens(tmp_path):
    padded = copy.deepcopy(load_tokenizer(V1))  # load_tokenizer's are shared: this one gains a token
    padded.add_special_tokens({"pad_token": "<|pad|>"})
    save_tokenizer(padded, tmp_path / "padded")
    model = pretrained(tmp_path / "model", 32000, V1)
    with pytest.raises(UserError, match=r"\(id 32000 is '<\|pad\|>' in the data, no token to the model\)"):
        check_matches_model(config(model, str(tmp_path / "padded"), tmp_path))
