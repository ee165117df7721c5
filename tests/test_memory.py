"""The memory planner (lctrain/memory.py, `lctrain plan`, `train`'s check).

References: the peak of CPU tensor storage measured through the real `Trainer.train_step` (the profiler's allocator
totals), autograd's saved tensors of a real Llama decoder layer, the parameters of a real model, a per-rank loop over
ZeRO's partitions, and the CLI's one-line errors.
"""

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from memory_helpers import saved_bytes_of_one_layer
from train_helpers import one_error_line
from typer.testing import CliRunner

from lctrain.cli import app
from lctrain.compat.transformers import set_attn_implementation
from lctrain.config import load_config
from lctrain.costmodel import ModelShape
from lctrain.errors import UserError
from lctrain.memory import Budget, layer_saved_bytes, longest_seq_len, plan_memory
from lctrain.units import GB

# set in the fresh process that measures again a peak the suite's process measured too high
MEASURED_ALONE = "LCTRAIN_TEST_MEASURED_ALONE"

VOCAB = 1024
ARCH = dict(
    model_type="llama",
    hidden_size=256,
    intermediate_size=688,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    tie_word_embeddings=False,
)


def config(seq_len, *extra):
    return load_config(
        None,
        [
            f"data.seq_len={seq_len}",
            "model.dtype=float32",
            f"model.arch={json.dumps(ARCH)}",
            "train.global_batch=1",
            "train.micro_batch=1",
            "parallel.zero_stage=0",
            "attention.engine=sdpa",
            *extra,
        ],
    )


def hf_config(dtype=torch.float32, **arch):
    from transformers import AutoConfig

    fields = {k: v for k, v in {**ARCH, **arch}.items() if k != "model_type"}
    return AutoConfig.for_model("llama", vocab_size=VOCAB, dtype=dtype, **fields)


def windows(seq_len):
    from lctrain.data.layouts import slimpajama_like_layouts, window_ids

    seg = slimpajama_like_layouts(seq_len, 1, 0)
    return [
        {
            "input_ids": window_ids(seg, vocab=VOCAB, anchor=1, seed=0),
            "seg_lens": [np.array(s) for s in seg],
            "seg_doc": [np.arange(len(s)) for s in seg],
            "tag_lens": [np.zeros(len(s), dtype=np.int64) for s in seg],
        }
    ]


