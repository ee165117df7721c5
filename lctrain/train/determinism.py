"""`train.deterministic`: steps that repeat bit for bit on a GPU.

On a CPU every kernel lctrain runs sums in a fixed order, so a run repeats bit for bit without this
(docs/training.md, Reproducibility). On a GPU two kernels do not: FlashAttention's backward adds the query gradients
of a block from several thread blocks with atomics, and cuBLAS picks its reduction split by the workspace it finds
free. PyTorch's switch, `torch.use_deterministic_algorithms`, makes its own kernels take their deterministic variants
(its FlashAttention backward included) and turns every op that has none into an error naming it; cuBLAS needs its
workspace fixed by an environment variable before its first call in the process; flash-attn's own kernel is asked by
argument (`lctrain.attention.engines.varlen`). The price is the attention backward's speed. Triton kernels (flex
attention, Liger's) are outside PyTorch's switch: the GPU test of this module checks each engine's repeatability.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

from lctrain.errors import UserError

# cuBLAS's documented setting for reproducible results: 8 buffers of 4 MiB (":16:8" also works, with less memory)
CUBLAS_VAR, CUBLAS_WORKSPACE = "CUBLAS_WORKSPACE_CONFIG", ":4096:8"

# how PyTorch words the error of an op without a deterministic variant under the switch
_NO_DETERMINISTIC = "does not have a deterministic implementation"


@contextlib.contextmanager
def deterministic_algorithms(on: bool) -> Iterator[None]:
    """While the body runs, with `on`: PyTorch's deterministic algorithms, cuBLAS's fixed workspace (a value the
    environment already sets is kept), and an op without a deterministic variant as a UserError naming it. The
    process's previous state is restored afterwards (the tests train in one process)."""
    if not on:
        yield
        return
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    set_here = CUBLAS_VAR not in os.environ
    os.environ.setdefault(CUBLAS_VAR, CUBLAS_WORKSPACE)
    torch.use_deterministic_algorithms(True)
    try:
        yield
    except RuntimeError as e:
        if _NO_DETERMINISTIC not in str(e):
            raise
        op = str(e).split(_NO_DETERMINISTIC)[0].strip()
        raise UserError(
            f"train.deterministic: {op} has no deterministic implementation on this device (called from "
            f"{_caller(e)}); where that is the attention, another attention.engine may have one; else set "
            f"train.deterministic=false"
        ) from e
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        if set_here:
            os.environ.pop(CUBLAS_VAR, None)


def _caller(e: BaseException) -> str:
    """The innermost frame of `e`'s traceback outside PyTorch, `file:line` from the package on (PyTorch's error names
    only the kernel: the frame says whose code ran it, the attention's, DeepSpeed's, a fused kernel's, or the
    backward's)."""
    found, tb = None, e.__traceback__
    while tb is not None:
        path = tb.tb_frame.f_code.co_filename
        if f"{os.sep}torch{os.sep}" not in path:
            found = f"{path.split('site-packages' + os.sep)[-1]}:{tb.tb_lineno}"
        tb = tb.tb_next
    return found or "PyTorch"
