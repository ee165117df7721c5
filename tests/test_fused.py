"""Fused kernels (`model.fused_kernels`, lctrain/fused.py) and the fused optimizer (`train.fused_optimizer`).

References: the same model without them (eager transformers, torch's unfused AdamW): losses, gradients and parameters
equal up to fp32 rounding; transformers' own `LlamaAttention.forward` for the per-instance copy in compat; the chunked
loss (`train.loss.chunked_loss_sum`) for Liger's fused linear cross-entropy, scaled as the trainer scales it.
Liger runs only on CUDA (`-m gpu`); on CPU its refusal is tested.
"""

import numpy as np
import pytest
import torch
from train_helpers import one_error_line
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRMSNorm, apply_rotary_pos_emb
from typer.testing import CliRunner

from lctrain import fused
from lctrain.attention import make_batch
from lctrain.cli import app
from lctrain.compat.transformers import is_llama_attention, llama_attention_forward
from lctrain.config import check_on_this_machine, load_config
from lctrain.errors import UserError
from lctrain.model import build_model
from lctrain.parallel.groups import init_topology, release_single_process
from lctrain.train.deepspeed_config import deepspeed_config
from lctrain.train.loss import CausalLMLossSum, chunked_loss_sum
from lctrain.train.runplan import RunPlan
from lctrain.train.trainer import Trainer

ARCH = dict(
    model_type="llama",
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    tie_word_embeddings=False,
)
EPS32 = torch.finfo(torch.float32).eps
# A sum of n fp32 terms in another order differs by at most (n - 1) eps of the sum of their magnitudes; the widest
# reduction a compiled region reorders is the MLP's (intermediate_size terms), so its relative bound covers them all.
COMPILE_RTOL = ARCH["intermediate_size"] * EPS32


def config(*overrides):
    cfg = load_config(None, ["data.seq_len=64", "model.dtype=float32", *overrides])
    cfg.model.arch = dict(ARCH)
    return cfg


def batch(mode="anchor"):
    ids = torch.randint(3, 100, (2, 64), generator=torch.Generator().manual_seed(0))
    ids[:, [0, 17, 40]] = 1
    return make_batch(ids, [[17, 23, 24], [17, 23, 24]], mode, seg_doc=[[0, 1, 2], [0, 1, 0]])


def loss_and_grads(cfg, device="cpu", steps=2):
    """Each step's summed token loss (CausalLMLossSum, the trainer's module) and gradients after it."""
    built = build_model(cfg, vocab_size=100, device=device)
    model = CausalLMLossSum(built.model.train(), fused_loss_sum=fused.loss_sum(cfg.model.fused_kernels))
    b = batch(cfg.attention.mode).to(device)
    out = []
    for _ in range(steps):
        model.zero_grad()
        loss = model(b)
        (loss / b.valid_labels()).backward()
        out.append((loss.detach().float().cpu(), [p.grad.float().cpu() for p in model.parameters()]))
    return out


def assert_relatively_close(got, want, rtol):
    for (loss, grads), (loss0, grads0) in zip(got, want):
        assert abs(loss - loss0) <= rtol * abs(loss0)
        for g, g0 in zip(grads, grads0):
            assert (g - g0).abs().max() <= rtol * g0.abs().max()


@pytest.mark.slow
@pytest.mark.parametrize("checkpointing", ["none", "full", "selective"])
def test_compile_keeps_losses_and_gradients(checkpointing):
    # compiling the regions takes ~50 s on one CPU core the first time (inductor's C++), then hits its cache
    eager = loss_and_grads(config(f"model.checkpointing={checkpointing}"))
    compiled = loss_and_grads(config(f"model.checkpointing={checkpointing}", "model.fused_kernels=compile"))
    assert_relatively_close(compiled, eager, COMPILE_RTOL)


@pytest.mark.slow
def test_compile_with_selective_matmul_is_refused_because_the_backward_fails():
    """Why the config refuses the pair: the compiled MLP writes into a matmul output the policy keeps."""
    cfg = config("model.fused_kernels=compile")
    object.__setattr__(cfg.model, "checkpointing", "selective_matmul")  # past the refusal
    with pytest.raises(RuntimeError, match="cached during selective activation checkpoint has been mutated"):
        loss_and_grads(cfg, steps=1)
    with pytest.raises(UserError, match="writes in place into matmul outputs"):
        load_config(None, ["model.fused_kernels=compile", "model.checkpointing=selective_matmul"])