@pytest.mark.parametrize(
    "extra",
    [
        [],
        ["model.gradient_checkpointing=true"],
        # tiled MLP is in the default suite with ZeRO-1 below; with checkpointing (22 s) it runs with the slow ones
        pytest.param(["model.gradient_checkpointing=true", "model.tiled_mlp=auto"], marks=pytest.mark.slow),
        ["parallel.zero_stage=1", "model.tiled_mlp=4"],
        ["model.checkpointing=selective"],
        # selective checkpointing is in the default suite as `selective`; its matmul policy runs with the slow ones
        pytest.param(["model.checkpointing=selective_matmul"], marks=pytest.mark.slow),
        # the reference engine's dense scores: slow-marked to keep the default suite under its budget
        pytest.param(["attention.engine=reference"], marks=pytest.mark.slow),
        pytest.param(["attention.engine=reference", "model.checkpointing=selective_matmul"], marks=pytest.mark.slow),
        # ZeRO-2 overlapping its reduction keeps two reduce buckets (measured 4,055 MB against 2,148 without, the
        # plan 4,082; DeepSpeed overlaps by default for ZeRO-3 only, which keeps one: 2,182 measured, 2,188 planned)
        pytest.param(["parallel.zero_stage=2", "parallel.overlap_comm=true"], marks=pytest.mark.slow),
    ],
    ids=[
        "plain",
        "checkpointing",
        "checkpointing+tiled",
        "zero1+tiled4",
        "selective",
        "selective_matmul",
        "reference",
        "reference+selective_matmul",
        "zero2+overlap",
    ],
)
def test_prediction_within_15_percent_of_the_measured_peak(extra, request):
    from lctrain.measure import cpu_peak_bytes
    from lctrain.parallel.groups import init_topology, release_single_process
    from lctrain.train.trainer import Trainer

    cfg = config(2048, *extra)
    batch = windows(2048)

    def setup():  # a first step creates the Adam moments: the second is the steady state
        trainer = Trainer(cfg, init_topology(cfg), vocab_size=VOCAB)
        trainer.train_step(batch)
        return trainer

    plan = plan_memory(cfg, ModelShape.from_hf_config(hf_config()), gpu=False)
    predicted = plan.total("device") + plan.total("host")
    # DeepSpeed 0.19.8's ZeRO-1/2 `setup_buckets` allocates a step's reduce bucket after dropping its list of the
    # last one, which is freed only once nothing else holds it: in about 1 run in 6 here the measured step holds
    # both (exactly one more bucket, 2 GB). The plan counts one; the test accepts the other measured state too.
    buckets = [i.bytes for i in plan.items if i.name == "DeepSpeed reduce bucket"]

    def error(peak: int) -> float:
        return min(abs((predicted + extra) / peak - 1) for extra in [0] + buckets)

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        peak = cpu_peak_bytes(setup, lambda trainer: trainer.train_step(batch))[0]
    finally:
        torch.set_num_threads(threads)
        release_single_process()
    if error(peak) > 0.15 and not os.environ.get(MEASURED_ALONE):
        # Twice in a full suite (CI, 2026-11-25 and 2026-11-29) `checkpointing` measured 119.7 MB, twice in a row,
        # where every run alone measures 106.6: the process's allocator, after the hundreds of tests before it, held
        # 13 MB more of the step, which a second measurement in that process kept. The plan is for a training
        # process, not for one with a test suite's past: the same measurement in a fresh process decides.
        alone = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", request.node.nodeid],
            env={**os.environ, MEASURED_ALONE: "1"},
            cwd=request.config.rootpath,
            capture_output=True,
            text=True,
        )
        assert alone.returncode == 0, (predicted / 2**20, peak / 2**20, alone.stdout[-3000:])
        return
    assert error(peak) <= 0.15, (predicted / 2**20, peak / 2**20)


# wide enough that the optimizer partition (100M parameters, 0.4 GB in fp32) outweighs the 1 GB reduce bucket's noise
WIDE = dict(
    ARCH, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8
)


