"""The hardware table: exact GPU model names against the vendors' datasheets, unknown GPUs without a number, the
CPU cores this process may use."""

import os
import warnings
from types import SimpleNamespace

import pytest
import torch

from lctrain import hardware, measure, plan
from lctrain.hardware import GPUS, UnknownGPUWarning, device_peak_flops, known_gpu, normalize, usable_cpus
from lctrain.units import GB

# Datasheet figures: dense bf16 tensor-core TFLOP/s (datasheets that list only the figure with sparsity, halved) and
# GB per GPU.
DATASHEETS = {
    "NVIDIA H100 80GB HBM3": (1979 / 2, 80),
    "NVIDIA H100 PCIe": (1513 / 2, 80),
    "NVIDIA H100 NVL": (1671 / 2, 94),
    "NVIDIA H200": (1979 / 2, 141),
    "NVIDIA A100-SXM4-40GB": (312, 40),
    "NVIDIA A100 80GB PCIe": (312, 80),
    "NVIDIA B200": (36000 / 8 / 2, 180),
    "NVIDIA GB200": (360000 / 72 / 2, 186),
    "NVIDIA L40S": (362.05, 48),
}


@pytest.mark.parametrize("name", sorted(DATASHEETS))
def test_each_model_has_its_own_datasheet_numbers(name):
    dense, memory = DATASHEETS[name]
    gpu = known_gpu(name)
    assert gpu.bf16_tflops == pytest.approx(dense, abs=0.5) and gpu.memory_gb == memory


def test_names_match_exactly_not_by_substring():
    # a substring match gave the PCIe card the SXM peak and a GB200 the B200's
    assert known_gpu("NVIDIA H100 PCIe").bf16_tflops != known_gpu("NVIDIA H100 80GB HBM3").bf16_tflops
    assert known_gpu("NVIDIA GB200") != known_gpu("NVIDIA B200")
    for unknown in ("NVIDIA H100", "H100", "NVIDIA H100 PCIe 2", "NVIDIA GH200 480GB", "NVIDIA H800", ""):
        assert known_gpu(unknown) is None, unknown
    # case, spacing and the vendor prefix are not part of the model name
    assert known_gpu("  nvidia   h100  PCIe ") == known_gpu("H100 PCIe") == known_gpu("NVIDIA H100 PCIe")


def test_every_entry_names_its_source_and_is_unique():
    assert len({normalize(g.name) for g in GPUS}) == len(GPUS)
    for g in GPUS:
        assert "https://" in g.source and g.memory_gb > 0, g
        assert g.bf16_tflops is None or g.bf16_tflops > 0, g


def on_gpu(monkeypatch, name: str, total_memory: int = 85 * 10**9):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: name)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a: SimpleNamespace(total_memory=total_memory))


def test_mfu_peak_of_a_known_an_unknown_and_a_peakless_gpu(monkeypatch):
    cuda = torch.device("cuda", 0)
    on_gpu(monkeypatch, "NVIDIA H100 PCIe")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert device_peak_flops(cuda) == 756.5e12
    on_gpu(monkeypatch, "NVIDIA H100")
    with pytest.warns(UnknownGPUWarning, match=r"'NVIDIA H100' is not in lctrain's hardware table.*peak_tflops"):
        assert device_peak_flops(cuda) is None
    on_gpu(monkeypatch, "NVIDIA A10G")
    with pytest.warns(UnknownGPUWarning, match="has no published dense bf16 peak"):
        assert device_peak_flops(cuda) is None
    assert device_peak_flops(cuda, override_tflops=125) == 125e12  # the user's number, no warning needed


def test_plan_budget_of_a_known_and_an_unknown_gpu(monkeypatch):
    on_gpu(monkeypatch, "NVIDIA H100 NVL")
    budget, known = plan.local_budget(host_mem_gb=64)
    assert (budget.device, known) == (94 * GB, True) and "94 GB" in budget.label
    on_gpu(monkeypatch, "Some Future GPU", total_memory=123 * 10**9)
    budget, known = plan.local_budget(host_mem_gb=64)
    assert (budget.device, known) == (123 * 10**9, False)


def test_usable_cpus_follows_the_affinity_mask(monkeypatch):
    assert usable_cpus() == len(os.sched_getaffinity(0))
    monkeypatch.delattr(os, "sched_getaffinity")  # macOS has none
    assert usable_cpus() == os.cpu_count()


def test_cpu_peak_is_measured_in_the_runs_dtype(monkeypatch):
    """The CPU's peak times matmuls in the dtype it is asked for, sized from a probe so that a dtype the CPU computes
    slowly does not take minutes; a fake clock at a known rate is the reference."""
    rate, seen = 1e10, []

    def clock(fn, device):
        out = fn()
        seen.append((out.dtype, out.shape[0]))
        return out, 2 * out.shape[0] ** 3 / rate

    monkeypatch.setattr(measure, "timed", clock)
    hardware._cpu_matmul_peak.cache_clear()
    before = torch.get_rng_state()
    try:
        assert device_peak_flops(torch.device("cpu"), dtype="bfloat16") == pytest.approx(rate)
    finally:
        hardware._cpu_matmul_peak.cache_clear()
    # the run's random stream is untouched: a resume restores it before this runs, and dropout draws from it
    assert torch.equal(torch.get_rng_state(), before)
    assert {dtype for dtype, _ in seen} == {torch.bfloat16}
    # the probe is 256; the measured matmul takes ~0.5 s at the probe's rate: (1e10 * 0.5 / 2) ** (1/3) = 1357
    assert sorted({n for _, n in seen}) == [256, 1357]
