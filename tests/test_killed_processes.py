"""A process killed by the OS, as the out-of-memory killer does (SIGKILL): a training rank, the launcher itself, a
tokenizer worker of `prepare`. Each is one line naming the process, the signal, the likely cause and what to run next,
never the launcher's multi-line report; the launcher's output is in RUN/ranks/launcher.log. After a rank's kill,
`lctrain resume` ends with the losses of an uninterrupted run."""

import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from train_helpers import clean_env, losses, prepared_workdir, set_args, two_tokenizer_workers

from lctrain.rundir import RunDir


def two_ranks(data_dir: Path, run_dir: Path) -> list[str]:
    """The tiny default at 256 tokens on 2 data-parallel CPU processes, a checkpoint every 2 steps."""
    return [
        "data.seq_len=256",
        "data.token_budget=40000",
        f"data.output_dir={data_dir}",
        f"train.run_dir={run_dir}",
        "train.steps=12",
        "train.global_batch=2",
        "train.micro_batch=1",
        "parallel.nproc_per_node=2",
        "checkpoint.every_steps=2",
        "checkpoint.hf_last=0",
    ]


def lctrain(*args: str) -> list[str]:
    return [sys.executable, "-m", "lctrain.cli", *args]


def start(cmd: list[str], stdout=subprocess.DEVNULL) -> subprocess.Popen:
    env = clean_env(CUDA_VISIBLE_DEVICES="", PYTHONFAULTHANDLER="1")
    return subprocess.Popen(cmd, env=env, stdout=stdout, stderr=subprocess.PIPE, text=True)


def wait_for_steps(run_dir: Path, n: int, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while len(RunDir(run_dir).read_metrics()) < n:
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-3000:]
        time.sleep(0.2)


def find(proc: subprocess.Popen, wanted) -> psutil.Process:
    for p in psutil.Process(proc.pid).children(recursive=True):
        try:
            if wanted(p):
                return p
        except psutil.Error:
            continue
    raise AssertionError("process not found")


def is_rank(rank: int):
    return lambda p: "lctrain.parallel.rank" in p.cmdline() and p.environ().get("RANK") == str(rank)


def is_launcher(p: psutil.Process) -> bool:
    return any(m in p.cmdline() for m in ("torch.distributed.run", "deepspeed.launcher.runner"))


def the_one_line(proc: subprocess.Popen, timeout: float = 120, code: int = 1) -> str:
    """The one `error:` line of `proc`, which must exit with `code`: 1, a run that failed (lctrain/errors.py)."""
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:  # a hang: SIGABRT makes faulthandler write every thread's stack
        proc.send_signal(signal.SIGABRT)
        pytest.fail(f"still running after {timeout} s; its threads at SIGABRT:\n{proc.communicate()[1][-6000:]}")
    err = proc.stderr.read()
    assert rc == code, err[-3000:]
    assert "Traceback" not in err and "ChildFailedError" not in err and "exitcode" not in err, err[-3000:]
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, err[-3000:]
    return errors[0]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return prepared_workdir(tmp_path_factory, "killed", two_ranks)


