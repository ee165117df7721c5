"""Sources resolved explicitly: an existing path is a path even with glob characters in its name, only regular files
are read (a named pipe is refused in one line, never opened), and dangling symlinks and unreadable files are skipped,
counted and named in the summary and the manifest."""

import json
import os

import pytest
from typer.testing import CliRunner

from lctrain.cli import app
from lctrain.config import load_config
from lctrain.data import sources
from lctrain.data.prepare import prepare
from lctrain.data.store import open_packed
from lctrain.errors import UserError


def corpus(path, n=30):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"text": f"document {i} " + "word " * 60}) + "\n" for i in range(n)))
    return path


def cfg(tmp_path, data_path, *extra):
    over = ["data.source=local", f"data.path={data_path}", "data.seq_len=64", "data.token_budget=640"]
    return load_config(None, [*over, f"data.output_dir={tmp_path / 'out'}", *extra])


def test_an_existing_path_with_glob_characters_is_a_path(tmp_path):
    corpus(tmp_path / "data[1]" / "a.jsonl")
    corpus(tmp_path / "data1" / "other.jsonl")  # what the pattern data[1] would match
    data = open_packed(prepare(cfg(tmp_path, tmp_path / "data[1]")))
    assert data.manifest.source["files"] == 1 and data.manifest.source["skipped_files"] == []
    assert sources.resolve_local_files(str(tmp_path / "data[1]"), "train", 0).files == [
        tmp_path / "data[1]" / "a.jsonl"
    ]
    # a path that does not exist is still a pattern
    assert sources.resolve_local_files(str(tmp_path / "data[12]" / "*.jsonl"), "train", 0).files == [
        tmp_path / "data1" / "other.jsonl"
    ]


@pytest.mark.timeout(60)  # opening a pipe for reading blocks until a writer comes: the bug this guards against
@pytest.mark.parametrize("how", ["in a directory", "as data.path", "matched by a pattern"])
def test_a_named_pipe_is_refused_in_one_line_without_opening_it(tmp_path, how):
    corpus(tmp_path / "in" / "a.jsonl")
    os.mkfifo(tmp_path / "in" / "pipe.jsonl")
    path = {"in a directory": "in", "as data.path": "in/pipe.jsonl", "matched by a pattern": "in/*.jsonl"}[how]
    args = ["prepare", "--set", "data.source=local", "--set", f"data.path={tmp_path / path}"]
    r = CliRunner().invoke(app, [*args, "--set", f"data.output_dir={tmp_path / 'out'}"])
    line = r.stderr.strip()
    assert r.exit_code == 2 and "\n" not in line, r.output
    assert f"{tmp_path / 'in' / 'pipe.jsonl'} is a named pipe, not a regular file" in line
    assert not (tmp_path / "out").exists()


def test_dangling_symlinks_and_unreadable_files_are_skipped_named_and_counted(tmp_path, monkeypatch):
    src = tmp_path / "in"
    corpus(src / "a.jsonl")
    corpus(src / "sub" / "b.jsonl")
    (src / "gone.jsonl").symlink_to(src / "deleted.jsonl")
    (src / "loop.jsonl").symlink_to(src / "loop.jsonl")
    locked = corpus(src / "locked.jsonl")
    locked.chmod(0)
    if os.access(locked, os.R_OK):  # root reads anything: make the OS say what it says to other users
        real = os.access
        monkeypatch.setattr(sources.os, "access", lambda p, mode: False if str(p) == str(locked) else real(p, mode))
    args = ["prepare", "--set", "data.source=local", "--set", f"data.path={src}", "--set", "data.seq_len=64"]
    r = CliRunner().invoke(app, [*args, "--set", "data.token_budget=640", "--set", f"data.output_dir={tmp_path / 'o'}"])
    assert r.exit_code == 0, r.output
    summary = " ".join(r.output.split())
    assert "skipped 3 input file(s):" in summary
    for name, why in [
        ("gone.jsonl", "dangling symlink (its target does not exist)"),
        ("locked.jsonl", "permission denied"),
        ("loop.jsonl", "symlink loop"),
    ]:
        assert f"{src / name} ({why})" in summary
    source = open_packed(tmp_path / "o").manifest.source
    assert source["files"] == 2
    assert sorted((s["path"], s["reason"]) for s in source["skipped_files"]) == [
        (str(src / "gone.jsonl"), "dangling symlink (its target does not exist)"),
        (str(src / "locked.jsonl"), "permission denied"),
        (str(src / "loop.jsonl"), "symlink loop"),
    ]


def test_nothing_readable_is_one_line_with_the_first_reason(tmp_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "gone.jsonl").symlink_to(tmp_path / "nowhere.jsonl")
    with pytest.raises(UserError, match=r"no readable .* file \(1 skipped; .*gone.jsonl: dangling symlink"):
        prepare(cfg(tmp_path, tmp_path / "in"))
    with pytest.raises(UserError, match=r"no readable .* file \(1 skipped; .*gone.jsonl: dangling symlink"):
        prepare(cfg(tmp_path, tmp_path / "in" / "gone.jsonl"))


def test_the_tail_that_cannot_fill_a_window_is_said_per_domain(tmp_path):
    src = tmp_path / "c.jsonl"
    src.write_text(
        "".join(
            json.dumps({"text": "word " * 37, "meta": {"redpajama_set_name": s}}) + "\n"
            for s in ["RedPajamaC4", "RedPajamaBook"] * 5
        )
    )
    args = ["prepare", "--set", "data.source=local", "--set", f"data.path={src}", "--set", "data.seq_len=64"]
    r = CliRunner().invoke(
        app, [*args, "--set", "data.token_budget=6400", "--set", f"data.output_dir={tmp_path / 'o'}"]
    )
    assert r.exit_code == 0, r.output
    data = open_packed(tmp_path / "o")
    m = data.manifest
    written_text = sum(int(data[w]["seg_lens"].sum()) - len(data[w]["seg_lens"]) for w in range(len(data)))  # anchors
    dropped_text = m.source["tokens_read"] - written_text
    # the document tokens that did not fit, and the anchors of their segments in the unfinished window
    assert m.source_exhausted and 0 < dropped_text < m.dropped_tail_tokens < 64
    assert sum(m.dropped_tail_by_domain.values()) == m.dropped_tail_tokens
    assert set(m.dropped_tail_by_domain) <= {"C4", "Book"}
    per_domain = ", ".join(f"{d} {n:,}" for d, n in m.dropped_tail_by_domain.items())
    assert f"the source's last {m.dropped_tail_tokens:,} tokens ({per_domain}; anchors and tags included) cannot " in (
        " ".join(r.output.split())
    )
