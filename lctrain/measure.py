"""Measuring a step: its wall time and its peak memory, on the device (PyTorch's allocator) and on the host (the
process's resident set).

- Time: the device is synchronized before and after, so the interval holds the work queued in it and not work queued
  before it.
- Device peak: `torch.cuda.max_memory_allocated` since `reset_peak`; `peak_reserved_bytes` what the caching allocator
  held from the device meanwhile (`torch.cuda.max_memory_reserved`: the allocations, cached blocks and fragmentation).
- Host peak: the process's high-water resident set. Linux resets it on writing "5" to /proc/self/clear_refs and
  reports it as VmHWM in /proc/self/status, so the peak is the interval's; elsewhere only `ru_maxrss` exists, which is
  the peak since the process started, and `reset_peak` says so by returning `LIFETIME`.
"""

from __future__ import annotations

import gc
import json
import resource
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from lctrain.units import KiB

T = TypeVar("T")

# What a peak read after `reset_peak` covers: the interval since the reset, or the process's whole life.
STEP, LIFETIME = "step", "lifetime"
_CLEAR_REFS = Path("/proc/self/clear_refs")
_STATUS = Path("/proc/self/status")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], T], device: torch.device) -> tuple[T, float]:
    """`fn()` and the seconds it took, the device's queued work included."""
    synchronize(device)
    t0 = time.perf_counter()
    result = fn()
    synchronize(device)
    return result, time.perf_counter() - t0


def reset_host_peak() -> bool:
    """Reset the process's high-water resident set to its current size; False where the platform cannot."""
    try:
        _CLEAR_REFS.write_text("5")
    except OSError:
        return False
    return True


def host_peak_bytes() -> int:
    """The process's peak resident set since `reset_host_peak` (since it started, if never reset or where the
    platform cannot reset it)."""
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * KiB
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * KiB  # bytes on macOS, KiB on Linux and the BSDs


def reset_peak(device: torch.device) -> str:
    """Start a peak-memory interval on `device`; returns what `peak_bytes` will cover, `STEP` or `LIFETIME`."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return STEP
    return STEP if reset_host_peak() else LIFETIME


def peak_bytes(device: torch.device) -> int:
    """Peak memory on `device` since `reset_peak`: PyTorch's allocations on a GPU, the resident set on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return host_peak_bytes()


def largest_peak_bytes(device: torch.device) -> int:
    """`peak_bytes` of the rank that peaked highest (every rank of the process group calls it: one all-reduce): what
    meets a device's limit first, where ranks hold different shares (ZeRO's partitions, uneven sequence slices)."""
    import torch.distributed as dist

    peak = peak_bytes(device)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return peak
    largest = torch.tensor([peak], dtype=torch.int64, device=device)
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    return int(largest.item())


def peak_reserved_bytes(device: torch.device) -> int:
    """Peak bytes PyTorch's caching allocator reserved on the GPU `device` since `reset_peak`."""
    return torch.cuda.max_memory_reserved(device)


# The region `cpu_peak_bytes` measures, as the profiler trace names it.
_MEASURED = "lctrain.measured"


def cpu_peak_bytes(setup: Callable[[], object], measured: Callable[[object], None]) -> tuple[int, int]:
    """(peak, baseline): the most bytes of CPU tensors alive while `measured(setup())` runs, and those alive when it
    starts, counting every tensor allocated since `setup` began. PyTorch's CPU allocator reports each allocation
    and free, with its running total, to the profiler when it records memory: an exact count of tensor storage,
    unlike the process's RSS (allocator caches, libraries, page granularity)."""
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
