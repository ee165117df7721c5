"""`lctrain eval` and `lctrain export` beside other processes and on a machine that refuses writes: a second one on
the same output is refused in one line naming the first's pid (the run lock's primitive); a checkpoint that the
training running in the run removed (`checkpoint.keep`) under an export is said to be that, not damage; a run
evaluated while it trains says so; a full disk or a read-only directory is one line naming the file (and, for eval,
`--out DIR`), with no temporary left behind.

The locks are held from the test itself (each lock is an open file description: the test's second one conflicts
with its first as another process's would), not by racing two evaluations."""

import errno
import json
import os
import types
from pathlib import Path

import pytest
from train_helpers import export_lock_fails, one_error_line
from typer.testing import CliRunner

from lctrain import lifetime
from lctrain.cli import app
from lctrain.config import load_config, write_resolved
from lctrain.errors import UserError, WriteFailed
from lctrain.eval import runner
from lctrain.eval.kept import Kept
from lctrain.eval.runner import EVAL_LOCK, PARTIAL_PREDICTIONS, EvalLock, Target, eval_writes, unfinished_note
from lctrain.export_record import write_export_record
from lctrain.files import temporary_of
from lctrain.lifetime import lock_holder
from lctrain.rundir import RunDir
from lctrain.train import checkpoint as ckpt
from lctrain.train import export as export_module
from lctrain.train.checkpoint import TargetLock

PID = os.getpid()


def invoke(*args) -> object:
    return CliRunner().invoke(app, [*map(str, args)])


def fake_run(root: Path, *overrides: str) -> Path:
    """A run directory as far as the checks before any weights are read go: its config and one recorded export."""
    run = root / "run"
    write_resolved(load_config(None, ["train.steps=20", *overrides]), run)
    export = RunDir(run).export(2)
    export.mkdir(parents=True)
    (export / "config.json").write_text("{}")
    write_export_record(export, 2)
    return run


def with_checkpoints(run: Path, *steps: int) -> Path:
    """Complete resume checkpoints (their trainer state) without weights."""
    for step in steps:
        d = RunDir(run).checkpoint(step)
        d.mkdir(parents=True)
        (d / ckpt.STATE_FILE).write_text(json.dumps({"step": step}))
    return run


# ------------------------------------------------------------------ eval


def test_a_second_eval_on_one_output_directory_is_refused_naming_the_first(tmp_path):
    run = fake_run(tmp_path)
    out = RunDir(run).eval_dir
    with EvalLock(out):
        line = one_error_line(invoke("eval", run, "--tasks", "vt"))
        assert line.startswith(f"error: {out}: another evaluation is writing its report there, pid {PID} on ")
        assert "('lctrain eval', since " in line and f"kill {PID}" in line and "another --out" in line
        # another output directory is free
        with EvalLock(tmp_path / "elsewhere"):
            pass
    assert not (out / EVAL_LOCK).exists()  # the lock file goes with its holder
    with EvalLock(out):  # and the directory is free again
        pass


def test_a_lock_file_removed_by_its_last_holder_is_not_held_twice(tmp_path, monkeypatch):
    """The first holder ends (removing its file) between a second's open and its flock: the second locks the file
    now in its place, which a third then finds held."""
    first = EvalLock(tmp_path).__enter__()
    flock, seen = lifetime.fcntl.flock, []

    def first_ends_meanwhile(fd, operation):
        if not seen:
            seen.append(fd)
            first.__exit__(None, None, None)
        return flock(fd, operation)

    monkeypatch.setattr(lifetime.fcntl, "flock", first_ends_meanwhile)
    with EvalLock(tmp_path) as second:
        monkeypatch.setattr(lifetime.fcntl, "flock", flock)
        assert os.fstat(second.fd).st_ino == (tmp_path / EVAL_LOCK).stat().st_ino
        with pytest.raises(UserError, match="another evaluation is writing"):
            with EvalLock(tmp_path):
                pass


def test_an_evaluation_of_a_run_being_trained_says_so(tmp_path):
    run = fake_run(tmp_path)
    tgt = Target("run", run, RunDir(run).read_config(), [("step_17", RunDir(run).export(17))])
    training = {"steps": 17, "train_steps": 20, "finished": False}
    done = "trained 17 of its 20 steps (train.steps), last evaluation checkpoint step_17: not the finished run's scores"
    assert lock_holder(run) is None
    assert unfinished_note(tgt, training) == f"{done}; `lctrain resume {run}`, then evaluate again"
    with RunDir(run).lock("lctrain train"):
        assert lock_holder(run)["pid"] == PID
        assert unfinished_note(tgt, training) == f"{done}; still training (pid {PID}): evaluate again when it ends"
    assert lock_holder(run) is None  # released: resume it


