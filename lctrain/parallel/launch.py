"""Multi-process runs: `lctrain train` re-starts itself under DeepSpeed's or torch's launcher.

The parent has already written the resolved `config.yaml` into the run directory; every worker reads it back from
there (`python -m lctrain.parallel.launch RUN_DIR`), so workers on other nodes need nothing but a shared filesystem.
Multi-node: DeepSpeed's launcher reads `parallel.hostfile` and starts the workers on every host over ssh/pdsh;
with torchrun, run the same `lctrain train` on each node under `torchrun --nnodes ... --node_rank ...` yourself
(then `lctrain train` sees the launcher's environment and does not relaunch).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Callable

from lctrain.config import Config, load_config
from lctrain.errors import UserError, environment_error_message
from lctrain.lifetime import exit_with_supervisor, supervise
from lctrain.parallel.groups import free_port, launcher_free_env


def launcher_command(cfg: Config, run_dir: Path, resume: bool) -> list[str]:
    return worker_command(cfg, ["lctrain.parallel.launch", str(run_dir)] + (["--resume"] if resume else []))


def worker_command(cfg: Config, worker: list[str]) -> list[str]:
    """The launcher command that runs `python -m <worker...>` on every process of `cfg`'s layout."""
    p = cfg.parallel
    if p.launcher == "torchrun":
        if p.num_nodes > 1:
            raise UserError(f"{cfg.source_file or 'config'}: parallel.launcher = torchrun cannot start other nodes; "
                            f"run 'torchrun --nnodes {p.num_nodes} ... -m lctrain.cli train' on every node, or set "
                            f"parallel.launcher: deepspeed with parallel.hostfile")
        return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(p.nproc_per_node),
                "--nnodes", "1", "--master_addr", "127.0.0.1", "--master_port", str(free_port()), "-m"] + worker
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--master_port", str(free_port())]
    if p.num_nodes > 1:
        if not p.hostfile or not Path(p.hostfile).is_file():
            raise UserError(f"{cfg.source_file or 'config'}: parallel.num_nodes = {p.num_nodes} needs "
                            f"parallel.hostfile naming the hosts (DeepSpeed hostfile: 'host slots=8' per line)")
        cmd += ["--hostfile", p.hostfile, "--num_nodes", str(p.num_nodes), "--num_gpus", str(p.nproc_per_node)]
    else:
        cmd += ["--num_gpus", str(p.nproc_per_node)]
    return cmd + ["--module"] + worker


def relaunch(cfg: Config, run_dir: Path, resume: bool) -> None:
    run_workers(launcher_command(cfg, run_dir, resume))


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


def main(argv: list[str] | None = None) -> None:
    from lctrain.train.trainer import run

    exit_with_supervisor()
    parser = argparse.ArgumentParser(prog="python -m lctrain.parallel.launch")
    parser.add_argument("run_dir")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--local_rank", type=int, default=None, help="set by DeepSpeed's launcher; unused")
    args = parser.parse_args(argv)
    run_dir = Path(args.run_dir)
    worker_main(lambda: run(load_config(str(run_dir / "config.yaml")), run_dir, resuming=args.resume))


if __name__ == "__main__":
    main()
