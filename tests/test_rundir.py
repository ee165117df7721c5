"""The run directory: metrics records (a torn last line, truncation on resume), step names old and new, and a run's
config read back from another directory with its relative paths meaning the same files, without changing directory.
The resume of such runs end to end is in test_train_resume.py."""

import json
import os
from pathlib import Path

import pytest

from lctrain.config import data_dir, load_config, run_dir
from lctrain.errors import UserError
from lctrain.rundir import RunDir, by_step, step_name, step_of
from lctrain.train import checkpoint as ckpt


def _write_metrics(rd: RunDir, text: str) -> None:
    rd.path.mkdir(parents=True, exist_ok=True)
    rd.metrics_file.write_text(text)


def test_append_then_read_metrics(tmp_path):
    rd = RunDir(tmp_path)
    assert rd.read_metrics() == []  # no file yet
    records = [{"step": 1, "loss": 2.5, "mfu": None}, {"step": 2, "loss": 0.1 + 0.2, "mfu": 0.25}]
    for r in records:
        rd.append_metrics(r)
    assert rd.read_metrics() == records
    assert rd.metrics_file.read_text() == "".join(json.dumps(r) + "\n" for r in records)


def test_a_torn_last_line_is_left_out_and_a_damaged_earlier_line_is_an_error(tmp_path):
    rd = RunDir(tmp_path)
    _write_metrics(rd, '{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n{"step": 3, "lo')
    assert rd.read_metrics() == [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.5}]
    _write_metrics(rd, '{"step": 1, "loss": 2.0}\n\n{"step": 2, "loss": 1.5}')  # complete, without the newline
    assert [r["step"] for r in rd.read_metrics()] == [1, 2]
    _write_metrics(rd, '{"step": 1, "lo\n{"step": 2, "loss": 1.5}\n')
    with pytest.raises(UserError, match=r"metrics.jsonl:1: not a step record"):
        rd.read_metrics()
    _write_metrics(rd, '{"loss": 1.0}\n{"step": 2, "loss": 1.5}\n')  # no step
    with pytest.raises(UserError, match=r"metrics.jsonl:1: not a step record"):
        rd.read_metrics()


def test_truncate_metrics_keeps_steps_up_to_the_checkpoint_and_drops_a_torn_line(tmp_path):
    lines = [json.dumps({"step": s, "loss": 1.0}) for s in (1, 2, 3, 4)]
    rd = RunDir(tmp_path)
    _write_metrics(rd, "\n".join(lines) + "\n" + '{"step": 5, "lo')
    rd.truncate_metrics(2)
    assert (tmp_path / "metrics.jsonl").read_text() == lines[0] + "\n" + lines[1] + "\n"
    # the lines are kept as written, not re-encoded
    _write_metrics(rd, '{"step":1,  "loss": 1.0}\n{"step": 3}\n')
    rd.truncate_metrics(2)
    assert rd.metrics_file.read_text() == '{"step":1,  "loss": 1.0}\n'
    RunDir(tmp_path / "missing").truncate_metrics(2)  # no metrics yet: nothing to do
    assert not (tmp_path / "missing").exists()


def test_one_step_name_for_checkpoints_and_exports_and_older_names_still_read(tmp_path):
    rd = RunDir(tmp_path / "run")
    assert step_name(20) == "step_20"
    assert rd.checkpoint(20) == tmp_path / "run" / "checkpoints" / "step_20"
    assert rd.export(20) == tmp_path / "run" / "hf" / "step_20"
    assert [step_of(n) for n in ("step_20", "step_00000020", "x/step_7", "step_x", "step_", ".tmp-step_4")] == [
        20,
        20,
        7,
        None,
        None,
        None,
    ]
    names = ["step_100", "step_00000004", "step_20", "latest", "step_3", "step_00000020"]
    # numeric order (not the names' order); of two names for step 20 the current one is the newer
    assert [p.name for p in by_step(Path(n) for n in names)] == [
        "step_3",
        "step_00000004",
        "step_00000020",
        "step_20",
        "step_100",
    ]


