"""The launcher command lines of a multi-process run (the 2-process runs in test_parallel_equivalence.py execute
them)."""

import os
import sys

import pytest

from lctrain.config import load_config
from lctrain.errors import UserError
from lctrain.parallel import groups
from lctrain.parallel.launch import RANK_MODULE, launcher_env, worker_command


def test_torchrun_command_runs_the_rank_module_on_every_process():
    cfg = load_config("tiny_anchor_sp2")
    cmd = worker_command(cfg, [RANK_MODULE, "runs/x/ranks"])
    assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert cmd[cmd.index("--nproc_per_node") + 1] == "2"
    assert cmd[-3:] == ["-m", "lctrain.parallel.rank", "runs/x/ranks"]


def test_deepspeed_command_uses_the_hostfile_for_several_nodes(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node1 slots=8\nnode2 slots=8\n")
    cfg = load_config("llama2_128k_anchor", ["parallel.num_nodes=2", f"parallel.hostfile={hostfile}"])
    cmd = worker_command(cfg, [RANK_MODULE, "runs/y/ranks"])
    assert cmd[:3] == [sys.executable, "-m", "deepspeed.launcher.runner"]
    assert cmd[cmd.index("--hostfile") + 1] == str(hostfile)
    assert cmd[cmd.index("--num_nodes") + 1] == "2" and cmd[cmd.index("--num_gpus") + 1] == "8"
    assert cmd[-3:] == ["--module", "lctrain.parallel.rank", "runs/y/ranks"]
    assert cmd[cmd.index("--log_level") + 1] == "warning"


def test_launchers_keep_their_info_and_warnings_out_of_the_training_log(monkeypatch):
    single = worker_command(load_config("tiny_anchor_sp2", ["parallel.launcher=deepspeed"]), [RANK_MODULE, "r"])
    # on one node: only "no hostfile", cmd = ... at info, and a failed rank's exit code, which lctrain names
    assert single[single.index("--log_level") + 1] == "critical"
    monkeypatch.delenv("LOGLEVEL", raising=False)
    assert launcher_env()["LOGLEVEL"] == "ERROR"  # torchrun's logging
    monkeypatch.setenv("LOGLEVEL", "INFO")
    assert launcher_env()["LOGLEVEL"] == "INFO"  # the user's choice stays


def test_several_nodes_without_a_hostfile_is_a_user_error():
    cfg = load_config("llama2_128k_anchor", ["parallel.num_nodes=2"])
    with pytest.raises(UserError, match="parallel.hostfile"):
        worker_command(cfg, [RANK_MODULE, "runs/z/ranks"])
    with pytest.raises(UserError, match="torchrun cannot start other nodes"):
        worker_command(
            load_config("llama2_128k_anchor", ["parallel.num_nodes=2", "parallel.launcher=torchrun"]),
            [RANK_MODULE, "runs/z/ranks"],
        )


def test_variables_set_for_a_single_process_run_are_not_a_launcher():
    keys = groups.LAUNCHER_ENV + ("LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    saved = {k: os.environ.pop(k) for k in keys if k in os.environ}
    saved_self_set = set(groups._SELF_SET)
    try:
        groups._SELF_SET.clear()
        assert not groups.under_launcher()
        groups._single_process_env()
        assert os.environ["WORLD_SIZE"] == "1" and not groups.under_launcher()
        assert not set(keys) & set(groups.launcher_free_env())
        for key in keys:
            os.environ.pop(key, None)
        groups._SELF_SET.clear()
        os.environ.update(RANK="1", WORLD_SIZE="2", LOCAL_RANK="1")
        assert groups.under_launcher()
    finally:
        for key in keys:
            os.environ.pop(key, None)
        os.environ.update(saved)
        groups._SELF_SET.clear()
        groups._SELF_SET.update(saved_self_set)


def test_a_launcher_that_starts_no_rank_is_named_with_its_last_error(tmp_path, monkeypatch, capsys):
    """DeepSpeed's multi-node launcher without pdsh (or ssh to a node) exits before any rank starts: the line names
    the launcher and its error, not "the ranks"."""
    from lctrain.parallel import launch

    failing = "import sys; print(\"RuntimeError: launcher 'pdsh' not installed.\", file=sys.stderr); sys.exit(1)"
    monkeypatch.setattr(launch, "worker_command", lambda cfg, worker, *stop: [sys.executable, "-c", failing])
    with pytest.raises(launch.RanksFailed):
        launch.run_on_ranks(load_config(None, ["parallel.nproc_per_node=2"]), "x:y", {}, tmp_path)
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line == (
        "error: the launcher (deepspeed), before any rank started, failed (exit code 1): RuntimeError: launcher "
        f"'pdsh' not installed.; the launcher's report is in {tmp_path / launch.LAUNCHER_LOG}"
    )
