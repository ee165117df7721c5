"""Functions tests/test_run_on_ranks.py runs on launched ranks (importable by them: the test puts tests/ on their
PYTHONPATH)."""

import os
from pathlib import Path

import torch

from lctrain.errors import RunFailed, UserError


def rank_and_world(request: dict) -> dict:
    """Every rank's (rank, request value) gathered over gloo, returned by rank 0 only."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:
        mine = torch.tensor([int(os.environ["RANK"]), request["value"]])
        parts = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, mine)
    finally:
        dist.destroy_process_group()
    return {"gathered": [p.tolist() for p in parts]} if dist_rank() == 0 else None


def dist_rank() -> int:
    return int(os.environ["RANK"])


def refuse(request: dict) -> None:
    raise UserError(f"rank {dist_rank()} refuses {request['what']}")


def fail_the_run(request: dict) -> None:
    """As a NaN loss stops every rank: work that ran and failed, not a refusal (exit code 1)."""
    raise RunFailed(f"rank {dist_rank()}: the loss is nan")


def out_of_memory_on_rank_1(request: dict) -> None:
    if dist_rank() == 1:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")
    import time

    time.sleep(60)  # rank 0 waits as in a collective: the launcher must end it


def crash(request: dict) -> None:
    if dist_rank() == 1:
        raise ValueError("a bug, not a user's mistake")
    return {"never": "read"}


def native_abort_on_rank_1(request: dict) -> None:
    """As a C++ library's abort() (gloo's terminate): no Python exception, the process ends by SIGABRT."""
    if dist_rank() == 1:
        os.abort()
    import time

    time.sleep(60)


def leaves_its_group_to_the_exit(request: dict) -> None:
    """Joins a gloo group and returns without tearing it down; when the rank exits (`os._exit`, past the
    interpreter's teardown), records whether the group was still there (`WORKDIR/group_at_exit.RANK`)."""
    import os

    import torch.distributed as dist

    dist.init_process_group("gloo")
    dist.barrier()
    record = Path(request["workdir"]) / f"group_at_exit.{dist_rank()}"
    real_exit = os._exit

    def exit_and_record(code: int) -> None:
        record.write_text(str(dist.is_initialized()))
        real_exit(code)

    os._exit = exit_and_record


def returns_nothing(request: dict) -> None:
    return None


def largest_peak(request: dict) -> dict | None:
    """`measure.largest_peak_bytes` over gloo with each rank's peak set to `request["peaks"][rank]`."""
    import torch.distributed as dist

    from lctrain import measure

    dist.init_process_group("gloo")
    try:
        measure.peak_bytes = lambda device: request["peaks"][dist_rank()]
        largest = measure.largest_peak_bytes(torch.device("cpu"))
    finally:
        dist.destroy_process_group()
    return {"largest": largest} if dist_rank() == 0 else None