@pytest.mark.slow  # torch.compile's first call imports dynamo and inductor: ~5 s
def test_compile_is_bound_on_the_instance():
    model = build_model(config(), vocab_size=100).model
    assert fused.apply(model, "none", "cpu") == 0
    assert fused.apply(model, "compile", "cpu") == ARCH["num_hidden_layers"]
    norms = [m for m in model.modules() if isinstance(m, LlamaRMSNorm)]
    assert len(norms) == 2 * ARCH["num_hidden_layers"] + 1
    assert all(type(m).forward is LlamaRMSNorm.forward for m in norms)  # the class is untouched


def test_a_model_without_llama_layers_is_refused():
    with pytest.raises(UserError, match="no Llama-style decoder layers"):
        fused.apply(torch.nn.Linear(2, 2), "compile", "cpu")
    with pytest.raises(UserError, match="no Llama-style decoder layers"):
        fused.apply(torch.nn.Linear(2, 2), "liger", "cuda")


def test_the_instance_attention_forward_is_transformers_own():
    # the compat copy bound with transformers' own rotary function computes what LlamaAttention.forward computes
    model = build_model(config("attention.engine=reference"), vocab_size=100).model
    attention = model.model.layers[0].self_attn
    assert is_llama_attention(attention)
    b = batch()
    hidden = torch.randn(2, 64, ARCH["hidden_size"], generator=torch.Generator().manual_seed(1))
    position = model.model.rotary_emb(hidden, b.position_ids)
    kwargs = {k: v for k, v in b.model_kwargs().items() if k not in ("input_ids", "position_ids")}
    want = LlamaAttention.forward(attention, hidden, position, None, **kwargs)[0]
    got = llama_attention_forward(apply_rotary_pos_emb)(attention, hidden, position, None, **kwargs)[0]
    torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_liger_is_refused_without_cuda_in_one_line():
    cfg = load_config(None, ["model.fused_kernels=liger"])
    with pytest.raises(UserError, match="liger runs Triton kernels, which need CUDA, and this machine has none"):
        check_on_this_machine(cfg, cuda_available=False)
    check_on_this_machine(cfg, cuda_available=True)  # the same config plans and loads anywhere
    with pytest.raises(UserError, match="on CUDA, not on cpu"):
        build_model(config("model.fused_kernels=liger"), vocab_size=100)


def test_lctrain_train_refuses_liger_here_in_one_line(tmp_path):
    result = CliRunner().invoke(
        app, ["train", "--set", "model.fused_kernels=liger", "--set", f"train.run_dir={tmp_path / 'run'}"]
    )
    assert "model.fused_kernels=liger runs Triton kernels, which need CUDA" in one_error_line(result)


