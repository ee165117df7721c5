"""Process topology: start torch.distributed through DeepSpeed and build the sequence-parallel groups.

Ranks are laid out sequence-parallel-major: ranks `g*P .. g*P+P-1` form sequence-parallel group `g`, so the
all-to-alls of one group stay on one node (fast links) and data-parallel replicas span nodes. ZeRO shards over
all ranks (DeepSpeed's "sequence data parallel" group), which is what DeepSpeed's own Ulysses state module builds.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any, Optional

import torch

from lctrain.compat.deepspeed import disable_cpu_shm_comm_op
from lctrain.config import Config
from lctrain.errors import UserError

LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


@dataclass(frozen=True)
class Topology:
    rank: int
    world: int
    local_rank: int
    sp: int
    device: torch.device
    sp_group: Any = None
    mpu: Any = None

    @property
    def dp(self) -> int:
        return self.world // self.sp

    @property
    def sp_rank(self) -> int:
        return self.rank % self.sp

    @property
    def dp_rank(self) -> int:
        return self.rank // self.sp

    @property
    def is_main(self) -> bool:
        return self.rank == 0


# Launcher variables this process set for itself (a single-process run); they do not mean a launcher started us,
# and child processes must not inherit them.
_SELF_SET: set[str] = set()


def under_launcher() -> bool:
    return all(k in os.environ for k in LAUNCHER_ENV) and not _SELF_SET


def launcher_free_env() -> dict:
    """This process's environment without the variables it set for its own single-process run."""
    return {k: v for k, v in os.environ.items() if k not in _SELF_SET}


def requested_world(cfg: Config) -> int:
    return cfg.parallel.nproc_per_node * cfg.parallel.num_nodes


def free_port() -> int:
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
    values = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
              "MASTER_PORT": str(free_port())}
    for key, value in values.items():
        if key not in os.environ:
            os.environ[key] = value
            _SELF_SET.add(key)


def init_topology(cfg: Config) -> Topology:
    """Initialise torch.distributed (gloo on CPU, nccl on GPU) and the sequence-parallel groups of `cfg`."""
    import deepspeed
    import deepspeed.comm as dist

    if not under_launcher():
        _single_process_env()
    world = int(os.environ["WORLD_SIZE"])
    sp = cfg.parallel.sequence_parallel
    check_layout(cfg, world)
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
    sp_group = mpu = None
    if sp > 1:
        import deepspeed.runtime.sequence_parallel.parallel_state_sp as sp_state

        try:
            sp_group = sp_state.get_sequence_parallel_group()
        except AssertionError:
            sp_state.initialize_sequence_parallel(sequence_parallel_size=sp)
            sp_group = sp_state.get_sequence_parallel_group()
        mpu = sp_state
    return Topology(rank=dist.get_rank(), world=world, local_rank=local_rank, sp=sp, device=device,
                    sp_group=sp_group, mpu=mpu)


def release_single_process() -> None:
    """After a single-process run started from Python (not a launcher): tear down the process group and the
    variables we set, so a later run in this process, or a child process, starts clean."""
    if not _SELF_SET:
        return
    import deepspeed.comm as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    for key in _SELF_SET:
        os.environ.pop(key, None)
    _SELF_SET.clear()


def check_layout(cfg: Config, world: Optional[int] = None) -> None:
    """Reject layouts that cannot run, before any process starts: one line naming the keys and a fix."""
    world = world or requested_world(cfg)
    p, t = cfg.parallel, cfg.train
    src = cfg.source_file or "config"
    if world % p.sequence_parallel:
        raise UserError(f"{src}: world size {world} (parallel.nproc_per_node x parallel.num_nodes) is not divisible "
                        f"by parallel.sequence_parallel = {p.sequence_parallel}")
    dp = world // p.sequence_parallel
    if t.global_batch % (t.micro_batch * dp):
        raise UserError(f"{src}: train.global_batch = {t.global_batch} is not divisible by train.micro_batch x "
                        f"data-parallel size = {t.micro_batch} x {dp}; change train.global_batch or train.micro_batch")
    if cfg.data.seq_len % p.sequence_parallel:
        raise UserError(f"{src}: data.seq_len = {cfg.data.seq_len} is not divisible by parallel.sequence_parallel = "
                        f"{p.sequence_parallel}")


def grad_accum_steps(cfg: Config, world: int) -> int:
    return cfg.train.global_batch // (cfg.train.micro_batch * (world // cfg.parallel.sequence_parallel))
