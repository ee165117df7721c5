"""Every artefact of a prepared dataset validated on open: each field of the manifest and each shard file of a small
dataset is damaged in turn (removed, retyped, changed, truncated, zeroed, swapped, replaced by a pipe), and each
damage must be one line naming the file and the command that rebuilds it; the quick check of large datasets and the
full check of `lctrain inspect` catch what they promise. A shard changed on disk after `open_packed` checked it,
while windows are read (a `prepare` elsewhere truncating or replacing it, a disk problem): each read of that shard is
one line naming it and the command that rebuilds it, never a SIGBUS or a library's traceback; windows of unchanged
shards still read, and an unchanged dataset reads exactly the rows its Arrow files hold."""

import json
import os
import shutil

import numpy as np
import pyarrow as pa
import pytest
from typer.testing import CliRunner

from lctrain import checksums
from lctrain.cli import app
from lctrain.config import load_config
from lctrain.data import store
from lctrain.data.prepare import prepare
from lctrain.data.store import open_packed
from lctrain.errors import UserError
from lctrain.train.data import open_checked

OVER = ["data.seq_len=128", "data.token_budget=6400", "data.shard_tokens=1024"]  # 7 shards of at most 8 windows


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("artefacts") / "data"
    prepare(load_config(None, [*OVER, f"data.output_dir={out}"]))
    return out


@pytest.fixture
def copy(built, tmp_path):
    # copytree keeps the built shards' mtimes, so a rewrite in a test always moves one past the filesystem's coarse
    # clock
    out = tmp_path / "data"
    shutil.copytree(built, out)
    return out


def refused(path, needle: str, **kw) -> str:
    with pytest.raises(UserError) as e:
        open_packed(path, **kw)
    line = str(e.value)
    assert "\n" not in line and needle in line and "run 'lctrain prepare" in line, line
    return line


def leaves(obj, path=()):
    """Every key path of a JSON object, inner nodes included."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield (*path, k)
            yield from leaves(v, (*path, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield (*path, i)
            yield from leaves(v, (*path, i))


def changed(value):
    """Another value of the same JSON type."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return value + 0.5
    if isinstance(value, str):
        return value + "x"
    if isinstance(value, list):
        return [*value, value[0]] if value else [0]
    if isinstance(value, dict):
        return {**value, "extra": 1}
    return 0  # None


def retyped(value):
    return "text" if not isinstance(value, str) else 7


def test_the_built_dataset_opens_and_checks_cleanly(built):
    data = open_packed(built, verify=True)
    assert len(data) == 50 and len(data.manifest.shards) == 7
    assert store.read_manifest(built) == data.manifest


def test_every_manifest_field_removed_retyped_or_changed_is_one_line_naming_the_manifest(copy):
    manifest = copy / "manifest.json"
    original = manifest.read_text()
    raw = json.loads(original)
    paths = list(leaves(raw))
    assert len(paths) > 200  # the statistics' histograms included
    cases = 0
    for path in paths:
        for mutate in ("remove", "retype", "change"):
            doc = json.loads(original)
            parent = doc
            for k in path[:-1]:
                parent = parent[k]
            key = path[-1]
            if mutate == "remove":
                if isinstance(parent, list):
                    parent.pop(key)
                else:
                    del parent[key]
            else:
                parent[key] = retyped(parent[key]) if mutate == "retype" else changed(parent[key])
            manifest.write_text(json.dumps(doc, indent=2))
            line = refused(copy, "manifest.json", verify=False)
            assert line.startswith(f"{copy}: "), line
            cases += 1
    manifest.write_text(original)
    assert len(open_packed(copy)) == 50
    assert cases == 3 * len(paths)


def test_missing_keys_and_wrong_types_say_which(copy):
    manifest = copy / "manifest.json"
    raw = json.loads(manifest.read_text())
    for doc, needle in [
        ({k: v for k, v in raw.items() if k != "num_windows"}, "num_windows: Field required"),
        ({k: v for k, v in raw.items() if k != "tokenizer"}, "tokenizer: Field required"),
        (
            {**raw, "shards": [{k: v for k, v in raw["shards"][0].items() if k != "file"}, *raw["shards"][1:]]},
            "shards.0.file: Field required",
        ),
        ({**raw, "seq_len": "128"}, "seq_len: Input should be a valid integer"),
        ({**raw, "num_windows": 51}, "the shards hold 50 windows, num_windows says 51"),
        (
            {**raw, "stats": {**raw["stats"], "documents": raw["stats"]["documents"] + 1}},
            "its content does not match its checksum",
        ),
    ]:
        manifest.write_text(json.dumps(doc))
        refused(copy, f"manifest.json: {needle}")


