"""What a config is checked into, once per process, before anything is built: its layout on this process's world,
the batch split, the precision rule, and the prepared dataset. The command edge (train/command.py) computes it and
hands it to the worker body; a worker started by a launcher computes its own, once."""

from __future__ import annotations

from dataclasses import dataclass

from lctrain.config import Config
from lctrain.errors import UserError
from lctrain.parallel.layout import ParallelLayout, layout_of
from lctrain.train.data import BatchPlan, open_checked


def check_precision(cfg: Config) -> None:
    """DeepSpeed keeps fp32 master weights for bf16/fp16 models only inside its ZeRO optimizers; stage 0 would
    update bf16 weights directly, which loses the small updates of continual pretraining (lr 2e-5)."""
    if cfg.model.dtype != "float32" and cfg.parallel.zero_stage == 0:
        raise UserError(
            f"{cfg.origin('model.dtype', 'parallel.zero_stage')}: model.dtype = {cfg.model.dtype} needs "
            f"parallel.zero_stage "
            f">= 1 (fp32 master weights); set parallel.zero_stage: 1, or model.dtype: float32"
        )


@dataclass(frozen=True)
class RunPlan:
    """`cfg`'s layout and batch split on a world, after the checks that refuse a config that cannot run there."""

    layout: ParallelLayout
    batches: BatchPlan

    @classmethod
    def of(cls, cfg: Config, layout: ParallelLayout | None = None) -> RunPlan:
        """The plan on `layout` (default: the processes `cfg` asks for), refusing in one line what cannot run."""
        layout = layout or layout_of(cfg)
        batches = BatchPlan.of(cfg, layout)
        check_precision(cfg)
        return cls(layout, batches)


@dataclass(frozen=True)
class Prepared:
    """A run checked once in this process: its plan and its prepared dataset (`open_checked`)."""

    plan: RunPlan
    packed: object

    @classmethod
    def of(cls, cfg: Config, layout: ParallelLayout | None = None, plan: RunPlan | None = None) -> Prepared:
        """`plan`: `RunPlan.of(cfg, layout)` already checked (the checks between it and the dataset's then come
        first)."""
        return cls(plan or RunPlan.of(cfg, layout), open_checked(cfg))