@pytest.mark.slow  # over 20 s on 2 cores: make test-slow
@pytest.mark.parametrize("offload", [False, True], ids=["zero3", "zero3+offload"])
def test_optimizer_step_peak_within_15_percent(offload):
    # short windows: the peak is the optimizer step's (ZeRO-3's flattened gradients, AdamW's temporaries, with the
    # offloaded optimizer's second fp32 gradient buffer), not the backward's
    from transformers import AutoConfig

    from lctrain.measure import cpu_peak_bytes
    from lctrain.parallel.groups import init_topology, release_single_process
    from lctrain.train.trainer import Trainer

    cfg = load_config(
        None,
        [
            "data.seq_len=512",
            "model.dtype=float32",
            f"model.arch={json.dumps(WIDE)}",
            "train.global_batch=1",
            "train.micro_batch=1",
            "parallel.zero_stage=3",
            f"parallel.offload_optimizer={str(offload).lower()}",
            "attention.engine=sdpa",
        ],
    )
    batch = windows(512)

    def setup():
        trainer = Trainer(cfg, init_topology(cfg), vocab_size=VOCAB)
        trainer.train_step(batch)
        return trainer

    try:
        peak, states = cpu_peak_bytes(setup, lambda trainer: trainer.train_step(batch))
    finally:
        release_single_process()
    fields = {k: v for k, v in WIDE.items() if k != "model_type"}
    plan = plan_memory(
        cfg, ModelShape.from_hf_config(AutoConfig.for_model("llama", vocab_size=VOCAB, **fields)), gpu=False
    )
    step = sum(i.bytes for i in plan.items if i.kind == "step")
    assert step > sum(i.bytes for i in plan.items if i.kind in ("saved", "transient"))  # the step's peak is tested
    assert abs((plan.total("device") + plan.total("host")) / peak - 1) <= 0.15, (plan.items, peak, states)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_saved_bytes_match_autograd_saved_tensors(dtype):
    """Every distinct storage autograd keeps of one decoder layer, weights excluded."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from lctrain.attention import ENGINES

    hf = hf_config(dtype)
    set_attn_implementation(hf, ENGINES["sdpa"].hf_name)
    layer = LlamaDecoderLayer(hf, 0).to(dtype)
    tokens = 1024
    measured = saved_bytes_of_one_layer(layer, hf, dtype, tokens, VOCAB)
    # the layer input is the caller's tensor (a checkpointed hidden state), counted apart from the layer
    expected = layer_saved_bytes(ModelShape.from_hf_config(hf), tokens, tokens, dtype.itemsize)
    assert measured == pytest.approx(expected, rel=0.03)


def test_param_count_is_the_models():
    from transformers import AutoModelForCausalLM

    for tied in (False, True):
        hf = hf_config(tie_word_embeddings=tied)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf)
        assert ModelShape.from_hf_config(hf).param_count() == sum(p.numel() for p in model.parameters())


def test_zero2_over_four_ranks_shards_adam_and_gradients():
    shape = ModelShape.from_hf_config(hf_config())
    n = shape.param_count()
    cfg = config(
        1024, "parallel.zero_stage=2", "parallel.nproc_per_node=4", "train.global_batch=4", "model.dtype=bfloat16"
    )
    items = {i.name: i for i in plan_memory(cfg, shape).items}
    per_rank = math.ceil(n / 4)
    partitions = [min(per_rank, n - r * per_rank) for r in range(4)]  # ZeRO pads the last one to per_rank
    assert sum(partitions) == n
    assert items["Adam moments (fp32)"].bytes == 2 * 4 * max(partitions)
    assert items["fp32 master weights"].bytes == 4 * max(partitions)
    assert items["fp32 gradient partition"].bytes == 4 * max(partitions)
    assert items["weights"].bytes == 2 * n  # ZeRO-2 keeps the bf16 weights whole


@pytest.mark.parametrize("stage, overlap, buckets", [(2, "true", 2), (2, "false", 1), (1, "true", 2), (3, "true", 1)])
def test_an_overlapping_zero1_or_2_plans_a_second_reduce_bucket(stage, overlap, buckets):
    cfg = config(2048, f"parallel.zero_stage={stage}", f"parallel.overlap_comm={overlap}")
    plan = plan_memory(cfg, ModelShape.from_hf_config(hf_config()), gpu=True)
    assert sum("reduce bucket" in i.name for i in plan.items) == buckets


@pytest.mark.parametrize(
    "stage,sp,reduce_dtype,element_bytes",
    [
        (2, 1, "float32", 4),
        (3, 1, "float32", 4),
        (3, 2, "float32", 4),
        (2, 1, "bfloat16", 2),
        (3, 1, "bfloat16", 2),
        (3, 2, "bfloat16", 2),
        (2, 2, "bfloat16", 2),
    ],
)
def test_the_reduce_bucket_holds_the_reduce_dtype(stage, sp, reduce_dtype, element_bytes):
    # DeepSpeed's engine reduces gradients in `communication_data_type`, under Ulysses in
    # `seq_parallel_communication_data_type` (fp32 unless set), both parallel.reduce_dtype's; measured by
    # tests/test_memory_bench.py's two-rank run, whose peak is mostly this bucket
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    cfg = config(
        1024,
        f"parallel.zero_stage={stage}",
        f"parallel.nproc_per_node={sp}",
        f"parallel.sequence_parallel={sp}",
        f"parallel.reduce_dtype={reduce_dtype}",
        "model.dtype=bfloat16",
    )
    items = {i.name: i for i in plan_memory(cfg, ModelShape.from_hf_config(hf_config())).items}
    assert items["DeepSpeed reduce bucket"].bytes == DeepSpeedZeroConfig().reduce_bucket_size * element_bytes


@pytest.mark.parametrize("reduce_dtype, cast_bytes", [("float32", None), ("bfloat16", 2)])
def test_bf16_zero1_keeps_every_fp32_gradient_and_no_reduce_bucket(reduce_dtype, cast_bytes):
    """bf16 at ZeRO-1 runs DeepSpeed's BF16_Optimizer (fp32 gradient accumulation): an fp32 gradient of every
    parameter on every rank, all-reduced in place, cast first when the reduction is in bf16. ZeRO's own ZeRO-1 (an
    fp32 model) accumulates this rank's partition, through an fp32 reduce bucket. Measured on two ranks:
    tests/test_memory_ranks.py."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    shape = ModelShape.from_hf_config(hf_config())
    n = shape.param_count()
    common = ["parallel.zero_stage=1", "parallel.nproc_per_node=4", "train.global_batch=4"]
    cfg = config(1024, *common, "model.dtype=bfloat16", f"parallel.reduce_dtype={reduce_dtype}")
    items = {i.name: i for i in plan_memory(cfg, shape).items}
    assert items["fp32 gradients (BF16_Optimizer: every parameter's)"].bytes == 4 * n
    assert "fp32 gradient partition" not in items and "DeepSpeed reduce bucket" not in items
    cast = items.get("gradients cast for the all-reduce")
    assert (cast.bytes if cast else None) == (cast_bytes * n if cast_bytes else None)
    items = {i.name: i for i in plan_memory(config(1024, *common, "model.dtype=float32"), shape).items}
    assert items["fp32 gradient partition"].bytes == 4 * math.ceil(n / 4)
    assert items["DeepSpeed reduce bucket"].bytes == DeepSpeedZeroConfig().reduce_bucket_size * 4