def test_eval_into_a_read_only_directory_suggests_out(tmp_path, monkeypatch):
    run = fake_run(tmp_path)
    real_open = lifetime.os.open

    def read_only(path, *args, **kwargs):
        if str(path).endswith(EVAL_LOCK):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(lifetime.os, "open", read_only)
    line = one_error_line(invoke("eval", run, "--tasks", "vt"))
    assert line == (
        f"error: cannot write eval's output directory {RunDir(run).eval_dir}: Read-only file system; choose a "
        f"path on a writable filesystem (eval's: --out DIR), then run the command again"
    )


def test_eval_writes_name_the_file_and_suggest_out(tmp_path, monkeypatch):
    """Its predictions (written through a temporary beside them) on a read-only filesystem, its plot on a full disk:
    the file in the message is the report's, not its temporary, and no temporary stays."""
    from lctrain import files
    from lctrain.reports import plots

    def read_only(path, *args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))

    monkeypatch.setattr(files, "open", read_only, raising=False)
    with pytest.raises(WriteFailed) as e, eval_writes(tmp_path):
        Kept.read(tmp_path, tmp_path / PARTIAL_PREDICTIONS, {"k": 1})
    assert str(e.value) == (
        f"cannot write eval's predictions {tmp_path / PARTIAL_PREDICTIONS}: Read-only file system; choose a path "
        f"on a writable filesystem (eval's: --out DIR), then run the command again"
    )
    monkeypatch.undo()

    def full_disk(results, path):
        Path(path).write_bytes(b"\x89PNG half")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # a file object's write: no file name

    monkeypatch.setattr(plots, "plot_ruler", full_disk)
    (tmp_path / "ruler.png").write_bytes(b"the earlier plot")
    with pytest.raises(WriteFailed) as e, eval_writes(tmp_path):
        runner.plot({}, tmp_path / "ruler.png")
    assert str(e.value) == (
        f"cannot write eval's plot {tmp_path / 'ruler.png'}: No space left on device; free disk space or choose a "
        f"path on another filesystem (eval's: --out DIR), then run the command again"
    )
    assert (tmp_path / "ruler.png").read_bytes() == b"the earlier plot"
    assert not temporary_of(tmp_path / "ruler.png").exists()
    # a write outside the output directory keeps its own remedy
    with pytest.raises(WriteFailed, match="free disk space or choose a path on another filesystem"):
        with eval_writes(tmp_path / "out"):
            runner.plot({}, tmp_path / "ruler.png")


@pytest.mark.slow  # a whole (tiny) evaluation: 3-5 s
def test_a_full_disk_at_the_plot_still_prints_the_scores(tmp_path, monkeypatch):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from lctrain.reports import plots
    from lctrain.tokenizer import load_tokenizer

    tok = load_tokenizer("builtin:mistral-7b-v0.1")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=1024,
    )
    model_dir = tmp_path / "model"
    LlamaForCausalLM(config).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)

    def full_disk(results, path):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(plots, "plot_ruler", full_disk)
    out = tmp_path / "out"
    result = invoke("eval", model_dir, "--tasks", "vt", "--lengths", "512", "--samples", "1", "--out", out)
    line = one_error_line(result)
    assert line == (
        f"error: cannot write eval's plot {out / 'ruler.png'}: No space left on device; free disk space or choose a "
        f"path on another filesystem (eval's: --out DIR), then run the command again"
    )
    assert "mean" in result.output and f"wrote {out}/results.json, predictions.jsonl\n" in result.output
    assert sorted(p.name for p in out.iterdir()) == ["predictions.jsonl", "results.json"]


# ------------------------------------------------------------------ export


def test_a_second_export_of_one_target_is_refused_naming_the_first(tmp_path):
    run = with_checkpoints(fake_run(tmp_path), 18)
    target = RunDir(run).export(18)
    with TargetLock(target, None):
        line = one_error_line(invoke("export", run, "--step", 18))
        assert line.startswith(f"error: {target}: another export is writing it, pid {PID} on ")
        assert "('lctrain export', since " in line and f"kill {PID}" in line
        other = tmp_path / "x"
        with TargetLock(other, "--out"):
            line = one_error_line(invoke("export", run, "--step", 18, "--out", other))
            assert line.startswith(f"error: {other}: another export is writing it, pid {PID}")
    assert [p.name for p in target.parent.iterdir()] == ["step_2"]  # no lock file left


