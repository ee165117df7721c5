"""Input files that cannot be records as a whole are refused in one line naming the file, what it is and what to do
(compressed otherwise than their name says, UTF-16/32, not UTF-8, NUL bytes, one JSON document spread over lines,
JSON strings instead of records) instead of vanishing into the skipped-record counts, while a few bad lines in a good
file are still skipped and counted. `text_field` reads dotted keys, and the advice for a corpus without `text` names
the field that holds its longest string."""

import bz2
import gzip
import json
import lzma
import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import sentencepiece as spm
import zstandard
from train_helpers import one_error_line, set_args
from typer.testing import CliRunner

from lctrain.cli import app
from lctrain.data import sources
from lctrain.data.store import open_packed
from lctrain.errors import UserError
from lctrain.tokenizer import builtin_model_file

TOKENIZER = "builtin:mistral-7b-v0.1"


def records(n=25):
    return [{"text": f"document {i} " + "word " * 40} for i in range(n)]


def jsonl(recs) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in recs).encode()


def run_prepare(tmp_path, *overrides, out="out"):
    over = ["data.seq_len=64", "data.token_budget=64000", f"data.output_dir={tmp_path / out}", *overrides]
    return CliRunner().invoke(app, ["prepare", *set_args(over)])


def test_a_gzip_file_among_good_ones_is_refused_naming_it(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "part1.jsonl").write_bytes(jsonl(records()))
    (corpus / "part2.jsonl").write_bytes(gzip.compress(jsonl(records())))
    line = one_error_line(run_prepare(tmp_path, "data.source=local", f"data.path={corpus}"))
    assert f"{corpus / 'part2.jsonl'}: gzip-compressed, not plain JSON text as its name says" in line
    assert "decompress it (gzip -dc)" in line and "name it part2.jsonl.zst" in line
    assert not (tmp_path / "out").exists()


def test_a_utf16_source_of_data_sources_is_refused_naming_it(tmp_path):
    src = tmp_path / "c.jsonl"
    src.write_bytes(jsonl(records()).decode().encode("utf-16"))
    line = one_error_line(run_prepare(tmp_path, f"data.sources=[{{name: corpus, path: '{src}'}}]"))
    assert f"{src}: UTF-16 text (it starts with a UTF-16 byte-order mark), not UTF-8; convert it to UTF-8" in line


def _zst(data: bytes) -> bytes:
    return zstandard.ZstdCompressor().compress(data)


LATIN1 = "".join(json.dumps({"text": "café " * 30}, ensure_ascii=False) + "\n" for _ in range(25)).encode("latin-1")
WRAPPED = {"version": "1.1", "data": records()}


@pytest.mark.parametrize(
    "name,content,says",
    [
        ("c.jsonl", _zst(jsonl(records())), "zstd-compressed, but its name does not say so; rename it to c.jsonl.zst"),
        ("c.json", bz2.compress(jsonl(records())), "bzip2-compressed, not plain JSON text as its name says"),
        ("c.jsonl", lzma.compress(jsonl(records())), "xz-compressed, not plain JSON text as its name says"),
        ("c.jsonl.zst", gzip.compress(jsonl(records())), "gzip-compressed, not zstd as its name says"),
        ("c.jsonl.zst", jsonl(records()), "not zstd-compressed as its name says; rename it to c.jsonl"),
        ("c.parquet", gzip.compress(b"PAR1"), "gzip-compressed, not a parquet file"),
        ("c.json", jsonl(records()).decode().encode("utf-32"), "UTF-32 text (it starts with a UTF-32 byte-order mark)"),
        ("c.jsonl", jsonl(records()).decode().encode("utf-16-le"), "hold NUL bytes (UTF-16 or UTF-32 text without a"),
        ("c.jsonl", LATIN1, "not UTF-8 text: none of its 25 lines decodes as UTF-8 (Latin-1"),
        ("c.jsonl.zst", _zst(LATIN1), "not UTF-8 text: none of its 25 lines decodes as UTF-8"),
        ("c.jsonl", b"not json\n\n{broken\n", "not JSON Lines: none of its 2 lines is a JSON object (2 not JSON)"),
        ("c.jsonl", json.dumps(records(), indent=1).encode(), "one JSON array of 25 records spread over lines"),
        ("c.jsonl", jsonl(["doc " * 30] * 3), "its 3 lines are JSON strings, not records"),
        ("c.json", json.dumps(["doc one", "doc two"]).encode(), "one JSON array of 2 strings, not of records"),
        ("c.json", json.dumps([1, [2]]).encode(), "one JSON array of 2 values, none of them a record"),
        ("c.json", json.dumps(WRAPPED, indent=2).encode(), "the file is one JSON object holding a list of 25 records"),
        ("c.json", json.dumps(WRAPPED).encode(), "record 1 is one JSON object holding a list of 25 records"),
        ("c.jsonl", json.dumps(records(1)[0], indent=1).encode(), "one JSON object spread over lines (keys: text)"),
    ],
    ids=[
        "zstd-named-jsonl",
        "bzip2",
        "xz",
        "gzip-named-zst",
        "plain-named-zst",
        "gzip-named-parquet",
        "utf32-bom",
        "utf16-no-bom",
        "latin1",
        "latin1-in-zst",
        "not-json",
        "pretty-array-named-jsonl",
        "json-string-lines",
        "array-of-strings",
        "array-of-values",
        "pretty-wrapped-array",
        "wrapped-array-one-line",
        "pretty-record",
    ],
)
def test_a_file_that_cannot_be_records_is_one_line_saying_what_it_is(tmp_path, name, content, says):
    src = tmp_path / name
    src.write_bytes(content)
    with pytest.raises(UserError) as e:
        list(sources.local_batches([src]))
    assert "\n" not in str(e.value)
    assert str(e.value).startswith(f"{src}: ") and says in str(e.value), str(e.value)


