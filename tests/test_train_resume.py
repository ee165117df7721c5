"""Single-process training end to end: run directory, checkpoints, exact resume after kills, and CLI errors.

One uninterrupted reference run is shared by all tests; interrupted runs are separate processes killed with SIGKILL
(at a random step, and inside a checkpoint write) and then resumed; they must end bit for bit where the reference
ends (CPU, fp32).
"""

import json
import random
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from train_helpers import (
    TINY_ARCH,
    clean_env,
    cli_train_command,
    export_lock_fails,
    killed_in_checkpoint_command,
    losses,
    metric_records,
    prepared_workdir,
    reference_run,
    set_args,
)
from typer.testing import CliRunner

from lctrain.cli import app
from lctrain.config import config_fingerprint, load_config
from lctrain.errors import UserError
from lctrain.files import TEMPORARY_PREFIX
from lctrain.measure import reset_host_peak
from lctrain.rundir import RunDir, step_name
from lctrain.train import checkpoint as ckpt
from lctrain.train.trainer import SIGTERM_SAID

STEPS = 8
AGAIN = "lctrain train --force"  # the start-over command a refusal cites


def overrides(data_dir: Path, run_dir: Path) -> list[str]:
    return [
        "data.seq_len=128",
        "data.token_budget=12000",
        f"data.output_dir={data_dir}",
        f"train.run_dir={run_dir}",
        f"train.steps={STEPS}",
        "train.global_batch=2",
        "train.micro_batch=1",
        "train.warmup_steps=2",
        "checkpoint.every_steps=2",
        "checkpoint.keep=2",
        "checkpoint.hf_every=2",
        "checkpoint.hf_last=4",
        f"model.arch={TINY_ARCH}",
    ]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return prepared_workdir(tmp_path_factory, "train", overrides)


@pytest.fixture(scope="module")
def reference(workdir):
    return reference_run(workdir, overrides)


def final_state(run_dir: Path) -> dict:
    path = RunDir(run_dir).checkpoint(STEPS)
    return torch.load(path / "mp_rank_00_model_states.pt", weights_only=False)


def assert_same_end(run_dir: Path, ref_dir: Path) -> None:
    assert losses(run_dir) == losses(ref_dir)  # bit for bit, every step once
    got, want = final_state(run_dir), final_state(ref_dir)
    assert got["module"].keys() == want["module"].keys()
    for k in want["module"]:
        assert torch.equal(got["module"][k], want["module"][k]), k
    got_opt, want_opt = got["optimizer"]["state"], want["optimizer"]["state"]
    for i in want_opt:
        for k in want_opt[i]:
            assert torch.equal(torch.as_tensor(got_opt[i][k]), torch.as_tensor(want_opt[i][k])), (i, k)
    assert got["lr_scheduler"] == want["lr_scheduler"]
    from safetensors.torch import load_file

    for step in (6, 8):
        a = load_file(RunDir(run_dir).export(step) / "model.safetensors")
        b = load_file(RunDir(ref_dir).export(step) / "model.safetensors")
        assert all(torch.equal(a[k], b[k]) for k in b)


def start_cli_train(workdir: Path, run_dir: Path, stdout=subprocess.DEVNULL) -> subprocess.Popen:
    return subprocess.Popen(
        cli_train_command(overrides, workdir, run_dir),
        env=clean_env(),
        stdout=stdout,
        stderr=subprocess.PIPE,
    )


