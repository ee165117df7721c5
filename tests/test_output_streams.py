"""What lctrain writes where (lctrain/console.py, docs/troubleshooting.md "Output"): data on stdout, progress and
warnings on stderr; a reader that goes away (`| head`) ends nothing; ASCII tables where the terminal cannot show
box drawing; a diverged run says so in its summary and its metrics records. The streams are checked as a shell
script sees them: real subprocesses on real pipes, stdout and stderr read apart."""

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from train_helpers import clean_env, prepared_workdir, set_args, tiny_run
from typer.testing import CliRunner

from lctrain.cli import app
from lctrain.config import load_config
from lctrain.console import STDOUT_CLOSED, say
from lctrain.lifetime import SUPERVISOR_ENV
from lctrain.progress_bar import ProgressBar, counted_bar
from lctrain.rundir import RunDir
from lctrain.train.metrics import SLOW_HISTORY, StepLogger
from lctrain.train.report import RunEnd, summary

BOX_DRAWING = set("┏┃━┡│└┘─┳╇┩┛┗")

# A worker as a command is: guarded or not, 1 MB on stdout (more than a pipe holds, so the writer is still writing
# when its reader goes away), a write of native code's, then its work's result in a file and a last line.
WORKER = textwrap.dedent(
    """
    import os, sys
    from pathlib import Path
    if sys.argv[1] == "guarded":
        from lctrain.console import survive_closed_outputs
        survive_closed_outputs()
    for i in range(20000):
        print(f"line {i} " + "x" * 40)
    sys.stdout.flush()
    os.write(1, b"native code's own write\\n")
    print("a warning", file=sys.stderr)
    Path(sys.argv[2]).write_text("finished")
    print("last line", flush=True)
    """
)


def worker(guarded: bool, marker: Path, **popen) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", WORKER, "guarded" if guarded else "bare", str(marker)], env=clean_env(), **popen
    )


def no_reader() -> int:
    """The write end of a pipe whose reader has already gone: every write to it fails with EPIPE."""
    read, write = os.pipe()
    os.close(read)
    return write


@pytest.mark.parametrize("guarded", [True, False], ids=["guarded", "bare Python, the reference"])
def test_a_reader_that_stops_after_one_line_ends_nothing(tmp_path, guarded):
    marker = tmp_path / "result"
    proc = worker(guarded, marker, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout.readline().startswith(b"line 0 ")  # `| head -1`
    proc.stdout.close()
    err = proc.stderr.read().decode()
    rc = proc.wait(timeout=30)
    if not guarded:  # what a command did before: killed by its first write after the reader left
        assert rc != 0 and "BrokenPipeError" in err and not marker.exists()
        return
    assert rc == 0, err
    assert marker.read_text() == "finished"
    assert err.splitlines() == [STDOUT_CLOSED, "a warning"]  # said once, and stderr still works


def test_stderr_without_a_reader_leaves_stdout_to_the_data(tmp_path):
    marker = tmp_path / "result"
    write = no_reader()
    proc = worker(True, marker, stdout=subprocess.PIPE, stderr=write)
    os.close(write)
    out = proc.stdout.read().decode()
    assert proc.wait(timeout=30) == 0
    assert marker.read_text() == "finished"
    lines = out.splitlines()
    assert lines[0] == "line 0 " + "x" * 40 and lines[-2:] == ["native code's own write", "last line"]
    assert len(lines) == 20002  # the data whole, no note about stderr among it


def test_both_streams_on_one_pipe_without_a_reader(tmp_path):
    """`lctrain ... 2>&1 | true`: the note about stdout has nowhere to go either, and is dropped."""
    marker = tmp_path / "result"
    write = no_reader()
    proc = worker(True, marker, stdout=write, stderr=write)
    os.close(write)
    assert proc.wait(timeout=30) == 0
    assert marker.read_text() == "finished"


def run_cli(args: list[str], stdout=subprocess.PIPE, **env) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "lctrain.cli", *args],
        stdout=stdout,
        stderr=subprocess.PIPE,
        env=clean_env(**env),
        text=True,
        timeout=60,
    )


def test_a_command_whose_stdout_reader_is_gone_finishes_and_says_so_once():
    write = no_reader()
    try:
        done = run_cli(["show-config", "--reference"], stdout=write)
    finally:
        os.close(write)
    assert done.returncode == 0, done.stderr
    assert done.stderr == STDOUT_CLOSED + "\n"


def test_a_refused_command_still_says_why_when_stdout_is_gone():
    write = no_reader()
    try:
        done = run_cli(["train", "--sett", "3"], stdout=write)
    finally:
        os.close(write)
    assert done.returncode == 2
    assert done.stderr == "error: No such option: --sett (Possible options: --set); see 'lctrain train --help'\n"


def test_characters_the_output_encoding_lacks_are_escaped_not_fatal():
    """rich's help names docs/design.md's section with a '§': under an ASCII encoding that was a UnicodeEncodeError."""
    done = run_cli(["--help"], PYTHONIOENCODING="ascii")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stderr == ""
    assert done.stdout.isascii() and "(docs/design.md \\xa72)" in done.stdout


