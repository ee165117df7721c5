"""The compat modules: each library internal or version difference lctrain relies on, checked against the installed
library (and, for the version differences, against a stand-in of the older API)."""

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import tomllib
import torch
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

from lctrain.compat.deepspeed import (
    DEEPSPEED_VERSION,
    disable_cpu_shm_comm_op,
    no_bf16_optimizer_load_print,
    no_bf16_optimizer_memory_report,
)
from lctrain.compat.transformers import (
    TRANSFORMERS_RELEASES,
    nested_rope_keys,
    quiet_gguf_conversion,
    rotary_in_fp32,
    set_attn_implementation,
)
from lctrain.config import load_config
from lctrain.errors import UserError
from lctrain.train.metrics import import_wandb


def test_nested_rope_keys_on_the_installed_transformers_and_the_5_17_fallback():
    from transformers import AutoConfig

    assert nested_rope_keys(AutoConfig.for_model("llama")) == []
    # transformers 5.17 has no nested_rope_parameter_keys: the keys that are layer types mark a nested dict
    old = SimpleNamespace(
        rope_parameters={"full_attention": {"rope_theta": 1e6}, "sliding_attention": {}},
        layer_types=["sliding_attention", "full_attention"],
    )
    assert nested_rope_keys(old) == ["full_attention", "sliding_attention"]
    flat = SimpleNamespace(rope_parameters={"rope_type": "default", "rope_theta": 1e4}, layer_types=None)
    assert nested_rope_keys(flat) == []


def test_the_attention_implementation_set_on_a_config_is_the_one_the_model_runs():
    from transformers import AutoConfig, AutoModelForCausalLM

    from lctrain.attention import ENGINES
    from lctrain.errors import UserError

    config = AutoConfig.for_model(
        "llama", hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, vocab_size=10
    )
    set_attn_implementation(config, ENGINES["sdpa"].hf_name)
    model = AutoModelForCausalLM.from_config(config)
    # lctrain's engine runs, and fails closed without the batch's segments
    with pytest.raises(UserError, match="got no segment metadata"):
        model(input_ids=torch.zeros(1, 4, dtype=torch.long))


def test_cpu_runs_skip_deepspeeds_op_probe(monkeypatch):
    import deepspeed.ops

    monkeypatch.delitem(vars(deepspeed.ops), "__compatible_ops__", raising=False)
    monkeypatch.setattr(deepspeed.ops, "_probe_compatible_ops", lambda: pytest.fail("op probe ran"))
    disable_cpu_shm_comm_op()
    assert deepspeed.ops.__compatible_ops__ == {"deepspeed_shm_comm": False}
    from deepspeed.comm.torch import build_shm_op

    assert build_shm_op() is None  # what deepspeed.comm does with it on a CPU accelerator: no build


def test_wandb_is_optional_with_one_clear_line(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "wandb", None)  # as on a machine without the extra
    cfg = load_config(None, ["logging.wandb=offline"])
    with pytest.raises(
        UserError, match=r"logging.wandb = offline needs Weights & Biases \(pip install 'lctrain\[wandb\]'\)"
    ):
        import_wandb(cfg)


def test_deepspeed_is_the_release_the_compat_entries_were_checked_against():
    import deepspeed

    assert deepspeed.__version__ == DEEPSPEED_VERSION, (
        f"DeepSpeed {deepspeed.__version__} is installed; lctrain/compat/deepspeed.py was written against "
        f"{DEEPSPEED_VERSION}: re-check __compatible_ops__, parallel_state_sp as mpu, "
        f"_zero3_consolidated_16bit_state_dict, the gradient averaging rule (tests/test_parallel_equivalence.py) and "
        f"TiledMLP's ready-gradient count (tests/test_tiled_mlp.py), the checkpoint offload context, the "
        f"accelerator it consults and its unpack's `_restore_tensor(cache=...)` (tests/test_offload_activations.py), "
        f"then update DEEPSPEED_VERSION"
    )