@pytest.mark.parametrize(
    "damage",
    ["empty", "truncated", "zeroed", "not utf-8", "a list", "missing"],
)
def test_a_damaged_manifest_file_is_one_line(copy, damage):
    manifest = copy / "manifest.json"
    body = manifest.read_bytes()
    if damage == "missing":
        manifest.unlink()
    else:
        manifest.write_bytes(
            {
                "empty": b"",
                "truncated": body[: len(body) // 2],
                "zeroed": bytes(len(body)),
                "not utf-8": b"\xff\xfe" + body,
                "a list": b"[1, 2]",
            }[damage]
        )
    refused(copy, "manifest.json")


def _flip_middle(f):
    body = bytearray(f.read_bytes())
    body[len(body) // 2] ^= 1
    f.write_bytes(bytes(body))


def _swap(a, b):
    tmp = a.with_suffix(".swap")
    os.rename(a, tmp)
    os.rename(b, a)
    os.rename(tmp, b)


SHARD_DAMAGE = {
    "missing": (lambda f, other: f.unlink(), "is missing"),
    "truncated": (lambda f, other: f.write_bytes(f.read_bytes()[:-100]), "bytes, not the"),
    "one byte longer": (lambda f, other: f.write_bytes(f.read_bytes() + b"\0"), "bytes, not the"),
    "zeroed at the same size": (lambda f, other: f.write_bytes(bytes(f.stat().st_size)), "checksum differs"),
    "one byte flipped": (lambda f, other: _flip_middle(f), "checksum differs"),
    "swapped with another shard": (lambda f, other: _swap(f, other), "data/shard-0000"),
    "a directory": (lambda f, other: (f.unlink(), f.mkdir()), "is not a regular file"),
    "a named pipe": (lambda f, other: (f.unlink(), os.mkfifo(f)), "is not a regular file"),
}


@pytest.mark.timeout(60)  # a pipe opened for reading would block forever
@pytest.mark.parametrize("damage", list(SHARD_DAMAGE))
def test_every_shard_damaged_in_turn_is_one_line_naming_it(built, tmp_path, damage):
    mutate, needle = SHARD_DAMAGE[damage]
    shards = sorted((built / "data").iterdir())
    assert len(shards) == 7
    for i, shard in enumerate(shards):
        out = tmp_path / f"d{i}"
        shutil.copytree(built, out)
        mutate(out / "data" / shard.name, out / "data" / shards[(i + 1) % len(shards)].name)
        line = refused(out, needle)
        assert f"data/{shard.name}" in line or (damage.startswith("swapped") and "data/shard-0000" in line), line


def test_equal_sized_shards_swapped_are_caught_by_their_checksum(built, tmp_path):
    sizes = {}
    for f in sorted((built / "data").iterdir()):
        sizes.setdefault(f.stat().st_size, []).append(f.name)
    same = next((names for names in sizes.values() if len(names) > 1), None)
    if same is None:
        pytest.skip("no two shards of this dataset have the same size")
    out = tmp_path / "d"
    shutil.copytree(built, out)
    _swap(out / "data" / same[0], out / "data" / same[1])
    refused(out, f"data/{same[0]}: its content is not what prepare wrote")


def test_large_datasets_check_edges_on_open_and_every_byte_in_inspect(tmp_path, monkeypatch):
    """Above FULL_VERIFY_BYTES an open checks sizes and the first and last EDGE_BYTES of each shard; the middle of a
    shard is checked by `lctrain inspect` (verify=True)."""
    monkeypatch.setattr(checksums, "FULL_VERIFY_BYTES", 0)
    monkeypatch.setattr(checksums, "EDGE_BYTES", 64)
    copy = tmp_path / "data"
    prepare(load_config(None, [*OVER, f"data.output_dir={copy}"]))
    shard = copy / "data" / "shard-00003.arrow"
    _flip_middle(shard)
    assert len(open_packed(copy)) == 50  # the quick check does not see the middle
    refused(copy, "data/shard-00003.arrow: its content is not what prepare wrote", verify=True)
    line = CliRunner().invoke(app, ["inspect", str(copy)]).stderr.strip()
    assert "data/shard-00003.arrow" in line and "lctrain prepare" in line and "\n" not in line
    shard.write_bytes(bytes(64) + shard.read_bytes()[64:])  # the head is checked
    refused(copy, "data/shard-00003.arrow: its content")


def test_training_names_its_prepare_command_and_prepare_rebuilds(tmp_path):
    out = tmp_path / "data"
    cfg = load_config(None, [*OVER, f"data.output_dir={out}"])
    prepare(cfg)
    (out / "data" / "shard-00001.arrow").write_bytes(bytes((out / "data" / "shard-00001.arrow").stat().st_size))
    with pytest.raises(UserError) as e:
        open_checked(cfg)
    line = str(e.value)
    assert (
        "data/shard-00001.arrow" in line
        and "run 'lctrain prepare' (with the same --set overrides) to rebuild it" in line
    )
    args = ["prepare"] + [x for o in [*OVER, f"data.output_dir={out}"] for x in ("--set", o)]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0 and "rebuilding it (data/shard-00001.arrow" in r.output, r.output
    assert len(open_checked(cfg)) == 50


SHARD = "data/shard-00001.arrow"  # windows 8-15
DTYPES = {"input_ids": np.int32, "seg_lens": np.int32, "seg_doc": np.int32, "seg_domain": np.int8, "tag_lens": np.int32}


def changed_line(data, i: int, what: str) -> str:
    with pytest.raises(UserError) as e:
        data[i]
    line = str(e.value)
    assert "\n" not in line and "changed on disk while it was being read" in line, line
    assert f"{SHARD} {what}" in line and "run 'lctrain prepare" in line and "lctrain resume" in line, line
    return line


def test_an_unchanged_dataset_reads_the_rows_of_its_arrow_files(built):
    data = open_packed(built)
    # the reference: each shard read as the Arrow IPC stream `datasets` writes, in the manifest's order
    rows = [
        row
        for s in data.manifest.shards
        for row in pa.ipc.open_stream(pa.OSFile(str(built / s.file))).read_all().to_pylist()
    ]
    assert len(data) == len(rows) == 50
    for i in [*range(len(rows)), -1, -len(rows)]:
        window = data[i]
        for k, dtype in DTYPES.items():
            assert window[k].dtype == dtype and window[k].tolist() == rows[i][k], (i, k)
    with pytest.raises(IndexError, match="window 50 out of range"):
        data[50]


def _replace(shard):
    other = shard.with_name("shard-00000.arrow")
    shutil.copy(other, shard.with_suffix(".new"))
    os.replace(shard.with_suffix(".new"), shard)  # what a rebuild's rename does: the path is now another inode


def _rewrite_in_place(shard):
    with open(shard, "r+b") as f:  # same size, same inode: only the mtime tells
        f.seek(os.path.getsize(shard) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 1]))