def start_killed_in_checkpoint(workdir: Path, run_dir: Path, step: int) -> subprocess.Popen:
    return subprocess.Popen(
        killed_in_checkpoint_command(overrides, workdir, run_dir, step),
        env=clean_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def test_run_directory_metrics_and_checkpoints(reference):
    rd = RunDir(reference)
    assert load_config(str(rd.config_file)).train.steps == STEPS
    records = metric_records(reference)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for key in ("loss", "lr", "grad_norm", "tokens", "tokens_per_s", "mfu", "peak_mem_gb"):
        assert all(r[key] is not None for r in records), key
    # each step's own peak where the platform can reset it (Linux), the process's so far elsewhere
    assert {r["peak_mem_scope"] for r in records} == {"step" if reset_host_peak() else "lifetime"}
    assert records[0]["lr"] == pytest.approx(0.5e-3) and records[-1]["lr"] == pytest.approx(1e-3)
    assert records[-1]["tokens"] == STEPS * 2 * 128
    # keep=2: only the two newest resume checkpoints survive; `latest` names the last
    names = sorted(p.name for p in rd.checkpoints.glob("step_*"))
    assert names == [step_name(6), step_name(8)] == ["step_6", "step_8"]
    assert (rd.checkpoints / "latest").read_text().strip() == step_name(8)
    state = ckpt.read_state(ckpt.latest_checkpoint(rd))
    assert state["step"] == STEPS and state["windows_consumed"] == STEPS * 2
    assert sorted(p.name for p in rd.exports_dir.iterdir()) == ["step_6", "step_8"]


def test_hf_checkpoint_loads_and_matches_the_training_loss(reference, workdir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lctrain.attention import make_batch
    from lctrain.data.store import open_packed
    from lctrain.train.loss import CausalLMLossSum

    hf = RunDir(reference).export(STEPS)
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(hf)
    assert tok.bos_token_id == 1 and model.config.vocab_size == 32000
    trained = final_state(reference)["module"]
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, CausalLMLossSum.lm_state_dict(trained)[name], rtol=0, atol=0)
    # Hugging Face's own loss on make_batch's labels equals our chunked token-sum / valid labels
    window = open_packed(workdir / "data")[0]
    batch = make_batch(window["input_ids"][None], [window["seg_lens"]], "full")
    with torch.no_grad():
        hf_loss = model(input_ids=batch.input_ids, labels=batch.labels, shift_labels=batch.labels, use_cache=False).loss
        ours = CausalLMLossSum(model, chunk_tokens=100)(batch) / batch.valid_labels()
    torch.testing.assert_close(ours, hf_loss)


@pytest.mark.slow  # 8 s; a SIGKILL inside a checkpoint's write (below) stays in the default suite
def test_sigkill_at_a_random_step_then_resume_matches(reference, workdir):
    run_dir = workdir / "killed_random"
    kill_after = random.Random().randint(3, 6)
    proc = start_cli_train(workdir, run_dir)
    metrics = RunDir(run_dir).metrics_file
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= kill_after:
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.02)
    assert proc.wait() == -signal.SIGKILL, proc.stderr.read().decode()[-2000:]
    result = CliRunner().invoke(app, ["resume", str(run_dir)])
    assert result.exit_code == 0, result.output
    assert_same_end(run_dir, reference)


@pytest.mark.slow  # ~8 s: slow-marked to keep the default suite under its 5-minute budget (CI runs it)
def test_sigkill_inside_a_checkpoint_write_then_resume_matches(reference, workdir):
    run_dir = workdir / "killed_in_checkpoint"
    proc = start_killed_in_checkpoint(workdir, run_dir, 4)
    assert proc.wait(timeout=180) == -signal.SIGKILL, proc.stderr.read().decode()[-2000:]
    root = RunDir(run_dir).checkpoints
    assert (root / ckpt.LATEST).read_text().strip() == step_name(2)
    assert (root / (TEMPORARY_PREFIX + step_name(4))).is_dir()  # the half-written one
    assert ckpt.latest_checkpoint(RunDir(run_dir)).name == step_name(2)
    result = CliRunner().invoke(app, ["resume", str(run_dir)])
    assert result.exit_code == 0, result.output
    assert not list(root.glob(TEMPORARY_PREFIX + "*"))
    assert_same_end(run_dir, reference)


def stopped_by_sigterm(proc: subprocess.Popen) -> int:
    """The step a run stopped at on SIGTERM, from its last words (exit code 143, no traceback)."""
    assert proc.wait(timeout=180) == 143
    err = proc.stderr.read().decode()
    assert "Traceback" not in err, err[-3000:]
    said = re.fullmatch(
        r"stopped by SIGTERM after step (\d+) of 8, checkpoint step_\1 written; "
        r"'lctrain resume (.+)' continues from it",
        err.strip().splitlines()[-1],
    )
    assert said is not None, err[-3000:]
    return int(said.group(1))