def test_the_bf16_optimizers_forced_memory_report_is_silent_while_the_engine_is_built(capsys):
    """BF16_Optimizer reports memory through its module's `see_memory_usage` (printing, whatever the log level): the
    name the context replaces, and only for its duration."""
    import inspect

    from deepspeed.runtime import bf16_optimizer

    assert "see_memory_usage(" in inspect.getsource(bf16_optimizer.BF16_Optimizer.__init__)
    with no_bf16_optimizer_memory_report():
        bf16_optimizer.see_memory_usage("begin bf16_optimizer", force=True)
    assert capsys.readouterr().out == ""
    bf16_optimizer.see_memory_usage("begin bf16_optimizer", force=True)
    assert "begin bf16_optimizer" in capsys.readouterr().out


def test_the_bf16_optimizers_print_on_loading_a_checkpoint_is_silent_while_it_loads(capsys):
    """The print sits in `_load_legacy_checkpoint`; the context shadows `print` in that module alone, while it lasts."""
    import inspect

    from deepspeed.runtime import bf16_optimizer

    assert "print(" in inspect.getsource(bf16_optimizer.BF16_Optimizer._load_legacy_checkpoint)
    in_module = vars(bf16_optimizer)
    with no_bf16_optimizer_load_print():
        eval("print('_load_legacy_checkpoint')", in_module)
        print("lctrain's own line")
    assert capsys.readouterr().out == "lctrain's own line\n"
    eval("print('_load_legacy_checkpoint')", in_module)
    assert capsys.readouterr().out == "_load_legacy_checkpoint\n"


QUIET_AND_IMPORT = """
import sys
from lctrain.compat.deepspeed import quiet_cpu_fallback_notice
if sys.argv[1] == "quiet":
    quiet_cpu_fallback_notice()
import deepspeed
deepspeed.utils.logger.warning("another warning")
"""


@pytest.mark.parametrize("quiet", [True, False])
def test_deepspeeds_cpu_fallback_notice_alone_is_filtered(quiet):
    # a process of its own: DeepSpeed decides its accelerator, and warns, once per process
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"} | {"CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, "-c", QUIET_AND_IMPORT, "quiet" if quiet else "loud"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    output = proc.stdout + proc.stderr
    assert "another warning" in output
    assert ("Setting accelerator to CPU" in output) is not quiet, output


def test_sequence_parallel_state_module_is_what_the_engine_reads_from_mpu():
    import inspect

    import deepspeed.runtime.sequence_parallel.parallel_state_sp as sp_state
    from deepspeed.runtime.engine import DeepSpeedEngine

    engine_source = inspect.getsource(DeepSpeedEngine)
    for name in (
        "get_sequence_parallel_group",
        "get_sequence_parallel_world_size",
        "get_sequence_data_parallel_group",
        "get_sequence_data_parallel_world_size",
    ):
        assert callable(getattr(sp_state, name)), name  # the module lctrain passes as mpu has it
        assert f"mpu.{name}" in engine_source or name in engine_source, name  # and the engine asks for it
    assert inspect.signature(sp_state.initialize_sequence_parallel).parameters.keys() >= {"sequence_parallel_size"}


def test_zero3_full_state_dict_is_what_save_16bit_model_gathers(monkeypatch):
    import inspect

    from deepspeed.runtime.engine import DeepSpeedEngine

    assert "_zero3_consolidated_16bit_state_dict(" in inspect.getsource(DeepSpeedEngine.save_16bit_model)
    assert list(inspect.signature(DeepSpeedEngine._zero3_consolidated_16bit_state_dict).parameters) == [
        "self",
        "exclude_frozen_parameters",
    ]


def test_gradient_divisor_rule():
    """ZeRO 0-2 average over the data-parallel group, ZeRO-3's reduce-scatter over every rank; the 2-process
    equivalence (tests/test_parallel_equivalence.py) is the behavioural check, this one names the code paths."""
    import inspect

    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    stage3 = inspect.getsource(DeepSpeedZeroOptimizer_Stage3)
    assert "__avg_scatter_grads" in stage3 and "reduce_scatter_coalesced" in stage3


def test_rotary_modules_return_fp32_for_the_probe():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(
        LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2, vocab_size=50)
    ).to(torch.bfloat16)
    x = torch.randn(1, 8, 32).bfloat16()
    positions = torch.arange(1000, 1008)[None]
    want = model.model.rotary_emb(x.float(), positions)  # what the module computes for an fp32 input
    assert rotary_in_fp32(model) == 1 and rotary_in_fp32(model) == 0  # hooked once
    got = model.model.rotary_emb(x, positions)
    for g, w in zip(got, want):
        assert g.dtype == torch.float32 and torch.equal(g, w)


