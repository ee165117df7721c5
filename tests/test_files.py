"""files.replace_file: the target holds the old content or the new, never a part, and a machine's refusal is one
line naming what was being written."""

from __future__ import annotations

import errno
import os

import pytest

from lctrain.errors import WriteFailed
from lctrain.files import readable_as_config_json, replace_file, temporary_of


def test_replace_file_swaps_whole_content(tmp_path):
    target = tmp_path / "state.json"
    target.write_text("old")
    with open(target) as reader:  # opened before: still sees the old file after the rename (no in-place rewrite)
        replace_file(target, "new", "a state file")
        assert reader.read() == "old"
    assert target.read_text() == "new"
    replace_file(target, b"\x00bytes", "a state file")
    assert target.read_bytes() == b"\x00bytes"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]


def test_replace_file_failure_keeps_old_content(tmp_path, monkeypatch):
    target = tmp_path / "state.json"
    target.write_text("old")

    def full_disk(src, dst):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(dst))

    monkeypatch.setattr(os, "replace", full_disk)
    with pytest.raises(WriteFailed, match="cannot write a state file .*No space left on device"):
        replace_file(target, "new", "a state file")
    assert target.read_text() == "old"
    assert not temporary_of(target).exists()  # the part written is removed: on a full disk, space needed back


def test_a_saved_models_weights_get_its_configs_mode(tmp_path):
    """safetensors writes 0600 whatever the umask: the weights of a model saved for others become as readable as
    its config.json (exports, the example model)."""
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "config.json").chmod(0o644)
    (tmp_path / "model.safetensors").write_bytes(b"")
    (tmp_path / "model.safetensors").chmod(0o600)
    readable_as_config_json(tmp_path)
    assert {p.name: p.stat().st_mode & 0o777 for p in tmp_path.iterdir()} == {
        "config.json": 0o644,
        "model.safetensors": 0o644,
    }