@pytest.mark.slow  # 9 s: the default suite is at its 5 minutes
def test_sigterm_stops_after_the_step_under_way_with_a_checkpoint_of_it_and_resume_matches(reference, workdir):
    """A scheduler's time limit or preemption costs no step: the run ends at a step boundary with a checkpoint there,
    whether or not one was due (odd steps are not, with checkpoint.every_steps=2)."""
    run_dir = workdir / "sigterm"
    log = workdir / "sigterm.log"
    with open(log, "w") as out:
        proc = start_cli_train(workdir, run_dir, stdout=out)
    metrics = RunDir(run_dir).metrics_file
    deadline = time.time() + 120
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 3):
        assert proc.poll() is None and time.time() < deadline
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    step = stopped_by_sigterm(proc)
    assert 3 <= step < STEPS and len(metric_records(run_dir)) == step
    # said when the signal came, not only when the step ended (a 64K-token step can take minutes)
    assert SIGTERM_SAID in log.read_text()
    assert ckpt.latest_checkpoint(RunDir(run_dir)).name == step_name(step)
    assert ckpt.read_state(ckpt.latest_checkpoint(RunDir(run_dir)))["step"] == step
    result = CliRunner().invoke(app, ["resume", str(run_dir)])
    assert result.exit_code == 0, result.output
    assert_same_end(run_dir, reference)


