"""Sources resolved explicitly: an existing path is a path even with glob characters in its name, only regular files
are read (a named pipe is refused in one line, never opened), and dangling symlinks, unreadable files and files of
other types are skipped, counted and named in the summary and the manifest; a folder passes over hidden files and
folders, as a glob over it does. A `.json` file is JSON Lines or one JSON array of records; a `data.path` corpus whose
records keep their text under another name is refused in one line saying how to name it."""

import glob
import json
import os
import re
import shutil
from pathlib import Path

import pytest
import zstandard
from train_helpers import one_error_line
from typer.testing import CliRunner

from lctrain.cli import app
from lctrain.config import load_config
from lctrain.data import sources
from lctrain.data.prepare import prepare
from lctrain.data.store import open_packed
from lctrain.errors import UserError

OTHER_TYPE = "unsupported file type: not .jsonl, .json, .jsonl.zst, .json.zst or .parquet"


def corpus(path, n=30):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records(n)))
    return path


def records(n=30):
    return [{"text": f"document {i} " + "word " * 60} for i in range(n)]


def run_prepare(tmp_path, data_path, *extra):
    args = ["prepare", "--set", "data.source=local", "--set", f"data.path={data_path}", "--set", "data.seq_len=64"]
    more = [x for o in ["data.token_budget=640", f"data.output_dir={tmp_path / 'o'}", *extra] for x in ("--set", o)]
    return CliRunner().invoke(app, [*args, *more])


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


def test_files_of_other_types_in_a_folder_or_a_glob_are_skipped_and_named(tmp_path):
    src = tmp_path / "gzdir"
    corpus(src / "a.jsonl")
    for name in ["x.jsonl.gz", "b.jsonl.gz", "sub/notes.txt", ".DS_Store", ".cache/huggingface/a.jsonl.lock"]:
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_bytes(b"\x1f\x8b not read")
    r = run_prepare(tmp_path, src)
    assert r.exit_code == 0, r.output
    other = [src / "b.jsonl.gz", src / "sub" / "notes.txt", src / "x.jsonl.gz"]
    summary = " ".join(r.output.split())
    assert "skipped 3 input file(s): " + "; ".join(f"{f} ({OTHER_TYPE})" for f in other) in summary
    source = open_packed(tmp_path / "o").manifest.source
    assert source["files"] == 1
    assert source["skipped_files"] == [{"path": str(f), "reason": OTHER_TYPE} for f in other]

    # a glob: what it matches that is not a supported type is named too
    resolved = sources.resolve_local_files(str(src / "*.*"), "train", 0)
    assert resolved.files == [src / "a.jsonl"]
    assert resolved.skipped == [(src / "b.jsonl.gz", OTHER_TYPE), (src / "x.jsonl.gz", OTHER_TYPE)]


def named_corpus(path, name, n):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"text": f"{name} document {i} " + "word " * 40}) + "\n" for i in range(n)))
    return path


def windows(out):
    data = open_packed(out)
    return [(data[i]["input_ids"].tolist(), data[i]["seg_lens"].tolist()) for i in range(len(data))]


