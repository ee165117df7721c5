"""Step time and per-step peak memory, against the clock and the process's resident set read independently."""

import resource
import time

import numpy as np
import psutil
import pytest
import torch

from lctrain import measure
from lctrain.units import GB, GiB, KiB, gb_to_bytes, to_gb

CPU = torch.device("cpu")
BLOCK = 256 * 2**20


def test_units():
    assert (GB, GiB, KiB) == (10**9, 2**30, 2**10)
    assert to_gb(3 * 10**9) == 3 and gb_to_bytes(1.5) == 1_500_000_000


def test_timed_returns_the_result_and_the_seconds():
    result, seconds = measure.timed(lambda: time.sleep(0.05) or "done", CPU)
    assert result == "done" and 0.05 <= seconds < 1


@pytest.mark.skipif(not measure.reset_host_peak(), reason="the platform cannot reset the peak resident set")
def test_host_peak_is_the_steps_own():
    assert measure.reset_peak(CPU) == measure.STEP
    before = psutil.Process().memory_info().rss
    block = np.ones(BLOCK, dtype=np.uint8)  # touched: resident
    peak = measure.peak_bytes(CPU)
    assert peak >= before + BLOCK * 0.95
    del block
    assert measure.reset_peak(CPU) == measure.STEP
    after = measure.peak_bytes(CPU)
    # the next step does not inherit the block: its peak is what is resident now
    assert after < peak - BLOCK * 0.9
    assert after == pytest.approx(psutil.Process().memory_info().rss, rel=0.05)


def test_where_the_peak_cannot_be_reset_it_is_the_lifetime_peak(monkeypatch, tmp_path):
    monkeypatch.setattr(measure, "_CLEAR_REFS", tmp_path / "missing" / "clear_refs")
    monkeypatch.setattr(measure, "_STATUS", tmp_path / "missing" / "status")
    assert measure.reset_peak(CPU) == measure.LIFETIME
    assert measure.peak_bytes(CPU) == resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * KiB


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_device_peak_is_the_steps_own():
    gpu = torch.device("cuda", 0)
    assert measure.reset_peak(gpu) == measure.STEP
    base = torch.cuda.memory_allocated(gpu)
    block, seconds = measure.timed(lambda: torch.ones(BLOCK, dtype=torch.uint8, device=gpu), gpu)
    assert measure.peak_bytes(gpu) >= base + BLOCK and seconds > 0
    del block
    measure.reset_peak(gpu)
    assert measure.peak_bytes(gpu) == torch.cuda.memory_allocated(gpu) < base + BLOCK
