"""ZeRO-1 with Ulysses sequence parallelism. bf16 ZeRO-1 is DeepSpeed's `BF16_Optimizer`, which took the
sequence-parallel `mpu` for tensor parallelism and collected no gradient to norm on sequence-parallel rank 1 ("stack
expects a non-empty TensorList"; compat/deepspeed.py: sequence_parallel_bf16_norm). `lctrain init` picks ZeRO-1 first,
so this is the layout a user adding sequence parallelism to an init'd config runs."""

from pathlib import Path

import pytest
import torch
from train_helpers import TINY_ARCH, metric_records, prepared_workdir, reference_run, run_cli_train

from lctrain.compat.deepspeed import sequence_parallel_bf16_norm

STEPS = 3

pytestmark = pytest.mark.usefixtures("one_thread")


def overrides(data_dir: Path, run_dir: Path) -> list[str]:
    # bf16 with ZeRO-1: DeepSpeed's BF16_Optimizer. Gradient clipping stays on (norms here are 2-5 against 1.0), so
    # the norm also scales the update: a norm measured over part of the gradients would move the losses after step 1.
    return [
        "data.seq_len=128",
        "data.token_budget=6000",
        f"data.output_dir={data_dir}",
        f"train.run_dir={run_dir}",
        f"train.steps={STEPS}",
        "train.global_batch=2",
        "train.micro_batch=1",
        "train.warmup_steps=0",
        "train.lr=3e-3",
        "train.grad_clip=1.0",
        "model.dtype=bfloat16",
        "parallel.zero_stage=1",
        "checkpoint.hf_last=0",
        f"model.arch={TINY_ARCH}",
    ]


def test_only_bf16_optimizer_loses_the_sequence_parallel_mpu():
    import deepspeed.runtime.sequence_parallel.parallel_state_sp as sp_state
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    class Engine:
        def __init__(self, optimizer):
            self.optimizer = optimizer

    bf16 = object.__new__(BF16_Optimizer)  # no process group: only its `mpu` is read
    bf16.mpu = sp_state
    sequence_parallel_bf16_norm(Engine(bf16))
    assert bf16.mpu is None

    megatron_like = object()  # a real tensor-parallel mpu is DeepSpeed's business, not changed
    bf16.mpu = megatron_like
    sequence_parallel_bf16_norm(Engine(bf16))
    assert bf16.mpu is megatron_like

    zero2 = object.__new__(DeepSpeedZeroOptimizer)  # ZeRO-1/2 recognise the sequence-parallel mpu themselves
    zero2.mpu = sp_state
    sequence_parallel_bf16_norm(Engine(zero2))
    assert zero2.mpu is sp_state


@pytest.mark.slow  # over 20 s on 2 cores: make test-slow
def test_bf16_zero1_with_sp2_and_dp1_matches_one_process(tmp_path_factory):
    workdir = prepared_workdir(tmp_path_factory, "zero1_sp", overrides)
    want = metric_records(reference_run(workdir, overrides))
    got = metric_records(
        run_cli_train(overrides, workdir, "sp2_zero1", ["parallel.nproc_per_node=2", "parallel.sequence_parallel=2"])
    )
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    assert [r["valid_labels"] for r in got] == [r["valid_labels"] for r in want]
    # bf16 matmuls over other shapes on 2 ranks: measured 6e-6 (losses) and 2e-4 (norms) relative; a norm over half
    # the gradients, or summed twice, is off by far more
    torch.testing.assert_close(
        torch.tensor([r["loss"] for r in got]), torch.tensor([r["loss"] for r in want]), rtol=1e-4, atol=0
    )
    torch.testing.assert_close(
        torch.tensor([r["grad_norm"] for r in got]), torch.tensor([r["grad_norm"] for r in want]), rtol=2e-3, atol=0
    )
