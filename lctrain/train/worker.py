"""The worker entry point launchers start on every process: `python -m lctrain.train.worker RUN_DIR [--resume]`.

The process that launched it has already written the resolved `config.yaml` into the run directory and holds its
lock; every worker reads the config back from there, so workers on other nodes need nothing but a shared filesystem.
Multi-node: DeepSpeed's launcher reads `parallel.hostfile` and starts the workers on every host over ssh/pdsh; with
torchrun, run the same `lctrain train` on each node under `torchrun --nnodes ... --node_rank ...` yourself (then
`lctrain train` sees the launcher's environment and trains in that process).
"""

from __future__ import annotations

import argparse

from lctrain.lifetime import exit_with_supervisor
from lctrain.parallel.launch import worker_main
from lctrain.rundir import RunDir
from lctrain.train.command import run_worker


def main(argv: list[str] | None = None) -> None:
    exit_with_supervisor()
    parser = argparse.ArgumentParser(prog="python -m lctrain.train.worker")
    parser.add_argument("run_dir")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--local_rank", type=int, default=None, help="set by DeepSpeed's launcher; unused")
    args = parser.parse_args(argv)
    worker_main(lambda: run_worker(RunDir(args.run_dir), resuming=args.resume))


if __name__ == "__main__":
    main()
