"""Process lifetime, provoked as a hostile user would: kills of multi-process training and of `prepare`, two trainers
on one run directory, SIGTERM, and a retry after a kill before the first checkpoint."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from train_helpers import clean_env, set_args, two_tokenizer_workers

from lctrain.cli import main
from lctrain.data import shipped_text
from lctrain.errors import UserError
from lctrain.lifetime import SUPERVISOR_ENV, RunLock, StopRequest, Terminated, is_alive, supervisor_token
from lctrain.parallel.launch import LAUNCHER_LOG
from lctrain.rundir import RunDir
from lctrain.train.trainer import SIGTERM_SAID

pytestmark = pytest.mark.usefixtures("one_thread")
LONG = ["train.steps=500", "checkpoint.every_steps=1000", "checkpoint.hf_last=0"]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    from lctrain.config import load_config
    from lctrain.data.prepare import prepare

    out = tmp_path_factory.mktemp("lifetime") / "data"
    prepare(load_config(None, [f"data.output_dir={out}"]))
    return out


def lctrain(*args: str) -> list[str]:
    return [sys.executable, "-m", "lctrain.cli", *args]


def as_from_a_terminal() -> None:
    """Ctrl-C live in the started command, as in a terminal's foreground job: a test run started in the background
    (`make test &`, `nohup ... &`) has SIGINT ignored, which every child inherits, and then the command never sees it
    (a prepare ran to its end with exit code 0)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start(cmd: list[str], **popen) -> subprocess.Popen:
    popen = {"stdout": subprocess.DEVNULL, **popen}
    return subprocess.Popen(
        cmd, env=clean_env(), stderr=subprocess.PIPE, text=True, preexec_fn=as_from_a_terminal, **popen
    )


def wait_for_steps(run_dir: Path, n: int, proc: subprocess.Popen, timeout: float = 180) -> None:
    metrics = RunDir(run_dir).metrics_file
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= n:
            return
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        time.sleep(0.3)
    pytest.fail(f"no {n} steps in {timeout} s")


