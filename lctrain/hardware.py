"""What lctrain knows about the machine: each accelerator model's memory and dense bf16 peak, the CPU's measured
matmul rate in the run's dtype, and the CPU cores this process may use.

GPUs are matched on their exact model name as `torch.cuda.get_device_name()` reports it (case and spacing aside, the
"NVIDIA " prefix optional): variants of one chip differ in memory and peak (an H100 PCIe has 756 dense bf16 TFLOP/s,
an H100 SXM 989), and a substring would give one the other's. A GPU not in the table gets no number: MFU is not
reported and `lctrain plan` reads the memory from the device. Peaks are dense (half the figure with sparsity where
that is all a datasheet gives); memory is the datasheet's GB per GPU.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where it is used: `prepare` (usable_cpus) starts without it
    import torch


@dataclass(frozen=True)
class GPU:
    name: str  # as torch.cuda.get_device_name() reports it
    memory_gb: float
    bf16_tflops: float | None  # dense; None where no vendor states it
    source: str


_H100 = "NVIDIA H100 Tensor Core GPU datasheet, https://www.nvidia.com/en-us/data-center/h100/"
_H100_PCIE = (
    "NVIDIA H100 Tensor Core GPU datasheet (SXM and PCIe edition, 2022), "
    "https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet"
)
_H200 = "NVIDIA H200 Tensor Core GPU datasheet, https://www.nvidia.com/en-us/data-center/h200/"
_A100 = (
    "NVIDIA A100 Tensor Core GPU datasheet, "
    "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf"
)
_B200 = "NVIDIA HGX B200 specifications (per GPU: 8-GPU totals / 8), https://www.nvidia.com/en-us/data-center/hgx/"
_GB200 = "NVIDIA GB200 NVL72 specifications (per GPU: 72-GPU totals / 72), https://www.nvidia.com/en-us/data-center/gb200-nvl72/"

GPUS = (
    GPU("NVIDIA H100 80GB HBM3", 80, 989, _H100),  # SXM5: 1,979 TFLOP/s with sparsity
    GPU("NVIDIA H100 NVL", 94, 835.5, _H100),  # 1,671 with sparsity
    GPU("NVIDIA H100 PCIe", 80, 756.5, _H100_PCIE),  # 1,513 with sparsity
    GPU("NVIDIA H200", 141, 989, _H200),  # SXM: 1,979 with sparsity
    GPU("NVIDIA H200 NVL", 141, 835.5, _H200),  # 1,671 with sparsity
    GPU("NVIDIA A100-SXM4-80GB", 80, 312, _A100),
    GPU("NVIDIA A100-SXM4-40GB", 40, 312, _A100),
    GPU("NVIDIA A100 80GB PCIe", 80, 312, _A100),
    GPU("NVIDIA A100-PCIE-40GB", 40, 312, _A100),
    GPU("NVIDIA B200", 180, 2250, _B200),  # 36 PFLOP/s with sparsity per 8 GPUs, 1.44 TB
    GPU("NVIDIA GB200", 186, 2500, _GB200),  # 360 PFLOP/s with sparsity per 72 GPUs, 13.4 TB
    GPU("NVIDIA L40S", 48, 362.05, "NVIDIA L40S datasheet, https://www.nvidia.com/en-us/data-center/l40s/"),
    GPU("NVIDIA L4", 24, 121, "NVIDIA L4 datasheet, https://www.nvidia.com/en-us/data-center/l4/"),
    GPU(
        "NVIDIA RTX A6000",
        48,
        154.8,
        "NVIDIA RTX A6000 datasheet, https://www.nvidia.com/en-us/design-visualization/rtx-a6000/",
    ),
    GPU(
        "NVIDIA GeForce RTX 4090",
        24,
        165.2,  # bf16 with fp32 accumulation, as training runs it
        "NVIDIA Ada GPU architecture whitepaper, appendix A, "
        "https://images.nvidia.com/aem-dam/Solutions/geforce/ada/nvidia-ada-gpu-architecture.pdf",
    ),
    # AWS states the A10G's memory but no tensor-core peak
    GPU("NVIDIA A10G", 24, None, "Amazon EC2 G5 instances, https://aws.amazon.com/ec2/instance-types/g5/"),
    GPU(
        "AMD Instinct MI300X",
        192,
        1307.4,
        "AMD Instinct MI300X data sheet, https://www.amd.com/en/products/accelerators/instinct/mi300/mi300x.html",
    ),
)


def normalize(name: str) -> str:
    """A device name with case, spacing and the optional "NVIDIA " prefix taken out."""
    words = name.lower().split()
    return " ".join(words[1:] if words[:1] == ["nvidia"] else words)


_BY_NAME = {normalize(g.name): g for g in GPUS}


class UnknownGPUWarning(UserWarning):
    """A GPU whose model lctrain's hardware table does not hold."""