def test_the_advice_for_a_wrapped_corpus_writes_its_records_out(tmp_path):
    src = tmp_path / "c.json"
    src.write_bytes(json.dumps(WRAPPED, indent=2).encode())
    with pytest.raises(UserError, match=re.escape("(jq -c '.data[]')")):
        list(sources.local_batches([src]))
    src.write_bytes(json.dumps({"my docs": ["one " * 9, "two " * 9]}).encode())
    with pytest.raises(UserError, match=re.escape("""(jq -c '.["my docs"][] | {text: .}')""")):
        list(sources.local_batches([src]))


def test_a_few_bad_lines_in_a_good_file_are_still_skipped_and_counted(tmp_path):
    src = tmp_path / "c.jsonl"
    bad = [json.dumps({"text": "café"}, ensure_ascii=False).encode("latin-1"), b'{"text": "\x00"}', b"[1]"]
    src.write_bytes(b"\n".join(bad) + b"\n" + jsonl(records()))  # the bad lines first
    r = run_prepare(tmp_path, "data.source=local", f"data.path={src}", "data.token_budget=640")
    assert r.exit_code == 0, r.output
    manifest = open_packed(tmp_path / "out").manifest
    assert manifest.skipped["counts"] == {"undecodable": 1, "malformed_json": 2}
    assert manifest.source["documents_read"] == 25


def nested(n=20):
    return [{"id": i, "doc": {"title": f"t{i}", "body": f"body{i} " + "nested " * 40}} for i in range(n)]


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_the_advice_names_a_nested_string_and_a_dotted_text_field_reads_it(tmp_path, kind):
    src = tmp_path / f"c.{kind}"
    if kind == "jsonl":
        src.write_bytes(jsonl(nested()))
    else:
        pq.write_table(pa.Table.from_pylist(nested()), src)
    line = one_error_line(run_prepare(tmp_path, "data.source=local", f"data.path={src}"))
    assert f"{src}: record 1 has no 'text' field (it has: doc, id)" in line
    advice = re.search(r"data\.sources=\[.*\]", line).group(0)
    assert advice == "data.sources=[{name: corpus, path: <data.path>, text_field: doc.body}]"

    # followed as written; documents in file order, so the packed text is the bodies' token ids one after another
    advised = advice.replace("<data.path>", f"'{src}'")
    r = run_prepare(tmp_path, advised, "data.token_budget=640", "data.shuffle_buffer_tokens=0", out="advised")
    assert r.exit_code == 0, r.output
    data = open_packed(tmp_path / "advised")
    packed, segments = [], 0
    for w in range(len(data)):
        row = data[w]
        assert not row["tag_lens"].any()
        starts = np.concatenate([[0], np.cumsum(row["seg_lens"])[:-1]])
        for s, n in zip(starts, row["seg_lens"]):
            packed += row["input_ids"][s + 1 : s + n].tolist()  # past the anchor
            segments += 1
    reference = spm.SentencePieceProcessor(model_file=str(builtin_model_file(TOKENIZER.removeprefix("builtin:"))))
    expected = [t for r in nested() for t in reference.encode(r["doc"]["body"])]
    assert len(packed) == 640 - segments
    assert packed == expected[: len(packed)]