def test_a_checkpoint_removed_by_the_running_training_is_not_called_damaged(tmp_path, monkeypatch):
    """keep=1: step_4 (its weights gone, as training's rotation removes them) is older than the step it keeps;
    while the run's lock is held that is the running training's doing, without it damage; step_5, which it keeps,
    missing its weights is damage either way."""
    run = with_checkpoints(fake_run(tmp_path, "checkpoint.keep=1"), 4, 5)
    rotated = (
        f"error: {RunDir(run).checkpoint(4)} was removed by the training running in {run} (pid {PID}; "
        f"checkpoint.keep=1); export again, or export a step it keeps"
    )
    damaged = f"error: {RunDir(run).checkpoint(4)}: damaged (mp_rank_00_model_states.pt is missing); export another"
    assert one_error_line(invoke("export", run, "--step", 4)).startswith(damaged)
    with RunDir(run).lock("lctrain train"):
        assert one_error_line(invoke("export", run, "--step", 4)) == rotated
        assert "damaged (mp_rank_00_model_states.pt is missing)" in one_error_line(invoke("export", run))

        # the whole checkpoint removed after it was chosen, before its state is read
        state_or_why = ckpt.state_or_why

        def removed_first(path):
            for f in path.iterdir():
                f.unlink()
            path.rmdir()
            return state_or_why(path)

        monkeypatch.setattr(ckpt, "state_or_why", removed_first)
        assert one_error_line(invoke("export", run, "--step", 4)) == rotated
    assert not (RunDir(run).exports_dir / ".lctrain-export-step_4.lock").exists()


def test_an_export_to_a_full_disk_leaves_no_temporary(tmp_path, monkeypatch):
    class FullDisk:
        """A model whose save_pretrained fills the disk after its first file (`checkpoint.write_export` runs it)."""

        config = types.SimpleNamespace(use_cache=False)

        def save_pretrained(self, path, **kwargs):
            Path(path).mkdir()
            (Path(path) / "model.safetensors").write_bytes(b"\0" * 1000)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    run = with_checkpoints(fake_run(tmp_path), 18)
    monkeypatch.setattr(export_module, "_weights", lambda *a: {})
    monkeypatch.setattr(export_module, "_skeleton", lambda *a: FullDisk())
    out = tmp_path / "exp2"
    line = one_error_line(invoke("export", run, "--step", 18, "--out", out))
    assert line == (
        f"error: cannot write the evaluation export {temporary_of(out)}: No space left on device; free disk space "
        f"or choose a path on another filesystem, then run the command again"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # neither .tmp-exp2 nor a lock file


def test_an_export_beside_a_read_only_target_is_one_line(tmp_path, monkeypatch):
    run = with_checkpoints(fake_run(tmp_path), 18)
    export_lock_fails(monkeypatch, errno.EROFS)
    assert one_error_line(invoke("export", run, "--step", 18)) == (
        f"error: cannot write the export's lock file {RunDir(run).exports_dir / '.lctrain-export-step_18.lock'}: "
        f"Read-only file system; choose a path on a writable filesystem, then run the command again"
    )


def test_an_export_marks_its_run_so_a_new_run_there_waits(tmp_path, monkeypatch):
    """While `lctrain export` reads a run's checkpoint (and writes into its hf/), starting a run over there (`train
    --force`, which clears both) is refused naming the export; once it has finished, nothing is left to refuse."""
    run = with_checkpoints(fake_run(tmp_path), 18)
    target = RunDir(run).export(18)
    seen = []

    def export_while_run_starts_over(run_dir, checkpoint, state, to, force, option):
        seen.append([r["reader"] for r in lifetime.readers(run)])
        with pytest.raises(UserError) as refused:
            RunDir(run).clear_outputs(force=True)
        seen.append(str(refused.value))
        return to

    monkeypatch.setattr(export_module, "_export", export_while_run_starts_over)
    assert invoke("export", run, "--step", 18).exit_code == 0
    reader = f"the export of step_18 into {target}"
    assert seen[0] == [reader]
    assert seen[1].startswith(f"{run}: {reader} (pid {PID} on ")
    assert seen[1].endswith(f"wait for it to finish or stop it (kill {PID}) before starting a run over here")
    assert lifetime.readers(run) == []
    RunDir(run).clear_outputs(force=True)
    assert not RunDir(run).checkpoints.exists()


def test_a_run_trained_with_fp32_rotation_evaluated_in_bf16_is_noted(tmp_path):
    """Eval runs exports as transformers and vLLM do (rotation in the model's dtype): a model.rope_fp32 run scored on
    a GPU got no word that its rotation differed from training's."""
    from lctrain.eval.runner import rope_fp32_note

    run = fake_run(tmp_path)
    cfg = RunDir(run).read_config()
    tgt = Target("run", run, cfg, [])
    assert rope_fp32_note(tgt, "cuda") is None  # trained with the rotation in the model's dtype
    cfg.model.rope_fp32 = True
    assert rope_fp32_note(tgt, "cuda").startswith("the run rotated q/k in fp32 in training (model.rope_fp32); eval")
    assert "rotating them in bfloat16" in rope_fp32_note(tgt, "cuda")
    assert rope_fp32_note(tgt, "cpu") is None  # fp32 evaluation rotates in fp32
    assert rope_fp32_note(Target("model", run, cfg, []), "cuda") is None
