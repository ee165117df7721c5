"""Measuring a step: its wall time and its peak memory, on the device (PyTorch's allocator) and on the host (the
process's resident set).

- Time: the device is synchronized before and after, so the interval holds the work queued in it and not work queued
  before it.
- Device peak: `torch.cuda.max_memory_allocated` since `reset_peak`.
- Host peak: the process's high-water resident set. Linux resets it on writing "5" to /proc/self/clear_refs and
  reports it as VmHWM in /proc/self/status, so the peak is the interval's; elsewhere only `ru_maxrss` exists, which is
  the peak since the process started, and `reset_peak` says so by returning `LIFETIME`.
"""

from __future__ import annotations

import resource
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

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
