"""Damaged inputs, as a hostile user provides them: a truncated Arrow shard, a truncated .jsonl.zst, a JSON line
nested past the parser's stack, a byte-order mark, a file that is not a tokenizer, a truncated or mistyped model
checkpoint, an absurd diagnostic length. Each ends in one line (or a counted skip), never a traceback."""

import json

import pytest
import zstandard
from train_helpers import one_error_line, set_args
from typer.testing import CliRunner

from lctrain.cli import app
from lctrain.config import load_config
from lctrain.data.prepare import prepare
from lctrain.data.store import open_packed
from lctrain.errors import UserError

SMALL = ["data.seq_len=128", "data.token_budget=6000", "data.synthetic.num_docs=200"]
ARCH = (
    "{model_type: llama, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 1, num_attention_heads: 2, "
    "num_key_value_heads: 1, tie_word_embeddings: true}"
)


def local(path, *extra) -> list[str]:
    return ["data.source=local", f"data.path={path}", "data.seq_len=64", "data.token_budget=64", *extra]


def test_truncated_shard_is_named_and_prepare_rebuilds_it(tmp_path):
    out = tmp_path / "data"
    over = SMALL + [f"data.output_dir={out}"]
    prepare(load_config(None, over))
    shard = out / open_packed(out).manifest.shards[0].file
    size = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[: size // 2])
    with pytest.raises(
        UserError,
        match=rf"the prepared dataset is damaged \(data/shard-00000.arrow is "
        rf"{size // 2:,} bytes, not the {size:,} prepare wrote\)",
    ):
        open_packed(out)
    assert "damaged" in one_error_line(CliRunner().invoke(app, ["inspect", str(out)]))
    result = CliRunner().invoke(app, ["prepare"] + set_args(over))
    assert result.exit_code == 0 and "nothing to do" not in result.output, result.output
    assert len(open_packed(out)) == 6000 // 128


def test_truncated_zst_source_is_an_error_not_a_short_corpus(tmp_path):
    lines = b"".join(json.dumps({"text": f"document {i} " + "word " * 50}).encode() + b"\n" for i in range(3000))
    whole = zstandard.ZstdCompressor().compress(lines)
    src = tmp_path / "part.jsonl.zst"
    src.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(UserError, match=r"part.jsonl.zst: the file ends inside a zstd frame \(truncated\) after line"):
        prepare(load_config(None, local(src, f"data.output_dir={tmp_path / 'out'}", "data.token_budget=10000000")))
    src.write_bytes(whole[:40])  # cut before a line is whole: no "after line 0"
    with pytest.raises(UserError, match=r"\(truncated\) before its first line"):
        prepare(load_config(None, local(src, f"data.output_dir={tmp_path / 'out'}", "data.token_budget=10000000")))
    # a complete file of two concatenated frames is read whole
    src.write_bytes(whole + zstandard.ZstdCompressor().compress(lines))
    data = open_packed(
        prepare(load_config(None, local(src, f"data.output_dir={tmp_path / 'ok'}", "data.token_budget=200000")))
    )
    assert data.manifest.source["records_read"] == 6000


def test_deep_nesting_and_byte_order_mark(tmp_path):
    src = tmp_path / "c.jsonl"
    good = [json.dumps({"text": "word " * 40}) for _ in range(20)]
    src.write_bytes(b"\xef\xbb\xbf" + "\n".join(good[:10] + ["[" * 200000] + good[10:]).encode() + b"\n")
    data = open_packed(
        prepare(load_config(None, local(src, f"data.output_dir={tmp_path / 'out'}", "data.token_budget=1000")))
    )
    skipped = data.manifest.skipped
    assert skipped["counts"] == {"malformed_json": 1}  # the nested line; the BOM line is a document
    assert skipped["examples"][0]["line"] == 11
    assert data.manifest.source["documents_read"] == 20


def test_a_file_that_is_not_a_tokenizer(tmp_path):
    bogus = tmp_path / "tokenizer.model"
    bogus.write_bytes(b"\x00\x01 not a sentencepiece model" * 10)
    with pytest.raises(UserError, match=r"tokenizer '.*tokenizer.model' is a file but not a SentencePiece model"):
        prepare(load_config(None, SMALL + [f"data.tokenizer={bogus}", f"data.output_dir={tmp_path / 'out'}"]))


@pytest.fixture
def model_dir(tmp_path):
    from lctrain.model import build_model

    path = tmp_path / "model"
    build_model(load_config(None, [f"model.arch={ARCH}"]), vocab_size=32000).model.save_pretrained(path)
    return path


def test_damaged_model_directories_in_eval_and_diagnose(model_dir):
    ids = load_config(None).data.tokenizer
    weights = model_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    for cmd in (
        # the directory has no tokenizer: eval is told the one its 32,000 ids are of
        ["eval", str(model_dir), "--tasks", "vt", "--samples", "1", "--lengths", "256", "-s", f"data.tokenizer={ids}"],
        ["diagnose", "rope", str(model_dir), "--seq-len", "64", "--max-len", "64"],
    ):
        assert "cannot" in one_error_line(CliRunner().invoke(app, cmd))
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "hidden_size": "big"}))
    line = one_error_line(CliRunner().invoke(app, ["diagnose", "rope", str(model_dir), "--seq-len", "64"]))
    assert "cannot be loaded as a Hugging Face model" in line


def test_diagnose_refuses_a_length_it_cannot_hold():
    line = one_error_line(CliRunner().invoke(app, ["diagnose", "rope", "tiny_anchor", "--seq-len", "200000"]))
    assert "need 2 <= seq_len <= 16384" in line


def test_why_a_model_cannot_be_loaded_is_said_in_words(tmp_path):
    from lctrain.model import unloadable_because

    (tmp_path / "empty").mkdir()
    assert (
        unloadable_because(str(tmp_path / "empty"), OSError("x"))
        == f"the directory {tmp_path / 'empty'} has no config.json"
    )
    offline = OSError("We couldn't connect to 'https://huggingface.co' to load the files. Check your internet or see")
    assert "nor a hub model in the cache or on a reachable hub" in unloadable_because("nobody/nothing", offline)
    (tmp_path / "config.json").write_text("{}")
    assert unloadable_because(str(tmp_path), ValueError("bad value. More text")) == "ValueError: bad value"
