"""`lctrain plan`'s verdict and advice (lctrain/plan.py, the fixes of lctrain/memory.py): the 90% budget, the fixes
offered, the layouts refused, the reference engine's dense scores.

References: the one-line refusal `lctrain train` gives, the config's own checks, hand arithmetic of the 90% budget
and of the sequence-parallel sizes a head count allows, a brute-force search over the fixes without offload,
autograd's saved tensors of a reference-engine layer.
"""

import itertools
import json

import pytest
import torch
from memory_helpers import saved_bytes_of_one_layer
from typer.testing import CliRunner

from lctrain.cli import app
from lctrain.compat.transformers import set_attn_implementation
from lctrain.config import load_config, with_overrides
from lctrain.costmodel import ModelShape
from lctrain.errors import UserError
from lctrain.memory import Budget, fixes, plan_memory
from lctrain.model import model_shape
from lctrain.train.runplan import RunPlan
from lctrain.units import GB

ROOMY = Budget(device=1 << 50, host=1 << 50, label="roomy")


def need(cfg, shape=None):
    """(device, host) bytes `cfg`'s plan needs on a GPU, runtime included."""
    return ROOMY.need(plan_memory(cfg, shape or model_shape(cfg)))


def sp_sizes(found) -> set[int]:
    return {int(o.split("=")[1]) for f in found for o in f.overrides if o.startswith("parallel.sequence_parallel=")}


def known_gpu(monkeypatch, device: int, host: int = 1 << 42):
    import lctrain.plan as plan

    monkeypatch.setattr(plan, "local_budget", lambda: (Budget(device, host, "test GPU"), True))
    return plan


# --- fixes the config's checks refuse are left out


def test_plan_with_fused_kernels_leaves_out_the_tiled_mlp_it_refuses(monkeypatch):
    result = CliRunner().invoke(
        app, ["plan", "-c", "llama2_128k_anchor", "--gpu-mem", "80", "--set", "model.fused_kernels=compile"]
    )
    assert result.exit_code == 0, result.output
    assert "FITS" in result.output
    cfg = load_config("llama2_128k_anchor", ["model.fused_kernels=compile"])
    found = fixes(cfg, model_shape(cfg), Budget(int(24 * GB), 1 << 42, "24 GB"))
    assert found and not any(o.startswith("model.tiled_mlp") for f in found for o in f.overrides)
    for f in found:  # each one runs: the config's own checks accept it
        RunPlan.of(with_overrides(cfg, list(f.overrides), "test"))
    # train's preflight on a GPU the plan exceeds: the refusal names fixes, not a check of a fix of its own
    plan = known_gpu(monkeypatch, int(24 * GB))
    with pytest.raises(UserError, match="does not fit: .*these would fit: parallel.offload_optimizer=true"):
        plan.memory_warning(cfg)


# --- a sequence-parallel size that does not split the heads

SIX_HEADS = [
    "--set",
    "model.arch.num_attention_heads=6",
    "--set",
    "model.arch.hidden_size=192",
    "--set",
    "parallel.nproc_per_node=4",
    "--set",
    "parallel.sequence_parallel=4",
]


