"""A full disk, a missing permission, a path through a file: one line and exit code 2 from every command, never a
traceback, and no half-written output left behind. The disk is filled by injecting the error the system raises."""

import errno
import os
import subprocess
from pathlib import Path

import pytest
import torch
from train_helpers import one_error_line, set_args
from typer.testing import CliRunner

from lctrain.cli import app
from lctrain.config import load_config
from lctrain.errors import WriteFailed, environment_error_message, writing
from lctrain.rundir import RunDir
from lctrain.tokenizer import load_tokenizer, save_tokenizer

TINY = [
    "data.seq_len=128",
    "data.token_budget=6000",
    "train.steps=2",
    "train.global_batch=2",
    "checkpoint.every_steps=1",
    "checkpoint.hf_last=0",
    "model.arch={model_type: llama, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 1, "
    "num_attention_heads: 2, num_key_value_heads: 1, tie_word_embeddings: true}",
]
FULL = OSError(errno.ENOSPC, "No space left on device")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    from lctrain.config import load_config
    from lctrain.data.prepare import prepare

    out = tmp_path_factory.mktemp("env") / "data"
    prepare(load_config(None, TINY + [f"data.output_dir={out}"]))
    return out


def test_messages():
    assert environment_error_message(ValueError("x")) is None
    assert environment_error_message(OSError(errno.ENOENT, "No such file")) is None  # a missing input is not this
    msg = environment_error_message(OSError(errno.ENOSPC, "No space left on device", "/data/x.arrow"))
    assert msg.startswith("/data/x.arrow: No space left on device; free disk space")
    torch_msg = "[enforce fail at inline_container.cc:664] . PytorchStreamWriter failed writing file data/0"
    assert "is the disk full?" in environment_error_message(RuntimeError(torch_msg))


def test_a_failed_torch_write_under_a_file_size_limit_names_the_limit(monkeypatch):
    """`ulimit -f` makes a large write fail as a full disk does, with space left: the message said only 'is the disk
    full?' (signals explorer)."""
    import resource

    torch_msg = "[enforce fail at inline_container.cc:664] . PytorchStreamWriter failed writing file data/0"
    monkeypatch.setattr(resource, "getrlimit", lambda what: (30_720_000, resource.RLIM_INFINITY))
    msg = environment_error_message(RuntimeError(torch_msg))
    assert "is the disk full, or a file past this process's file-size limit of 30,720,000 bytes (ulimit -f)?" in msg
    assert msg.endswith("or raise this shell's file-size limit (ulimit -f unlimited), then run the command again")
    # safetensors (the evaluation exports) says EFBIG in its text: a traceback, exit code 1 (verify explorer)
    msg = environment_error_message(Exception("Error while serializing: I/O error: File too large (os error 27)"))
    assert msg == (
        "a file: File too large; raise this shell's file-size limit (ulimit -f unlimited) or choose another "
        "filesystem, then run the command again"
    )


def test_train_on_a_full_disk_names_the_step_and_resume(data_dir, tmp_path, monkeypatch):
    def full_disk(*args, **kwargs):  # what torch.save raises when the disk fills up mid-checkpoint
        raise RuntimeError(
            "[enforce fail at inline_container.cc:664] . PytorchStreamWriter failed writing file "
            "data/0: file write failed"
        )

    monkeypatch.setattr(torch, "save", full_disk)
    run_dir = tmp_path / "run"
    line = one_error_line(
        CliRunner().invoke(
            app, ["train"] + set_args(TINY + [f"data.output_dir={data_dir}", f"train.run_dir={run_dir}"])
        )
    )
    assert "cannot write the step 1 resume checkpoint (the write failed; is the disk full?)" in line
    assert "no checkpoint was written yet" in line
    assert "lctrain resume" not in line  # there is no checkpoint to resume from


@pytest.mark.parametrize("error", [errno.ENOSPC, errno.EROFS], ids=["no-inodes", "read-only"])
def test_a_checkpoint_directory_that_cannot_be_made_is_one_line_naming_the_resume(
    data_dir, tmp_path, monkeypatch, error
):
    """Out of inodes, or checkpoints/ remounted read-only, after step 1's checkpoint: DeepSpeed logged its failed
    makedirs and went on, and the next write ended in a 70-line traceback ('Parent directory ... does not exist'),
    exit code 1 (signals explorer)."""
    from lctrain.files import TEMPORARY_PREFIX

    real_mkdir = os.mkdir

    def mkdir(path, *args, **kwargs):
        if Path(path).name == TEMPORARY_PREFIX + "step_2":
            raise OSError(error, os.strerror(error), str(path))
        return real_mkdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", mkdir)
    run_dir = tmp_path / "run"
    line = one_error_line(
        CliRunner().invoke(
            app, ["train"] + set_args(TINY + [f"data.output_dir={data_dir}", f"train.run_dir={run_dir}"])
        )
    )
    assert "cannot write the step 2 resume checkpoint" in line and os.strerror(error) in line
    assert f"'lctrain resume {run_dir}' continues from step_1" in line
    assert RunDir(run_dir).checkpoint(1).is_dir()