def test_complete_checkpoints_of_an_older_run_in_step_order(tmp_path):
    rd = RunDir(tmp_path)
    for name in ("step_00000008", "step_00000010", "step_12", ".tmp-step_14"):
        (rd.checkpoints / name).mkdir(parents=True)
        (rd.checkpoints / name / ckpt.STATE_FILE).write_text(json.dumps({"step": int(name.rsplit("_", 1)[1])}))
    (rd.checkpoints / "step_00000009").mkdir()  # incomplete: no state
    assert [p.name for p in ckpt.complete_checkpoints(rd)] == ["step_00000008", "step_00000010", "step_12"]
    (rd.checkpoints / ckpt.LATEST).write_text("step_00000010\n")
    assert [p.name for p in ckpt.resume_candidates(rd)] == ["step_00000010", "step_12", "step_00000008"]
    (rd.checkpoints / ckpt.LATEST).unlink()
    assert ckpt.latest_checkpoint(rd).name == "step_12"
    ckpt.prune(rd, keep=2)
    assert sorted(p.name for p in rd.checkpoints.iterdir()) == ["step_00000009", "step_00000010", "step_12"]


def test_exports_in_step_order(tmp_path):
    rd = RunDir(tmp_path)
    assert rd.exports() == []
    for name in ("step_20", "step_3", "step_100", "step_x"):
        (rd.exports_dir / name).mkdir(parents=True)
    assert [p.name for p in rd.exports()] == ["step_3", "step_20", "step_100"]


def test_clear_outputs_removes_what_a_new_run_replaces(tmp_path):
    rd = RunDir(tmp_path)
    rd.checkpoint(2).mkdir(parents=True)
    rd.export(2).mkdir(parents=True)
    (rd.profile_dir / "steps_1-2").mkdir(parents=True)
    rd.append_metrics({"step": 1})
    rd.config_file.write_text("seed: 0\n")
    rd.clear_outputs()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml"]


def _forbid_chdir(monkeypatch):
    def no_chdir(path):
        raise AssertionError(f"os.chdir({path})")

    monkeypatch.setattr(os, "chdir", no_chdir)


def test_relative_paths_resolve_where_the_config_was_written(tmp_path, monkeypatch):
    """`--set` paths are relative to the current directory (as the embedded default's are); the run directory's
    config.yaml keeps them as written, with `workdir`, so from another directory they name the same files."""
    first, elsewhere = tmp_path / "a", tmp_path / "b"
    first.mkdir(), elsewhere.mkdir()
    (first / "tok").mkdir()
    (first / "hosts").write_text("node1 slots=8\n")
    monkeypatch.chdir(first)
    cfg = load_config(
        None,
        ["data.output_dir=data", "train.run_dir=run", "data.tokenizer=tok", "parallel.hostfile=hosts"],
    )
    assert cfg.workdir is None
    assert data_dir(cfg) == Path("data") and run_dir(cfg) == Path("run")  # relative, as before
    rd = RunDir.of(cfg)
    rd.write_config(cfg)
    text = rd.config_file.read_text()
    assert "output_dir: data\n" in text and "run_dir: run\n" in text  # as the user wrote them
    assert f"workdir: {first}\n" in text

    monkeypatch.chdir(elsewhere)
    _forbid_chdir(monkeypatch)
    back = RunDir(first / "run").read_config()
    assert back.workdir == str(first)
    assert data_dir(back) == first / "data" and run_dir(back) == first / "run"
    assert back.resolve_path(back.parallel.hostfile) == first / "hosts"
    assert back.resolve_source(back.data.tokenizer) == str(first / "tok")  # a local directory there
    assert back.resolve_source("builtin:mistral-7b-v0.1") == "builtin:mistral-7b-v0.1"
    assert back.resolve_source("org/hub-model") == "org/hub-model"  # no such directory: a hub name
    assert back.resolve_path("/abs/file") == Path("/abs/file")
    # the config is the same run: fingerprints and the settings a checkpoint compares leave `workdir` out
    from lctrain.config import config_fingerprint, data_fingerprint, settings

    assert config_fingerprint(back) == config_fingerprint(cfg) and data_fingerprint(back.data) == data_fingerprint(
        cfg.data
    )
    assert "workdir" not in settings(back)