def test_a_folder_passes_over_hidden_files_and_folders_as_a_glob_does(tmp_path):
    """A git checkout's .git/, Jupyter's checkpoint copies (the same records again) and macOS's AppleDouble files
    (binary, named like the file they describe) are not data: a folder reads what a glob over it reads, the same
    windows as the folder without them, and says nothing of them. A path or a pattern that names a hidden file reads
    it."""
    clean = tmp_path / "clean"
    named_corpus(clean / "a.jsonl", "alpha", 12)
    named_corpus(clean / "sub" / "b.jsonl", "beta", 9)
    src = tmp_path / "src"
    shutil.copytree(clean, src)
    named_corpus(src / ".hidden.jsonl", "hidden", 5)
    named_corpus(src / ".git" / "x.jsonl", "git", 5)
    named_corpus(src / "sub" / ".cache" / "y.jsonl", "cache", 5)
    (src / ".ipynb_checkpoints").mkdir()
    shutil.copy(src / "a.jsonl", src / ".ipynb_checkpoints" / "a-checkpoint.jsonl")
    (src / "._a.jsonl").write_bytes(b"\x00\x05\x16\x07\x00\x02\x00\x00Mac OS X        " + bytes(range(256)) * 4)

    # the reference: Python's glob, which passes over names that start with a dot
    globbed = sorted(Path(f) for f in glob.glob(str(src / "**" / "*.jsonl"), recursive=True))
    assert globbed == [src / "a.jsonl", src / "sub" / "b.jsonl"]
    resolved = sources.resolve_local_files(str(src), "train", 0)
    assert sorted(resolved.files) == globbed and resolved.skipped == []

    everything = ["data.token_budget=64000"]  # more than the input: every document is in the windows
    built = {}
    for name, path in [("folder", src), ("clean", clean), ("glob", src / "**" / "*.jsonl")]:
        r = run_prepare(tmp_path / name, path, *everything)
        assert r.exit_code == 0 and "skipped" not in r.output, r.output
        built[name] = windows(tmp_path / name / "o")
    assert built["folder"] == built["clean"] == built["glob"]
    assert open_packed(tmp_path / "folder" / "o").manifest.source["files"] == 2

    # named, a hidden file is read
    assert sources.resolve_local_files(str(src / ".hidden.jsonl"), "train", 0).files == [src / ".hidden.jsonl"]
    assert sources.resolve_local_files(str(src / ".h*.jsonl"), "train", 0).files == [src / ".hidden.jsonl"]


@pytest.mark.parametrize("path", ["only_gz", "only_gz/*"])
def test_only_files_of_other_types_is_one_line_naming_one(tmp_path, path):
    (tmp_path / "only_gz").mkdir()
    (tmp_path / "only_gz" / "a.jsonl.gz").write_bytes(b"\x1f\x8b")
    with pytest.raises(UserError, match=r"no .*\.jsonl.* file.* \(1 file\(s\) of other types, e\.g\. a\.jsonl\.gz; "):
        sources.resolve_local_files(str(tmp_path / path), "train", 0)


@pytest.mark.parametrize(
    "name,dump",
    [
        ("indented.json", lambda recs: json.dumps(recs, indent=2).encode()),
        ("compact.json", lambda recs: json.dumps(recs).encode()),
        ("bom_and_blank_lines.json", lambda recs: b"\xef\xbb\xbf\n\n  " + json.dumps(recs).encode()),
        ("array.json.zst", lambda recs: zstandard.ZstdCompressor().compress(json.dumps(recs).encode())),
        ("json_lines.json", lambda recs: "".join(json.dumps(r) + "\n" for r in recs).encode()),
    ],
)
def test_a_json_array_file_reads_as_the_same_records_as_json_lines(tmp_path, name, dump):
    recs = records()
    (tmp_path / name).write_bytes(dump(recs))
    reference = open_packed(
        prepare(cfg(tmp_path, corpus(tmp_path / "ref" / "c.jsonl"), "data.output_dir=" + str(tmp_path / "ref_out")))
    )
    data = open_packed(prepare(cfg(tmp_path, tmp_path / name)))
    assert data.manifest.source["documents_read"] == len(recs) == reference.manifest.source["documents_read"]
    assert [data[w]["input_ids"].tolist() for w in range(len(data))] == [
        reference[w]["input_ids"].tolist() for w in range(len(reference))
    ]


def test_a_json_array_counts_and_numbers_its_elements_like_lines(tmp_path):
    recs = records(300)  # more than one batch of records
    bad = {257: 5, 258: ["not", "an", "object"], 260: {"meta": {}}, 299: {"text": "  "}}  # element numbers, 1-based
    for n, value in bad.items():
        recs[n - 1] = value
    src = tmp_path / "c.json"
    src.write_text(json.dumps(recs, indent=1))
    data = open_packed(prepare(cfg(tmp_path, src, "data.token_budget=64000")))
    sk = data.manifest.skipped
    assert sk["counts"] == {"malformed_json": 2, "no_text": 1, "empty_text": 1}
    assert [(e["reason"], e["line"]) for e in sk["examples"]] == [
        ("malformed_json", 257),
        ("malformed_json", 258),
        ("no_text", 260),
        ("empty_text", 299),
    ]
    assert {e["source"] for e in sk["examples"]} == {str(src)}
    assert data.manifest.source["documents_read"] == 300 - len(bad)