def test_unwritable_metrics_is_one_line(data_dir, tmp_path):
    run_dir = tmp_path / "run"
    RunDir(run_dir).metrics_file.mkdir(parents=True)  # cannot be appended to (as a read-only file cannot)
    line = one_error_line(
        CliRunner().invoke(
            app, ["train"] + set_args(TINY + [f"data.output_dir={data_dir}", f"train.run_dir={run_dir}"])
        )
    )
    assert "metrics.jsonl: Is a directory" in line


def test_run_directory_under_a_file(data_dir, tmp_path):
    (tmp_path / "file").write_text("")
    line = one_error_line(
        CliRunner().invoke(
            app,
            ["train"] + set_args(TINY + [f"data.output_dir={data_dir}", f"train.run_dir={tmp_path / 'file' / 'run'}"]),
        )
    )
    assert "file/run" in line and "Not a directory" in line


def test_out_under_a_file_in_estimate(tmp_path):
    (tmp_path / "file").write_text("")
    line = one_error_line(
        CliRunner().invoke(
            app, ["estimate", "--tflops", "100", "--out", str(tmp_path / "file" / "x.json")] + set_args(TINY)
        )
    )
    why = f"cannot create the directory (Not a directory): {tmp_path / 'file'} is a file"
    assert line == f"error: --out {tmp_path / 'file' / 'x.json'}: {why}; move it away or choose another --out"


def test_prepare_on_a_full_disk_leaves_nothing_behind(tmp_path, monkeypatch):
    from lctrain.data import store

    def full(self, *args, **kwargs):
        raise FULL

    monkeypatch.setattr(store.ShardWriter, "_flush", full)
    monkeypatch.setattr(store.ShardWriter, "abort", full)  # closing the shard fails again on the full disk
    out = tmp_path / "data"
    line = one_error_line(CliRunner().invoke(app, ["prepare"] + set_args(TINY + [f"data.output_dir={out}"])))
    assert f"cannot write the dataset to {out} (No space left on device)" in line
    assert not out.exists() and not list(tmp_path.glob(".data.partial-*"))


