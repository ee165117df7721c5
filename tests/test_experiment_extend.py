"""`lctrain experiment extend` (lctrain/experiments/extend.py): its arithmetic against the training schedule and plain
counting, its refusals, --keep-going with the runs' commands stood in for, its reruns on a tiny random model, and
(slow, on the real example model) the CPU smoke version 1K -> 2K end to end: the plumbing, not the science.
References: the schedule that writes the evaluation checkpoints, the prepared windows themselves, plain transformers
(fp32) for each mode's first-step loss, and for a rerun the bytes training wrote and the settings each results.json
records."""

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from train_helpers import clean_env, set_args
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
from typer.testing import CliRunner

from lctrain import example_model
from lctrain.cli import app
from lctrain.config import data_fingerprint, load_config, max_steps
from lctrain.data.store import open_packed
from lctrain.errors import UserError
from lctrain.eval.tasks import generate, task_specs
from lctrain.experiments import extend as ex
from lctrain.init_config import rope_base
from lctrain.lifetime import Terminated, terminate_as_interrupt
from lctrain.rundir import RunDir
from lctrain.tokenizer import load_tokenizer, resolve_anchor, text_encoder
from lctrain.train import checkpoint as ckpt
from lctrain.train.data import stream_rows
from lctrain.train.schedule import hf_checkpoint_steps


@pytest.mark.parametrize("steps, checkpoints", [(2000, 5), (20, 5), (2, 2), (7, 1), (400, 3), (5, 5)])
def test_checkpoint_spacing_gives_that_many_checkpoints_ending_at_the_last_step(steps, checkpoints):
    every, last = ex.checkpoint_spacing(steps, checkpoints)
    cfg = load_config(None, [f"checkpoint.hf_every={every}", f"checkpoint.hf_last={last}"])
    exported = hf_checkpoint_steps(steps, cfg.checkpoint)
    assert len(exported) == checkpoints and exported[-1] == steps
    if steps == 2000:
        assert list(exported) == [1960, 1970, 1980, 1990, 2000]  # the paper's protocol (§4.2)


def test_checkpoint_spacing_refuses_more_checkpoints_than_steps():
    with pytest.raises(UserError, match="at most 3 checkpoints"):
        ex.checkpoint_spacing(3, 4)
    with pytest.raises(UserError, match="at least 1"):
        ex.checkpoint_spacing(3, 0)


def test_steps_from_tokens_data_and_time():
    assert ex.steps_for_tokens(10 * 131072 + 5, 131072) == 10  # whole steps, never more tokens than asked
    with pytest.raises(UserError, match="less than one step"):
        ex.steps_for_tokens(1000, 131072)
    # 100 windows, 8 held out for perplexity, 4 per step: 23 steps read 92 windows once
    assert max_steps(100, 8, 4) == 23 and max_steps(5, 8, 4) == 0
    assert ex.sized_steps(60.0, 20000.0, 131072, 5, 23) == 9  # 1.2M tokens in 60 s
    assert ex.sized_steps(600.0, 20000.0, 131072, 5, 23) == 23  # the data's limit
    assert ex.sized_steps(1.0, 20000.0, 131072, 5, 23) == 5  # at least the checkpoints averaged


def test_the_bundled_experiment_configs():
    """One data setting for the modes (one prepared dataset; intra_doc_reset's on request too), the paper's RoPE base
    rule for a 4x extension of the model's own 1e5, the evaluation lengths and checkpoints of the experiment."""
    modes = ex.MODES + ex.OPTIONAL_MODES
    configs = {m: load_config(ex.CONFIG.format(mode=m)) for m in modes}
    assert {m: c.attention.mode for m, c in configs.items()} == {m: m for m in modes}
    assert len({data_fingerprint(c.data) for c in configs.values()}) == 1
    cfg = configs["anchor"]
    assert cfg.model.name_or_path == cfg.data.tokenizer == ex.MODEL_DIR
    assert cfg.data.sources[0].path == ex.CORPUS
    assert cfg.model.rope_theta == rope_base(1e5, cfg.data.seq_len)[0] == 1e6
    assert cfg.eval.lengths == ex.default_eval_lengths(cfg.data.seq_len) == [8192, 16384, 32768]
    assert all(t.startswith("niah_") for t in cfg.eval.tasks)
    assert len(hf_checkpoint_steps(cfg.train.steps, cfg.checkpoint)) == 5
    windows = cfg.data.token_budget // cfg.data.seq_len
    assert cfg.train.steps <= max_steps(windows, cfg.eval.ppl_windows, cfg.train.global_batch)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"steps": 3, "tokens": 10**6}, "one of --steps, --tokens"),
        ({"steps": 0}, "--steps 0"),
        ({"train_seconds": -1.0}, "--train-seconds -1.0"),
        ({"seeds": 0}, "--seeds 0"),
        ({"checkpoints": 0}, "--checkpoints 0"),
        ({"modes": ("full", "nope")}, "--modes full,nope"),
        ({"modes": ("full", "full")}, "each once"),
        ({"seq_len": 2050}, "--seq-len 2050"),
        ({"eval_lengths": [4096, 65536]}, "65536 is beyond"),
        ({"overrides": ("train.nope=1",)}, "train.nope"),
        ({"tokens": -5}, "--tokens -5: less than one step of 131,072 tokens"),
        ({"tokens": 131071}, "--tokens 131,071: less than one step"),
        ({"train_seconds": float("inf")}, "--train-seconds inf"),
        ({"train_seconds": float("nan")}, "--train-seconds nan"),
        ({"steps": 2, "checkpoints": 3}, "--checkpoints 3: a run of 2 step"),
        # 100 windows of 32K in the configs' token budget, 8 held out, 4 per step: 23 steps
        (
            {"steps": 24},
            "24 steps x 4 windows read more than the 100 windows of --seq-len 32768 in data.token_budget = "
            "3,276,800 leave beside 8 held out for perplexity: give --steps or --tokens of at most 23 steps",
        ),
        ({"seq_len": 2**40}, "the 0 windows of --seq-len 1099511627776 in data.token_budget = 3,276,800 leave 0 step"),
    ],
)
def test_bad_requests_are_refused_before_anything_is_built(tmp_path, kwargs, message):
    out = tmp_path / "exp"
    with pytest.raises(UserError, match=re.escape(message)):
        ex.extend(out, device="cpu", **kwargs)
    assert not out.exists()