def long_records(n: int) -> list[dict]:
    return [
        {"text": f"doc {i} " + "x" * (50 + 37 * (i % 7)), "body": {"text": f"nested {i} " + "y" * 80}} for i in range(n)
    ]


@pytest.mark.parametrize("kind", ["parquet", "json array", "parquet of data.sources", "json array of data.sources"])
def test_rows_are_batched_by_their_text_as_lines_are_by_their_bytes(tmp_path, monkeypatch, kind):
    """Rows (parquet, a JSON array) weighed nothing towards the batch's bytes: 256 long documents made one batch of
    millions of tokens in flight, and no shard for an interrupted prepare to keep until it was tokenized whole."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    monkeypatch.setattr(sources, "BATCH_BYTES", 1000)
    recs = long_records(300)
    field = "body.text" if "data.sources" in kind else "text"
    src = tmp_path / ("c.parquet" if "parquet" in kind else "c.json")
    if "parquet" in kind:
        pq.write_table(pa.Table.from_pylist(recs), src)
    else:
        src.write_text(json.dumps(recs))
    if "data.sources" in kind:
        stream = sources.SourceStream("c", field, None, 1.0, sources.local_batches([src], ("body",)), "data.sources[0]")
        batches = list(sources.mixed_batches([stream], seed=0))
        rows = [[item for _, _, _, _, item in b.items] for b in batches]
    else:
        batches = list(sources.local_batches([src]))
        rows = [b.items for b in batches]
    text = [[sources.field_at(r, field) for r in batch] for batch in rows]
    assert [r for batch in text for r in batch] == [sources.field_at(r, field) for r in recs]  # every row, in order
    assert [b.first for b in batches] == [1 + sum(map(len, rows[:i])) for i in range(len(rows))]
    # each batch closes on the row that brings its text to 1000 characters
    for batch in text:
        assert sum(map(len, batch[:-1])) < 1000
    assert all(sum(map(len, batch)) >= 1000 for batch in text[:-1])


@pytest.mark.parametrize(
    "content,needle",
    [
        (b'[{"text": "a"}, {"text": "b"', "not a valid JSON array (JSONDecodeError: Expecting ',' delimiter"),
        (b'[{"text": "a"}]\n[{"text": "b"}]\n', "not a valid JSON array (JSONDecodeError: Extra data: line 2"),
        (b'[{"text": "\xff"}]', "not a valid JSON array (UnicodeDecodeError"),
    ],
)
def test_a_broken_json_array_is_one_line_naming_the_file(tmp_path, content, needle):
    (tmp_path / "c.json").write_bytes(content)
    r = run_prepare(tmp_path, tmp_path / "c.json")
    line = one_error_line(r)
    assert r.stderr.strip().splitlines()[-1] == line
    assert f"{tmp_path / 'c.json'}: {needle}" in line
    assert not (tmp_path / "o").exists()


def test_a_truncated_json_array_zst_is_one_line_naming_the_file(tmp_path):
    whole = zstandard.ZstdCompressor().compress(json.dumps(records()).encode())
    (tmp_path / "c.json.zst").write_bytes(whole[: len(whole) // 2])
    r = run_prepare(tmp_path, tmp_path / "c.json.zst")
    line = one_error_line(r)
    assert r.stderr.strip().splitlines()[-1] == line
    assert f"{tmp_path / 'c.json.zst'}: the file ends inside a zstd frame (truncated)" in line


@pytest.mark.parametrize("name", ["c.jsonl", "c.json"])
def test_text_under_another_field_is_refused_saying_how_to_read_it(tmp_path, name):
    # the first JSON object is the one checked (5 is not one)
    items = [5, {"meta": {"k": 1}, "content": "x"}, *({"content": r["text"], "id": i} for i, r in enumerate(records()))]
    src = tmp_path / name
    src.write_text("".join(json.dumps(r) + "\n" for r in items) if name.endswith(".jsonl") else json.dumps(items))
    r = run_prepare(tmp_path, src)
    line = one_error_line(r)
    assert r.stderr.strip().splitlines()[-1] == line
    assert f"{src}: record 2 has no 'text' field (it has: content, meta); data.path reads the text from 'text'" in line
    assert not (tmp_path / "o").exists()

    # the advice, followed as written, reads the corpus
    advice = re.search(r"data\.sources=\[.*\]", line).group(0)
    assert "text_field: content" in advice
    advised = advice.replace("<data.path>", f"'{src}'")
    args = ["prepare", "--set", advised, "--set", "data.seq_len=64", "--set", "data.token_budget=640"]
    r = CliRunner().invoke(app, [*args, "--set", f"data.output_dir={tmp_path / 'advised'}"])
    assert r.exit_code == 0, r.output
    assert open_packed(tmp_path / "advised").manifest.source["documents_read"] == 31  # and record 2


def test_a_parquet_file_without_its_text_column_is_refused_naming_its_columns(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    src = tmp_path / "c.parquet"
    rows = [{"content": r["text"], "meta": {"k": 1}} for r in records()]
    pq.write_table(pa.Table.from_pylist(rows), src)
    r = run_prepare(tmp_path, src)
    assert r.exit_code == 2, r.output
    assert f"{src}: record 1 has no 'text' field (it has: content, meta)" in r.stderr


def test_records_without_text_after_the_first_are_counted_not_refused(tmp_path):
    src = tmp_path / "c.jsonl"
    recs = [*records(), {"content": "elsewhere"}, {"meta": {}}, *records(5)]
    src.write_text("".join(json.dumps(r) + "\n" for r in recs))
    data = open_packed(prepare(cfg(tmp_path, src)))
    assert data.manifest.skipped["counts"] == {"no_text": 2}


def test_training_on_a_dataset_whose_input_changed_since_says_so(tmp_path, capsys):
    """prepare refuses to call such a dataset prepared; train takes what it has, but says what changed and how to
    train on the input as it is now."""
    from lctrain.train.command import preflight

    src = corpus(tmp_path / "c.jsonl")
    c = cfg(tmp_path, src, "train.steps=1", "train.global_batch=1", "train.micro_batch=1", "eval.ppl_windows=0")
    prepare(c)
    capsys.readouterr()
    preflight(c)
    assert "prepared from other input files" not in "".join(capsys.readouterr())
    with src.open("a") as f:
        f.write(json.dumps({"text": "a late document"}) + "\n")
    preflight(c)
    out, err = capsys.readouterr()
    assert "prepared from other input files" not in out  # a warning: on stderr
    said = " ".join(err.split())
    assert f"warning: {tmp_path / 'out'} was prepared from other input files than data's now (" in said
    assert "run 'lctrain prepare --force' first" in said


def test_the_bar_of_a_budget_above_the_input_is_the_inputs(tmp_path, monkeypatch):
    """With data.token_budget above what the input holds ("use all of it"), the bar's total (and so its ETA) is the
    input's tokens, estimated from the files read once the first is done, not the budget; it ends full."""
    from lctrain.data import prepare as preparing

    seen, progress = [], preparing._progress

    class Recorded:
        def __init__(self):
            self.bar = progress()

        def __enter__(self):
            self.bar.__enter__()
            return self

        def __exit__(self, *exc):
            return self.bar.__exit__(*exc)

        def add_task(self, *args, **kwargs):
            seen.append((kwargs["total"], kwargs["completed"]))
            return self.bar.add_task(*args, **kwargs)

        def update(self, task, **kwargs):
            seen.append((kwargs.get("total", seen[-1][0]), kwargs["completed"]))
            self.bar.update(task, **kwargs)

    monkeypatch.setattr(preparing, "_progress", Recorded)
    for i in range(4):  # equal files: the first file's tokens per byte are every file's
        corpus(tmp_path / "in" / f"{i}.jsonl")
    budget = 10**7
    prepare(cfg(tmp_path, tmp_path / "in", f"data.token_budget={budget}"))
    packed = open_packed(tmp_path / "out").manifest.num_tokens
    assert seen[0][0] >= budget - 64  # the budget's windows, before any file is done
    estimated = [total for total, _ in seen[1:-1] if total < budget - 64]
    assert estimated and all(abs(total - packed) < 0.1 * packed for total in estimated)  # anchors and tail aside
    assert seen[-1] == (packed, packed)
