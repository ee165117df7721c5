"""Resuming on another parallel layout: a resume checkpoint written by N ranks, continued on M.

A cluster job is often requeued on a different allocation (two nodes instead of four, after a preemption), and a run
that outgrew its memory plan may need a higher ZeRO stage or more sequence parallelism. DeepSpeed's ZeRO checkpoint
holds each rank's partition of the fp32 master weights and Adam moments, so it loads only into the world size and
ZeRO stage it was written with. lctrain converts it once to DeepSpeed's *universal* checkpoint (every parameter's
state unpartitioned, `step_N/universal/`) and loads that into the new layout; nothing else of the run changes: the
windows of each step are the same (`train.global_batch` is fixed, only their split over ranks moves), the learning
rate schedule is lctrain's own function of the step, and each rank's RNG state is that of the rank it replaces
(`rank % old world size`).

What converts: a change of `parallel.nproc_per_node`, `num_nodes`, `sequence_parallel`, `offload_optimizer`,
`offload_params` and `zero_stage` among 1-3. DeepSpeed 0.19.8's ZeRO-1/2 and ZeRO-3 loaders read different forms of
the universal checkpoint, and its conversion writes the form of the family it read: a move between the families
completes the other form first (`lctrain.compat.deepspeed.universal_for_stage`; ZeRO-3 -> 1/2 rewrites every
parameter's state, as long as the conversion). A ZeRO-0 run (fp32 only) may change its world size and
sequence-parallel degree without a conversion (`needs_universal`); a move to or from ZeRO-0 is refused in one line
(its optimizer is torch's, not ZeRO's, whose partitions the conversion reads).

Two faults of DeepSpeed 0.19.8's ZeRO-3 universal load are mended where it is called
(`lctrain.compat.deepspeed.loading_universal`): every parameter group got the first group's weight decay, and all
groups one shared Adam step counter. Tested against the ordinary load of the same checkpoint, to the bit
(tests/test_resume_reshard.py).
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from lctrain.compat.deepspeed import to_universal_checkpoint, universal_for_stage, universal_loads_in
from lctrain.errors import UserError, writing
from lctrain.files import TEMPORARY_PREFIX, fsync_path
from lctrain.hardware import usable_cpus

LAYOUT_KEYS = (
    "parallel.zero_stage",
    "parallel.sequence_parallel",
    "parallel.nproc_per_node",
    "parallel.num_nodes",
    "parallel.offload_optimizer",
    "parallel.offload_params",
)
UNIVERSAL = "universal"
_PARTIAL = TEMPORARY_PREFIX + UNIVERSAL


def layout_changes(saved: dict | None, now: dict) -> list[str]:
    """The parallel-layout keys (flattened, `parallel.x`) whose values differ between a checkpoint's saved settings
    and the run's; none for a checkpoint written before checkpoints stored their settings."""
    if saved is None:
        return []
    before, after = saved.get("parallel", {}), now.get("parallel", {})
    return [k for k in LAYOUT_KEYS if before.get(k.split(".")[1]) != after.get(k.split(".")[1])]


def check_reshardable(saved: dict, now: dict, source: str, checkpoint: str) -> None:
    """Refuse, in one line, a layout change the universal checkpoint cannot carry (module docstring)."""
    changed = layout_changes(saved, now)
    if not changed:
        return
    stage_before, stage_now = saved["parallel"]["zero_stage"], now["parallel"]["zero_stage"]
    if stage_before != stage_now and 0 in (stage_before, stage_now):
        raise UserError(
            f"{source}: checkpoint {checkpoint} was written with parallel.zero_stage={stage_before} and the run now "
            f"asks for zero_stage={stage_now}; a checkpoint moves between ZeRO stages 1-3 only (ZeRO-0's optimizer "
            f"is torch's, not ZeRO's): keep zero_stage={stage_before} (the world size and sequence_parallel may change)"
        )


def needs_universal(saved: dict, now: dict) -> bool:
    """Whether a layout change loads through the universal checkpoint: every change but one between ZeRO-0 layouts,
    whose checkpoint holds the whole model and torch's optimizer state in one file (the same on every rank), which any
    world size and sequence-parallel degree load as it is."""
    return not saved["parallel"]["zero_stage"] == now["parallel"]["zero_stage"] == 0


def universal_dir(checkpoint: Path) -> Path:
    return checkpoint / UNIVERSAL


def converted_for(checkpoint: Path, zero_stage: int) -> bool:
    """Whether `checkpoint`'s universal form is complete and loads at ZeRO stage `zero_stage`."""
    return universal_dir(checkpoint).is_dir() and universal_loads_in(universal_dir(checkpoint), zero_stage)


def discard_conversion(checkpoint: Path) -> None:
    """Remove `checkpoint`'s universal form (one that could not be loaded), so that the next resume converts it anew;
    the checkpoint itself is left as it is."""
    shutil.rmtree(universal_dir(checkpoint), ignore_errors=True)


def convert(checkpoint: Path, changed: list[str], zero_stage: int, sync: bool = True) -> float:
    """Write `checkpoint`'s universal form, loadable at ZeRO stage `zero_stage`, unless a complete one is there; the
    seconds it took (0 if it was). Written under a temporary name and renamed when complete, so a kill mid-way leaves
    no half-converted state that a later resume would load; one converted for the other ZeRO family is completed in
    place (`universal_for_stage`, whose last file marks it complete). `sync` (`checkpoint.sync_files`): the files are
    on the disk before the rename or the last file, as a resume checkpoint's are before it is complete."""
    final, partial = universal_dir(checkpoint), checkpoint / _PARTIAL
    t0 = time.monotonic()
    if converted_for(checkpoint, zero_stage):
        return 0.0
    if final.is_dir():
        print(
            f"resuming at ZeRO stage {zero_stage}: completing {checkpoint.name}'s universal checkpoint, converted "
            f"for the other ZeRO family, in {final}",
            flush=True,
        )
        universal_for_stage(final, zero_stage, sync)
        return time.monotonic() - t0
    print(
        f"resuming on another parallel layout ({', '.join(changed)} changed): converting {checkpoint.name} to "
        f"DeepSpeed's universal checkpoint in {final}",
        flush=True,
    )
    shutil.rmtree(partial, ignore_errors=True)
    with writing(partial, "the universal checkpoint"):
        to_universal_checkpoint(checkpoint, partial, workers=min(8, usable_cpus()))
        universal_for_stage(partial, zero_stage)
        if sync:
            for file in partial.rglob("*"):
                fsync_path(file)
        partial.rename(final)
        fsync_path(checkpoint)
    return time.monotonic() - t0


def rng_rank(rank: int, saved: dict) -> int:
    """The rank whose saved RNG state rank `rank` continues with (`saved`: the checkpoint's settings): its own where
    the old layout had it."""
    return rank % _world(saved)


def _world(settings: dict) -> int:
    return settings["parallel"]["nproc_per_node"] * settings["parallel"]["num_nodes"]


def rng_ranks(saved: dict, now: dict) -> list[int]:
    """The saved ranks whose RNG states the new layout's ranks continue with (`rng_rank` of each)."""
    return sorted({rng_rank(rank, saved) for rank in range(_world(now))})