def test_an_out_through_a_file_is_refused_first(tmp_path):
    (tmp_path / "afile").write_text("")
    with pytest.raises(UserError) as e:
        ex.extend(tmp_path / "afile" / "x", steps=1, device="cpu")  # --steps 1 < 5 checkpoints: refused after
    assert str(e.value) == (
        f"--out {tmp_path}/afile/x: cannot create the directory (Not a directory): {tmp_path}/afile is a file; "
        "move it away or choose another --out"
    )


def test_a_bad_number_on_the_command_line_writes_nothing(tmp_path, monkeypatch):
    """--tokens -5 was refused only once the example model and the corpus were written."""
    monkeypatch.setattr(ex.example_model, "build", lambda out: pytest.fail("the example model was built"))
    out = tmp_path / "exp"
    for bad in (
        ["--tokens", "-5"],
        ["--steps", "24"],
        ["--train-seconds", "inf"],
        ["--checkpoints", "3", "--steps", "2"],
    ):
        result = CliRunner().invoke(app, ["experiment", "extend", "--out", str(out), "--device", "cpu", *bad])
        assert result.exit_code == 2 and result.output.startswith("error: "), result.output
        assert len(result.output.splitlines()) == 1 and bad[0] in result.output, result.output
        assert not out.exists()


@pytest.mark.real_model
def test_eval_lengths_are_counted_with_the_example_tokenizer_before_the_model_is_built(tmp_path, monkeypatch):
    """Without --model, the example model was built (some 20 s, into --out) before the eval lengths were refused."""
    monkeypatch.setattr(ex.example_model, "build", lambda out: pytest.fail("the example model was built"))
    out = tmp_path / "exp"
    command = ["experiment", "extend", "--out", str(out), "--device", "cpu", "--seq-len", "100"]
    result = CliRunner().invoke(app, command)
    assert result.exit_code == 2, result.output
    assert result.output.splitlines()[-1].startswith("error: --seq-len 100: evaluates at 25,50,100 (seq_len/4, /2")
    assert not out.exists()


@pytest.mark.parametrize(
    "exit_by, message",
    [
        (
            "os.kill(os.getpid(), signal.SIGKILL)",
            "was killed by SIGKILL (most likely the kernel's out-of-memory killer",
        ),
        (
            "os.kill(os.getpid(), signal.SIGSEGV)",
            "lctrain train (anchor) crashed with SIGSEGV in native code (a library aborted or faulted); run the same",
        ),
        ("sys.exit(143)", "lctrain train (anchor) was stopped by SIGTERM (from outside: a scheduler or a user)"),
    ],
)
def test_a_stage_that_ends_badly_is_one_line_naming_how(monkeypatch, tmp_path, exit_by, message):
    """A stage's command (here a stand-in that ends as a killed, stopped or failed `lctrain train` would) ends the
    experiment in one line that says how it ended and that rerunning continues."""
    code = f"import os, signal, sys; {exit_by}"
    monkeypatch.setattr(ex, "lctrain_command", lambda *args: [sys.executable, "-c", code])
    exp = ex.Experiment(tmp_path, 2048, ex.MODES, 1, 5, (512, 1024, 2048), "cpu", None, ())
    with pytest.raises(UserError, match=re.escape(message)) as e:
        exp.run("lctrain train (anchor)", ["train"])
    assert str(e.value).endswith("run the same `lctrain experiment extend` again to continue from what is finished")
    assert e.value.exit_code == 1


