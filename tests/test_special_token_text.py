"""Document text that spells a special token ("<|endoftext|>", "<|im_start|>", "</s>") is encoded as the text it is,
for every encoder kind, against an independent reference: the Hugging Face tokenizer called with
`split_special_tokens=True`, ByT5's bytes, SentencePiece's own ids. A packed window holds the anchor only where a
segment starts, and a dataset prepared under the old rule is rebuilt by `prepare` and refused by readers."""

import json
import pickle

import pytest
import sentencepiece as spm
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, ByT5Tokenizer, PreTrainedTokenizerFast

from lctrain.config import load_config
from lctrain.data.manifest import MANIFEST, Manifest, write_manifest
from lctrain.data.prepare import prepare
from lctrain.data.store import FORMAT_VERSION, open_packed, read_manifest
from lctrain.errors import UserError
from lctrain.tokenizer import builtin_model_file, load_encoder, resolve_anchor, text_encoder

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2, as in SmolLM2's vocabulary
TEXTS = [
    "a literal special token <|endoftext|> in the middle",
    "<|im_start|>user\nhello<|im_end|>",
    "quoted twice: '<|endoftext|>' and <|endoftext|><|endoftext|>",
    "plain text without any",
]
DOCS = [t * 8 for t in TEXTS * 3]


def byte_level_bpe() -> PreTrainedTokenizerFast:
    """A small GPT-2-style byte-level BPE whose special tokens are SmolLM2's first three."""
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(TEXTS * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=core)


def split_reference(tok, texts: list[str]) -> list[list[int]]:
    return tok(texts, add_special_tokens=False, split_special_tokens=True)["input_ids"]


def test_tokenizers_pipeline_encodes_special_token_text_as_text():
    tok = byte_level_bpe()
    assert tok("<|endoftext|>", add_special_tokens=False)["input_ids"] == [0]  # what the text meant before
    encoder = text_encoder(tok)
    assert encoder.kind == "tokenizers"
    expected = split_reference(tok, TEXTS)
    for got in (encoder, pickle.loads(pickle.dumps(encoder))):  # prepare's workers rebuild it from the blob
        ids = [x.tolist() for x in got.encode_batch(TEXTS)]
        assert ids == expected
        assert not {0, 1, 2} & {i for x in ids for i in x}
    assert tok.decode(expected[0]) == TEXTS[0]
    anchored = encoder.prompted(resolve_anchor(tok))
    assert anchored.encode(TEXTS[0], specials=True) == [0, *expected[0]]  # a prompt still starts with the anchor


def test_pickled_tokenizer_encodes_special_token_text_as_text():
    """ByT5 (not a fast tokenizer): its ids are the UTF-8 bytes after its 3 special tokens, whatever the text."""
    tok = ByT5Tokenizer()
    texts = ["a</s>b", "<pad><unk>", "x <extra_id_0> y"]
    assert tok(texts[0], add_special_tokens=False)["input_ids"] == [100, 1, 101]
    encoder = text_encoder(tok)
    assert encoder.kind == "pickled"
    got = [x.tolist() for x in pickle.loads(pickle.dumps(encoder)).encode_batch(texts)]
    assert got == [[b + 3 for b in t.encode()] for t in texts] == split_reference(tok, texts)


@pytest.mark.parametrize("name", ["mistral-7b-v0.1", "mistral-7b-v0.3"])
def test_sentencepiece_encodes_control_symbols_in_text_as_text(name):
    reference = spm.SentencePieceProcessor(model_file=str(builtin_model_file(name)))
    texts = ["a <s> b </s> c <unk>", "[INST] hi [/INST]", "<|endoftext|>"]
    got = [x.tolist() for x in load_encoder(f"builtin:{name}").encode_batch(texts)]
    assert got == reference.encode(texts)
    assert not any(reference.is_control(i) or reference.is_unknown(i) for ids in got for i in ids)
    assert reference.decode(got) == texts


def _prepare(tmp_path, tokenizer: str, out: str):
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in DOCS))
    cfg = load_config(
        None,
        [
            "data.source=local",
            f"data.path={src}",
            f"data.tokenizer={tokenizer}",
            "data.seq_len=64",
            "data.token_budget=640",
            "data.shuffle_buffer_tokens=0",
            "data.domain_tags=false",
            "data.num_workers=1",
            f"data.output_dir={tmp_path / out}",
        ],
    )
    return cfg, prepare(cfg)


def test_packed_windows_hold_the_anchor_only_at_segment_starts(tmp_path):
    tok = byte_level_bpe()
    tok.save_pretrained(str(tmp_path / "bpe"))
    _, out = _prepare(tmp_path, str(tmp_path / "bpe"), "data")
    data = open_packed(out)
    assert data.manifest.tokenizer.encoder == "tokenizers" and data.manifest.anchor.id == 0
    bodies = []
    for w in range(len(data)):
        row = data[w]
        starts = [0, *row["seg_lens"].cumsum()[:-1].tolist()]
        assert [i for i, x in enumerate(row["input_ids"].tolist()) if x == 0] == starts
        for start, n in zip(starts, row["seg_lens"].tolist()):
            bodies += row["input_ids"][start + 1 : start + n].tolist()
    expected = [i for ids in split_reference(tok, DOCS) for i in ids]
    assert len(bodies) > 500 and bodies == expected[: len(bodies)]


def _as_format_4(out):
    """The dataset at `out` as an older lctrain wrote it: format 4, with a checksum that matches."""
    raw = json.loads((out / MANIFEST).read_text())
    del raw["checksum"]
    write_manifest(out, Manifest.model_validate(raw | {"format_version": 4}))


def test_a_dataset_of_the_old_rule_is_rebuilt_or_refused(tmp_path, capsys):
    byte_level_bpe().save_pretrained(str(tmp_path / "bpe"))
    cfg, out = _prepare(tmp_path, str(tmp_path / "bpe"), "data")
    _as_format_4(out)
    assert read_manifest(out) is None
    why = "dataset format 4, in which document text spelling a special token, such as <|endoftext|>, became"
    with pytest.raises(UserError, match=f"{why} that token's id; run 'lctrain prepare' with the same config"):
        open_packed(out)
    capsys.readouterr()
    prepare(cfg)
    assert f"rebuilding it ({MANIFEST}: it is of {why}" in capsys.readouterr().out
    assert open_packed(out).manifest.format_version == FORMAT_VERSION


def test_a_sentencepiece_dataset_of_format_4_is_still_current(tmp_path, capsys):
    """SentencePiece never read control symbols from text: its format-4 windows are this lctrain's."""
    _, out = _prepare(tmp_path, "builtin:mistral-7b-v0.1", "spm")
    _as_format_4(out)
    assert open_packed(out).manifest.format_version == 4
    capsys.readouterr()
    _prepare(tmp_path, "builtin:mistral-7b-v0.1", "spm")
    assert "already prepared" in capsys.readouterr().out


@pytest.mark.real_model
def test_smollm2_encodes_its_special_token_text_as_text(model_dir):
    """The real case: SmolLM2's <|endoftext|> (id 0) is lctrain's anchor."""
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    ids = [x.tolist() for x in text_encoder(tok).encode_batch(TEXTS)]
    assert ids == split_reference(tok, TEXTS)
    assert 0 not in {i for x in ids for i in x} and resolve_anchor(tok).id == 0
