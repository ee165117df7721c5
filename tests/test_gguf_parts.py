"""The example model's GGUF carried in parts: split here, joined there, byte for byte, refusing a missing or damaged
part; and `lctrain example-model` reading the joined file through $LCTRAIN_EXAMPLE_GGUF."""

import json

import pytest

from devtools.gpu_check import gguf_parts
from devtools.gpu_check.cli import main as gpu_check_main
from lctrain import example_model
from lctrain.errors import UserError

MIB = 1 << 20


@pytest.fixture
def blob(tmp_path):
    data = bytes(range(256)) * (10 * MIB // 256) + b"tail"  # 10 MiB and 4 bytes: the last part is short
    path = tmp_path / "src" / "model.gguf"
    path.parent.mkdir()
    path.write_bytes(data)
    return path, data


def test_split_then_join_gives_the_same_bytes(blob, tmp_path):
    path, data = blob
    folders = gguf_parts.split(path, tmp_path / "carry" / ".gguf", 3 * MIB)
    assert [f.name for f in folders] == [".gguf1", ".gguf2", ".gguf3", ".gguf4"]
    sizes = [sum(p.stat().st_size for p in f.glob("*.part*")) for f in folders]
    assert sizes == [3 * MIB, 3 * MIB, 3 * MIB, MIB + 4]
    joined = gguf_parts.join(list(reversed(folders)), tmp_path / "there")  # any order of folders
    assert joined.name == "model.gguf" and joined.read_bytes() == data


def test_a_missing_or_damaged_part_is_refused(blob, tmp_path):
    path, _ = blob
    folders = gguf_parts.split(path, tmp_path / ".gguf", 4 * MIB)
    with pytest.raises(ValueError, match="parts missing: model.gguf.part3"):
        gguf_parts.join(folders[:2], tmp_path / "there")
    part = next(folders[1].glob("*.part*"))
    part.write_bytes(b"\0" * part.stat().st_size)
    with pytest.raises(ValueError, match="does not match"):
        gguf_parts.join(folders, tmp_path / "there")
    with pytest.raises(ValueError, match="expected one parts.json"):
        gguf_parts.join(folders[1:], tmp_path / "there")


def test_parts_json_records_the_whole_file(blob, tmp_path):
    path, data = blob
    folders = gguf_parts.split(path, tmp_path / ".gguf", 8 * MIB)
    manifest = json.loads((folders[0] / gguf_parts.MANIFEST).read_text())
    assert manifest["size"] == len(data) and manifest["parts"] == ["model.gguf.part1", "model.gguf.part2"]


def test_the_gpu_check_joins_the_parts_for_the_example_model(blob, tmp_path, monkeypatch):
    path, data = blob
    folders = gguf_parts.split(path, tmp_path / ".gguf", 6 * MIB)
    monkeypatch.delenv(example_model.GGUF_ENV, raising=False)
    gguf_parts.use_joined(folders, tmp_path / "out")
    assert example_model.gguf_file().read_bytes() == data


def test_gguf_parts_command_writes_folders_under_the_limit(blob, tmp_path, monkeypatch, capsys):
    path, _ = blob
    monkeypatch.setenv(example_model.GGUF_ENV, str(path))
    assert gpu_check_main(["gguf-parts", "--dest", str(tmp_path / ".g"), "--max-mib", "4"]) == 0
    folders = capsys.readouterr().out.split()
    assert [f.rsplit("/", 1)[1] for f in folders] == [".g1", ".g2", ".g3"]
    assert all(p.stat().st_size <= 4 * MIB for p in tmp_path.glob(".g*/*.part*"))


def test_an_example_gguf_variable_naming_no_file_is_one_line(monkeypatch, tmp_path):
    monkeypatch.setenv(example_model.GGUF_ENV, str(tmp_path / "absent.gguf"))
    with pytest.raises(UserError, match="is not a file"):
        example_model.gguf_file()