def test_a_stage_that_refused_its_command_says_to_correct_it_first(monkeypatch, tmp_path):
    """Exit code 2 is the stage's "fix the command": the same command again would meet the same refusal."""
    monkeypatch.setattr(ex, "lctrain_command", lambda *args: [sys.executable, "-c", "import sys; sys.exit(2)"])
    exp = ex.Experiment(tmp_path, 2048, ex.MODES, 1, 5, (512, 1024, 2048), "cpu", None, ())
    with pytest.raises(UserError) as e:
        exp.run("lctrain eval runs/anchor_s0", ["eval"])
    assert str(e.value) == (
        "lctrain eval runs/anchor_s0 failed (exit code 2; its output is above); correct what its error names, then "
        "run `lctrain experiment extend` again to continue from what is finished"
    )
    assert e.value.exit_code == 2


def test_sigterm_to_the_experiment_is_passed_to_its_stage_which_stops_in_its_own_time(monkeypatch, tmp_path):
    """A scheduler's SIGTERM to `experiment extend` reaches the stage (a training run then writes a checkpoint where it
    stops) and the experiment waits for it to end by itself, then says which stage stopped and how to continue."""
    marker = tmp_path / "stopped"
    stage = (
        "import signal, sys, time\n"
        "def stop(signum, frame):\n"
        "    time.sleep(1)  # a checkpoint's write\n"
        f"    open({str(marker)!r}, 'w').write('kept')\n"
        "    sys.exit(143)\n"
        "signal.signal(signal.SIGTERM, stop)\n"
        f"open({str(marker)!r} + '.ready', 'w')\n"
        "time.sleep(120)\n"
    )
    monkeypatch.setattr(ex, "lctrain_command", lambda *args: [sys.executable, "-c", stage])
    exp = ex.Experiment(tmp_path, 2048, ex.MODES, 1, 5, (512, 1024, 2048), "cpu", None, ())

    def scheduler():
        while not Path(f"{marker}.ready").exists():
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)

    previous = signal.getsignal(signal.SIGTERM)
    terminate_as_interrupt()
    try:
        threading.Thread(target=scheduler, daemon=True).start()
        with pytest.raises(Terminated) as stopped:
            exp.run("lctrain train (anchor)", ["train"])
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert marker.read_text() == "kept"
    assert str(stopped.value) == (
        "lctrain train (anchor) stopped by SIGTERM; run the same `lctrain experiment extend` again to continue from "
        "what is finished"
    )


# ---------------------------------------------------------------- --keep-going, the stages' commands stood in for

STAND_IN_STEPS = 2


def stand_in_stage(fail: dict[tuple[str, str], int], calls: list):
    """`supervise` for the arms without lctrain: a stand-in that writes what `train`/`resume` and `eval` leave in a run
    directory for the experiment to read (config, metrics, a checkpoint, the export, results.json), or ends with the
    exit code `fail` gives its (command, run name); a failed training leaves its step-1 checkpoint, as one that ran
    out of memory at step 2 would."""

    def stage(cmd, env, **supervision):
        command, args = cmd[3], cmd[4:]
        if command == "train":
            sets = [args[i + 1] for i, a in enumerate(args) if a == "--set"]
            cfg = load_config(args[args.index("-c") + 1], sets)
            rd = RunDir(cfg.train.run_dir)
            rd.write_config(cfg)
        else:
            rd = RunDir(args[0])
        calls.append((command, rd.path.name))
        if command in ("train", "resume"):
            last = 1 if (command, rd.path.name) in fail else STAND_IN_STEPS
            for step in range(1, last + 1):
                rd.append_metrics({"step": step})
            rd.checkpoint(last).mkdir(parents=True)
            (rd.checkpoint(last) / ckpt.STATE_FILE).write_text("{}")
            if last == STAND_IN_STEPS:
                rd.export(last).mkdir(parents=True)
        elif (command, rd.path.name) not in fail:
            rd.eval_dir.mkdir(exist_ok=True)
            (rd.eval_dir / "results.json").write_text(json.dumps({"checkpoints": [p.name for p in rd.exports()]}))
        return fail.get((command, rd.path.name), 0)

    return stage


@pytest.fixture
def stand_ins(monkeypatch):
    """The experiment around the arms stood in for: no model or corpus built, a prepared dataset of 100 windows
    assumed, the report reduced to the runs it was given and those it names left out ("not ..."). Yields (fail,
    calls, reported)."""
    fail, calls, reported = {}, [], []
    monkeypatch.setattr(ex, "supervise", stand_in_stage(fail, calls))
    monkeypatch.setattr(ex, "ensure_model", lambda exp: None)
    monkeypatch.setattr(ex, "check_evaluation", lambda exp, lengths_given: None)
    monkeypatch.setattr(ex, "ensure_corpus", lambda exp: None)
    monkeypatch.setattr(ex, "prepare_once", lambda exp, state, steps: {"path": "prepared", "windows": 100})
    monkeypatch.setattr(
        ex,
        "write_report",
        lambda runs, out, last, left_out: reported.append([r.name for r in runs] + [f"not {x}" for x in left_out]),
    )
    monkeypatch.setattr(ex, "print_report", lambda report, out: None)
    return fail, calls, reported


def extend_command(out, *more):
    command = ["experiment", "extend", "--out", str(out), "--seq-len", "2048", "--steps", str(STAND_IN_STEPS)]
    return CliRunner().invoke(app, [*command, "--checkpoints", "1", "--device", "cpu", *more])


