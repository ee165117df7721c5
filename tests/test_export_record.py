"""An evaluation export's record (`lctrain.export_record`): written over the files of an export, it refuses, on
open, the export's files swapped with another export's, edited, truncated or missing, and an export under another
step's name; checked against xxh3 computed here over the files' bytes."""

import json
import shutil
from pathlib import Path

import pytest
import xxhash

from lctrain import checksums
from lctrain.errors import UserError
from lctrain.export_record import EXPORT_RECORD, read_export_record, verify_export, write_export_record


def export(directory: Path, step: int, seed: int) -> Path:
    """A stand-in export: weights differing by step, as training makes them, beside files equal in every step."""
    directory.mkdir(parents=True)
    (directory / "model.safetensors").write_bytes(bytes((seed * 7 + i * 13) % 256 for i in range(5000)))
    (directory / "config.json").write_text('{"model_type": "llama"}\n')
    (directory / "anchor.json").write_text('{"token": "<s>", "id": 1}\n')
    write_export_record(directory, step)
    return directory


@pytest.fixture
def two(tmp_path) -> tuple[Path, Path]:
    return export(tmp_path / "step_2", 2, seed=1), export(tmp_path / "step_4", 4, seed=2)


def refused(directory: Path, step: int | None, pattern: str) -> None:
    with pytest.raises(UserError, match=pattern) as e:
        verify_export(directory, step)
    assert "\n" not in str(e.value)


def test_the_record_holds_the_step_and_each_files_size_and_checksums(two):
    step2, _ = two
    record = json.loads((step2 / EXPORT_RECORD).read_text())
    assert record["step"] == 2 and sorted(record["files"]) == ["anchor.json", "config.json", "model.safetensors"]
    weights = (step2 / "model.safetensors").read_bytes()
    assert record["files"]["model.safetensors"] == {
        "bytes": len(weights),
        "checksum": "xxh3_128:" + xxhash.xxh3_128_hexdigest(weights),
        # the first and last EDGE_BYTES: both are the whole of a small file
        "edge_checksum": "xxh3_128:" + xxhash.xxh3_128_hexdigest(weights + weights),
    }
    assert verify_export(step2, 2)
    assert verify_export(step2, None)  # a directory not named by a step: its files are still checked


def test_files_equal_in_every_step_may_be_swapped_but_the_weights_may_not(two):
    step2, step4 = two
    for name in ("config.json", "anchor.json"):
        _swap(step2 / name, step4 / name)
    assert verify_export(step2, 2)
    _swap(step2 / "model.safetensors", step4 / "model.safetensors")
    refused(step2, 2, r"step_2/model.safetensors: not the file this export wrote \(checksum differs")
    refused(step4, 4, r"step_4/model.safetensors: not the file this export wrote")


def test_an_export_under_another_steps_name_is_refused(two, tmp_path):
    step2, step4 = two
    _swap(step2, step4)
    refused(step2, 2, r"step_2/export.json: records step 4, not 2 \(exports renamed or swapped\)")


@pytest.mark.parametrize(
    "damage, pattern",
    [
        (
            lambda f: f.write_bytes(f.read_bytes()[:100]),
            r"model.safetensors: 100 bytes, not the 5,000 the export wrote",
        ),
        (lambda f: f.write_bytes(b"\0" * 5000), r"model.safetensors: not the file this export wrote"),
        (lambda f: f.unlink(), r"model.safetensors: missing \(the export wrote it\)"),
    ],
    ids=["truncated", "zeroed", "deleted"],
)
def test_a_damaged_file_is_named(two, damage, pattern):
    damage(two[0] / "model.safetensors")
    refused(two[0], 2, pattern)


@pytest.mark.parametrize(
    "content, why",
    [
        ("", "JSONDecodeError"),
        ("[1]", "valid dictionary"),
        ('{"step": 2}', "Field required"),
        (None, "step: Input should be greater than or equal to 0"),
    ],
)
def test_a_damaged_record_is_refused(two, content, why):
    path = two[0] / EXPORT_RECORD
    if content is None:  # right keys, a value outside its domain
        record = json.loads(path.read_text())
        record["step"] = -1
        content = json.dumps(record)
    path.write_text(content)
    refused(two[0], 2, rf"step_2/export.json: not an export record \(.*{why}.*\); restore it, or delete it")


def test_a_string_step_is_not_a_step(two):
    path = two[0] / EXPORT_RECORD
    path.write_text(path.read_text().replace('"step": 2', '"step": "2"'))
    refused(two[0], 2, r"not an export record")


def test_without_a_record_there_is_nothing_to_check(two):
    (two[0] / EXPORT_RECORD).unlink()
    assert read_export_record(two[0]) is None
    assert not verify_export(two[0], 2)


def test_large_exports_are_checked_at_their_edges(two, monkeypatch):
    """Above FULL_VERIFY_BYTES the first and last EDGE_BYTES of each file (what swapped weights differ in); the
    middle of a large file is not read twice on every evaluation (the loader reads it)."""
    step2, step4 = two
    monkeypatch.setattr(checksums, "FULL_VERIFY_BYTES", 0)
    monkeypatch.setattr(checksums, "EDGE_BYTES", 64)
    shutil.rmtree(step2)
    export(step2, 2, seed=1)
    weights = step2 / "model.safetensors"
    body = bytearray(weights.read_bytes())
    body[2500] ^= 1
    weights.write_bytes(bytes(body))
    assert verify_export(step2, 2)
    monkeypatch.setattr(checksums, "FULL_VERIFY_BYTES", 1 << 30)
    refused(step2, 2, r"model.safetensors: not the file this export wrote")


def _swap(a: Path, b: Path) -> None:
    tmp = a.with_name(a.name + ".swap")
    a.rename(tmp)
    b.rename(a)
    tmp.rename(b)


def test_an_export_generates_with_its_kv_cache_and_is_as_readable_as_its_config(tmp_path, monkeypatch):
    """Training runs without the KV cache; the export is saved with it on (a plain `generate()` recomputed the whole
    prefix per token), the training model keeps its own setting, and the weights file gets the mode the config was
    created with (safetensors writes 0600 whatever the umask)."""
    import os

    from transformers import LlamaConfig, LlamaForCausalLM

    from lctrain.config import load_config
    from lctrain.rundir import RunDir
    from lctrain.tokenizer import Anchor, load_tokenizer
    from lctrain.train import checkpoint

    monkeypatch.setattr(checkpoint, "barrier", lambda: None)  # one process, no group
    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        use_cache=False,
    )
    lm = LlamaForCausalLM(config)
    umask = os.umask(0o022)
    try:
        out = checkpoint.save_hf(
            None,
            lm,
            load_tokenizer("builtin:mistral-7b-v0.1"),
            Anchor("<s>", 1, "test"),
            RunDir(tmp_path),
            3,
            rank=0,
            zero_stage=0,
            cfg=load_config(None, []),
        )
    finally:
        os.umask(umask)
    assert json.loads((out / "config.json").read_text())["use_cache"] is True
    assert lm.config.use_cache is False
    assert {f.stat().st_mode & 0o777 for f in out.iterdir()} == {0o644}
