"""The compat modules: each library internal or version difference lctrain relies on, checked against the installed
library (and, for the version differences, against a stand-in of the older API)."""

from types import SimpleNamespace

import pytest

from lctrain.compat.deepspeed import disable_cpu_shm_comm_op
from lctrain.compat.transformers import attn_implementation, nested_rope_keys, set_attn_implementation
from lctrain.config import load_config
from lctrain.errors import UserError
from lctrain.train.metrics import import_wandb


def test_nested_rope_keys_on_the_installed_transformers_and_the_5_17_fallback():
    from transformers import AutoConfig

    assert nested_rope_keys(AutoConfig.for_model("llama")) == []
    # transformers 5.17 has no nested_rope_parameter_keys: the keys that are layer types mark a nested dict
    old = SimpleNamespace(rope_parameters={"full_attention": {"rope_theta": 1e6}, "sliding_attention": {}},
                          layer_types=["sliding_attention", "full_attention"])
    assert nested_rope_keys(old) == ["full_attention", "sliding_attention"]
    flat = SimpleNamespace(rope_parameters={"rope_type": "default", "rope_theta": 1e4}, layer_types=None)
    assert nested_rope_keys(flat) == []


def test_attn_implementation_round_trip():
    from transformers import AutoConfig

    config = AutoConfig.for_model("llama")
    set_attn_implementation(config, "lctrain_sdpa")
    assert attn_implementation(config) == "lctrain_sdpa"
    assert attn_implementation(SimpleNamespace(config=config)) == "lctrain_sdpa"


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
    with pytest.raises(UserError, match=r"logging.wandb = offline needs Weights & Biases \(pip install 'lctrain\[wandb\]'\)"):
        import_wandb(cfg)
