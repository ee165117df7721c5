"""A full disk, a missing permission, a path through a file: one line and exit code 2 from every command, never a
traceback, and no half-written output left behind. The disk is filled by injecting the error the system raises."""

import errno

import pytest
import torch
from train_helpers import one_error_line, set_args
from typer.testing import CliRunner

from lctrain.cli import app
from lctrain.errors import environment_error_message
from lctrain.rundir import RunDir

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
    assert "cannot write the step 1 checkpoint (the write failed; is the disk full?)" in line
    assert f"lctrain resume {run_dir}" in line


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
    assert f"{tmp_path / 'file'}: File exists" in line


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