def test_offload_moves_optimizer_states_to_the_host():
    shape = ModelShape.from_hf_config(hf_config())
    n = shape.param_count()
    overrides = [
        "parallel.zero_stage=3",
        "model.dtype=bfloat16",
        "parallel.offload_optimizer=true",
        "parallel.offload_params=true",
    ]
    on_gpu = plan_memory(config(1024, *overrides), shape)  # the trainer's choice there: DeepSpeed's CPU Adam
    pinned = 2 ** math.ceil(math.log2(4 * n))  # PyTorch's page-locked blocks are powers of two
    assert {i.name: i.bytes for i in on_gpu.items if i.where == "host"} == {
        "weights (ZeRO-3 shard)": 2 * n,
        "fp32 gradient partition": pinned,
        "fp32 gradients of the host step": pinned,
        "fp32 master weights": 4 * n,
        "Adam moments (fp32)": 8 * n,
        "unpinned copy while the engine is built": 4 * n,
    }
    assert not [i for i in on_gpu.items if i.kind == "step"]  # CPU Adam updates in place
    states = sum(i.bytes for i in on_gpu.items if i.where == "host" and i.kind == "state")
    assert on_gpu.total("host") == states + 4 * n  # the construction's copy is this plan's host peak
    with_torch_adam = plan_memory(config(1024, *overrides, "train.torch_adam=true"), shape)
    assert [(i.name, i.bytes, i.where) for i in with_torch_adam.items if i.kind == "step"] == [
        ("AdamW temporaries", 2 * 4 * n, "host")
    ]  # single-tensor AdamW on host tensors: sqrt(v) and its quotient
    zero2 = plan_memory(
        config(1024, "parallel.zero_stage=2", "model.dtype=bfloat16", "parallel.offload_optimizer=true"), shape
    )
    assert {i.name: i.bytes for i in zero2.items if i.where == "host"} == {  # stage_1_and_2.py's pinned buffers
        "fp32 gradient partition": pinned,
        "fp32 master weights": pinned,
        "Adam moments (fp32)": 8 * n,
        "model-dtype partition for the upload": 2 ** math.ceil(math.log2(2 * n)),
        "unpinned copy while the engine is built": 4 * n,
    }
    on_cpu = plan_memory(config(1024, *overrides), shape, gpu=False)  # nothing is page-locked on the CPU
    assert {i.name: i.bytes for i in on_cpu.items}["fp32 gradient partition"] == 4 * n
    assert not [i for i in on_cpu.items if i.kind == "build"]


def test_longest_seq_len_fits_and_the_next_does_not():
    shape = ModelShape.from_hf_config(hf_config())
    cfg = config(1024, "model.gradient_checkpointing=true")
    budget = Budget(device=int(2 * GB), host=64 * 2**30, label="test")
    longest = longest_seq_len(cfg, shape, budget)
    assert longest % 1024 == 0
    assert budget.fits(plan_memory(config(longest, "model.gradient_checkpointing=true"), shape))
    assert not budget.fits(plan_memory(config(longest + 1024, "model.gradient_checkpointing=true"), shape))


