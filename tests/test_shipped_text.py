"""The shipped-text corpus against Python's own copies of its documents, read back as plain JSON lines."""

import json
import sysconfig
from pathlib import Path
from pydoc_data.topics import topics

import pytest

from lctrain.cli import main
from lctrain.data import shipped_text
from lctrain.errors import UserError


def test_prose_is_every_pydoc_topic_once_in_sorted_order(tmp_path):
    info = shipped_text.write_jsonl(tmp_path / "p.jsonl", ("prose",))
    records = [json.loads(line) for line in (tmp_path / "p.jsonl").read_text(encoding="utf-8").splitlines()]
    assert [r["meta"]["name"] for r in records] == sorted(topics)
    assert all(r["text"] == topics[r["meta"]["name"]] and r["meta"]["kind"] == "prose" for r in records)
    assert info["kinds"]["prose"] == {"documents": len(topics), "characters": sum(map(len, topics.values()))}
    assert info["fingerprint"] == shipped_text.fingerprint(("prose",))


def test_code_is_the_standard_library_outside_its_tests():
    root = Path(sysconfig.get_path("stdlib"))
    names = [name for kind, name, _ in shipped_text.documents(("code",))]
    assert "json/decoder.py" in names and "os.py" in names
    assert not [n for n in names if "test" in Path(n).parts[:-1]]
    assert names == sorted(names)
    first = next(iter(shipped_text.documents(("code",))))
    assert first[2] == (root / first[1]).read_text(encoding="utf-8")


def test_code_holds_each_text_of_the_standard_library_once():
    """The standard library has copies (one text under two names): the corpus keeps the first name of each text."""
    root = Path(sysconfig.get_path("stdlib"))
    every = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"} & set(rel.parts[:-1]):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if text.strip():
            every.setdefault(text, rel.as_posix())
    corpus = [(name, text) for _, name, text in shipped_text.documents(("code",))]
    assert len({text for _, text in corpus}) == len(corpus)
    assert sorted(corpus) == sorted((name, text) for text, name in every.items())


def test_corpus_kinds_have_distinct_fingerprints():
    assert shipped_text.fingerprint(("prose",)) != shipped_text.fingerprint(("prose", "code"))


@pytest.mark.parametrize("kinds", [(), ("poems",), ("prose", "poems")])
def test_unknown_kinds_are_refused(kinds):
    with pytest.raises(UserError, match="kinds are prose, code"):
        list(shipped_text.documents(kinds))


def test_cli_writes_the_corpus_and_says_what_it_holds(tmp_path, capsys):
    with pytest.raises(SystemExit) as done:
        main(["example-text", str(tmp_path / "c" / "p.jsonl"), "--kinds", "prose"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert f"prose: {len(topics)} documents" in out and "fingerprint" in out
    assert not list((tmp_path / "c").glob(".*partial"))


@pytest.mark.parametrize("where", [".", "corpus"])
def test_a_directory_is_refused_before_anything_is_written(tmp_path, monkeypatch, capsys, where):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "corpus").mkdir()
    with pytest.raises(SystemExit) as done:
        main(["example-text", where])
    assert done.value.code == 2
    suggested = Path(where) / "shipped.jsonl"
    assert f"{where}: a directory; give the file to write, e.g. {suggested}" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus"] and not list((tmp_path / "corpus").iterdir())