def test_plan_refuses_what_train_refuses_in_the_same_line(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    trained = CliRunner().invoke(app, ["train", "-c", "tiny_anchor_sp2", *SIX_HEADS])
    planned = CliRunner().invoke(app, ["plan", "-c", "tiny_anchor_sp2", "--gpu-mem", "80", *SIX_HEADS])
    assert trained.exit_code == planned.exit_code == 2, (trained.output, planned.output)
    assert "6 attention heads are not divisible by parallel.sequence_parallel = 4" in trained.output
    assert planned.output.strip().splitlines() == trained.output.strip().splitlines()[-1:]


def shaped(heads: int, kv_heads: int, *overrides: str):
    arch = dict(model_type="llama", hidden_size=64 * heads, intermediate_size=512, num_hidden_layers=2)
    arch |= dict(num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=1024)
    cfg = load_config(
        None,
        [
            f"model.arch={json.dumps(arch)}",
            "data.seq_len=3072",
            "train.global_batch=24",
            "train.micro_batch=1",
            "parallel.sequence_parallel=1",
            *overrides,
        ],
    )
    return cfg, ModelShape(2, 64 * heads, heads, kv_heads, 64, 512, 1024)


@pytest.mark.parametrize(
    "heads,kv_heads,world,allowed",
    [
        (6, 2, 8, {2}),  # 4 and 8 do not divide 6 heads
        (6, 6, 6, {2, 3, 6}),  # every divisor of the world, not only the doubling of the group
        (8, 2, 8, {2, 4, 8}),  # fewer KV heads than ranks: replicated, as train does
    ],
)
def test_fixes_offer_every_sequence_parallel_size_that_splits_the_heads(heads, kv_heads, world, allowed):
    cfg, shape = shaped(heads, kv_heads, f"parallel.nproc_per_node={world}")
    found = fixes(cfg, shape, Budget(1000, 1 << 50, "nothing fits"))
    assert sp_sizes(found) == allowed


# --- the 90% budget, and the memory that is over it


def test_plan_and_train_hold_a_plan_to_90_percent_of_the_device(monkeypatch):
    cfg = load_config("llama2_128k_anchor", [])
    device, host = need(cfg)
    plan = known_gpu(monkeypatch, round(device / 0.95))  # 95% of the GPU: within it, above 90%
    from lctrain.plan import report

    r = report(cfg, Budget(round(device / 0.95), 1 << 42, "test GPU"))
    assert not r["fits"] and r["over"] == ["device"]
    assert r["device_budget_bytes"] == int(0.9 * round(device / 0.95))
    warning = plan.memory_warning(cfg)
    assert "above 90% of the device memory" in warning and "host memory, this" not in warning
    known_gpu(monkeypatch, round(device / 0.85))
    assert plan.memory_warning(cfg) is None
    assert report(cfg, Budget(round(device / 0.85), 1 << 42, "test GPU"))["fits"]


def test_train_warns_of_the_host_when_the_host_is_over(monkeypatch):
    cfg = load_config("llama2_128k_anchor", ["model.offload_activations=true"])
    device, host = need(cfg)
    plan = known_gpu(monkeypatch, 2 * device, round(host / 0.95))
    assert "above 90% of the host memory" in plan.memory_warning(cfg)


def test_the_longest_seq_len_fits_in_90_percent_and_the_next_does_not():
    from lctrain.plan import report

    cfg = load_config("llama2_128k_anchor", [])
    memory = Budget(int(80 * GB), int(512 * GB), "80 GB")
    longest = report(cfg, memory)["longest_seq_len"]
    at = need(with_overrides(cfg, [f"data.seq_len={longest}"], "test"))[0]
    beyond = need(with_overrides(cfg, [f"data.seq_len={longest + 8 * 1024}"], "test"))[0]
    assert at <= 0.9 * 80 * GB < beyond


def test_plan_prints_the_budget():
    result = CliRunner().invoke(app, ["plan", "-c", "llama2_128k_anchor", "--gpu-mem", "80", "--host-mem", "512"])
    assert result.exit_code == 0, result.output
    assert "needed of 72.00 GB, 90% of 80.00 GB" in result.output
    assert "of 460.80 GB, 90% of 512.00 GB" in result.output
    assert "FITS in 90% of the memory" in result.output


# --- the fixes: full checkpointing from selective, the cheapest combination


def test_full_checkpointing_is_offered_from_selective():
    cfg = load_config("llama2_128k_anchor", ["model.checkpointing=selective"])
    full = need(with_overrides(cfg, ["model.checkpointing=full"], "test"))[0]
    assert full < need(cfg)[0]
    found = fixes(cfg, model_shape(cfg), Budget(full, 1 << 42, "between full and selective"))
    assert found[0].overrides == ("model.checkpointing=full",) and found[0].fits


def test_the_combined_fix_offloads_nothing_when_a_fit_without_offload_exists():
    """The user's case: fp32 at ZeRO-1 and SP 2 on 8 x 80 GB. Found by brute force over every combination of the
    fixes that move nothing to the host; the combined row must be one of them."""
    cfg = load_config(
        "llama2_128k_anchor", ["model.dtype=float32", "parallel.zero_stage=1", "parallel.sequence_parallel=2"]
    )
    shape = model_shape(cfg)
    budget = Budget(int(80 * GB), int(512 * GB), "80 GB").planned()
    found = fixes(cfg, shape, budget)
    assert not any(f.fits for f in found if len(f.overrides) == 1)
    fitting = []
    for sp, zero, tiled in itertools.product([None, 4, 8], [None, 2, 3], [False, True]):
        overrides = [f"parallel.sequence_parallel={sp}"] * bool(sp) + [f"parallel.zero_stage={zero}"] * bool(zero)
        overrides += ["model.tiled_mlp=auto"] * tiled
        if overrides and budget.fits(plan_memory(with_overrides(cfg, overrides, "test"), shape)):
            fitting.append(set(overrides))
    assert fitting
    (combined,) = [f for f in found if f.fits]
    assert not any("offload" in o for o in combined.overrides)
    assert set(combined.overrides) in fitting
    assert set(combined.overrides) == {"parallel.sequence_parallel=8", "parallel.zero_stage=2"}


def test_a_fit_without_offload_comes_before_an_offload_that_fits_alone():
    """Llama-3-8B at 128K on 4 x 80 GB from ZeRO-1 and SP 2: the optimizer offload fits alone, and so does sequence
    parallel 4 under ZeRO-3, which neither fits alone. Found by brute force over the settings that move nothing to
    the host; the first row must be one of them, before every offload."""
    cfg = load_config(
        "llama3_128k_anchor", ["parallel.nproc_per_node=4", "parallel.zero_stage=1", "parallel.sequence_parallel=2"]
    )
    shape = model_shape(cfg)
    budget = Budget(int(80 * GB), int(1000 * GB), "80 GB").planned()
    found = fixes(cfg, shape, budget)
    offloads = [f for f in found if f.fits and any("offload" in o for o in f.overrides)]
    assert offloads and all(len(f.overrides) <= 2 for f in offloads)
    fitting = []
    for sp, zero, tiled in itertools.product([None, 4], [None, 3], [False, True]):
        overrides = [f"parallel.sequence_parallel={sp}"] * bool(sp) + [f"parallel.zero_stage={zero}"] * bool(zero)
        overrides += ["model.tiled_mlp=auto"] * tiled
        if overrides and budget.fits(plan_memory(with_overrides(cfg, overrides, "test"), shape)):
            fitting.append(set(overrides))
    assert fitting and all(len(f) > 1 for f in fitting)  # none fits alone
    assert found[0].fits and set(found[0].overrides) in fitting
    assert found.index(found[0]) < min(found.index(f) for f in offloads)


# --- selective checkpointing never below full


@pytest.mark.parametrize(
    "overrides",
    [
        ["parallel.zero_stage=1", "parallel.sequence_parallel=8"],  # the end of the backward is the peak
        ["parallel.zero_stage=1", "parallel.sequence_parallel=2"],
        ["parallel.zero_stage=3", "parallel.sequence_parallel=8"],
        ["parallel.zero_stage=0", "model.dtype=float32", "data.seq_len=16384"],
        ["parallel.zero_stage=2", "model.tiled_mlp=auto", "model.offload_activations=true"],
    ],
)
def test_selective_checkpointing_plans_at_least_full(overrides):
    full = load_config("llama2_128k_anchor", [*overrides, "model.checkpointing=full"])
    selective = with_overrides(full, ["model.checkpointing=selective"], "test")
    for gpu in (True, False):
        full_plan, selective_plan = (plan_memory(c, model_shape(c), gpu) for c in (full, selective))
        for where in ("device", "host"):
            assert selective_plan.total(where) >= full_plan.total(where)


# --- --nproc


def test_plan_names_nproc_when_its_layout_cannot_run():
    from lctrain.plan import plan

    with pytest.raises(UserError) as refused:
        plan(load_config("llama2_64k_anchor", []), gpu_mem_gb=80, nproc=3)
    message = str(refused.value)
    assert message.startswith("--nproc 3: ") and "parallel.sequence_parallel = 4" in message
    assert "--set" not in message
    assert plan(load_config("llama2_64k_anchor", []), gpu_mem_gb=80, nproc=4)["ranks_per_host"] == 4


# --- the reference engine's dense scores


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_engine_saved_bytes_match_autograd(dtype):
    """Every distinct storage autograd keeps of one decoder layer through the reference engine, weights excluded:
    the plan's layer with its dense scores, and the boolean mask the layer shares with the others."""
    from transformers import AutoConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from lctrain.attention import ENGINES
    from lctrain.memory import layer_saved_bytes

    hf = AutoConfig.for_model(
        "llama",
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        dtype=dtype,
    )
    set_attn_implementation(hf, ENGINES["reference"].hf_name)
    layer = LlamaDecoderLayer(hf, 0).to(dtype)
    tokens = 1024
    measured = saved_bytes_of_one_layer(layer, hf, dtype, tokens, 1024)
    scores = 4 * tokens * tokens  # heads x tokens x tokens
    shape = ModelShape.from_hf_config(hf)
    expected = layer_saved_bytes(shape, tokens, tokens, dtype.itemsize, scores) + tokens * tokens
    assert measured == pytest.approx(expected, rel=0.03)


def test_reference_engine_at_128k_does_not_fit_and_is_told_to_use_a_kernel():
    cfg = load_config("llama2_128k_anchor", ["attention.engine=reference"])
    items = {i.name: i.bytes for i in plan_memory(cfg, model_shape(cfg)).items}
    # 32 heads over 8 ranks, 131,072^2 scores each: the fp32 softmax, its bf16 copy and two fp32 gradients
    assert items["one layer recomputed"] >= 4 * 131072**2 * (4 + 2 + 2 * 4)
    result = CliRunner().invoke(
        app, ["plan", "-c", "llama2_128k_anchor", "--gpu-mem", "80", "--set", "attention.engine=reference"]
    )
    assert result.exit_code == 0, result.output
    assert "DOES NOT FIT" in result.output
    first_fix = result.output.split("settings that lower the memory")[1]
    assert "attention.engine=auto" in first_fix.splitlines()[4]