def test_an_older_run_directory_resolves_where_origin_json_says(tmp_path, monkeypatch):
    origin, elsewhere = tmp_path / "origin", tmp_path / "elsewhere"
    origin.mkdir(), elsewhere.mkdir()
    rd = RunDir(tmp_path / "run")
    rd.path.mkdir()
    rd.config_file.write_text("base: tiny_anchor\ndata:\n  output_dir: data\n")
    monkeypatch.chdir(elsewhere)
    _forbid_chdir(monkeypatch)
    assert rd.read_config().workdir is None  # neither workdir nor origin.json: the current directory, as before
    (rd.path / "origin.json").write_text(json.dumps({"cwd": str(origin)}))
    assert data_dir(rd.read_config()) == origin / "data"
    (rd.path / "origin.json").write_text(json.dumps({"cwd": str(tmp_path / "gone")}))
    assert rd.read_config().workdir is None  # a directory that no longer exists: the current one
    # a config.yaml with `workdir` wins over an origin.json left from an earlier run
    rd.config_file.write_text(f"base: tiny_anchor\ndata:\n  output_dir: data\nworkdir: {elsewhere}\n")
    assert data_dir(rd.read_config()) == elsewhere / "data"


def test_a_new_run_refuses_files_lctrain_does_not_write_where_it_clears_and_force_deletes_them(tmp_path):
    """A project folder used as the run directory: its own eval/ script and profile/ notes are not what an earlier
    run left, so a plain `train` names them instead of deleting them; --force deletes them, as documented."""
    rd = RunDir(tmp_path)
    (rd.eval_dir).mkdir()
    (rd.eval_dir / "my_eval.py").write_text("print(1)")
    (rd.eval_dir / "results.json").write_text("{}")
    rd.profile_dir.mkdir()
    (rd.profile_dir / "notes.md").write_text("mine")
    (rd.checkpoints / ".tmp-step_2").mkdir(parents=True)  # a checkpoint write a kill interrupted: lctrain's
    with pytest.raises(UserError) as refused:
        rd.clear_outputs()
    assert str(refused.value) == (
        f"{tmp_path}: a new run clears checkpoints/, hf/, profile/, eval/ and tensorboard/ of what an earlier run "
        f"left, and lctrain did not write {rd.profile_dir / 'notes.md'}, {rd.eval_dir / 'my_eval.py'}: move them "
        f"elsewhere, choose another train.run_dir, or start over with --force, which deletes them"
    )
    assert (rd.eval_dir / "my_eval.py").is_file() and (rd.checkpoints / ".tmp-step_2").is_dir()
    (rd.eval_dir / "my_eval.py").unlink()
    (rd.profile_dir / "notes.md").unlink()
    rd.clear_outputs()  # only what lctrain wrote is left: cleared
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    (rd.eval_dir).mkdir()
    (rd.eval_dir / "my_eval.py").write_text("print(1)")
    rd.clear_outputs(force=True)
    assert not rd.eval_dir.exists()


@pytest.mark.parametrize(
    "files, why",
    [
        ([], None),
        (["config.yaml", "metrics.jsonl"], None),  # a run's own
        (["config.json"], None),  # a project's own config, no weights: nothing from_pretrained loads
        (["model.safetensors"], None),  # weights without the config from_pretrained needs
        (["config.json", "model.safetensors"], "a model's folder (it holds config.json and model.safetensors)"),
        (
            ["config.json", "model-00001-of-00002.safetensors", "model.safetensors.index.json"],
            "a model's folder (it holds config.json and model.safetensors.index.json)",
        ),
        (["config.json", "pytorch_model.bin"], "a model's folder (it holds config.json and pytorch_model.bin)"),
        (["manifest.json", "config.yaml"], "a prepared dataset (it holds manifest.json)"),
    ],
)
def test_a_dataset_or_a_models_folder_may_not_become_a_run_directory(tmp_path, files, why):
    for name in files:
        (tmp_path / name).write_text("{}")
    assert RunDir(tmp_path).not_for_a_run() == (None if why is None else f"{why}, not a run directory")
