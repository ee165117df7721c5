"""The parallel layout of a run as a value (torchtitan's `ParallelDims`): the world size, the sequence- and
data-parallel degrees, which rank holds which slice, and the arithmetic of splitting attention heads over the
sequence-parallel ranks. Pure: it imports nothing above the config, builds no process group and reads no device.

Ranks are laid out sequence-parallel-major: ranks `g*P .. g*P+P-1` form sequence-parallel group `g`, so the
all-to-alls of one group stay on one node (fast links) and data-parallel replicas span nodes. ZeRO shards over
all ranks (DeepSpeed's "sequence data parallel" group). Each sequence-parallel rank holds a contiguous `L/P` slice of
every per-token tensor (`lctrain.attention.Batch.shard`); which windows a data-parallel rank reads is the data
order's business (`lctrain.train.data.BatchPlan`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lctrain.errors import UserError

if TYPE_CHECKING:  # config.py asks this module for the data-parallel size
    from lctrain.config import Config

# the keys whose product is the world size, and those a layout is made of: what a message about either names
WORLD_KEYS = ("parallel.nproc_per_node", "parallel.num_nodes")
LAYOUT_KEYS = (*WORLD_KEYS, "parallel.sequence_parallel")


@dataclass(frozen=True)
class ParallelLayout:
    world: int
    sp: int

    def __post_init__(self) -> None:
        if self.world < 1 or self.sp < 1 or self.world % self.sp:
            raise ValueError(f"a layout of {self.world} ranks cannot form sequence-parallel groups of {self.sp}")

    @property
    def dp(self) -> int:
        return self.world // self.sp

    def sp_rank(self, rank: int) -> int:
        return rank % self.sp

    def dp_rank(self, rank: int) -> int:
        return rank // self.sp


def layout_of(cfg: Config, world: int | None = None) -> ParallelLayout:
    """The layout of `cfg` on `world` processes (default: the processes it asks for), refusing one that cannot run
    in one line naming the keys and a fix."""
    p = cfg.parallel
    world = world or p.world
    if world % p.sequence_parallel:
        raise UserError(
            f"{cfg.origin(*LAYOUT_KEYS)}: world size {world} (parallel.nproc_per_node x parallel.num_nodes) is not "
            f"divisible by parallel.sequence_parallel = {p.sequence_parallel}"
        )
    if cfg.data.seq_len % p.sequence_parallel:
        raise UserError(
            f"{cfg.origin('data.seq_len', 'parallel.sequence_parallel')}: data.seq_len = {cfg.data.seq_len} is "
            f"not divisible by parallel.sequence_parallel "
            f"= {p.sequence_parallel}"
        )
    return ParallelLayout(world=world, sp=p.sequence_parallel)


def kv_replication(num_heads: int, num_kv_heads: int, sp: int, source: str = "config") -> int:
    """How many copies of each KV head make the KV heads split evenly over `sp` ranks (grouped-query attention with
    fewer KV heads than ranks); 1 when they already do. Raises UserError when the query heads cannot be split."""
    if num_heads % sp:
        raise UserError(
            f"{source}: the model's {num_heads} attention heads are not divisible by "
            f"parallel.sequence_parallel = {sp}; use a sequence-parallel size that divides {num_heads}"
        )
    if num_heads % num_kv_heads:
        raise UserError(f"{source}: {num_heads} attention heads are not a multiple of {num_kv_heads} KV heads")
    if num_kv_heads % sp == 0:
        return 1
    # Smallest r with (kv*r) % sp == 0; kv*r = lcm(kv, sp) divides the query-head count as kv and sp both do.
    return sp // math.gcd(num_kv_heads, sp)
