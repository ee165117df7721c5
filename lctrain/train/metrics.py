"""Step metrics: `metrics.jsonl`, the progress bar and Weights & Biases; the CPU's exact peak of tensor storage.

The model FLOPs of a step come from `lctrain.costmodel`: 6 x (non-embedding parameters) x tokens plus 12 x layers x
width per visible query-key pair, so MFU measures useful work and `anchor` is not credited with FLOPs it skips
(`mfu`, strict). `mfu_full_square` counts the whole L x L square of pairs per window, torchtitan's and Megatron's
convention, for comparison with their numbers.
`peak_mem_gb` is in GB (10^9 bytes, the unit of `lctrain plan`) and is the step's own peak (`lctrain.measure`):
PyTorch's allocations on a GPU, the resident set on the CPU; `peak_mem_scope` is "lifetime" where the platform
cannot reset the host's peak, and the value is then the process's peak so far.
"""

from __future__ import annotations

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from lctrain.config import settings
from lctrain.errors import UserError
from lctrain.rundir import RunDir


def import_wandb(cfg):
    """Weights & Biases is an optional extra: an offline cluster trains without it."""
    try:
        # optional dependency: wandb (the `wandb` extra)
        import wandb
    except ImportError:
        raise UserError(
            f"{cfg.source_file or 'config'}: logging.wandb = {cfg.logging.wandb} needs Weights & Biases "
            f"(pip install 'lctrain[wandb]'); or set logging.wandb: disabled"
        ) from None
    return wandb


class StepLogger:
    """Rank 0 only: appends one JSON line per step, drives the progress bar and Weights & Biases."""

    def __init__(self, run: RunDir, cfg, start_step: int, total_steps: int, wandb_id: str):
        self.run = run
        self.every = cfg.logging.log_every
        self.progress = Progress(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeRemainingColumn(),
            TextColumn("{task.fields[info]}"),
            transient=False,
        )
        self.task = self.progress.add_task("train", total=total_steps, completed=start_step, info="")
        self.progress.start()
        self.wandb = None
        if cfg.logging.wandb != "disabled":
            wandb = import_wandb(cfg)

            self.wandb = wandb.init(
                project=cfg.logging.wandb_project,
                name=cfg.name,
                id=wandb_id,
                resume="allow",
                mode=cfg.logging.wandb,
                dir=str(run.path),
                config=settings(cfg),
            )

    def log(self, record: dict) -> None:
        self.run.append_metrics(record)
        mfu = f"{record['mfu']:.1%}" if record.get("mfu") is not None else "n/a"
        square = f"{record['mfu_full_square']:.1%}" if record.get("mfu_full_square") is not None else "n/a"
        info = (
            f"loss {record['loss']:.4f}  {record['tokens_per_s']:,.0f} tok/s  MFU {mfu} strict, {square} full-square  "
            f"mem {record['peak_mem_gb']:.1f} GB"
        )
        self.progress.update(self.task, completed=record["step"], info=info)
        if self.wandb is not None and record["step"] % self.every == 0:
            self.wandb.log({k: v for k, v in record.items() if v is not None}, step=record["step"])

    def close(self) -> None:
        self.progress.stop()
        if self.wandb is not None:
            self.wandb.finish()