def test_keep_going_trains_and_reports_the_other_runs_then_fails_naming_the_failed_one(stand_ins, tmp_path):
    """One run's training fails (at step 2, after its first checkpoint): with --keep-going it is said as it happens,
    recorded and not evaluated; the other runs train, are evaluated and reported; the command fails naming it. The
    same command again resumes it from its checkpoint and clears the record."""
    fail, calls, reported = stand_ins
    fail[("train", "intra_doc_s0")] = 1
    result = extend_command(tmp_path, "--keep-going")
    assert result.exit_code == 1  # the runs failed, not the command (lctrain/errors.py)
    assert calls == [("train", "full_s0"), ("train", "intra_doc_s0"), ("train", "anchor_s0")] + [
        ("eval", "full_s0"),
        ("eval", "anchor_s0"),
    ]
    said = result.output.splitlines()
    assert (
        "[experiment] train: lctrain train (intra_doc, seed 0 (2 of 3)) failed (exit code 1; its output is above); "
        "going on without this run (--keep-going)"
    ) in said
    assert "[experiment] eval: intra_doc, seed 0 (2 of 3): not evaluated, its training failed" in said
    assert f"[experiment] report: 2 of 3 runs into {tmp_path}/report, leaving out intra_doc_s0 (train failed)" in said
    assert reported == [
        ["full_s0", "anchor_s0", f"not intra_doc_s0 (train failed; {tmp_path}/experiment.json records why)"]
    ]
    assert said[-1] == (
        f"error: 1 of 3 runs failed: intra_doc_s0 (train failed), left out of the report ({tmp_path}/experiment.json "
        "records why); run the same `lctrain experiment extend` again to retry them (a run with a checkpoint resumes "
        "from it)"
    )
    runs = json.loads((tmp_path / ex.STATE_FILE).read_text())["runs"]
    assert runs["intra_doc_s0"]["failed"] == {
        "stage": "train",
        "error": "lctrain train (intra_doc, seed 0 (2 of 3)) failed (exit code 1; its output is above)",
    }
    assert "evaluated" not in runs["intra_doc_s0"]
    assert [name for name, run in runs.items() if "failed" in run] == ["intra_doc_s0"]

    # the same command, without --keep-going: the failed run resumes, is evaluated, and its record goes
    fail.clear()
    calls.clear()
    result = extend_command(tmp_path)
    assert result.exit_code == 0, result.output
    assert calls == [("resume", "intra_doc_s0"), ("eval", "intra_doc_s0")]
    assert reported[-1] == ["full_s0", "intra_doc_s0", "anchor_s0"]
    runs = json.loads((tmp_path / ex.STATE_FILE).read_text())["runs"]
    assert not [name for name, run in runs.items() if "failed" in run]
    assert runs["intra_doc_s0"]["exports"] == [f"step_{STAND_IN_STEPS}"]


def test_without_keep_going_the_first_failure_stops_the_experiment(stand_ins, tmp_path):
    fail, calls, reported = stand_ins
    fail[("train", "full_s0")] = 1
    result = extend_command(tmp_path)
    assert result.exit_code == 1  # the stage's run failed: the experiment's too
    assert calls == [("train", "full_s0")]
    assert result.output.splitlines()[-1] == (
        "error: lctrain train (full, seed 0 (1 of 3)) failed (exit code 1; its output is above); run the same "
        "`lctrain experiment extend` again to continue from what is finished"
    )
    assert not reported
    runs = json.loads((tmp_path / ex.STATE_FILE).read_text())["runs"]
    assert runs["full_s0"]["failed"]["stage"] == "train"
    fail[("resume", "full_s0")] = 2  # the rerun's stage refused its command: fix the command, as it said
    assert extend_command(tmp_path).exit_code == 2


def test_a_failed_evaluation_is_left_out_and_retried(stand_ins, tmp_path):
    """An evaluation that fails leaves its run out of the report, which then reads the others against the next mode;
    the rerun evaluates it again (its training finished, skipped) and clears the record."""
    fail, calls, reported = stand_ins
    fail[("eval", "full_s0")] = 1
    result = extend_command(tmp_path, "--keep-going")
    assert result.exit_code == 1
    assert calls[-3:] == [("eval", "full_s0"), ("eval", "intra_doc_s0"), ("eval", "anchor_s0")]
    assert (
        f"[experiment] report: 2 of 3 runs into {tmp_path}/report, leaving out full_s0 (eval failed); intra_doc is "
        "the reference row in place of full"
    ) in result.output.splitlines()
    assert reported == [
        ["intra_doc_s0", "anchor_s0", f"not full_s0 (eval failed; {tmp_path}/experiment.json records why)"]
    ]
    assert "full_s0 (eval failed), left out of the report" in result.output
    assert json.loads((tmp_path / ex.STATE_FILE).read_text())["runs"]["full_s0"]["failed"]["stage"] == "eval"

    fail.clear()
    calls.clear()
    result = extend_command(tmp_path, "--keep-going")
    assert result.exit_code == 0, result.output
    assert calls == [("eval", "full_s0")]
    assert "failed" not in json.loads((tmp_path / ex.STATE_FILE).read_text())["runs"]["full_s0"]