CHANGES = {
    # in this process: were the check gone, reading it would be a SIGBUS that ends pytest (its faulthandler names
    # this test), a price a child interpreter's 1-3 s start on every run of the suite would not be worth
    "truncated": (lambda shard: os.truncate(shard, 100), "is now 100 bytes, not the"),
    "replaced by another file": (_replace, "was replaced by another file"),
    "deleted": (lambda shard: shard.unlink(), "is missing"),
    "rewritten in place at the same size": (_rewrite_in_place, "was written to"),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_changed_shard_is_one_line_naming_it_and_other_shards_still_read(copy, change):
    mutate, what = CHANGES[change]
    data = open_packed(copy)
    before = data[0]["input_ids"]
    mutate(copy / SHARD)
    for i in (8, 15, -42):  # the shard's first and last window, and one by a negative index
        changed_line(data, i, what)
    assert np.array_equal(data[0]["input_ids"], before) and len(data[16]["input_ids"]) == 128


def test_a_change_between_the_check_and_the_read_is_named_not_the_librarys_error(copy):
    data = open_packed(copy)

    class ChangedMidRead:
        def __getitem__(self, i):
            _rewrite_in_place(copy / SHARD)
            raise pa.ArrowInvalid("offsets out of bounds")  # what a map of rewritten bytes may give

    data._np = ChangedMidRead()
    changed_line(data, 9, "was written to")
