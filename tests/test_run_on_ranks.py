"""lctrain.parallel.launch.run_on_ranks: a function on 2 gloo ranks under torchrun, and each typed outcome (the
functions are in rank_functions.py)."""

import os
from pathlib import Path

import pytest

from lctrain.config import load_config
from lctrain.errors import RunFailed, UserError
from lctrain.parallel.launch import LAUNCHER_LOG, Finished, OutOfMemory, ProcessKilled, RanksFailed, run_on_ranks

TESTS = Path(__file__).resolve().parent
CFG = ["parallel.nproc_per_node=2", "parallel.launcher=torchrun"]


@pytest.fixture
def ranks_env(monkeypatch):
    """The ranks import rank_functions from tests/ and run on the CPU, one thread each."""
    path = os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH")) if p)
    monkeypatch.setenv("PYTHONPATH", path)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)


def run(function: str, request: dict, workdir: Path):
    return run_on_ranks(load_config(None, CFG), f"rank_functions:{function}", request, workdir)


@pytest.mark.slow  # the launch itself is in the refusal, crash and out-of-memory tests below, each ~4 s
@pytest.mark.usefixtures("ranks_env")
def test_rank_0s_return_value_comes_back(tmp_path):
    assert run("rank_and_world", {"value": 7}, tmp_path) == Finished({"gathered": [[0, 7], [1, 7]]})
    assert run("returns_nothing", {}, tmp_path) == Finished(None)  # training's kind of function


@pytest.mark.slow  # 2 processes importing torch and lctrain
@pytest.mark.usefixtures("ranks_env")
def test_the_logged_peak_memory_is_the_highest_ranks(tmp_path):
    """metrics.jsonl's peak_mem_gb was rank 0's alone, under ZeRO or uneven slices not the rank nearest its limit."""
    assert run("largest_peak", {"peaks": [3_000, 5_000_000_000]}, tmp_path) == Finished({"largest": 5_000_000_000})


@pytest.mark.usefixtures("ranks_env")
def test_a_user_error_in_a_rank_is_one_user_error_here(tmp_path, capfd):
    with pytest.raises(UserError) as raised:
        run("refuse", {"what": "this window"}, tmp_path)
    assert str(raised.value) == "rank 0 refuses this window"  # the lowest rank's line, once
    assert type(raised.value) is UserError and raised.value.exit_code == 2  # a refusal: fix the command
    assert "refuses" not in capfd.readouterr().err  # the ranks print nothing of it themselves


@pytest.mark.slow  # 2 launched ranks
@pytest.mark.usefixtures("ranks_env")
def test_a_run_failed_in_a_rank_is_one_run_failed_here(tmp_path):
    """A rank's RunFailed (a NaN loss) comes back as a RunFailed, so `lctrain train` exits 1 for it, not 2."""
    with pytest.raises(RunFailed) as raised:
        run("fail_the_run", {}, tmp_path)
    assert str(raised.value) == "rank 0: the loss is nan" and raised.value.exit_code == 1


@pytest.mark.usefixtures("ranks_env")
def test_out_of_memory_on_any_rank_is_the_typed_outcome(tmp_path):
    # rank 0 sleeps as if in a collective: the launcher ends it once rank 1 has exited
    outcome = run("out_of_memory_on_rank_1", {}, tmp_path)
    assert isinstance(outcome, OutOfMemory) and outcome.rank == 1
    assert "CUDA out of memory. Tried to allocate 2.00 GiB (simulated)" in outcome.message


@pytest.mark.usefixtures("ranks_env")
def test_a_crash_is_ranks_failed_with_the_launchers_exit_code(tmp_path, capfd):
    with pytest.raises(RanksFailed) as raised:
        run("crash", {}, tmp_path)
    assert raised.value.exit_code == raised.value.code != 0
    assert "ValueError: a bug, not a user's mistake" in capfd.readouterr().err  # the rank's traceback, above


@pytest.mark.usefixtures("ranks_env")
def test_a_native_crash_is_named_with_the_python_stack_in_the_log(tmp_path):
    with pytest.raises(ProcessKilled) as raised:
        run("native_abort_on_rank_1", {}, tmp_path)
    line = str(raised.value)
    assert line.startswith("rank 1 (pid ") and "crashed with SIGABRT in native code" in line, line
    assert "killed" not in line and "out-of-memory" not in line
    log = (tmp_path / LAUNCHER_LOG).read_text()
    assert "Fatal Python error: Aborted" in log and "in native_abort_on_rank_1" in log, log[-3000:]


@pytest.mark.usefixtures("ranks_env")
def test_every_rank_tears_down_its_process_group_before_it_exits(tmp_path):
    """Not left to the exit, where gloo's threads end unjoined and abort a rank whose work had succeeded."""
    assert run("leaves_its_group_to_the_exit", {"workdir": str(tmp_path)}, tmp_path) == Finished(None)
    assert [(tmp_path / f"group_at_exit.{r}").read_text() for r in (0, 1)] == ["False", "False"]
