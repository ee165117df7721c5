"""Step metrics: `metrics.jsonl`, the progress bar and Weights & Biases; the CPU's exact peak of tensor storage.

The model FLOPs of a step come from `lctrain.costmodel`: 6 x (non-embedding parameters) x tokens plus 12 x layers x
width per visible query-key pair, so MFU measures useful work and `anchor` is not credited with FLOPs it skips.
`peak_mem_gb` is in GB (10^9 bytes, the unit of `lctrain plan`) and is the step's own peak (`lctrain.measure`):
PyTorch's allocations on a GPU, the resident set on the CPU; `peak_mem_scope` is "lifetime" where the platform
cannot reset the host's peak, and the value is then the process's peak so far.
"""

from __future__ import annotations

import gc
import json
import tempfile
from collections.abc import Callable
from pathlib import Path

from lctrain.errors import UserError

# The region `cpu_peak_bytes` measures, as the profiler trace names it.
_MEASURED = "lctrain.measured"


def cpu_peak_bytes(setup: Callable[[], object], measured: Callable[[object], None]) -> tuple[int, int]:
    """(peak, baseline): the most bytes of CPU tensors alive while `measured(setup())` runs, and those alive when it
    starts, counting every tensor allocated since `setup` began. PyTorch's CPU allocator reports each allocation
    and free, with its running total, to the profiler when it records memory: an exact count of tensor storage,
    unlike the process's RSS (allocator caches, libraries, page granularity)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    gc.collect()  # what earlier code left for the collector is not freed inside the measurement
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        state = setup()
        with record_function(_MEASURED):
            measured(state)
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
    region = next(e for e in events if e.get("name") == _MEASURED)
    start, end = region["ts"], region["ts"] + region["dur"]
    memory = sorted(
        (e["ts"], e["args"]["Total Allocated"], e["args"]["Bytes"])
        for e in events
        if e.get("name") == "[memory]" and e["args"].get("Device Type") == 0
    )
    # the running total also counts what earlier profiled code left alive: measure from the first event on
    offset = memory[0][1] - memory[0][2] if memory else 0
    before = [total - offset for ts, total, _ in memory if ts < start]
    inside = [total - offset for ts, total, _ in memory if start <= ts <= end]
    baseline = before[-1] if before else 0
    return max(inside, default=baseline), baseline


def import_wandb(cfg):
    """Weights & Biases is an optional extra: an offline cluster trains without it."""
    try:
        import wandb
    except ImportError:
        raise UserError(
            f"{cfg.source_file or 'config'}: logging.wandb = {cfg.logging.wandb} needs Weights & Biases "
            f"(pip install 'lctrain[wandb]'); or set logging.wandb: disabled"
        ) from None
    return wandb


class StepLogger:
    """Rank 0 only: appends one JSON line per step, drives the progress bar and Weights & Biases."""

    def __init__(self, run_dir: Path, cfg, start_step: int, total_steps: int, wandb_id: str):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.path = Path(run_dir) / "metrics.jsonl"
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
                dir=str(run_dir),
                config=cfg.model_dump(mode="json", exclude={"source_file"}),
            )

    def log(self, record: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        mfu = f"{record['mfu']:.1%}" if record.get("mfu") is not None else "n/a"
        info = (
            f"loss {record['loss']:.4f}  {record['tokens_per_s']:,.0f} tok/s  MFU {mfu}  "
            f"mem {record['peak_mem_gb']:.1f} GB"
        )
        self.progress.update(self.task, completed=record["step"], info=info)
        if self.wandb is not None and record["step"] % self.every == 0:
            self.wandb.log({k: v for k, v in record.items() if v is not None}, step=record["step"])

    def close(self) -> None:
        self.progress.stop()
        if self.wandb is not None:
            self.wandb.finish()


def truncate_metrics(run_dir: Path, last_step: int) -> None:
    """Drop lines of steps after `last_step` (written before a crash, redone after resume)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] <= last_step:
                kept.append(line)
        except (ValueError, KeyError, TypeError):
            pass  # blank, or the torn last line of a run killed while appending it
    path.write_text("".join(line + "\n" for line in kept))