def test_prepare_with_no_room_for_its_progress_is_one_line(tmp_path, monkeypatch):
    """The progress saved after each shard (the shuffle buffer's tokens: tens of MB) is what fills a disk first; its
    failed write is one line naming it, and no part of it stays on the full disk."""
    import builtins

    from lctrain import files

    class FillsTheDisk:  # writes a part, then the disk is full
        def __init__(self, path, mode):
            self.f = builtins.open(path, mode)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, content):
            self.f.write(content[: len(content) // 2])
            raise FULL

    monkeypatch.setattr(files, "open", FillsTheDisk, raising=False)  # replace_file's open: every whole-file write
    out = tmp_path / "data"
    sets = TINY + [f"data.output_dir={out}", "data.shard_tokens=1024"]  # progress is saved after the first shard
    line = one_error_line(CliRunner().invoke(app, ["prepare"] + set_args(sets)))
    assert line.startswith("error: cannot write prepare's progress ") and "No space left on device" in line
    assert not out.exists() and not list(tmp_path.rglob(".tmp-*"))


def test_eval_out_under_a_file(data_dir, tmp_path):
    run_dir = tmp_path / "run"
    result = CliRunner().invoke(
        app,
        ["train"]
        + set_args(
            TINY
            + [
                f"data.output_dir={data_dir}",
                f"train.run_dir={run_dir}",
                "checkpoint.hf_last=2",
                "checkpoint.hf_every=2",
            ]
        ),
    )
    assert result.exit_code == 0, result.output
    (tmp_path / "file").write_text("")
    line = one_error_line(
        CliRunner().invoke(
            app,
            [
                "eval",
                str(run_dir),
                "--tasks",
                "vt",
                "--samples",
                "1",
                "--lengths",
                "256",
                "--out",
                str(tmp_path / "file" / "eval"),
            ],
        )
    )
    assert "Not a directory" in line


# Each library's form of a failed write, as it reaches lctrain: (the error, the cause the line names, the remedy).
WRITE_FAILURES = {
    "os": (OSError(errno.ENOSPC, "No space left on device"), "No space left on device", "free disk space"),
    "quota": (OSError(errno.EDQUOT, "Disk quota exceeded"), "Disk quota exceeded", "quota"),
    "read-only": (OSError(errno.EROFS, "Read-only file system"), "Read-only file system", "writable filesystem"),
    "permission": (PermissionError(errno.EACCES, "Permission denied"), "Permission denied", "fix the permissions"),
    "mount point": (OSError(errno.EBUSY, "Device or resource busy"), "Device or resource busy", "mount point"),
    "tokenizers": (Exception("No space left on device (os error 28)"), "No space left on device", "free disk space"),
    "safetensors": (
        Exception("Error while serializing: IoError(Os { code: 28, kind: StorageFull }) (os error 28)"),
        "No space left on device",
        "free disk space",
    ),
    "pyarrow": (
        OSError("Error writing bytes to file. Detail: [errno 28] No space left on device"),
        "No space left on device",
        "free disk space",
    ),
    "torch zip writer": (
        RuntimeError("[enforce fail at inline_container.cc:664] . PytorchStreamWriter failed writing file data/0"),
        "the write failed; is the disk full?",
        "free disk space",
    ),
    "torch unexpected pos": (
        RuntimeError("[enforce fail at inline_container.cc:858] . unexpected pos 1664 vs 1558"),
        "the write failed; is the disk full?",
        "free disk space",
    ),
}


@pytest.mark.parametrize("name", WRITE_FAILURES)
def test_every_library_s_failed_write_is_one_line(name, tmp_path):
    error, cause, remedy = WRITE_FAILURES[name]
    target = tmp_path / "step_1"
    with pytest.raises(WriteFailed) as info, writing(target, "the evaluation checkpoint"):
        raise error
    line = str(info.value)
    assert line.startswith(f"cannot write the evaluation checkpoint {target}: {cause}; "), line
    assert remedy in line and line.endswith("then run the command again") and "\n" not in line
    assert info.value.cause == cause and info.value.path == target


@pytest.mark.parametrize(
    "error",
    [ValueError("bad value"), OSError(errno.ENOENT, "No such file"), Exception("parse (os error 2)"), KeyError(1)],
)
def test_other_failures_pass_through_unchanged(error, tmp_path):
    with pytest.raises(type(error)) as info, writing(tmp_path / "x", "a file"):
        raise error
    assert info.value is error


def test_tokenizer_export_on_a_full_disk_names_the_directory(tmp_path, monkeypatch):
    tok = load_tokenizer(load_config(None, TINY).data.tokenizer)

    def full(*args, **kwargs):  # what tokenizers raises: a plain Exception
        raise Exception("No space left on device (os error 28)")

    monkeypatch.setattr(tok, "save_pretrained", full)
    with pytest.raises(WriteFailed, match=f"cannot write the tokenizer {tmp_path}: No space left on device"):
        save_tokenizer(tok, tmp_path)


def test_prepare_into_a_mount_point_is_one_line(tmp_path, monkeypatch):
    out = tmp_path / "data"
    out.mkdir()
    real_rename = os.rename

    def busy(src, dst):  # renaming a mount point away fails so
        if Path(src) == out:
            raise OSError(errno.EBUSY, "Device or resource busy", str(src), str(dst))
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", busy)
    line = one_error_line(CliRunner().invoke(app, ["prepare"] + set_args(TINY + [f"data.output_dir={out}"])))
    assert f"cannot write the prepared dataset {out}: Device or resource busy" in line
    assert "mount point" in line


@pytest.fixture
def tiny_filesystem(tmp_path):
    """A 256 KiB tmpfs (needs root; skipped where mounting is not allowed)."""
    where = tmp_path / "small"
    where.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(where)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    yield where
    subprocess.run(["umount", str(where)], check=True)


def test_a_really_full_disk_under_torch_and_tokenizers(tiny_filesystem):
    with pytest.raises(WriteFailed, match="resume checkpoint .*: (No space left on device|the write failed)"):
        with writing(tiny_filesystem / "rng.pt", "the resume checkpoint"):
            torch.save(torch.zeros(1 << 20), tiny_filesystem / "rng.pt")
    (tiny_filesystem / "rng.pt").unlink()
    (tiny_filesystem / "filler").write_bytes(b"\0" * (256 * 1024 - 4096))
    tok = load_tokenizer(load_config(None, TINY).data.tokenizer)
    with pytest.raises(WriteFailed, match="cannot write the tokenizer .*: No space left on device"):
        save_tokenizer(tok, tiny_filesystem)