def survivors(procs: list[psutil.Process], timeout: float = 30) -> list[psutil.Process]:
    """The processes still running (not zombies) after up to `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        alive = []
        for p in procs:
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(p)
            except psutil.NoSuchProcess:
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.3)


def test_run_lock_refuses_a_second_holder_and_names_the_first(tmp_path):
    with RunLock(tmp_path / "run", "lctrain train"):
        with pytest.raises(
            UserError,
            match=rf"is being trained by pid {os.getpid()} on .*'lctrain train'.*kill "
            rf"{os.getpid()}",
        ):
            with RunLock(tmp_path / "run", "lctrain resume"):
                pass
    with RunLock(tmp_path / "run", "lctrain resume"):  # released when its holder is done
        pass
    (tmp_path / "file").write_text("")
    with pytest.raises(UserError, match="cannot create the run directory's lock file"):
        with RunLock(tmp_path / "file" / "run", "lctrain train"):
            pass


@pytest.mark.parametrize("supervised, rank", [(False, None), (True, None), (False, "0"), (False, "1")])
@pytest.mark.parametrize("stop, code", [(KeyboardInterrupt, 130), (Terminated, 143)])
def test_an_interrupted_command_says_so_once_whoever_started_it(monkeypatch, capsys, supervised, rank, stop, code):
    """A command started by another lctrain command (`experiment extend` runs `train`, `eval`, ...) is stopped by it,
    which says "interrupted" itself: the stopped one exits with the same code in silence. Under a launcher the user
    started (torchrun stopped by SLURM), rank 0 says it for all."""

    def interrupted(*args, **kwargs):
        raise stop()

    monkeypatch.setattr(shipped_text, "write_jsonl", interrupted)
    if supervised:
        monkeypatch.setenv(SUPERVISOR_ENV, supervisor_token())
    else:
        monkeypatch.delenv(SUPERVISOR_ENV, raising=False)
    if rank is None:
        monkeypatch.delenv("RANK", raising=False)
    else:
        monkeypatch.setenv("RANK", rank)
    with pytest.raises(SystemExit) as done:
        main(["example-text", "corpus.jsonl"])
    assert done.value.code == code
    assert capsys.readouterr().err == ("" if supervised or rank == "1" else "interrupted\n")


def test_a_stop_request_takes_sigterms_as_one_request_and_gives_the_handler_back():
    def before(signum, frame):
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, before)
    previous_int = signal.signal(signal.SIGINT, signal.default_int_handler)  # ignored in a background test run
    try:
        with StopRequest() as stop:
            assert not stop.requested
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)  # a scheduler's, and the launcher's again: no raise
            assert stop.requested
            with pytest.raises(KeyboardInterrupt):  # Ctrl-C still stops at once
                os.kill(os.getpid(), signal.SIGINT)
        assert signal.getsignal(signal.SIGTERM) is before
        with pytest.raises(Terminated):
            os.kill(os.getpid(), signal.SIGTERM)
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, previous_int)


def test_is_alive_sees_running_zombie_reaped_and_reused_processes():
    assert is_alive(os.getpid()) and is_alive(psutil.Process())
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    handle = psutil.Process(child.pid)
    deadline = time.monotonic() + 30
    while handle.status() != psutil.STATUS_ZOMBIE:  # exited, not yet reaped: a zombie, gone all the same
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert not is_alive(child.pid) and not is_alive(handle)
    child.wait()  # reaped: the pid is free
    assert not is_alive(handle)
    assert not is_alive(2**22 + 1)  # above Linux's largest pid
    assert is_alive(1)  # another user's process (init) exists all the same


def start_sp2_run(data_dir: Path, run_dir: Path, **popen) -> tuple[subprocess.Popen, list[psutil.Process], list[str]]:
    """A 2-process `lctrain train` under torchrun, two steps in: (its process, every process under it, its args)."""
    args = set_args([f"data.output_dir={data_dir}", f"train.run_dir={run_dir}", *LONG])
    proc = start(lctrain("train", "-c", "tiny_anchor_sp2", *args), **popen)
    wait_for_steps(run_dir, 2, proc)
    tree = psutil.Process(proc.pid).children(recursive=True)
    assert len(tree) >= 3  # the launcher and two workers
    return proc, tree, args


@pytest.mark.slow  # over 20 s on 2 cores: make test-slow
def test_multiprocess_run_is_locked_and_ctrl_c_stops_every_process_quietly(data_dir, tmp_path):
    run_dir = tmp_path / "sp2"
    proc, tree, args = start_sp2_run(data_dir, run_dir, stdout=subprocess.PIPE)

    for second in (lctrain("train", "-c", "tiny_anchor_sp2", *args), lctrain("resume", str(run_dir))):
        other = subprocess.run(second, env=clean_env(), capture_output=True, text=True, timeout=120)
        assert other.returncode == 2
        assert other.stderr.strip().splitlines()[-1].startswith(f"error: {run_dir} is being trained by pid {proc.pid}")

    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == 130
    err = proc.stderr.read()
    assert err.count("interrupted") == 1 and "Traceback" not in err, err[-3000:]
    # the ranks stop at once, quietly: passed on as SIGTERM, rank 0 said it would finish its step and checkpoint
    assert "SIGTERM" not in proc.stdout.read()
    assert "Traceback" not in (run_dir / "ranks" / LAUNCHER_LOG).read_text()
    assert not survivors(tree)


@pytest.mark.slow  # over 20 s on 2 cores: make test-slow
@pytest.mark.parametrize("to", ["the command", "every process", "one rank", "rank 0"])
def test_multiprocess_run_stops_on_sigterm_at_a_checkpoint_of_the_last_step(data_dir, tmp_path, to):
    """SIGTERM to `lctrain train` (kill), to every process of the job at once (a SLURM time limit or preemption:
    the launcher too, whose own handling would kill the ranks 30 s later), or to one rank: the ranks agree to stop
    after the same step, write its checkpoint and end; one line says where, and nothing is left running."""
    run_dir = tmp_path / "sp2"
    with open(tmp_path / "stdout", "w") as stdout:
        proc, tree, _ = start_sp2_run(data_dir, run_dir, stdout=stdout)
    targets = {
        "the command": [psutil.Process(proc.pid)],
        "every process": [psutil.Process(proc.pid), *tree],
        "one rank": [p for p in tree if "lctrain.parallel.rank" in p.cmdline() and p.environ().get("RANK") == "1"],
        "rank 0": [p for p in tree if "lctrain.parallel.rank" in p.cmdline() and p.environ().get("RANK") == "0"],
    }[to]
    assert targets
    for p in targets:
        p.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 143
    err = proc.stderr.read()
    assert "Traceback" not in err and "interrupted" not in err, err[-3000:]
    last = err.strip().splitlines()[-1]
    step = len(RunDir(run_dir).read_metrics())
    assert last == (
        f"stopped by SIGTERM after step {step} of 500, checkpoint step_{step} written; 'lctrain resume "
        f"{run_dir}' continues from it"
    ), err[-3000:]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step_{step}"
    assert not survivors(tree)
    # said once, when the signal came, by the command that got it; a SIGTERM to the ranks alone is what the launcher
    # sends when another rank died (no step will be finished then): rank 0 says nothing of it
    said = (tmp_path / "stdout").read_text().count(SIGTERM_SAID)
    assert said == (0 if to in ("one rank", "rank 0") else 1)


@pytest.mark.slow  # over 20 s on 2 cores: make test-slow
def test_kill_9_of_the_launching_command_takes_its_workers_along(data_dir, tmp_path):
    run_dir = tmp_path / "sp2"
    proc, tree, _ = start_sp2_run(data_dir, run_dir)
    proc.kill()
    proc.wait()
    assert not survivors(tree), [p.cmdline() for p in survivors(tree, 0)]
    with RunLock(run_dir, "test"):  # and the run directory is free for a resume
        pass


@two_tokenizer_workers
@pytest.mark.parametrize(
    ("sig", "moment"),
    [
        (signal.SIGKILL, "encoding"),
        # SIGTERM takes the clean-up path of Ctrl-C; both slow-marked to keep the default suite under its budget
        pytest.param(signal.SIGTERM, "encoding", marks=pytest.mark.slow),
        pytest.param(signal.SIGINT, "starting", marks=pytest.mark.slow),
    ],
    ids=["kill-9", "kill", "ctrl-c-while-the-workers-start"],
)
def test_a_killed_prepare_takes_its_tokenizer_workers_along(tmp_path, sig, moment):
    """SIGINT goes to the process group, as a terminal's Ctrl-C does: the workers get it too, while their interpreters
    start."""
    over = [
        f"data.output_dir={tmp_path / 'big'}",
        "data.num_workers=2",
        "data.token_budget=50000000",
        "data.synthetic.num_docs=200000",
    ]
    proc = start(lctrain("prepare", *set_args(over)), start_new_session=True)
    deadline = time.monotonic() + 120
    while len(psutil.Process(proc.pid).children()) < 3:  # the two workers and multiprocessing's resource tracker
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-3000:]
        time.sleep(0.01)
    if moment == "encoding":
        time.sleep(2)
    tree = psutil.Process(proc.pid).children(recursive=True)
    if sig == signal.SIGINT:
        os.killpg(proc.pid, sig)
    else:
        proc.send_signal(sig)
    rc = proc.wait(timeout=60)
    assert not survivors(tree), [p.cmdline() for p in survivors(tree, 0)]
    if sig != signal.SIGKILL:  # cleaned up like Ctrl-C: one line, no partial output
        err = proc.stderr.read()
        assert rc == 128 + sig and err.count("interrupted") == 1 and "Traceback" not in err, err[-3000:]
        assert not list(tmp_path.glob(".big.partial-*")) and not (tmp_path / "big").exists()


@pytest.mark.slow  # over 20 s on 2 cores: make test-slow
def test_retry_after_a_kill_before_the_first_checkpoint_starts_a_clean_run(data_dir, tmp_path):
    run_dir = tmp_path / "one"
    base = [f"data.output_dir={data_dir}", f"train.run_dir={run_dir}"]
    proc = start(lctrain("train", *set_args(base + LONG)))
    wait_for_steps(run_dir, 3, proc)
    proc.kill()
    proc.wait()
    retry = subprocess.run(
        lctrain("train", *set_args(base + ["train.steps=2", "checkpoint.hf_last=0"])),
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert retry.returncode == 0, retry.stderr[-3000:]
    steps = [json.loads(line)["step"] for line in RunDir(run_dir).metrics_file.read_text().splitlines()]
    assert steps == [1, 2]


@pytest.mark.slow  # two Python start-ups and lctrain's imports: ~10-20 s
def test_a_command_another_lctrain_command_started_ends_with_it(tmp_path):
    """`kill -9` of `lctrain experiment` left the `lctrain train` it had started training on, unwatched, in a process
    group of its own (experiment explorer): every command started under an lctrain supervisor now ends with it."""
    supervisor = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    token = f"{supervisor.pid}:{psutil.Process(supervisor.pid).create_time()}"
    command = (
        "import time; from lctrain import cli\ncli.app.command('wait')(lambda: time.sleep(120))\ncli.main(['wait'])\n"
    )
    started = subprocess.Popen([sys.executable, "-c", command], env={**clean_env(), SUPERVISOR_ENV: token})
    try:
        time.sleep(5)  # the command is up, watching its supervisor
        assert started.poll() is None
        supervisor.kill()
        supervisor.wait()
        assert started.wait(timeout=30) == 1
    finally:
        for p in (started, supervisor):
            p.kill()
            p.wait()