def test_liger_names_what_is_missing(monkeypatch):
    monkeypatch.setattr(fused.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(UserError, match=r"needs liger-kernel and triton \(pip install liger-kernel\)"):
        fused.require_liger("cuda")


@pytest.mark.parametrize(
    "overrides,match",
    [
        (["model.fused_kernels=liger", "model.rope_fp32=true"], "cannot keep model.rope_fp32"),
        (["model.fused_kernels=compile", "model.tiled_mlp=2"], "replaces the MLP that model.tiled_mlp shards"),
        (["model.fused_kernels=liger", "parallel.zero_stage=3"], "which ZeRO-3 partitions"),
        (["model.fused_kernels=liger", "model.checkpointing=selective_matmul"], "writes in place into matmul outputs"),
        (["model.fused_kernels=compile", "model.checkpointing=selective_matmul"], "set model.checkpointing=selective"),
        (["model.fused_kernels=fast"], "model.fused_kernels"),
    ],
)
def test_contradicting_settings_are_one_line(overrides, match):
    with pytest.raises(UserError, match=match):
        load_config(None, overrides)


def test_fused_optimizer_goes_to_torch_adamw_only():
    def params(*overrides, gpu):
        cfg = load_config(None, list(overrides))
        return deepspeed_config(cfg, RunPlan.of(cfg), gpu=gpu)["optimizer"]["params"]

    assert "fused" not in params(gpu=False)
    assert params("train.fused_optimizer=true", gpu=False)["fused"] is True
    offloaded = ("train.fused_optimizer=true", "parallel.zero_stage=1", "parallel.offload_optimizer=true")
    assert "fused" not in params(*offloaded, gpu=True)  # DeepSpeed's CPU Adam: refused at preflight, below
    with pytest.raises(UserError, match="CPU Adam"):
        check_on_this_machine(load_config(None, list(offloaded)), cuda_available=True)
    check_on_this_machine(load_config(None, [*offloaded, "train.torch_adam=true"]), cuda_available=True)


def _trained_parameters(fused_optimizer: bool, steps: int):
    cfg = config(
        "train.global_batch=1",
        "train.micro_batch=1",
        "train.lr=3e-3",
        "train.grad_clip=0",
        f"train.fused_optimizer={fused_optimizer}",
    )
    trainer = Trainer(cfg, init_topology(cfg), vocab_size=100)
    try:
        assert trainer.engine.optimizer.defaults["fused"] is (True if fused_optimizer else None)
        rng = np.random.default_rng(0)
        for _ in range(steps):
            ids = rng.integers(3, 100, (1, 64))
            ids[:, 0] = 1
            window = {
                "input_ids": ids,
                "seg_lens": [np.array([40, 24])],
                "seg_doc": [np.arange(2)],
                "tag_lens": [np.zeros(2, dtype=np.int64)],
            }
            trainer.train_step([window])
        return [p.detach().clone() for p in trainer.engine.module.parameters()]
    finally:
        del trainer
        release_single_process()


def test_fused_adamw_trains_the_same_parameters():
    steps, lr = 3, 3e-3
    plain, fused_run = _trained_parameters(False, steps), _trained_parameters(True, steps)
    for a, b in zip(fused_run, plain):
        # Each update rounds p - lr * m / (sqrt(v) + eps) once more or less: an ulp or two of the parameter (rtol),
        # and for parameters near 0 a few eps of the update itself (at most lr), which the next steps' gradients
        # carry on (atol: steps x lr x 64 eps; measured: 1 ulp of the norm weights, 1.2e-7 at 1.0)
        torch.testing.assert_close(a, b, atol=steps * lr * 64 * EPS32, rtol=4 * EPS32)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode", ["full", "anchor"])
def test_liger_keeps_losses_and_gradients_on_the_gpu(mode):
    # fp32: Liger's kernels against transformers' eager ops (matmuls without TF32, torch's default); then bf16
    # against that fp32 run: Liger's bf16 error is at most twice eager bf16's (both round the same products to 8 bits)
    common = [f"attention.mode={mode}", "attention.engine=sdpa"]
    fp32 = loss_and_grads(config(*common), device="cuda")
    liger32 = loss_and_grads(config(*common, "model.fused_kernels=liger"), device="cuda")
    assert_relatively_close(liger32, fp32, 1e-4)
    eager16 = loss_and_grads(config(*common, "model.dtype=bfloat16"), device="cuda")
    liger16 = loss_and_grads(config(*common, "model.dtype=bfloat16", "model.fused_kernels=liger"), device="cuda")
    for (loss16, grads16), (loss_l, grads_l), (loss32, grads32) in zip(eager16, liger16, fp32):
        assert abs(loss_l - loss32) <= 2 * abs(loss16 - loss32) + 1e-3 * abs(loss32)
        for g16, gl, g32 in zip(grads16, grads_l, grads32):
            assert (gl - g32).norm() <= 2 * (g16 - g32).norm() + 1e-3 * g32.norm()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_liger_fused_loss_is_the_chunked_sum_scaled_by_the_incoming_gradient():
    gen = torch.Generator(device="cuda").manual_seed(0)
    head = torch.nn.Linear(64, 1000, bias=False, device="cuda")
    hidden = torch.randn(2, 300, 64, device="cuda", generator=gen, requires_grad=True)
    labels = torch.randint(0, 1000, (2, 300), device="cuda", generator=gen)
    labels[:, :7] = -100
    scale = 1 / 37.0  # the trainer's grad_divisor / n_valid: not 1, so a loss that drops it fails
    results = []
    for loss_sum in (
        lambda: chunked_loss_sum(head, hidden, labels, 128),
        lambda: fused.liger_loss_sum(head, hidden, labels),
    ):
        head.zero_grad()
        hidden.grad = None
        loss = loss_sum()
        (loss * scale).backward()
        results.append((loss.detach(), head.weight.grad.clone(), hidden.grad.clone()))
    for got, want in zip(results[1], results[0]):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_liger_is_bound_on_the_instance_only():
    model = build_model(config("model.fused_kernels=liger"), vocab_size=100, device="cuda").model
    plain = build_model(config(), vocab_size=100, device="cuda").model
    layer = model.model.layers[0]
    assert type(layer.input_layernorm).forward is LlamaRMSNorm.forward
    assert layer.input_layernorm.forward.__func__ is not LlamaRMSNorm.forward
    assert layer.self_attn.forward.__func__ is not LlamaAttention.forward
    assert plain.model.layers[0].input_layernorm.forward.__func__ is LlamaRMSNorm.forward
