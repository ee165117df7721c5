"""A shard changed on disk after `open_packed` checked it, while windows are read (a `prepare` elsewhere truncating or
replacing it, a disk problem): each read of that shard is one line naming it and the command that rebuilds it, never
a SIGBUS or a library's traceback; windows of unchanged shards still read, and an unchanged dataset reads exactly
the rows its Arrow files hold."""

import os
import shutil

import numpy as np
import pyarrow as pa
import pytest

from lctrain.config import load_config
from lctrain.data.prepare import prepare
from lctrain.data.store import open_packed
from lctrain.errors import UserError

OVER = ["data.seq_len=128", "data.token_budget=6400", "data.shard_tokens=1024"]  # 7 shards of at most 8 windows
SHARD = "data/shard-00001.arrow"  # windows 8-15
DTYPES = {"input_ids": np.int32, "seg_lens": np.int32, "seg_doc": np.int32, "seg_domain": np.int8, "tag_lens": np.int32}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("changed") / "data"
    prepare(load_config(None, [*OVER, f"data.output_dir={out}"]))
    return out


@pytest.fixture
def copy(built, tmp_path):
    # copytree keeps the built shards' mtimes, so a rewrite in a test always moves one past the filesystem's coarse
    # clock
    out = tmp_path / "data"
    shutil.copytree(built, out)
    return out


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