@pytest.mark.slow  # the same stop, with the signal during a scheduled checkpoint's write
def test_sigterm_inside_a_checkpoint_write_finishes_it_and_stops_there(reference, workdir):
    run_dir = workdir / "sigterm_in_checkpoint"
    proc = subprocess.Popen(
        killed_in_checkpoint_command(overrides, workdir, run_dir, 4) + ["--signal", "TERM"],
        env=clean_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    assert stopped_by_sigterm(proc) == 4
    root = RunDir(run_dir).checkpoints
    assert sorted(p.name for p in root.iterdir()) == [ckpt.LATEST, step_name(2), step_name(4)]
    result = CliRunner().invoke(app, ["resume", str(run_dir)])
    assert result.exit_code == 0, result.output
    assert_same_end(run_dir, reference)


def test_evaluation_says_when_the_runs_dataset_was_prepared_again_since_it_trained(reference, workdir):
    """Perplexity holds windows out by number: in a dataset rebuilt from other input they may hold trained-on text."""
    from lctrain.data.store import open_packed
    from lctrain.eval.perplexity import rebuilt_since_training

    manifest = open_packed(workdir / "data").manifest
    assert rebuilt_since_training(reference, manifest, workdir / "data") is None
    first = manifest.shards[0]
    other = manifest.model_copy(
        update={"shards": [first.model_copy(update={"checksum": "xxh3_128:" + "0" * 32}), *manifest.shards[1:]]}
    )
    note = rebuilt_since_training(reference, other, workdir / "data")
    assert note.startswith(f"{workdir / 'data'} was prepared again since the run trained on it (the same ")
    assert note.endswith("its held-out windows may hold text the run trained on")


def test_resume_refuses_a_dataset_rebuilt_with_other_windows(reference, workdir):
    """`prepare --force` after the corpus changed rebuilds the dataset under the same data fingerprint: the checkpoint
    knows the windows it was trained on (their number and the shards' checksums) and refuses the others."""
    from lctrain.data.store import open_packed
    from lctrain.train.command import check_same_dataset

    cfg = load_config(None, overrides(workdir / "data", reference))
    manifest = open_packed(workdir / "data").manifest
    state = ckpt.read_state(ckpt.latest_checkpoint(RunDir(reference)))
    check_same_dataset(cfg, state, manifest, "step_8", AGAIN)  # the dataset it trained on
    older = {k: v for k, v in state.items() if k != "dataset"}  # an older run's
    check_same_dataset(cfg, older, manifest, "step_8", AGAIN)
    first = manifest.shards[0]
    other_content = manifest.model_copy(
        update={"shards": [first.model_copy(update={"checksum": "xxh3_128:" + "0" * 32}), *manifest.shards[1:]]}
    )
    with pytest.raises(
        UserError,
        match=rf"the prepared dataset changed since checkpoint step_8 \(the same {manifest.num_windows} windows, "
        "with other content",
    ):
        check_same_dataset(cfg, state, other_content, "step_8", AGAIN)
    more = manifest.model_copy(update={"num_windows": manifest.num_windows + 25})
    with pytest.raises(
        UserError,
        match=rf"\(it had {manifest.num_windows} windows, now {manifest.num_windows + 25}, rebuilt from other "
        r"input\); resuming would read other windows",
    ):
        check_same_dataset(cfg, state, more, "step_8", AGAIN)
    # the same windows cut at other places (another data.shard_tokens): other file checksums, named as such
    n, cut = manifest.num_windows, manifest.shards[0].model_copy(update={"checksum": "xxh3_128:" + "1" * 32})
    recut = manifest.model_copy(
        update={"shards": [cut.model_copy(update={"num_windows": n - 1}), cut.model_copy(update={"num_windows": 1})]}
    )
    with pytest.raises(UserError, match=rf"\(the same {n} windows cut into 2 shards where the run's were 1 "):
        check_same_dataset(cfg, state, recut, "step_8", AGAIN)


def _empty_state(path: Path) -> None:
    (path / ckpt.STATE_FILE).write_text("")


def _truncated_model_states(path: Path) -> None:
    f = path / "mp_rank_00_model_states.pt"
    f.write_bytes(f.read_bytes()[:4096])


def _flipped_byte_of_a_weight(path: Path) -> None:
    """The same size and structure: only the checksum the checkpoint recorded shows it (loaded, the run went on from
    other weights)."""
    f = path / "mp_rank_00_model_states.pt"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(data)


@pytest.mark.parametrize(
    "damage",
    # the same fallback for other damage: slow-marked to keep the default suite under its budget
    [
        pytest.param(_empty_state, marks=pytest.mark.slow),
        _truncated_model_states,
        pytest.param(_flipped_byte_of_a_weight, marks=pytest.mark.slow),
    ],
    ids=["empty-state", "truncated-states", "flipped-byte"],
)
def test_a_damaged_latest_checkpoint_falls_back_to_the_one_before(reference, workdir, damage):
    run_dir = workdir / f"damaged_{damage.__name__}"
    proc = start_killed_in_checkpoint(workdir, run_dir, 6)  # dies writing step 6: step 2 and 4 complete
    assert proc.wait(timeout=180) == -signal.SIGKILL, proc.stderr.read().decode()[-2000:]
    latest = ckpt.latest_checkpoint(RunDir(run_dir))
    assert latest.name == step_name(4)
    damage(latest)
    result = CliRunner().invoke(app, ["resume", str(run_dir)])
    assert result.exit_code == 0, result.output
    assert f"checkpoint {step_name(4)} is damaged" in result.output
    assert_same_end(run_dir, reference)  # from step 2, exactly as if nothing had happened


@pytest.mark.slow  # ~8 s: slow-marked to keep the default suite under its 5-minute budget (CI runs it)
def test_resume_from_another_directory_and_refuses_incompatible_edits(reference, workdir, tmp_path, monkeypatch):
    """The run directory is all `resume` needs (relative paths resolve where `train` ran), and a config edited
    in a way the checkpoint cannot continue with is refused in one line naming the keys."""
    monkeypatch.chdir(workdir)
    rel = ["data.output_dir=data", "train.run_dir=relative_run"]
    proc = subprocess.Popen(
        killed_in_checkpoint_command(lambda d, r: overrides(d, r) + rel, Path("."), Path("x"), 6),
        env=clean_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    assert proc.wait(timeout=180) == -signal.SIGKILL, proc.stderr.read().decode()[-2000:]
    run_dir = workdir / "relative_run"
    config = RunDir(run_dir).config_file
    original = config.read_text()
    assert "output_dir: data\n" in original  # relative, as the user wrote it

    monkeypatch.chdir(tmp_path)  # elsewhere
    config.write_text(original.replace("hidden_size: 64", "hidden_size: 128").replace("zero_stage: 0", "zero_stage: 1"))
    msg = _cli_error(["resume", str(run_dir)])
    assert "model.arch.hidden_size 64 -> 128 changed since checkpoint step_4" in msg
    # another parallel layout converts the checkpoint, but not one of ZeRO-0 (docs/training.md)
    config.write_text(original.replace("zero_stage: 0", "zero_stage: 1"))
    msg = _cli_error(["resume", str(run_dir)])
    assert "written with parallel.zero_stage=0 and the run now asks for zero_stage=1" in msg
    # the optimizer state restores its groups' weight decay, so a new decay would not take effect: refused too
    assert "decay_norms_and_biases: false" in original
    config.write_text(original.replace("decay_norms_and_biases: false", "decay_norms_and_biases: true"))
    assert "train.decay_norms_and_biases False -> True changed since checkpoint" in _cli_error(["resume", str(run_dir)])
    config.write_text(original.replace(f"steps: {STEPS}", f"steps: {STEPS}  # unchanged"))
    result = CliRunner().invoke(app, ["resume", str(run_dir)])
    assert result.exit_code == 0, result.output
    assert_same_end(run_dir, reference)


def test_a_run_from_before_step_n_names_and_workdir_resumes(reference, workdir, tmp_path, monkeypatch):
    """An older run directory: zero-padded checkpoint names, `latest` naming one, and a relative data directory in a
    config.yaml without `workdir`, which resolves where its `origin.json` says `train` ran; resumed from elsewhere,
    and without changing directory, it ends where the uninterrupted run ends."""
    import os
    import shutil

    rd = RunDir(tmp_path / "legacy")
    shutil.copytree(reference, rd.path)
    shutil.rmtree(rd.checkpoint(8))
    rd.checkpoint(6).rename(rd.checkpoints / "step_00000006")
    (rd.checkpoints / ckpt.LATEST).write_text("step_00000006\n")
    lines = rd.config_file.read_text().splitlines(keepends=True)
    text = "".join(line for line in lines if not line.startswith("workdir:"))
    assert f"output_dir: {workdir / 'data'}\n" in text
    rd.config_file.write_text(text.replace(f"output_dir: {workdir / 'data'}\n", "output_dir: data\n"))
    (rd.path / "origin.json").write_text(json.dumps({"cwd": str(workdir)}))
    monkeypatch.chdir(tmp_path)  # no data/ here

    def no_chdir(path):
        raise AssertionError(f"os.chdir({path})")

    monkeypatch.setattr(os, "chdir", no_chdir)
    result = CliRunner().invoke(app, ["resume", str(rd.path)])
    assert result.exit_code == 0, result.output
    assert "resuming from step_00000006" not in result.output  # the checkpoint `latest` names, not a fallback
    assert_same_end(rd.path, reference)


def _cli_error(args: list[str]) -> str:
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    return lines[0]


def test_a_resume_trains_on_with_the_configs_learning_rate_betas_and_eps(reference, tmp_path):
    """The checkpoint's optimizer state restores the rate, betas and eps it was written with; a resume that changes
    them (a lower rate after a divergence) trains with the new ones. At train.lr=1e-30 an AdamW update (its decoupled
    decay is scaled by the rate too) is below half an fp32 ulp of every weight, so step 9's weights are step 8's,
    bit for bit."""
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    sessions = RunDir(run_dir).sessions_file
    (first,) = [json.loads(line) for line in sessions.read_text().splitlines()]
    assert first["start_step"] == 0 and first["world"] == 1 and first["software"]["torch"] == torch.__version__
    # the first session ran another torch: this one says so, since its steps may differ in their last bits
    sessions.write_text(json.dumps({**first, "software": {**first["software"], "torch": "2.0.0"}}) + "\n")
    sets = ["train.steps=9", "train.lr=1e-30", "train.betas=[0.8, 0.9]", "train.eps=1e-6"]
    result = CliRunner().invoke(app, ["resume", str(run_dir), *set_args(sets)])
    assert result.exit_code == 0, result.output
    assert f"other software than the last one (from step 0): torch 2.0.0 -> {torch.__version__}; " in result.output
    second = json.loads(sessions.read_text().splitlines()[1])
    assert second["start_step"] == STEPS and second["config_fingerprint"] != first["config_fingerprint"]
    assert second["config_fingerprint"] == config_fingerprint(load_config(str(RunDir(run_dir).config_file)))
    assert "(train.betas [0.9, 0.95] -> [0.8, 0.9], train.eps 1e-08 -> 1e-06, train.lr " in result.output
    assert f"-> 1e-30, train.steps {STEPS} -> 9); continuing with the new values" in result.output
    before = final_state(run_dir)
    after = torch.load(RunDir(run_dir).checkpoint(9) / "mp_rank_00_model_states.pt", weights_only=False)
    for k in before["module"]:
        assert torch.equal(after["module"][k], before["module"][k]), k
    assert before["optimizer"]["param_groups"][0]["lr"] > 0
    assert {(tuple(g["betas"]), g["eps"]) for g in after["optimizer"]["param_groups"]} == {((0.8, 0.9), 1e-6)}
    assert set(after["lr_scheduler"]["base_lrs"]) == {1e-30}


def test_train_refuses_a_run_directory_with_checkpoints(reference, workdir):
    msg = _cli_error(["train"] + set_args(overrides(workdir / "data", reference)))
    assert "lctrain resume" in msg and "--force" in msg


def test_resume_of_a_finished_run_says_it_is_complete(reference):
    from typer.testing import CliRunner

    from lctrain.cli import app

    before = RunDir(reference).metrics_file.read_text()
    result = CliRunner().invoke(app, ["resume", str(reference)])
    assert result.exit_code == 0 and f"{reference} is complete: step {STEPS} of {STEPS}" in result.output
    assert f"--set train.steps=N, N > {STEPS}" in result.output
    assert RunDir(reference).metrics_file.read_text() == before


def test_a_finished_runs_resume_names_what_it_trained_and_a_layout_refusal_names_the_set(reference):
    """`--set train.steps` below the steps trained said "step 8 of 2"; a layout a ZeRO-0 checkpoint cannot resume on
    (another ZeRO stage), asked for with --set, was blamed on config.yaml."""
    result = CliRunner().invoke(app, ["resume", str(reference), "--set", "train.steps=2"])
    assert (
        result.exit_code == 0 and f"{reference} is complete: {STEPS} steps trained; nothing to resume" in result.output
    )
    more, layout = f"train.steps={STEPS + 2}", "parallel.zero_stage=1"
    line = _cli_error(["resume", str(reference), "--set", more, "--set", layout])
    assert line.startswith(f"error: --set {layout}: checkpoint step_{STEPS} was written with parallel.zero_stage=0 ")


def test_resume_without_checkpoints_is_a_user_error(tmp_path):
    assert "not a run directory" in _cli_error(["resume", str(tmp_path)])


@pytest.mark.parametrize("force", [[], ["--force"]], ids=["plain", "force"])
def test_a_prepared_dataset_as_run_directory_is_refused_and_left_alone(tmp_path, force):
    # train once wrote its config.yaml over the dataset's (prepare writes one beside the manifest) and its
    # outputs into the dataset, --force or not
    data = tmp_path / "dataset"
    data.mkdir()
    files = {"manifest.json": "{}", "config.yaml": "base: tiny_anchor\n"}
    for name, text in files.items():
        (data / name).write_text(text)
    error = _cli_error(["train", "--set", f"train.run_dir={data}", *force])
    assert f"train.run_dir = {data}: a prepared dataset (it holds manifest.json), not a run directory" in error
    assert {p.name: p.read_text() for p in data.iterdir()} == files


@pytest.mark.parametrize("command", [[], ["--force"], ["--resume-if-exists"]], ids=["plain", "force", "if-exists"])
@pytest.mark.parametrize(
    "weights",
    ["model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json"],
)
def test_a_models_folder_as_run_directory_is_refused_and_left_alone(tmp_path, command, weights):
    """A folder `from_pretrained` loads (config.json and its weights, or the index of their shards) would get the
    run's config.yaml, lock, checkpoints and metrics among the model's files."""
    model = tmp_path / "my model"
    model.mkdir()
    files = {"config.json": '{"model_type": "llama"}', weights: "weights", "tokenizer.json": "{}"}
    for name, text in files.items():
        (model / name).write_text(text)
    error = _cli_error(["train", "--set", f"train.run_dir={model}", *command])
    assert error == (
        f"error: train.run_dir = {model}: a model's folder (it holds config.json and {weights}), not a run "
        f"directory; set train.run_dir to another directory"
    )
    assert {p.name: p.read_text() for p in model.iterdir()} == files


def test_an_lctrain_export_as_run_directory_is_refused_and_config_json_alone_is_not_a_model(reference, tmp_path):
    export = RunDir(reference).export(STEPS)
    before = sorted(p.name for p in export.iterdir())
    error = _cli_error(["train", "--set", f"train.run_dir={export}", "--force"])
    assert error.startswith(f"error: train.run_dir = {export}: a model's folder (it holds config.json and model.")
    assert sorted(p.name for p in export.iterdir()) == before
    # a config.json without weights is nothing from_pretrained loads (a project folder's own config, say)
    (tmp_path / "config.json").write_text("{}")
    assert RunDir(tmp_path).not_for_a_run() is None and RunDir(reference).not_for_a_run() is None


def test_an_export_lock_that_cannot_be_created_is_worded_for_whoever_exports(tmp_path, monkeypatch):
    """The training's own export of a step goes into the run's hf/, where no --out can be chosen: its refusal names
    that directory and what to do instead; `lctrain export RUN` (into hf/ too) has --out to go elsewhere."""
    import errno

    export_lock_fails(monkeypatch, errno.ENAMETOOLONG)
    monkeypatch.setattr(ckpt, "write_export", lambda *args, **kwargs: pytest.fail("written without its lock"))
    monkeypatch.setattr(ckpt, "barrier", lambda: None)
    run = RunDir(tmp_path / "run")
    with pytest.raises(UserError) as info:
        ckpt.save_hf(None, None, None, None, run, 10, rank=0, zero_stage=1, cfg=load_config(None, []))
    assert str(info.value) == (
        f"{run.exports_dir}: cannot create the lock file .lctrain-export-step_10.lock of the training's evaluation "
        f"export of step 10 (File name too long); the run's exports go into this directory: fix it, or set "
        f"checkpoint.hf_last=0 to train without them ('lctrain export' writes one from a resume checkpoint later); "
        f"{ckpt.resume_hint(run)}"
    )
    with pytest.raises(UserError) as info, ckpt.TargetLock(run.export(10), None):
        pass
    assert str(info.value) == (
        f"the export {run.export(10)}: cannot create its lock file {run.exports_dir / '.lctrain-export-step_10.lock'} "
        f"(File name too long); export to another directory with --out"
    )


def test_the_output_check_of_the_longest_run_is_arithmetic(tmp_path, monkeypatch):
    """Whether a step after the session's start writes a resume checkpoint, as `resume_checkpoint_due` says of each
    (the reference, on short runs), is known at once for a run of a billion steps (asking each step took minutes)."""
    import itertools

    from lctrain.config import CheckpointConfig
    from lctrain.train import trainer
    from lctrain.train.schedule import resume_checkpoint_due

    probed = []
    monkeypatch.setattr(ckpt, "check_output_dir", lambda path, what: probed.append(what))

    def probes(total: int, every: int, final: bool, start: int) -> bool:
        probed.clear()
        sets = [f"train.steps={total}", f"checkpoint.every_steps={every}", f"checkpoint.save_final={final}"]
        cfg = load_config(None, [*sets, "checkpoint.on_sigterm=false", "checkpoint.hf_last=0"])
        trainer.check_output_dirs(cfg, RunDir(tmp_path), start)
        return probed == ["resume checkpoints"]

    for total, every, final in itertools.product((1, 5, 10), (1, 3, 5, 12), (True, False)):
        plan = CheckpointConfig(every_steps=every, save_final=final)
        for start in range(total + 1):
            due = any(resume_checkpoint_due(s, total, plan) for s in range(start + 1, total + 1))
            assert probes(total, every, final, start) == due, (total, every, final, start)
    began = time.monotonic()
    assert probes(10**9, 10**9, False, 1) and not probes(10**9 - 1, 10**9, False, 1)
    assert time.monotonic() - began < 5


@pytest.mark.parametrize(
    "extra, expected",
    [
        (["train.global_batch=3", "train.micro_batch=2"], "train.global_batch = 3 is not divisible"),
        (
            ["parallel.nproc_per_node=8", "parallel.sequence_parallel=8", "data.seq_len=132"],
            "data.seq_len = 132 is not divisible by parallel.sequence_parallel = 8",
        ),
        (
            ["parallel.nproc_per_node=8", "parallel.sequence_parallel=8"],
            "4 attention heads are not divisible by parallel.sequence_parallel = 8",
        ),
        (["data.seed=7"], "prepared with other data settings (data.seed 0 -> 7); run 'lctrain prepare"),
    ],
)
def test_bad_configs_fail_before_training(workdir, tmp_path, extra, expected):
    msg = _cli_error(["train"] + set_args(overrides(workdir / "data", tmp_path / "run") + extra))
    assert expected in msg
    assert not RunDir(tmp_path / "run").checkpoints.exists()


def test_unwritable_checkpoint_is_one_line(workdir, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    # a file where the evaluation exports go: refused before the first step, not at the first export
    RunDir(run_dir).exports_dir.write_text("not a directory")
    result = CliRunner().invoke(app, ["train"] + set_args(overrides(workdir / "data", run_dir)))
    assert result.exit_code == 2, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in result.output, result.output
    assert errors[0] == (
        f"error: {RunDir(run_dir).exports_dir}: the directory of the evaluation exports is a file where it goes; move "
        f"or remove the file, then run the command again"
    )
    assert not RunDir(run_dir).metrics_file.exists()


class _FailingEngine:
    def __init__(self, error):
        self.error = error

    def load_checkpoint(self, *args, **kwargs):
        raise self.error


@pytest.mark.parametrize(
    "error,damaged",
    [
        (RuntimeError("PytorchStreamReader failed reading zip archive: failed finding central directory"), True),
        (EOFError("Ran out of input"), True),
        (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), False),
        (RuntimeError("NCCL error in: ProcessGroupNCCL.cpp, unhandled system error"), False),
        (PermissionError(13, "Permission denied"), False),
    ],
)
def test_a_failing_machine_is_not_taken_for_a_damaged_checkpoint(tmp_path, error, damaged):
    """Only a damaged checkpoint makes resume fall back to an older one; out of memory, a collective error or a
    permission error while loading propagates (falling back would hide it and end in advice to start over)."""
    path = tmp_path / step_name(4)
    path.mkdir()
    (path / ckpt.STATE_FILE).write_text(json.dumps({"step": 4}))
    if damaged:
        state, why, _ = ckpt.load_resume(_FailingEngine(error), path, rank=0)
        assert state is None and type(error).__name__ in why
    else:
        with pytest.raises(type(error)):
            ckpt.load_resume(_FailingEngine(error), path, rank=0)


def test_resume_with_no_readable_checkpoint_state_is_one_line(reference, tmp_path):
    import shutil

    run_dir = tmp_path / "copy"
    shutil.copytree(reference, run_dir)
    for path in ckpt.resume_candidates(RunDir(run_dir)):
        (path / ckpt.STATE_FILE).write_text("")
    msg = _cli_error(["resume", str(run_dir)])
    assert "no checkpoint has a readable trainer_state.json" in msg and "--force" in msg


def test_a_resume_may_change_how_the_step_is_computed_but_not_the_model():
    from lctrain.config import settings
    from lctrain.train.command import check_resumable

    saved = {"config": settings(load_config(None, []))}
    faster = load_config(None, ["model.fused_kernels=compile", "model.checkpointing=selective"])
    check_resumable(faster, saved, "config.yaml", "step_4", AGAIN)
    # what `lctrain plan` offers a run that does not fit
    smaller = ["model.tiled_mlp=auto", "train.micro_batch=2", "train.loss_gradients=recompute"]
    check_resumable(load_config(None, smaller), saved, "config.yaml", "step_4", AGAIN)
    with pytest.raises(UserError, match=r"model.rope_fp32 False -> True changed since checkpoint step_4"):
        check_resumable(load_config(None, ["model.rope_fp32=true"]), saved, "config.yaml", "step_4", AGAIN)