def test_keep_going_with_too_few_runs_left(stand_ins, tmp_path):
    """One mode left: reported with nothing to compare it with, said so; none left: no report, one line."""
    fail, _, reported = stand_ins
    fail[("train", "full_s0")] = fail[("train", "intra_doc_s0")] = 1
    result = extend_command(tmp_path, "--keep-going")
    assert result.exit_code == 1
    assert "only anchor is left, with no other mode to compare it with" in result.output
    assert reported[0][0] == "anchor_s0" and len(reported[0]) == 3  # full_s0 and intra_doc_s0 named left out

    fail[("train", "anchor_s0")] = 1
    reported.clear()
    result = extend_command(tmp_path / "none", "--keep-going")
    assert result.exit_code == 1
    assert not reported
    assert result.output.splitlines()[-1] == (
        "error: every run failed: full_s0 (train failed), intra_doc_s0 (train failed), anchor_s0 (train failed); no "
        f"report written ({tmp_path}/none/experiment.json records why); run the same `lctrain experiment extend` "
        "again to retry them"
    )


def test_sigterm_stops_a_keep_going_experiment_at_once(stand_ins, tmp_path, monkeypatch):
    """SIGTERM is no failed run: the experiment stops at the stage it reached, --keep-going or not."""
    _, calls, reported = stand_ins

    def terminated(cmd, env, **supervision):
        calls.append(cmd[3])
        raise Terminated()

    monkeypatch.setattr(ex, "supervise", terminated)
    result = extend_command(tmp_path, "--keep-going")
    assert result.exit_code == 143
    assert calls == ["train"] and not reported
    assert "lctrain train (full, seed 0 (1 of 3)) stopped by SIGTERM" in result.output


# ---------------------------------------------------------------- the CPU smoke version, on the example model

SEQ_LEN = 2048
STEPS = 2
CHECKPOINTS = 1  # the averaging over several is the report's, tested there; each checkpoint costs a CPU eval
WINDOWS = 6
SMOKE = [
    "train.global_batch=1",
    f"data.token_budget={WINDOWS * SEQ_LEN}",
    "data.shuffle_buffer_tokens=0",  # the corpus's first documents: prepare reads no more than it packs
    "data.num_workers=1",
    "eval.tasks=[niah_single_1]",
    "eval.samples_per_task=1",
    "eval.ppl_windows=1",
]


@pytest.fixture(scope="module")
def smoke(model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("extend")
    command = [sys.executable, "-m", "lctrain.cli", "experiment", "extend", "--out", str(out)]
    command += ["--seq-len", str(SEQ_LEN), "--steps", str(STEPS), "--checkpoints", str(CHECKPOINTS)]
    command += ["--eval-lengths", "1k,2k", "--device", "cpu", "--model", str(model_dir), *set_args(SMOKE)]
    start = time.monotonic()
    proc = subprocess.run(command, env=clean_env(), capture_output=True, text=True, timeout=1500)
    seconds = time.monotonic() - start
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    print(f"experiment extend, CPU smoke: {seconds:.0f} s")
    return out, proc.stdout, command


def runs(out):
    return {m: RunDir(out / "runs" / f"{m}_s0") for m in ex.MODES}


@pytest.mark.slow
@pytest.mark.real_model
def test_every_mode_trains_on_the_same_prepared_windows(smoke):
    out, said, _ = smoke
    state = json.loads((out / ex.STATE_FILE).read_text())
    packed = open_packed(state["prepared"]["path"])
    assert len(packed) == WINDOWS == state["prepared"]["windows"]
    recorded = {m: data_fingerprint(rd.read_config().data) for m, rd in runs(out).items()}
    assert set(recorded.values()) == {packed.manifest.data_fingerprint}
    assert {r["mode"] for r in state["runs"].values()} == set(ex.MODES)
    assert {r["data_fingerprint"] for r in state["runs"].values()} == {packed.manifest.data_fingerprint}
    assert said.count("tokenizing and packing the corpus once") == 1
    for m, rd in runs(out).items():
        cfg = rd.read_config()
        assert (cfg.attention.mode, cfg.data.seq_len, cfg.model.rope_theta) == (m, SEQ_LEN, 1e6)
        assert [r["step"] for r in rd.read_metrics()] == list(range(1, STEPS + 1))
        assert [p.name for p in rd.exports()] == [f"step_{s}" for s in range(STEPS - CHECKPOINTS + 1, STEPS + 1)]


def reference_loss(model_dir, window, mode):
    """Plain transformers, fp32, eager attention: the example model at base 1e6 on one prepared window, every next
    token a target; intra_doc and anchor through a block-diagonal causal mask over the window's segments (each its
    own document here: no interleaving), anchor with every segment's opening anchor at position 0."""
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation="eager")
    config = model.config
    config.rope_parameters = {**config.rope_parameters, "rope_theta": 1e6}
    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir), config=config, dtype=torch.float32, attn_implementation="eager"
    )
    ids = torch.as_tensor(window["input_ids"], dtype=torch.long)[None]
    L = ids.shape[1]
    seg_lens = torch.as_tensor(window["seg_lens"])
    starts = torch.cumsum(seg_lens, 0) - seg_lens
    position = torch.arange(L)
    kwargs = {}
    if mode != "full":
        doc = torch.repeat_interleave(torch.as_tensor(window["seg_doc"]), seg_lens)
        seen = (doc[:, None] == doc[None, :]) & torch.ones(L, L, dtype=torch.bool).tril()
        kwargs["attention_mask"] = torch.zeros(1, 1, L, L).masked_fill(~seen, torch.finfo(torch.float32).min)
        if mode == "anchor":
            position = position.clone()
            position[starts] = 0
    with torch.no_grad():
        return float(model(ids, position_ids=position[None], labels=ids, **kwargs).loss), len(seg_lens)


