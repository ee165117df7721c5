"""DeepSpeed internals lctrain relies on, each naming the release it was written against (0.19.8)."""

from __future__ import annotations


def disable_cpu_shm_comm_op() -> None:
    """CPU runs communicate over gloo. DeepSpeed's CPU backend would otherwise JIT-build its shared-memory all-reduce
    op, and deciding whether it can runs `deepspeed.ops`' probe of every op builder: compiler subprocesses, a
    `cannot find -laio` error on machines without libaio, seconds per process. 0.19.8 computes the module attribute
    `__compatible_ops__` lazily and reads it only to decide on that op (`deepspeed.comm.torch.build_shm_op`), so
    placing the answer there first skips both the probe and the build."""
    import deepspeed.ops

    vars(deepspeed.ops).setdefault("__compatible_ops__", {})["deepspeed_shm_comm"] = False