def test_a_longest_seq_len_at_the_search_limit_is_a_lower_bound():
    from lctrain.memory import searched_to_the_limit

    shape = ModelShape.from_hf_config(hf_config())
    cfg = config(1024, "model.gradient_checkpointing=true")
    roomy = Budget(device=10**18, host=10**18, label="test")
    longest = longest_seq_len(cfg, shape, roomy, limit=64 * 1024)
    assert longest == 63 * 1024 and searched_to_the_limit(cfg, longest, limit=64 * 1024)
    tight = longest_seq_len(cfg, shape, Budget(device=int(2 * GB), host=64 * 2**30, label="test"))
    assert not searched_to_the_limit(cfg, tight)


def test_every_fix_offered_lowers_a_memory_and_one_window_per_pass_is_one():
    """The fixes table lists settings that lower the memory: on one process, ZeRO-3's buffers and the parameter
    offload it needs raised both memories and were listed (checkpointing explorer); a micro-batch of several windows
    was never offered one window per pass."""
    from lctrain.memory import fixes

    shape = ModelShape.from_hf_config(hf_config())
    cfg = config(2048, "train.global_batch=4", "train.micro_batch=4")
    budget = Budget(device=1 << 20, host=1 << 40, label="test")
    base = budget.need(plan_memory(cfg, shape))
    found = fixes(cfg, shape, budget)
    assert found and all(f.device < base[0] or f.host < base[1] for f in found)
    assert not any("parallel.zero_stage=3" in f.overrides for f in found)
    one = [f for f in found if f.overrides == ("train.micro_batch=1",)]
    assert one and one[0].device < base[0]