@pytest.mark.slow
@pytest.mark.real_model
def test_each_modes_first_step_loss_is_the_models_own(smoke, model_dir):
    out, _, _ = smoke
    state = json.loads((out / ex.STATE_FILE).read_text())
    packed = open_packed(state["prepared"]["path"])
    for mode, rd in runs(out).items():
        first = rd.read_metrics()[0]
        (row,) = stream_rows(rd.read_config().seed, len(packed), 0, 1)  # the window step 1 read
        window = packed[row]
        assert first["valid_labels"] == SEQ_LEN - 1  # every next token, the next documents' anchors included
        expected, segments = reference_loss(model_dir, window, mode)
        print(f"{mode}: first-step loss {first['loss']:.6f}, transformers {expected:.6f} ({segments} segments)")
        assert first["loss"] == pytest.approx(expected, rel=1e-5)
        if mode != "full":
            assert segments > 1  # the window has documents to keep apart: the masked reference is not the full one


@pytest.mark.slow
@pytest.mark.real_model
def test_every_run_is_evaluated_and_reported(smoke):
    out, said, command = smoke
    for rd in runs(out).values():
        results = json.loads((rd.eval_dir / "results.json").read_text())
        assert results["checkpoints"] == [p.name for p in rd.exports()]
        assert results["lengths"] == [1024, 2048] and results["tasks"] == ["niah_single_1"]
        assert results["perplexity"]["windows"] == 1
    report = json.loads((out / ex.REPORT_DIR / "report.json").read_text())
    assert [row["mode"] for row in report["rows"]] == list(ex.MODES)
    assert all(row["training_tokens"] == STEPS * SEQ_LEN for row in report["rows"])
    assert all(len(run["checkpoints"]) == CHECKPOINTS for row in report["rows"] for run in row["runs"])
    for stage in ("inputs", "prepare", "train", "eval", "report"):
        assert f"[experiment] {stage}:" in said
    # a rerun finds everything done: nothing is trained or evaluated again
    again = subprocess.run(command, env=clean_env(), capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.count("finished, skipped") == 2 * len(ex.MODES)
    assert "step=1/" not in again.stdout


# ---------------------------------------------------------------- reruns, on a tiny model in this process

TINY_SEQ_LEN = 512
TINY_STEPS = 2
TINY_MODES = ("anchor",)  # one run: each evaluation of it costs seconds
TINY = [
    "train.global_batch=1",
    f"data.token_budget={8 * TINY_SEQ_LEN}",
    "data.shuffle_buffer_tokens=0",
    "data.num_workers=1",
    "logging.peak_tflops=1",  # no CPU matmul measurement for the MFU column
    "eval.tasks=[niah_single_1]",
    "eval.samples_per_task=1",
    "eval.ppl_windows=1",
]


def in_this_process(cmd, env, **supervision):
    """`supervise` for the tiny experiment: the lctrain command in this process (no interpreter start per stage)."""
    assert cmd[:3] == [sys.executable, "-m", "lctrain.cli"]
    result = CliRunner().invoke(app, cmd[3:])
    print(result.output)
    return result.exit_code


def tiny_extend(out, model, *, lengths=(TINY_SEQ_LEN,), overrides=()):
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ex, "supervise", in_this_process)
        return ex.extend(
            out,
            seq_len=TINY_SEQ_LEN,
            steps=TINY_STEPS,
            checkpoints=1,
            eval_lengths=list(lengths),
            modes=TINY_MODES,
            device="cpu",
            model=model,
            overrides=(*TINY, *overrides),
        )


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A tiny random Llama with the built-in tokenizer, an example-model directory by its marker."""
    model = tmp_path_factory.mktemp("tiny_model") / "model"
    tokenizer = load_tokenizer(load_config(None).data.tokenizer)
    arch = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=len(tokenizer),
    )
    torch.manual_seed(0)
    LlamaForCausalLM(arch).save_pretrained(model)
    tokenizer.save_pretrained(model)
    (model / example_model.DONE).write_text("")
    return model


@pytest.fixture(scope="module")
def tiny_experiment(tmp_path_factory, tiny_model):
    """An experiment on the tiny model and a small corpus of its own, trained and evaluated once."""
    model = tiny_model
    out = tmp_path_factory.mktemp("tiny_extend") / "exp"
    corpus = out / ex.CORPUS
    corpus.parent.mkdir(parents=True)
    words = "the quick brown fox jumps over a lazy dog while the python code runs".split()
    with corpus.open("w") as f:
        for doc in range(40):
            text = " ".join(words[(doc + i) % len(words)] for i in range(200))
            f.write(json.dumps({"text": text, "meta": {"kind": "prose"}}) + "\n")
    tiny_extend(out, model)
    return out, model


def trained_bytes(out) -> dict[str, str]:
    """A digest of every file training wrote into the runs (weights, exports, metrics, config), by path."""
    return {
        str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted((out / "runs").rglob("*"))
        if p.is_file() and "eval" not in p.relative_to(out / "runs").parts
    }


def evaluated_as(out) -> dict[str, tuple]:
    """What each run's results.json records it was evaluated with: lengths, samples per task, and how many
    predictions of each length predictions.jsonl holds."""
    seen = {}
    for mode in TINY_MODES:
        eval_dir = out / "runs" / f"{mode}_s0" / "eval"
        results = json.loads((eval_dir / "results.json").read_text())
        predictions = [json.loads(line) for line in (eval_dir / "predictions.jsonl").read_text().splitlines()]
        per_length = {L: sum(p["length"] == L for p in predictions) for L in results["lengths"]}
        seen[mode] = (results["lengths"], results["samples_per_task"], per_length)
    return seen


@pytest.mark.slow  # 3-7 s in CI: slow-marked to keep `make test` under its 5 minutes
def test_an_eval_only_change_re_evaluates_the_trained_runs_without_training(tiny_experiment, capsys):
    out, model = tiny_experiment
    trained = trained_bytes(out)
    assert evaluated_as(out) == {m: ([512], 1, {512: 1}) for m in TINY_MODES}
    capsys.readouterr()

    report = tiny_extend(out, model, lengths=(256, 512), overrides=("eval.samples_per_task=2",))
    said = capsys.readouterr().out
    changed = [line for line in said.splitlines() if "eval settings changed" in line]
    assert changed == [
        "[experiment] eval: eval settings changed (eval.lengths [512] -> [256, 512], eval.samples_per_task 1 -> 2): "
        "re-evaluating the trained runs"
    ]
    assert said.count("finished, skipped") == len(TINY_MODES)  # the training, not the evaluation
    assert trained_bytes(out) == trained
    assert evaluated_as(out) == {m: ([256, 512], 2, {256: 2, 512: 2}) for m in TINY_MODES}
    assert report["lengths"]["ruler"] == [256, 512]
    assert json.loads((out / ex.REPORT_DIR / "report.json").read_text()) == report

    # the same command again: nothing to evaluate
    tiny_extend(out, model, lengths=(256, 512), overrides=("eval.samples_per_task=2",))
    said = capsys.readouterr().out
    assert "eval settings changed" not in said and said.count("finished, skipped") == 2 * len(TINY_MODES)

    # back to the settings the runs trained with (and their config.yaml holds): evaluated with those again
    tiny_extend(out, model)
    said = capsys.readouterr().out
    assert "eval settings changed (eval.lengths [256, 512] -> [512], eval.samples_per_task 2 -> 1)" in said
    assert trained_bytes(out) == trained
    assert evaluated_as(out) == {m: ([512], 1, {512: 1}) for m in TINY_MODES}


def test_a_training_change_is_still_refused(tiny_experiment):
    out, model = tiny_experiment
    results = {p: p.read_bytes() for p in (out / "runs").glob("*/eval/results.json")}
    state = (out / ex.STATE_FILE).read_bytes()
    with pytest.raises(UserError, match="trained with other settings than this experiment's"):
        tiny_extend(out, model, overrides=("train.lr=1e-3", "eval.samples_per_task=2"))
    assert {p: p.read_bytes() for p in results} == results
    assert (out / ex.STATE_FILE).read_bytes() == state  # the refused plan is not recorded: the runs did not change


def test_each_runs_description_names_its_model_and_window_and_a_former_one_is_no_change(tiny_experiment, capsys):
    """The bundled configs' description names SmolLM2 and 32K, untrue of a run on another model or --seq-len; a run
    directory whose config.yaml holds another description (an earlier lctrain's) trained the same."""
    out, model = tiny_experiment
    for mode in TINY_MODES:
        config = out / "runs" / f"{mode}_s0" / "config.yaml"
        recorded = load_config(str(config))
        assert (
            recorded.description == f"{model.name} at 512 windows, {mode} attention, seed 0 (lctrain experiment extend)"
        )
        former = config.read_text()
        config.write_text(former.replace(recorded.description, load_config(ex.CONFIG.format(mode=mode)).description))
        try:
            capsys.readouterr()
            tiny_extend(out, model)
            assert capsys.readouterr().out.count("finished, skipped") == 2 * len(TINY_MODES)
        finally:
            config.write_text(former)
    mine = ex.Experiment(out, TINY_SEQ_LEN, TINY_MODES, 1, 1, (512,), "cpu", model, ("description=mine",))
    assert mine.config("anchor", mine.run_overrides("anchor", 0, TINY_STEPS)).description == "mine"


def test_the_modes_are_warned_before_training_when_no_window_read_holds_two_documents(tiny_experiment, capsys):
    out, model = tiny_experiment
    exp = ex.Experiment(out, TINY_SEQ_LEN, ("full", "anchor"), 1, 1, (TINY_SEQ_LEN,), "cpu", model, tuple(TINY))
    packed = open_packed(next((out / "prepared").iterdir()))
    order = stream_rows(0, len(packed), 0, len(packed))  # seed 0, global batch 1: step s reads order[s]
    multi = [len(set(packed[r]["seg_doc"].tolist())) > 1 for r in order]
    capsys.readouterr()
    for steps in range(1, len(packed)):
        ex.warn_identical_modes(exp, steps)
        warned = "holds more than one document" in capsys.readouterr().out
        assert warned == (not any(multi[:steps])), steps
    # this corpus packs several documents in every window: the warning itself, on windows counted as single-document
    one_document = ex.Windows(packed.path, frozenset({0}), frozenset(), frozenset())
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ex, "trained_windows", lambda cfg, steps: one_document)
        ex.warn_identical_modes(exp, 1)
    assert capsys.readouterr().out == (
        "[experiment] train: warning: none of the 1 windows the runs will train on holds more than one document, so "
        "full, anchor will train identically (one mask, the same positions); read more windows (--steps, "
        "train.global_batch) or pack more documents per window (a longer --seq-len) for the modes to differ\n"
    )