def known_gpu(name: str) -> GPU | None:
    """The table's entry for a device named like torch.cuda.get_device_name() reports it, or None."""
    return _BY_NAME.get(normalize(name))


@cache
def _cpu_matmul_peak(dtype: str) -> float:
    """Achievable FLOP/s of this CPU in `dtype` (a torch dtype's name): the best of several square matmuls (up to
    2048). CPUs have no spec-sheet peak to use, and their rates differ by dtype far more than a GPU's tensor cores do
    (bf16 is several times fp32's on a CPU with AMX, a fraction of it on one without bf16 instructions), so the peak is
    measured in the dtype the run computes in. On a busy machine this under-estimates the peak: CPU MFU is indicative
    only."""
    # torch (and lctrain.measure, which imports it) on use: this module loads without torch (start-up time)
    import torch

    from lctrain.measure import timed

    cpu = torch.device("cpu")
    # its own generator: drawing from the global one would shift every later draw of the run (dropout masks), so
    # a resume, which restores the global state before this runs, would not continue where the run left off
    values = torch.Generator().manual_seed(0)

    def rate(n: int, repeats: int) -> float:
        a = torch.randn(n, n, generator=values).to(getattr(torch, dtype))
        b = torch.randn(n, n, generator=values).to(getattr(torch, dtype))
        a @ b
        return 2 * n**3 / min(timed(lambda: a @ b, cpu)[1] for _ in range(repeats))

    # sized from a small probe so that one matmul takes ~0.5 s: 2048 for fp32 and bf16 on a modern core, smaller
    # for a dtype this CPU computes slowly (fp16 runs at a few GFLOP/s on most), whose 2048^3 would take minutes
    probe = rate(256, 2)
    n = round(min(2048, max(256, (probe * 0.5 / 2) ** (1 / 3))))
    return max(probe, rate(n, 8))


def device_peak_flops(
    device: torch.device, override_tflops: float | None = None, dtype: str = "float32"
) -> float | None:
    """The peak FLOP/s MFU is measured against: `override_tflops`, else a GPU's dense bf16 peak from the table (None,
    with an `UnknownGPUWarning`, for a GPU the table does not hold; MFU's convention divides by the bf16 peak whatever
    the run's dtype), else the CPU's matmul rate measured in `dtype`, the name of the run's compute dtype."""
    if override_tflops:
        return override_tflops * 1e12
    if device.type == "cuda":
        # torch on use: this module loads without it (start-up time of the light commands)
        import torch

        name = torch.cuda.get_device_name(device)
        gpu = known_gpu(name)
        if gpu is None or gpu.bf16_tflops is None:
            why = "is not in lctrain's hardware table" if gpu is None else "has no published dense bf16 peak"
            warnings.warn(
                f"GPU {name!r} {why} (lctrain/hardware.py): MFU is not reported; set logging.peak_tflops to its "
                f"dense bf16 TFLOP/s to report it",
                UnknownGPUWarning,
                stacklevel=2,
            )
            return None
        return gpu.bf16_tflops * 1e12
    return _cpu_matmul_peak(dtype)


def usable_cpus() -> int:
    """CPU cores this process may run on: its affinity mask (a container's or `taskset`'s limit) where the platform
    has one, else all of the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1