ROOT = Path(__file__).resolve().parents[1]


def declared_ranges() -> dict[str, SpecifierSet]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in project["dependencies"]]
    return {canonicalize_name(r.name): r.specifier for r in reqs}


def test_pyproject_admits_exactly_the_releases_compat_was_checked_against():
    ranges = declared_ranges()
    # DeepSpeed: the one release whose internals compat/deepspeed.py names, nothing beside it
    pinned = Version(DEEPSPEED_VERSION)
    assert ranges["deepspeed"].contains(DEEPSPEED_VERSION)
    major, minor, micro = pinned.release
    for other in (f"{major}.{minor}.{micro - 1}", f"{major}.{minor}.{micro + 1}", f"{major}.{minor + 1}.0"):
        assert not ranges["deepspeed"].contains(other), other
    # transformers: every minor release from the first to the last compat/transformers.py was checked against
    first, last = (Version(v).release for v in TRANSFORMERS_RELEASES)
    assert first[0] == last[0] and first[1] <= last[1]
    for minor in range(first[1], last[1] + 1):
        for patch in (0, 9):
            assert ranges["transformers"].contains(f"{first[0]}.{minor}.{patch}"), (minor, patch)
    for outside in (f"{first[0]}.{first[1] - 1}.9", f"{first[0]}.{last[1] + 1}.0", f"{first[0] + 1}.0.0"):
        assert not ranges["transformers"].contains(outside), outside
    # torch: from the GPU image's 2.11 on
    assert ranges["torch"].contains("2.11.0") and not ranges["torch"].contains("2.10.9")


def test_the_tested_lock_lies_inside_the_declared_ranges():
    # constraints.txt pins what the suite passes with: each pin must be installable under pyproject's ranges
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, version = line.split("==")
            pins[canonicalize_name(name)] = version.strip()
    for name, spec in declared_ranges().items():
        if name in pins:
            assert spec.contains(pins[name], prereleases=True), (name, pins[name], str(spec))
    assert {"torch", "transformers", "deepspeed"} <= pins.keys()


def test_the_installed_transformers_is_one_compat_supports():
    import transformers

    first, last = (Version(v).release for v in TRANSFORMERS_RELEASES)
    assert first <= Version(transformers.__version__).release[:2] <= last, transformers.__version__


def test_the_gguf_readers_own_bar_is_off_only_while_a_gguf_is_read(capsys):
    import inspect

    from transformers import modeling_gguf_pytorch_utils as gguf_reader

    assert "tqdm(" in inspect.getsource(gguf_reader.load_gguf_checkpoint)
    with quiet_gguf_conversion():
        list(gguf_reader.tqdm(range(3), desc="Converting and de-quantizing GGUF tensors..."))
    assert "Converting" not in capsys.readouterr().err
    list(gguf_reader.tqdm(range(3), desc="Converting and de-quantizing GGUF tensors..."))
    assert "Converting" in capsys.readouterr().err


ORPHANED_CONVERSION_POOL = """
import os, time
from deepspeed.checkpoint import ds_to_universal
from lctrain.compat.deepspeed import conversion_workers_die_with_this_process
with conversion_workers_die_with_this_process():
    pool = ds_to_universal.ProcessPoolExecutor(max_workers=1)
    print(pool.submit(os.getpid).result(), flush=True)
    time.sleep(120)
"""


@pytest.mark.slow  # 3-7 s in CI: slow-marked to keep `make test` under its 5 minutes
def test_the_universal_conversions_workers_exit_when_its_process_is_killed():
    """A `kill -9` mid-conversion left DeepSpeed's pool workers waiting on their queue for ever, holding the run's
    lock; the pool the conversion gets has workers that exit once their parent is gone."""
    import psutil

    proc = subprocess.Popen([sys.executable, "-c", ORPHANED_CONVERSION_POOL], stdout=subprocess.PIPE, text=True)
    try:
        worker = psutil.Process(int(proc.stdout.readline()))
    finally:
        proc.kill()
    proc.wait()
    gone, _ = psutil.wait_procs([worker], timeout=10)
    assert gone, "the conversion's worker outlived the process that started it"
