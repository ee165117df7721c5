"""torchtitan's internals that scripts/bench_peer.py's torchtitan runner reads (written against torchtitan 0.2.2)."""

from __future__ import annotations

import torch


def op_sac_save_list() -> set[torch._ops.OpOverload]:
    """The ops whose outputs torchtitan's op-level selective activation checkpointing keeps (its Llama-3 recipe's
    list: attention kernels, every other matmul, reductions); private in torchtitan, so read here only."""
    from torchtitan.models.llama3.infra.parallelize import _op_sac_save_list

    return set(_op_sac_save_list)
