"""This process in the run: start torch.distributed through DeepSpeed, build the sequence-parallel groups of the
layout (parallel/layout.py), and tell a launched worker from a process that must launch its workers itself."""

from __future__ import annotations

import os
import random
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lctrain.compat.deepspeed import disable_cpu_shm_comm_op, sequence_parallel_groups
from lctrain.config import Config
from lctrain.errors import UserError
from lctrain.parallel.layout import ParallelLayout, layout_of

LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
RENDEZVOUS_ENV = ("MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class Topology:
    rank: int
    local_rank: int
    device: torch.device
    layout: ParallelLayout
    sp_group: Any = None
    mpu: Any = None

    @property
    def world(self) -> int:
        return self.layout.world

    @property
    def sp(self) -> int:
        return self.layout.sp

    @property
    def sp_rank(self) -> int:
        return self.layout.sp_rank(self.rank)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


# Launcher variables this process set for itself (a single-process run); they do not mean a launcher started us,
# and child processes must not inherit them.
_SELF_SET: set[str] = set()


def under_launcher() -> bool:
    return all(k in os.environ for k in LAUNCHER_ENV) and not _SELF_SET


def check_launcher_env() -> None:
    """Refuse, in one line, a launcher's variables without the rendezvous address (a half-configured scheduler job),
    which torch.distributed would report as a traceback from every rank, and srun's tasks without a launcher (each a
    run of its own)."""
    given = [k for k in LAUNCHER_ENV if k in os.environ and k not in _SELF_SET]
    if given and len(given) < len(LAUNCHER_ENV):  # a leftover of another job: WORLD_SIZE=2 alone would wait forever
        unset = [k for k in LAUNCHER_ENV if k not in given]
        raise UserError(
            f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} set but {', '.join(unset)} not: a launcher sets "
            f"all of {', '.join(LAUNCHER_ENV)}; unset {', '.join(given)} to let lctrain start its own processes, or "
            f"start the job with torchrun or deepspeed"
        )
    numbers = {
        k: os.environ[k]
        for k in (*LAUNCHER_ENV, "LOCAL_WORLD_SIZE", "MASTER_PORT")
        if k in os.environ and k not in _SELF_SET
    }
    bad = [f"{k}={v!r}" for k, v in numbers.items() if not v.strip().isdigit()]
    if not bad and given and int(os.environ["RANK"]) >= int(os.environ["WORLD_SIZE"]):
        bad = [f"RANK={os.environ['RANK']} with WORLD_SIZE={os.environ['WORLD_SIZE']}"]
    if bad:
        raise UserError(
            f"{', '.join(bad)}: launcher variables must be non-negative integers with RANK < WORLD_SIZE; fix or "
            f"unset them"
        )
    tasks = os.environ.get("SLURM_STEP_NUM_TASKS", "1")
    if not given and tasks.isdigit() and int(tasks) > 1:
        # srun's tasks set no RANK or WORLD_SIZE: each would train the whole run alone, into one run directory
        raise UserError(
            f"this is task {os.environ.get('SLURM_PROCID', '?')} of {tasks} that srun started, and each would train "
            f"the whole run on its own: start one task per node running torchrun (its processes are the ranks), or "
            f"lctrain alone in the batch script with parallel.hostfile (docs/cluster.md)"
        )
    missing = [k for k in RENDEZVOUS_ENV if k not in os.environ]
    if under_launcher() and missing:
        raise UserError(
            f"{', '.join(LAUNCHER_ENV)} are set, as a launcher sets them, but {' and '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not: start the job with torchrun or deepspeed, set "
            f"{' and '.join(missing)}, or unset {', '.join(LAUNCHER_ENV)} to let lctrain start its own processes"
        )


def launcher_free_env() -> dict:
    """This process's environment without the variables it set for its own single-process run."""
    return {k: v for k, v in os.environ.items() if k not in _SELF_SET}


# Where Linux says it hands out ephemeral ports (the ports `bind(0)` and outgoing connections get).
_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST_PORT = 10000


def free_port() -> int:
    """A port for a rendezvous, free now and outside the ephemeral range. Between this check and the store's bind,
    a port from `bind(0)` can be handed to any other socket on the machine (another job's gloo mesh, an outgoing
    connection): the store then fails with EADDRINUSE (seen with several `check sp` at once). A port below the
    ephemeral range is only ever taken by someone asking for it by number."""
    try:
        low = int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 0
    rng = random.Random()  # its own generator: the training seed must neither pick the port nor be moved by it
    for _ in range(50) if low > _LOWEST_PORT else ():
        port = rng.randrange(_LOWEST_PORT, low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pick_backend(cfg: Config) -> str:
    if cfg.parallel.backend != "auto":
        return cfg.parallel.backend
    return "nccl" if torch.cuda.is_available() else "gloo"


def _single_process_env() -> None:
    """A bare `lctrain train` with one process still needs the launcher's variables (DeepSpeed reads LOCAL_RANK)
    and a rendezvous address for torch.distributed."""
    values = {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }
    for key, value in values.items():
        if key not in os.environ:
            os.environ[key] = value
            _SELF_SET.add(key)


def init_topology(cfg: Config, layout: ParallelLayout | None = None) -> Topology:
    """Initialise torch.distributed (gloo on CPU, nccl on GPU) and the sequence-parallel groups of `cfg`'s layout
    on the processes the launcher started; `layout`: the one this process already checked on this world."""
    # deepspeed on use: it takes seconds to import (start-up time)
    import deepspeed
    import deepspeed.comm as dist

    if not under_launcher():
        _single_process_env()
    layout = layout or layout_of(cfg, int(os.environ["WORLD_SIZE"]))
    local_rank = int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        if device.type == "cpu":
            disable_cpu_shm_comm_op()  # gloo does the job; no op probe, no C++ build
        deepspeed.init_distributed(dist_backend=pick_backend(cfg), auto_mpi_discovery=False)
    sp_group, mpu = sequence_parallel_groups(layout.sp) if layout.sp > 1 else (None, None)
    return Topology(
        rank=dist.get_rank(), local_rank=local_rank, device=device, layout=layout, sp_group=sp_group, mpu=mpu
    )


def end_process_groups() -> None:
    """When this process's distributed work has succeeded: tear its process groups down now. Left to the interpreter's
    exit, gloo's threads are torn down unjoined ("terminate called without an active exception", SIGABRT) on a rank
    whose work had succeeded: 10 of 24 two-rank launches, four at once on 2 cores; 0 of 24 with this. Not on a
    failure: a rank that leaves a collective early would break its peers' wait into their own errors, where the
    launcher would otherwise stop them."""
    if not torch.distributed.is_initialized():
        return
    # DeepSpeed keeps its own record of the groups it made: through it when it made them, or a later run in this
    # process finds groups torch no longer knows
    ds_comm = sys.modules.get("deepspeed.comm")
    if ds_comm is not None and ds_comm.is_initialized():
        ds_comm.destroy_process_group()
    else:
        torch.distributed.destroy_process_group()


def release_single_process() -> None:
    """After a single-process run started from Python (not a launcher): tear down the process group and the
    variables we set, so a later run in this process, or a child process, starts clean."""
    if not _SELF_SET:
        return
    end_process_groups()
    for key in _SELF_SET:
        os.environ.pop(key, None)
    _SELF_SET.clear()
