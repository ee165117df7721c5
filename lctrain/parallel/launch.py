"""Starting workers under DeepSpeed's or torch's launcher, and a launched worker's one-line errors: shared by
training (`lctrain.train.worker`) and `lctrain check sp`; this module knows neither."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

from lctrain.config import Config
from lctrain.errors import UserError, environment_error_message
from lctrain.lifetime import supervise
from lctrain.parallel.groups import free_port, launcher_free_env


def worker_command(cfg: Config, worker: list[str]) -> list[str]:
    """The launcher command that runs `python -m <worker...>` on every process of `cfg`'s layout."""
    p = cfg.parallel
    if p.launcher == "torchrun":
        if p.num_nodes > 1:
            raise UserError(
                f"{cfg.source_file or 'config'}: parallel.launcher = torchrun cannot start other nodes; "
                f"run 'torchrun --nnodes {p.num_nodes} ... -m lctrain.cli train' on every node, or set "
                f"parallel.launcher: deepspeed with parallel.hostfile"
            )
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            str(p.nproc_per_node),
            "--nnodes",
            "1",
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            str(free_port()),
            "-m",
        ] + worker
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--master_port", str(free_port())]
    if p.num_nodes > 1:
        hostfile = cfg.resolve_path(p.hostfile) if p.hostfile else None
        if hostfile is None or not hostfile.is_file():
            raise UserError(
                f"{cfg.source_file or 'config'}: parallel.num_nodes = {p.num_nodes} needs "
                f"parallel.hostfile naming the hosts (DeepSpeed hostfile: 'host slots=8' per line)"
            )
        cmd += ["--hostfile", str(hostfile), "--num_nodes", str(p.num_nodes), "--num_gpus", str(p.nproc_per_node)]
    else:
        cmd += ["--num_gpus", str(p.nproc_per_node)]
    return cmd + ["--module"] + worker


def run_workers(cmd: list[str]) -> None:
    """Run the workers and wait; their exit status becomes ours (a worker's UserError is already printed). Ctrl-C
    or SIGTERM stops them all (lifetime.supervise); a kill of this process ends them too (exit_with_supervisor)."""
    rc = supervise(cmd, env=launcher_free_env())
    if rc:
        raise SystemExit(rc)


def worker_main(body: Callable[[], object]) -> None:
    """Run a launched worker's body: a UserError or an environment failure (full disk) ends it with one line,
    printed by rank 0 only, and exit code 2."""
    try:
        body()
    except (UserError, OSError, RuntimeError) as e:
        message = str(e) if isinstance(e, UserError) else environment_error_message(e)
        if message is None:
            raise
        if os.environ.get("RANK", "0") == "0":
            print(f"error: {message}", file=sys.stderr, flush=True)
        raise SystemExit(UserError.exit_code) from None
