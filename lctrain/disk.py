"""The disk a run's outputs take at their peak, known before it starts, against the free space where they go.

A run writes resume checkpoints (`checkpoint.every_steps`; the `checkpoint.keep` newest stay, and a new one is
written whole before the oldest is removed) and evaluation exports (`checkpoint.hf_every` within `hf_last`, every
one kept). With the paper's schedule the exports all come in the last 50 steps, so a filesystem that holds the first
checkpoints but not the exports fails a run at 96% of its steps. For Llama-2-7B in bf16 at ZeRO-1 or 2 a resume
checkpoint is 94.3 GB (the weights 2 bytes per parameter, fp32 master weights and Adam moments 12) and an export
13.5 GB: with keep 2, three checkpoints while the last is written and the four exports before it, 337 GB.

The bytes are the tensors' (what DeepSpeed's checkpoint files and `save_pretrained`'s safetensors hold); the small
files beside them (RNG states, trainer state, config, tokenizer) are left out, as is the copy a resume's universal
conversion writes once for another parallel layout.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from lctrain.config import CheckpointConfig, Config
from lctrain.memory import FP32, dtype_bytes
from lctrain.rundir import RunDir
from lctrain.train.schedule import hf_checkpoint_steps
from lctrain.units import to_gb

ADAM_MOMENTS = 2


def checkpoint_bytes(n: int, dtype: str, zero_stage: int) -> int:
    """A resume checkpoint of `n` parameters, all ranks' files together: the module's weights in the model's dtype
    (mp_rank_00_model_states.pt; ZeRO-3 keeps none there), the fp32 master weights (ZeRO's optimizers keep them even
    for fp32 weights; without ZeRO only mixed precision has them) and the two fp32 Adam moments."""
    b = dtype_bytes(dtype)
    weights = 0 if zero_stage == 3 else n * b
    master = n * FP32 if zero_stage >= 1 or b != FP32 else 0
    return weights + master + ADAM_MOMENTS * n * FP32


def export_bytes(n: int, dtype: str) -> int:
    """An evaluation export's weights (`hf/step_N/`): the model's, in its dtype."""
    return n * dtype_bytes(dtype)


def checkpoint_steps(total_steps: int, ckpt: CheckpointConfig) -> tuple[int, int]:
    """(how many resume checkpoints a run of `total_steps` writes, the step of the last): the steps of
    `schedule.resume_checkpoint_due`, by arithmetic."""
    multiples = total_steps // ckpt.every_steps
    if ckpt.save_final and total_steps % ckpt.every_steps:
        return multiples + 1, total_steps
    return multiples, multiples * ckpt.every_steps


@dataclass(frozen=True)
class DiskPlan:
    """A run's outputs on the disk at their peak: `checkpoints` resume checkpoints and `exports` evaluation exports."""

    checkpoint_bytes: int
    checkpoints: int
    keep: int
    export_bytes: int
    exports: int

    @property
    def total(self) -> int:
        return self.checkpoint_bytes * self.checkpoints + self.export_bytes * self.exports

    def words(self) -> str:
        """What the peak is made of, e.g. '3 resume checkpoints of 94.34 GB (checkpoint.keep 2, and the last while
        it is written), 4 evaluation exports of 13.48 GB'."""
        parts = []
        if self.checkpoints:
            plural = "s" if self.checkpoints > 1 else ""
            held = (
                f" (checkpoint.keep {self.keep}, and the last while it is written)"
                if self.checkpoints > self.keep
                else ""
            )
            parts.append(f"{self.checkpoints} resume checkpoint{plural} of {to_gb(self.checkpoint_bytes):.2f} GB{held}")
        if self.exports:
            plural = "s" if self.exports > 1 else ""
            parts.append(f"{self.exports} evaluation export{plural} of {to_gb(self.export_bytes):.2f} GB")
        return ", ".join(parts) or "no checkpoint and no export"


def plan_disk(cfg: Config, n: int) -> DiskPlan:
    """The peak of a run of `cfg` training `n` parameters. Checkpoints only accumulate up to `keep` + 1 (the newest
    is written whole before the oldest goes) and exports only accumulate, each written after its step's
    checkpoint: the peak is while the last checkpoint is written (with the exports of the steps before it) or at
    the end (`keep` checkpoints and every export), whichever is larger."""
    ckpt, steps = cfg.checkpoint, cfg.train.steps
    written, last = checkpoint_steps(steps, ckpt)
    exported = hf_checkpoint_steps(steps, ckpt)
    c = checkpoint_bytes(n, cfg.model.dtype, cfg.parallel.zero_stage)
    x = export_bytes(n, cfg.model.dtype)
    writing_last = DiskPlan(
        c,
        min(ckpt.keep + 1, written),
        ckpt.keep,
        x,
        len(range(exported.start, min(exported.stop, last), exported.step)),
    )
    at_end = DiskPlan(c, min(ckpt.keep, written), ckpt.keep, x, len(exported))
    return max(writing_last, at_end, key=lambda p: p.total)


def bytes_under(path: Path) -> int:
    """The files' bytes under `path` (0 if it is not there)."""
    if not path.is_dir():
        return 0
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def free_bytes(path: Path) -> int:
    """Free bytes, for an unprivileged user, of the filesystem `path` is or would be created on."""
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


@dataclass(frozen=True)
class RunDisk:
    """A run's peak (`plan`) against its run directory (`path`) now: the outputs it holds (`written`: a resume's
    checkpoints and exports, which count towards the peak as they are kept or replaced) and the free space of its
    filesystem (`free`)."""

    plan: DiskPlan
    path: Path
    written: int
    free: int

    @classmethod
    def of(cls, cfg: Config, n: int) -> RunDisk:
        rd = RunDir.of(cfg)
        written = bytes_under(rd.checkpoints) + bytes_under(rd.exports_dir)
        return cls(plan_disk(cfg, n), rd.path, written, free_bytes(rd.path))

    @property
    def more(self) -> int:
        """The bytes the run still adds to its directory at its peak."""
        return max(0, self.plan.total - self.written)

    def refusal(self) -> str | None:
        """Why the run cannot start here (None: its peak fits in the free space)."""
        if self.more <= self.free:
            return None
        return (
            f"{self.path} needs {to_gb(self.more):.1f} GB more disk than its filesystem has free "
            f"({to_gb(self.free):.1f} GB) at its peak: {self.plan.words()}; free space there, set train.run_dir on a "
            f"larger filesystem, lower checkpoint.keep or checkpoint.hf_last, or set checkpoint.check_disk=false to "
            f"start all the same"
        )
