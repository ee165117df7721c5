"""Step metrics: the device's peak for MFU, memory, `metrics.jsonl`, the progress bar and Weights & Biases.

The model FLOPs of a step come from `lctrain.costmodel`: 6 x (non-embedding parameters) x tokens plus 12 x layers x
width per visible query-key pair, so MFU measures useful work and `anchor` is not credited with FLOPs it skips.
"""

from __future__ import annotations

import gc
import json
import resource
import sys
import tempfile
import time
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path

import torch

from lctrain.config import settings
from lctrain.errors import UserError
from lctrain.rundir import RunDir

# Dense bf16 tensor-core peaks (no sparsity), FLOP/s.
GPU_PEAK_BF16 = {
    "H200": 989e12,
    "H100": 989e12,
    "H800": 989e12,
    "A100": 312e12,
    "A800": 312e12,
    "L40S": 362e12,
    "A6000": 155e12,
    "4090": 165e12,
    "B200": 2250e12,
    "MI300X": 1307e12,
    "MI250X": 383e12,
}


@lru_cache(maxsize=1)
def _cpu_matmul_peak() -> float:
    """Achievable fp32 FLOP/s of this CPU: the best of several 2048^3 matmuls (CPUs have no spec-sheet peak to
    use; on a busy machine this under-estimates the peak, so CPU MFU is indicative only)."""
    n = 2048
    a = torch.randn(n, n)
    b = torch.randn(n, n)
    a @ b
    best = float("inf")
    for _ in range(8):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def device_peak_flops(device: torch.device, override_tflops: float | None = None) -> float | None:
    if override_tflops:
        return override_tflops * 1e12
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, peak in GPU_PEAK_BF16.items():
            if key in name:
                return peak
        return None
    return _cpu_matmul_peak()


def peak_memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kb / 2**20 if sys.platform != "darwin" else kb / 2**30


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


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

    def __init__(self, run: RunDir, cfg, start_step: int, total_steps: int, wandb_id: str):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

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