def test_a_text_field_naming_an_object_is_refused_naming_the_string_inside(tmp_path):
    src = tmp_path / "c.jsonl"
    src.write_bytes(jsonl(nested()))
    line = one_error_line(run_prepare(tmp_path, f"data.sources=[{{name: corpus, path: '{src}', text_field: doc}}]"))
    assert "data.sources[0].text_field = 'doc': in" in line
    assert "record 1 holds an object there (with: body, title), not text" in line
    assert "e.g. doc.body (its longest string)" in line

    # data.path: a 'text' that is an object
    src.write_bytes(jsonl([{"text": r["doc"]} for r in nested()]))
    line = one_error_line(run_prepare(tmp_path, "data.source=local", f"data.path={src}"))
    assert "record 1's 'text' is an object (it has: body, title), not a string" in line
    assert "text_field: text.body}]" in line


def test_each_file_of_a_corpus_is_checked_for_its_text_field(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.jsonl").write_bytes(jsonl(records()))
    (corpus / "b.jsonl").write_bytes(jsonl(nested()))
    line = one_error_line(run_prepare(tmp_path, "data.source=local", f"data.path={corpus}"))
    assert f"{corpus / 'b.jsonl'}: record 1 has no 'text' field" in line


def test_a_source_that_yields_nothing_is_named_in_words(tmp_path):
    (tmp_path / "empty.jsonl").write_bytes(b"")
    line = one_error_line(run_prepare(tmp_path, f"data.sources=[{{name: e, path: '{tmp_path / 'empty.jsonl'}'}}]"))
    assert f"the 1 source of data.sources (e: {tmp_path / 'empty.jsonl'}, 0 bytes) yielded 0 tokens in 0 usable" in line


def test_capitalised_extensions_are_read_as_their_lower_case_would_be(tmp_path):
    """`A.JSONL` (as some exports name files) was passed over as an unsupported file type; a `.JSON.ZST` array, a
    `.Parquet` file and a `.JSONL` are read as their lower-case names are; the array advice keeps the name's case."""
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "a.JSONL").write_bytes(jsonl(records(3)))
    (folder / "b.JSON.ZST").write_bytes(_zst(json.dumps(records(4)).encode()))
    pq.write_table(pa.Table.from_pylist(records(5)), folder / "c.Parquet")
    files = sources.resolve_local_files(str(folder), "train", 0).files
    assert sorted(f.name for f in files) == ["a.JSONL", "b.JSON.ZST", "c.Parquet"]
    texts = [r for b in sources.local_batches(sorted(files)) for r in b.items]
    assert len(texts) == 3 + 4 + 5
    pretty = folder / "d.JSONL.Zst"
    pretty.write_bytes(_zst(json.dumps(records(2), indent=1).encode()))
    with pytest.raises(UserError, match=r"rename it to d\.json\.Zst "):
        list(sources.local_batches([pretty]))


def test_a_folder_that_yields_nothing_names_what_it_read_and_skipped(tmp_path):
    """Said only as 'the local source yielded 0 tokens' once: which file was empty, and that a file of another type
    was passed over, were in no line."""
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "a.jsonl").write_bytes(b"\n\n")
    (folder / "b.csv").write_bytes(jsonl(records()))
    line = one_error_line(run_prepare(tmp_path, "data.source=local", f"data.path={folder}"))
    assert line.startswith(
        f"error: the local source ({folder / 'a.jsonl'}, 2 bytes; skipped 1 input file(s): {folder / 'b.csv'} "
        f"(unsupported file type: not .jsonl, .json, .jsonl.zst, .json.zst or .parquet)) yielded 0 tokens in 0 usable "
        "documents (skipped: 2 blank_line)"
    )