def run_to_end(cmd: list[str]) -> None:
    done = subprocess.run(cmd, env=clean_env(CUDA_VISIBLE_DEVICES=""), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.fixture(scope="module")
def reference(workdir):
    run_dir = workdir / "ref"
    run_to_end(lctrain("train", *set_args(two_ranks(workdir / "data", run_dir) + ["parallel.launcher=torchrun"])))
    return losses(run_dir)


@pytest.mark.slow  # two 2-process runs and a resume on 2 cores, per launcher
@pytest.mark.parametrize("launcher", ["torchrun", "deepspeed"])
def test_a_rank_killed_by_the_os_is_one_line_then_resume_ends_as_the_uninterrupted_run(
    workdir, reference, tmp_path, launcher
):
    run_dir = tmp_path / "run"
    with open(tmp_path / "stdout", "w") as stdout:
        args = set_args(two_ranks(workdir / "data", run_dir) + [f"parallel.launcher={launcher}"])
        proc = start(lctrain("train", *args), stdout)
    wait_for_steps(run_dir, 3, proc)
    victim = find(proc, is_rank(1))
    victim.send_signal(signal.SIGKILL)
    line = the_one_line(proc)
    # the launcher's SIGTERM to the ranks left is no request to finish a step, and no line says it is
    assert "SIGTERM" not in (tmp_path / "stdout").read_text()
    assert line.startswith(f"error: rank 1 (pid {victim.pid}) was killed by SIGKILL (most likely the kernel's out")
    assert f"'lctrain resume {run_dir}' continues from step_" in line
    assert (run_dir / "ranks" / "launcher.log").is_file() and str(run_dir / "ranks" / "launcher.log") in line
    # the session's record names the cause, not what rank 0 met in the collective the dead rank left
    assert RunDir(run_dir).read_sessions()[-1]["error"].startswith(f"RunFailed: rank 1 (pid {victim.pid}) was killed")
    run_to_end(lctrain("resume", str(run_dir)))
    assert losses(run_dir) == reference


@pytest.mark.slow  # a 2-process run on 2 cores
def test_a_rank_killed_under_the_users_own_torchrun_leaves_rank_0s_error_line(workdir, tmp_path):
    """Under a torchrun the user started, lctrain's launcher is not there to name a dead rank: torchrun's summary
    does, and rank 0, whose collective failed, ends with one `error:` line saying so and what continues the run."""
    from lctrain.parallel.groups import free_port

    run_dir = tmp_path / "run"
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(free_port()),
    ]
    cmd = [*torchrun, "-m", "lctrain.cli", "train", *set_args(two_ranks(workdir / "data", run_dir))]
    proc = start(cmd)
    wait_for_steps(run_dir, 3, proc)
    find(proc, lambda p: "lctrain.cli" in p.cmdline() and p.environ().get("RANK") == "1").send_signal(signal.SIGKILL)
    assert proc.wait(timeout=120) == 1
    errors = [line for line in proc.stderr.read().splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith("error: rank 0 failed in step "), errors
    assert "another rank stopped first: the launcher's summary names it" in errors[0]
    assert f"'... -m lctrain.cli resume {run_dir}' continues from step_" in errors[0]
    assert RunDir(run_dir).read_sessions()[-1]["outcome"] == "failed"


@pytest.mark.slow  # a 2-process run and its resume on 2 cores
def test_a_rank_that_hangs_is_named_within_the_step_timeout_then_resume_ends_as_the_uninterrupted_run(
    workdir, reference, tmp_path
):
    """SIGSTOP, as a rank stuck where it cannot even show its stack: without the watchdog, rank 0 waited 30 minutes
    in the gradient all-reduce, and gloo's error then named rank 0."""
    run_dir = tmp_path / "run"
    proc = start(
        lctrain("train", *set_args(two_ranks(workdir / "data", run_dir) + ["train.step_timeout_minutes=0.25"]))
    )
    wait_for_steps(run_dir, 3, proc)
    tree = psutil.Process(proc.pid).children(recursive=True)
    victim = find(proc, is_rank(1))
    stopped = time.monotonic()
    victim.send_signal(signal.SIGSTOP)
    line = the_one_line(proc, timeout=180)
    assert time.monotonic() - stopped < 120
    assert line.startswith("error: rank 1 hung in step "), line
    assert "rank 1 wrote no stack (a stopped process" in line and "rank 0 waited for it in a collective for" in line
    assert f"every rank's stack is in {run_dir / 'ranks' / 'launcher.log'}" in line
    assert f"'lctrain resume {run_dir}' continues from step_" in line
    assert "distributed_c10d.py" in (run_dir / "ranks" / "launcher.log").read_text()  # rank 0's stack
    assert RunDir(run_dir).read_sessions()[-1]["outcome"] == "failed"
    gone, alive = psutil.wait_procs(tree, timeout=30)
    assert not alive, [p.cmdline() for p in alive]
    run_to_end(lctrain("resume", str(run_dir)))
    assert losses(run_dir) == reference


@pytest.mark.slow  # a 2-process run on 2 cores
def test_the_launcher_killed_is_one_line_and_takes_its_ranks_along(workdir, tmp_path):
    run_dir = tmp_path / "run"
    cmd = lctrain("train", *set_args(two_ranks(workdir / "data", run_dir) + ["parallel.launcher=torchrun"]))
    proc = start(cmd)
    wait_for_steps(run_dir, 3, proc)  # step 3 runs after step 2's checkpoint is complete: the advice resumes it
    tree = psutil.Process(proc.pid).children(recursive=True)
    find(proc, is_launcher).send_signal(signal.SIGKILL)
    line = the_one_line(proc)
    assert line.startswith("error: the launcher (torchrun) was killed by SIGKILL (most likely the kernel's out")
    assert f"'lctrain resume {run_dir}'" in line
    gone, alive = psutil.wait_procs(tree, timeout=30)
    assert not alive, [p.cmdline() for p in alive]


@two_tokenizer_workers
@pytest.mark.slow  # a prepare with two tokenizer processes and a kill: ~6 s each, over the default suite's budget
@pytest.mark.parametrize("moment", ["starting", "encoding"], ids=["while-starting", "while-encoding"])
def test_a_tokenizer_worker_killed_by_the_os_is_one_line(tmp_path, moment):
    over = [
        f"data.output_dir={tmp_path / 'big'}",
        "data.num_workers=2",
        "data.token_budget=50000000",
        "data.synthetic.num_docs=200000",
    ]
    proc = start(lctrain("prepare", *set_args(over)))
    deadline = time.monotonic() + 120
    while True:
        workers = [p for p in psutil.Process(proc.pid).children() if "resource_tracker" not in " ".join(p.cmdline())]
        if len(workers) == 2:
            break
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-3000:]
        time.sleep(0.05)
    while moment == "encoding" and workers[0].cpu_times().user < 3:  # past its imports, tokenizing
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-3000:]
        time.sleep(0.1)
    tree = psutil.Process(proc.pid).children(recursive=True)
    workers[0].send_signal(signal.SIGKILL)
    line = the_one_line(proc, code=2)  # prepare's: not one of the run failures lctrain/errors.py gives exit code 1
    assert "a tokenizer worker process (of 2, data.num_workers) was killed by SIGKILL" in line
    assert "most likely the kernel's out-of-memory killer" in line and "run 'lctrain prepare' again" in line
    assert not (tmp_path / "big").exists()
    gone, alive = psutil.wait_procs(tree, timeout=30)
    assert not alive, [p.cmdline() for p in alive]
