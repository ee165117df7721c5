"""`train.deterministic` (lctrain/train/determinism.py): PyTorch's deterministic algorithms and cuBLAS's fixed workspace
while a run trains, the process's state restored after, an op without a deterministic variant one line. References:
on a CPU, where every kernel already sums in a fixed order, the run with the switch equals the run without it bit for
bit; on a GPU (`-m gpu`), two runs with it equal each other bit for bit, per attention engine."""

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from train_helpers import losses, prepared_workdir, set_args, tiny_run
from typer.testing import CliRunner

from lctrain.cli import app
from lctrain.config import load_config
from lctrain.errors import UserError
from lctrain.parallel.groups import init_topology, release_single_process
from lctrain.train import trainer as trainer_module
from lctrain.train.determinism import CUBLAS_VAR, CUBLAS_WORKSPACE, deterministic_algorithms
from lctrain.train.trainer import Trainer

# PyTorch's words for an op without a deterministic variant (aten's Context::alertNotDeterministic), which no CPU op
# lctrain runs can produce
NOT_DETERMINISTIC = (
    "index_put_with_accumulate_cuda does not have a deterministic implementation, but you set "
    "'torch.use_deterministic_algorithms(True)'. You can turn off determinism just for this operation"
)


@pytest.fixture
def no_cublas_setting(monkeypatch):
    monkeypatch.delenv(CUBLAS_VAR, raising=False)


@pytest.mark.usefixtures("no_cublas_setting")
def test_the_switch_holds_while_the_body_runs_and_is_undone_after():
    assert not torch.are_deterministic_algorithms_enabled()
    with deterministic_algorithms(False):
        assert not torch.are_deterministic_algorithms_enabled() and CUBLAS_VAR not in os.environ
    with deterministic_algorithms(True):
        assert torch.are_deterministic_algorithms_enabled()
        assert not torch.is_deterministic_algorithms_warn_only_enabled()  # an op without a variant is an error
        assert os.environ[CUBLAS_VAR] == CUBLAS_WORKSPACE
    assert not torch.are_deterministic_algorithms_enabled() and CUBLAS_VAR not in os.environ


def test_a_workspace_setting_of_the_environment_is_kept(monkeypatch):
    monkeypatch.setenv(CUBLAS_VAR, ":16:8")
    with deterministic_algorithms(True):
        assert os.environ[CUBLAS_VAR] == ":16:8"
    assert os.environ[CUBLAS_VAR] == ":16:8"


@pytest.mark.usefixtures("no_cublas_setting")
def test_an_op_without_a_deterministic_variant_is_one_line_naming_it():
    def attention():
        raise RuntimeError(NOT_DETERMINISTIC)

    with pytest.raises(UserError) as caught:
        with deterministic_algorithms(True):
            attention()
    line = attention.__code__.co_firstlineno + 1
    assert str(caught.value) == (
        "train.deterministic: index_put_with_accumulate_cuda has no deterministic implementation on this device "
        f"(called from {__file__}:{line}); where that is the attention, another attention.engine may have one; else "
        "set train.deterministic=false"
    )
    assert not torch.are_deterministic_algorithms_enabled()
    with pytest.raises(RuntimeError, match="^another failure$"):  # other errors pass as they are
        with deterministic_algorithms(True):
            raise RuntimeError("another failure")


def tiny(data_dir: Path, run_dir: Path) -> list[str]:
    return tiny_run(data_dir, run_dir, steps=3) + [
        "train.lr=3e-3",
        "train.grad_clip=0",
        "checkpoint.save_final=false",
    ]


@pytest.mark.slow  # two tiny runs, 5 s here
@pytest.mark.usefixtures("one_thread", "no_cublas_setting")
def test_a_cpu_run_with_the_switch_equals_the_run_without(tmp_path_factory, tmp_path, monkeypatch):
    workdir = prepared_workdir(tmp_path_factory, "determinism", tiny)
    seen = []
    step = Trainer.train_step

    def watched(self, windows):
        seen.append((torch.are_deterministic_algorithms_enabled(), os.environ.get(CUBLAS_VAR)))
        return step(self, windows)

    monkeypatch.setattr(trainer_module.Trainer, "train_step", watched)
    runs = {}
    for on in (False, True):
        run = tmp_path / f"deterministic_{on}"
        extra = [f"train.deterministic={str(on).lower()}"]
        result = CliRunner().invoke(app, ["train", *set_args(tiny(workdir / "data", run) + extra)])
        assert result.exit_code == 0, result.output
        runs[on] = losses(run)
    assert seen == [(False, None)] * 3 + [(True, CUBLAS_WORKSPACE)] * 3
    assert runs[True] == runs[False]  # bit for bit: the CPU's kernels sum in one order either way
    assert not torch.are_deterministic_algorithms_enabled()


def _gpu_steps(engine: str, mode: str, steps: int = 3) -> tuple[list[float], list[torch.Tensor]]:
    cfg = load_config(
        None,
        [
            "data.seq_len=256",
            "model.dtype=bfloat16",
            "parallel.zero_stage=1",
            f"attention.engine={engine}",
            f"attention.mode={mode}",
            "train.global_batch=1",
            "train.micro_batch=1",
            "train.lr=3e-3",
            "train.deterministic=true",
        ],
    )
    cfg.model.arch = {
        "model_type": "llama",
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    }
    torch.manual_seed(0)
    with deterministic_algorithms(True):
        trainer = Trainer(cfg, init_topology(cfg), vocab_size=1000)
        try:
            rng = np.random.default_rng(0)
            out = []
            for _ in range(steps):
                ids = rng.integers(3, 1000, (1, 256))
                ids[:, [0, 100, 180]] = 1
                window = {
                    "input_ids": ids,
                    "seg_lens": [np.array([100, 80, 76])],
                    "seg_doc": [np.arange(3)],
                    "tag_lens": [np.zeros(3, dtype=np.int64)],
                }
                result = trainer.train_step([window])
                out.append((result.loss, result.grad_norm))
            return out, [p.detach().float().cpu() for p in trainer.engine.module.parameters()]
        finally:
            del trainer
            release_single_process()


@pytest.fixture
def deepspeed_on_cuda():
    """The suite points DeepSpeed at the CPU (conftest); a test that trains on the GPU in its own process points it
    at CUDA for its duration (on the CPU accelerator the engine keeps the model on the host, which nccl cannot
    broadcast)."""
    from deepspeed.accelerator import get_accelerator, set_accelerator
    from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator

    before = get_accelerator()
    set_accelerator(CUDA_Accelerator())
    yield
    set_accelerator(before)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("engine", ["sdpa", "flex", "varlen"])
@pytest.mark.parametrize("mode", ["full", "anchor"])
@pytest.mark.usefixtures("no_cublas_setting", "deepspeed_on_cuda")
def test_two_gpu_runs_with_the_switch_are_equal_bit_for_bit(engine, mode):
    first, first_params = _gpu_steps(engine, mode)
    second, second_params = _gpu_steps(engine, mode)
    assert first == second
    assert all(torch.equal(a, b) for a, b in zip(first_params, second_params))