def test_runs_evaluated_before_the_settings_were_recorded_are_not_evaluated_again(tiny_experiment, capsys):
    """An experiment.json written before it recorded each run's eval settings ("evaluated": true): the runs were
    evaluated with their own config's, so the same command skips them."""
    out, model = tiny_experiment
    state = json.loads((out / ex.STATE_FILE).read_text())
    for run in state["runs"].values():
        run["evaluated"] = True
    (out / ex.STATE_FILE).write_text(json.dumps(state))
    results = {p: p.read_bytes() for p in (out / "runs").glob("*/eval/results.json")}
    capsys.readouterr()
    tiny_extend(out, model)
    assert capsys.readouterr().out.count("eval finished, skipped") == len(TINY_MODES)
    assert {p: p.read_bytes() for p in results} == results


def test_eval_lengths_too_short_for_a_task_are_refused_before_anything_is_written(tiny_model, tmp_path, monkeypatch):
    """--seq-len 100 evaluates at 25, 50 and 100 tokens, less than a needle task's prompt with an empty haystack:
    every run trained, then its evaluation failed naming eval's --lengths, and the same command again trained
    nothing, evaluated again and failed again. Now the command refuses before it writes or runs anything, naming
    its own options, and so does the same command again."""
    stages = []
    monkeypatch.setattr(ex, "supervise", lambda cmd, env, **kw: stages.append(cmd[3:]) or 0)
    out = tmp_path / "exp"
    command = ["experiment", "extend", "--out", str(out), "--model", str(tiny_model), "--steps", "2"]
    command += ["--checkpoints", "1", "--modes", "anchor", "--device", "cpu"]
    for _ in range(2):
        result = CliRunner().invoke(app, [*command, "--seq-len", "100"])
        assert result.exit_code == 2, result.output
        line = result.output.splitlines()[-1]
        assert line.startswith(
            "error: --seq-len 100: evaluates at 25,50,100 (seq_len/4, /2 and seq_len), too short for the prompt and "
            "generation of niah_single_1 ("
        )
        assert ", give --eval-lengths of at least " in line and "--set eval.exclude=[" in line
        assert not out.exists() and stages == []
    result = CliRunner().invoke(app, [*command, "--seq-len", "512", "--eval-lengths", "64,512"])
    assert result.exit_code == 2 and not out.exists() and stages == []
    line = result.output.splitlines()[-1]
    assert line.startswith("error: --eval-lengths 64,512: too short for the prompt and generation of niah_single_1 (")
    # the generator refuses those samples too; the length the message names is enough for every task
    need = int(re.search(r"give --eval-lengths of at least (\d+)", line).group(1))
    exp = ex.Experiment(out, 512, ("anchor",), 1, 1, (64,), "cpu", tiny_model, ())
    cfg = exp.config("anchor")
    tokenizer = load_tokenizer(str(tiny_model))
    encoder = text_encoder(tokenizer).prompted(resolve_anchor(tokenizer, cfg.data.anchor))
    spec = task_specs(cfg.eval.seed)["niah_single_1"]
    with pytest.raises(UserError, match="too short for task niah_single_1"):
        generate(spec, 64, cfg.eval.samples_per_task, cfg.eval.seed, lambda t: len(encoder.encode(t, specials=True)))
    ex.check_evaluation(ex.Experiment(out, 512, ("anchor",), 1, 1, (need, 512), "cpu", tiny_model, ()), True)
    assert not out.exists()