TABLE = "from lctrain.console import plain_console; from rich.table import Table; t = Table('a', 'b'); " + (
    "t.add_row('1', '2'); plain_console().print(t)"
)


@pytest.mark.parametrize(
    "env, boxes",
    [
        ({"LANG": "C"}, False),  # Python itself turns on UTF-8 under it (PEP 538), the terminal does not
        ({"LC_ALL": "POSIX", "LANG": "en_US.UTF-8"}, False),  # LC_ALL decides
        ({"LANG": "C.UTF-8", "TERM": "dumb"}, False),
        ({"LANG": "C.UTF-8", "TERM": "xterm"}, True),
        ({"LC_CTYPE": "C.UTF-8", "LANG": "C", "TERM": "xterm"}, True),  # the user's own LC_CTYPE decides
        ({"TERM": "xterm"}, True),  # no locale at all: Python's UTF-8
    ],
)
def test_tables_are_ascii_where_the_terminal_cannot_draw_boxes(env, boxes):
    base = {k: v for k, v in clean_env().items() if k not in ("LANG", "LC_ALL", "LC_CTYPE", "TERM", "PYTHONUTF8")}
    done = subprocess.run(
        [sys.executable, "-c", TABLE], env={**base, **env}, capture_output=True, text=True, encoding="utf-8"
    )
    assert done.returncode == 0, done.stderr
    assert bool(BOX_DRAWING & set(done.stdout)) == boxes, done.stdout
    if not boxes:
        assert done.stdout.splitlines()[0] == "+-------+" and "| a | b |" in done.stdout


@pytest.mark.parametrize(
    "args, listed",
    [(["--help"], ["prepare", "train", "--version"]), (["train", "--help"], ["--config", "--resume-if-exists"])],
)
@pytest.mark.parametrize(
    "env, boxes",
    [
        ({"LANG": "C.UTF-8", "TERM": "dumb"}, False),
        ({"LANG": "C", "TERM": "xterm"}, False),
        ({"LANG": "C.UTF-8", "TERM": "xterm"}, True),  # the reference: a terminal that shows them
    ],
)
def test_typers_help_is_ascii_where_the_terminal_cannot_draw_boxes(args, listed, env, boxes):
    """typer draws its help's panels on a console of its own: ASCII where lctrain's tables are, the help texts'
    other characters (the '§' of `prepare`'s "docs/design.md §2") written as escapes."""
    base = {k: v for k, v in clean_env().items() if k not in ("LANG", "LC_ALL", "LC_CTYPE", "TERM", "PYTHONUTF8")}
    done = subprocess.run(
        [sys.executable, "-m", "lctrain.cli", *args],
        env={**base, **env},
        capture_output=True,
        text=True,
        encoding="utf-8",
        timeout=60,
    )
    assert done.returncode == 0 and done.stderr == "", done.stderr[-2000:]
    assert bool(BOX_DRAWING & set(done.stdout)) == boxes, done.stdout
    assert done.stdout.isascii() != boxes, done.stdout
    assert all(word in done.stdout for word in listed), done.stdout
    if not boxes:
        assert "+- Options -" in done.stdout  # the panels are still drawn, in ASCII


def test_a_launched_rank_whose_stdout_reader_is_gone_finishes_its_work(tmp_path):
    """A worker rank (`lctrain check sp`, the memory bench) writes to the command's stdout: with `| head -1` it was
    killed by its next write, and the command failed."""
    from lctrain.parallel.launch import REQUEST_FILE, RESULT_FILE

    # the rank's work: a print of its request
    (tmp_path / REQUEST_FILE).write_text(json.dumps({"function": "builtins:print", "request": "a line of the work"}))
    write = no_reader()
    try:
        done = subprocess.run(
            [sys.executable, "-m", "lctrain.parallel.rank", str(tmp_path)],
            stdout=write,
            stderr=subprocess.PIPE,
            env=clean_env(),
            text=True,
            timeout=60,
        )
    finally:
        os.close(write)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr == STDOUT_CLOSED + "\n"
    assert json.loads((tmp_path / RESULT_FILE).read_text()) == {"result": None}


@pytest.mark.slow  # over 20 s on 2 cores: make test-slow
def test_check_sp_piped_into_head_finishes(tmp_path):
    arch = (
        "{model_type: llama, hidden_size: 64, intermediate_size: 128, num_hidden_layers: 1, num_attention_heads: 4, "
        "num_key_value_heads: 1}"
    )
    overrides = ["data.seq_len=128", f"model.arch={arch}", "model.dtype=float32", f"data.output_dir={tmp_path / 'no'}"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "lctrain.cli", "check", "sp", "--modes", "full", "--out", str(tmp_path / "out")]
        + set_args(overrides),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=clean_env(CUDA_VISIBLE_DEVICES=""),  # CPU processes over gloo even where a GPU is visible
        text=True,
    )
    assert proc.stdout.readline()  # `| head -1`: the ranks' progress
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=300) == 0, err[-3000:]
    assert "BrokenPipeError" not in err
    assert (tmp_path / "out" / "check_sp.json").is_file()