def test_fixes_combine_when_none_fits_alone():
    from lctrain.config import with_overrides
    from lctrain.memory import fixes

    shape = ModelShape.from_hf_config(hf_config(num_hidden_layers=16))
    cfg = config(
        16384,
        "parallel.zero_stage=3",
        "model.dtype=bfloat16",
        "model.gradient_checkpointing=true",
        "model.tiled_mlp=auto",
    )
    plain = plan_memory(cfg, shape)
    # a device between the plain plan less its optimizer states and less its hidden states too: each alone falls
    # short, both together fit
    states = sum(
        i.bytes
        for i in plain.items
        if i.name in ("fp32 master weights", "Adam moments (fp32)", "fp32 gradient partition")
    )
    hidden = sum(i.bytes for i in plain.items if i.name.startswith("checkpointed hidden states"))
    need = Budget(device=1 << 50, host=1 << 50, label="any").need(plain)[0]  # with the runtime overhead
    budget = Budget(device=need - states - hidden // 2, host=1 << 40, label="test")
    found = fixes(cfg, shape, budget)
    assert found[0].fits and all(not f.fits for f in found[1:])
    combined = set(found[0].overrides)
    assert {"parallel.offload_optimizer=true", "model.offload_activations=true"} <= combined
    want = plan_memory(with_overrides(cfg, list(found[0].overrides), "test"), shape)
    assert (found[0].device, found[0].host) == budget.need(want)


def test_combined_fixes_keep_the_zero_stage_their_offloads_need():
    """From ZeRO-0 the optimizer offload alone asks for ZeRO-1 and the weight offload for ZeRO-3; combined, whatever
    their order, they run at ZeRO-3 (ZeRO-1 would leave offload_params without the stage it needs)."""
    from lctrain.memory import fixes
    from lctrain.model import model_shape

    # Llama-2-7B's shape: its optimizer states and weights, not DeepSpeed's buffers, are what the offloads move
    cfg = load_config("llama2_64k_anchor", ["parallel.zero_stage=0", "model.dtype=float32"])
    found = fixes(cfg, model_shape(cfg), Budget(device=1000, host=1 << 50, label="test"))
    combined = max(found, key=lambda f: len(f.overrides)).overrides
    assert {"parallel.offload_optimizer=true", "parallel.offload_params=true"} <= set(combined)
    assert [o for o in combined if o.startswith("parallel.zero_stage=")] == ["parallel.zero_stage=3"]


def test_train_refuses_beyond_a_known_gpu_naming_fixes(monkeypatch):
    import lctrain.plan as plan

    # 7.08 GB planned, 5.68 with checkpointing (the runtime's 1.07 included): within 90% of 6.6 GB
    monkeypatch.setattr(plan, "local_budget", lambda: (Budget(int(6.6 * GB), 64 * 2**30, "test GPU"), True))
    with pytest.raises(UserError, match="does not fit.*would fit: .*gradient_checkpointing=true"):
        plan.memory_warning(config(16384))
    monkeypatch.setattr(plan, "local_budget", lambda: (Budget(None, int(1.1 * GB), "CPU"), False))
    monkeypatch.setattr(plan, "machine_memory", lambda: 64 * 2**30)
    assert plan.memory_warning(config(4096)).startswith("warning: ")


def test_train_refuses_a_cpu_plan_beyond_the_machines_memory_and_swap(monkeypatch):
    """A config without `base:` is the full-size Llama: its plan on a 24 GB machine was 195 GB, and the kernel killed
    the run 3 minutes later without a word from lctrain."""
    import lctrain.plan as plan
    from lctrain.model import model_shape

    cfg = config(4096)
    host = Budget(None, 1 << 50, "CPU").need(plan_memory(cfg, model_shape(cfg), False))[1]
    monkeypatch.setattr(plan, "local_budget", lambda: (Budget(None, host // 4, "CPU"), False))
    monkeypatch.setattr(plan, "machine_memory", lambda: host // 2)
    with pytest.raises(UserError, match=rf"does not fit: the memory plan needs {host / GB:.1f} GB of host memory .*"
                       rf"more than this machine's {host / 2 / GB:.1f} GB of memory and swap"):  # fmt: skip
        plan.memory_warning(cfg)
    monkeypatch.setattr(plan, "fixes", lambda *args: [])  # nothing of this model fits: say what is left
    with pytest.raises(UserError, match=r"no setting `lctrain plan` knows of fits it: a smaller model \(model"):
        plan.memory_warning(cfg)
    monkeypatch.setattr(plan, "machine_memory", lambda: host + 1)
    assert plan.memory_warning(cfg).startswith("warning: ")


def test_tiny_demo_plans_without_a_warning():
    from lctrain.plan import memory_warning

    assert memory_warning(load_config(None, [])) is None


def test_plan_cli_prints_a_verdict_and_json(tmp_path):
    out = tmp_path / "plan.json"
    result = CliRunner().invoke(app, ["plan", "--gpu-mem", "80", "--host-mem", "64", "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "FITS" in result.output
    assert json.loads(out.read_text())["fits"] is True
    assert "memory per rank: tiny_anchor, model llama (model.arch), seq_len 1,024" in result.output
    # the model planned, also when a --set replaces the config file's
    sets = ["--set", "model.arch=null", "--set", "model.name_or_path=meta-llama/Llama-2-7b-hf"]
    result = CliRunner().invoke(app, ["plan", "--gpu-mem", "80", *sets, "--json", str(out)])
    assert "memory per rank: tiny_anchor, model meta-llama/Llama-2-7b-hf, seq_len 1,024" in result.output
    assert json.loads(out.read_text())["model"] == "meta-llama/Llama-2-7b-hf"


def test_plan_json_to_stdout_is_the_file_a_script_pipes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "plan.json"
    args = ["plan", "--gpu-mem", "80", "--host-mem", "64"]
    assert CliRunner().invoke(app, [*args, "--json", str(out)]).exit_code == 0
    piped = CliRunner().invoke(app, [*args, "--json", "-"])
    assert piped.exit_code == 0, piped.output
    piped_plan, written_plan = json.loads(piped.stdout), json.loads(out.read_text())  # the JSON alone: the table
    for plan in (piped_plan, written_plan):  # went to stderr; the free disk is read when planned (plan.json took some)
        del plan["disk"]["free_bytes"]
    assert piped_plan == written_plan
    assert "FITS" in piped.stderr and "memory per rank" in piped.stderr
    assert not (tmp_path / "-").exists()


@pytest.mark.parametrize(
    "args",
    [["--gpu-mem", "-1"], ["--host-mem", "0"], ["-c", "no_such_config"], ["--json", "/proc/no_such_dir/plan.json"]],
)
def test_plan_cli_bad_input_is_one_line(args):
    one_error_line(CliRunner().invoke(app, ["plan", *args]))


@pytest.mark.parametrize(
    "name,published",
    [
        ("meta-llama/Llama-2-7b-hf", 6_738_415_616),
        ("meta-llama/Meta-Llama-3-8B", 8_030_261_248),
        ("mistralai/Mistral-7B-v0.3", 7_248_023_552),
    ],
)
def test_known_base_models_have_their_published_parameter_counts(name, published):
    from lctrain.model import model_shape

    cfg = load_config(None, [f"model.name_or_path={name}", "model.arch=null"])
    assert model_shape(cfg).param_count() == published


def test_plan_of_a_paper_config_needs_no_download():
    """Llama-2 is gated on the hub and this machine is offline: the paper's configs plan from the known shape."""
    result = CliRunner().invoke(app, ["plan", "-c", "llama2_128k_anchor", "--gpu-mem", "80", "--host-mem", "1000"])
    assert result.exit_code == 0, result.output
    assert "FITS" in result.output and "longest seq_len that fits" in result.output


def test_selective_checkpointing_keeps_attention_outputs_and_is_suggested_when_it_fits():
    from lctrain.memory import SELECTIVE, faster_fit, fixes, kept_bytes

    shape = ModelShape.from_hf_config(hf_config())
    full, selective, none = (config(8192, f"model.checkpointing={m}") for m in ("full", "selective", "none"))
    kept = sum(i.bytes for i in plan_memory(selective, shape).items if i.name.startswith("kept by selective"))
    # per layer and token: the attention output (width values) and one fp32 log-sum-exp per head
    assert kept == shape.layers * 8192 * (shape.width * 4 + shape.heads * 4)
    assert kept_bytes(shape, 8192, 4, "full") == kept_bytes(shape, 8192, 4, "none") == 0
    need = {
        name: Budget(device=1 << 50, host=1 << 50, label="any").need(plan_memory(c, shape))[0]
        for name, c in (("full", full), ("selective", selective), ("none", none))
    }
    assert need["full"] < need["selective"] < need["none"]
    roomy = Budget(device=need["selective"], host=1 << 40, label="test")
    assert faster_fit(full, shape, roomy).overrides == (SELECTIVE,)
    assert faster_fit(selective, shape, roomy) is None and faster_fit(none, shape, roomy) is None
    assert faster_fit(full, shape, Budget(device=need["selective"] - 1, host=1 << 40, label="test")) is None
    # without checkpointing and out of memory, selective leads the fixes when it fits
    assert fixes(none, shape, roomy)[0].overrides == (SELECTIVE,)


def test_flex_keeps_nothing_under_selective_checkpointing_so_the_plan_counts_and_suggests_full():
    """flex trains compiled on CUDA, out of the checkpoint policy's sight (0 bytes kept beyond whole-layer
    checkpointing on an H100): its selective plan is full's, and selective is never the suggested fix for it."""
    from lctrain.costmodel import hardware_step_flops
    from lctrain.memory import SELECTIVE, faster_fit, fixes

    shape = ModelShape.from_hf_config(hf_config())
    flex = {m: config(8192, f"model.checkpointing={m}", "attention.engine=flex") for m in ("full", "selective", "none")}
    any_budget = Budget(device=1 << 50, host=1 << 50, label="any")
    assert any_budget.need(plan_memory(flex["selective"], shape)) == any_budget.need(plan_memory(flex["full"], shape))
    full_need = any_budget.need(plan_memory(flex["full"], shape))[0]
    roomy = Budget(device=2 * full_need, host=1 << 40, label="test")
    assert faster_fit(flex["full"], shape, roomy) is None
    assert all(SELECTIVE not in f.overrides for f in fixes(flex["none"], shape, Budget(device=1, host=1, label="t")))
    args = (shape, shape.linear_params(), 8192, 8192 * 8193 // 2)
    assert hardware_step_flops(*args, "selective", attention_kept=False) == hardware_step_flops(*args, "full")
    assert hardware_step_flops(*args, "selective") < hardware_step_flops(*args, "full")