def log_lines_of(bar: ProgressBar) -> None:
    with bar:
        bar.advance(bar.add_task("samples", total=2), 2)


def test_progress_goes_to_stderr(capsys):
    log_lines_of(counted_bar())
    out, err = capsys.readouterr()
    assert out == ""
    assert [line.split()[:2] for line in err.splitlines()] == [["samples", "0/2"], ["samples", "2/2"]]


def test_a_warning_goes_to_stderr_and_in_a_launched_rank_to_stdout(capsys, monkeypatch):
    """A rank lctrain's launcher started has the launcher's log for its stderr: the user sees its stdout."""
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv(SUPERVISOR_ENV, raising=False)
    say("warning: here")
    assert capsys.readouterr() == ("", "warning: here\n")
    monkeypatch.setenv(SUPERVISOR_ENV, "1:0")
    say("note: under a launcher the user started")  # its own stderr: not lctrain's launcher
    assert capsys.readouterr() == ("", "note: under a launcher the user started\n")
    monkeypatch.setenv("RANK", "0")
    say("warning: rank 0")
    assert capsys.readouterr() == ("warning: rank 0\n", "")


def record(step: int, tokens_per_s: float) -> dict:
    return {
        "step": step,
        "loss": 9.0,
        "lr": 1e-3,
        "grad_norm": 1.0,
        "tokens_per_s": tokens_per_s,
        "mfu": 0.1,
        "peak_mem_gb": 1.0,
    }


def test_training_prints_its_step_lines_on_stdout_and_its_notes_on_stderr(tmp_path, capsys):
    steps = SLOW_HISTORY + 1
    cfg = load_config(None, [f"train.run_dir={tmp_path}"])
    logger = StepLogger(RunDir(tmp_path), cfg, 0, steps, "id")
    for step in range(1, steps + 1):
        logger.log(record(step, 1000.0 if step < steps else 10.0))  # the last step slow
    logger.close()
    out, err = capsys.readouterr()
    assert [line.split()[0] for line in out.splitlines()] == [f"step={s}/{steps}" for s in range(1, steps + 1)]
    assert err.startswith(f"note: step {steps} ran at 10 tokens/s") and err.count("\n") == 1


def run_end(diverged: dict | None) -> RunEnd:
    run = Path("runs/x")
    return RunEnd(
        run_dir=run,
        last={"step": 60, "loss": 1371.3325, "tokens": 245760},
        steps=60,
        start_step=0,
        tokens_per_step=4096,
        wall_s=200.0,
        peak_mem_gb=None,
        checkpoint=run / "checkpoints" / "step_60",
        exports=[run / "hf" / "step_60"],
        metrics_file=run / "metrics.jsonl",
        start_over="lctrain train --config runs/x/config.yaml --set train.lr=0.0001 --force",
        diverged=diverged,
    )


def test_the_summary_of_a_diverged_run_says_so_first_and_sends_it_nowhere_near_eval():
    said = summary(run_end({"step": 12, "loss": 4496.82114}))
    lines = said.splitlines()
    assert lines[0] == "done: runs/x (diverged at step 12)"
    assert lines[2] == '  diverged     loss 4496.8211 at step 12; metrics.jsonl says "diverged": true from there'
    assert lines[-1] == (
        "  next         start over with a lower train.lr, e.g. lctrain train --config runs/x/config.yaml --set "
        "train.lr=0.0001 --force"
    )
    healthy = summary(run_end(None))
    assert healthy.splitlines()[0] == "done: runs/x" and "diverged" not in healthy
    assert healthy.splitlines()[-1] == "  next         lctrain eval runs/x; lctrain plot runs/x"


@pytest.mark.slow
def test_a_run_that_diverges_but_stays_finite_completes_and_says_it(tmp_path_factory, monkeypatch, one_thread):
    from lctrain.train.trainer import StepResult, Trainer

    root = prepared_workdir(tmp_path_factory, "diverged", tiny_run)
    real_step = Trainer.train_step

    def step(self, windows):  # update 1 (step 2) far above ln V, as a too-high learning rate makes it; then finite
        result = real_step(self, windows)
        loss = 1e4 if self.state.step == 1 else result.loss
        return StepResult(loss, result.valid_labels, result.grad_norm, result.pairs)

    monkeypatch.setattr(Trainer, "train_step", step)
    run = root / "run"
    result = CliRunner().invoke(app, ["train", *set_args(tiny_run(root / "data", run, steps=3))])
    assert result.exit_code == 0, result.output
    records = RunDir(run).read_metrics()
    assert [(r["step"], r["diverged"]) for r in records] == [(1, False), (2, True), (3, True)]
    assert math.isfinite(records[-1]["loss"])
    assert f"done: {run} (diverged at step 2)" in result.stdout.splitlines()
    warning = "warning: step 2: loss 1e+04 is over 2 x that of guessing uniformly"
    assert warning in result.stderr and warning not in result.stdout
