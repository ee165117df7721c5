"""Every bundled config loads, validates, and can run on the layout it asks for."""

import pytest
from transformers import AutoConfig

from lctrain.config import bundled_config_names, load_config
from lctrain.parallel.ds_config import build_ds_config
from lctrain.parallel.groups import check_layout, grad_accum_steps, requested_world
from lctrain.parallel.ulysses import kv_replication

# (query heads, KV heads) of the paper's models, from their published config.json files (no hub access in tests).
HEADS = {
    "meta-llama/Llama-2-7b-hf": (32, 32),
    "meta-llama/Meta-Llama-3-8B": (32, 8),
    "mistralai/Mistral-7B-v0.3": (32, 8),
    "Qwen/Qwen1.5-1.8B": (16, 16),
}
MODES = {"full": ("full", False), "intra_doc": ("intra_doc", False), "intra_doc_reset": ("intra_doc_reset", False),
         "anchor": ("anchor", False), "anchor_tag": ("anchor", True)}


@pytest.mark.parametrize("name", bundled_config_names())
def test_bundled_config_is_valid_and_runnable(name):
    cfg = load_config(name)
    assert cfg.name == name
    assert cfg.description and "\n" not in cfg.description
    check_layout(cfg)
    world = requested_world(cfg)
    ds = build_ds_config(cfg, world, use_torch_adam=True)
    assert ds["train_batch_size"] == cfg.train.global_batch
    assert grad_accum_steps(cfg, world) >= 1
    if cfg.model.arch is not None:
        arch = dict(cfg.model.arch)
        mc = AutoConfig.for_model(arch.pop("model_type"), **arch)
        heads, kv = mc.num_attention_heads, mc.num_key_value_heads
    else:
        heads, kv = HEADS[cfg.model.name_or_path]
        assert cfg.data.tokenizer == cfg.model.name_or_path
        assert cfg.data.source == "hub" and cfg.data.token_budget == 2_000_000_000
        assert cfg.train.global_batch == 8 and cfg.train.steps == 2000 and cfg.train.lr == 2e-5
        assert cfg.model.dtype == "bfloat16" and world == 8
    kv_replication(heads, kv, cfg.parallel.sequence_parallel, name)


@pytest.mark.parametrize("data, seq_len, mixture", [("64k", 65536, "slimpajama"), ("128k", 131072, "slimpajama"),
                                                     ("upsampled128k", 131072, "upsampled")])
def test_table1_has_every_cell(data, seq_len, mixture):
    for key, (mode, tags) in MODES.items():
        cfg = load_config(f"llama2_{data}_{key}")
        assert (cfg.data.seq_len, cfg.data.mixture) == (seq_len, mixture)
        assert (cfg.attention.mode, cfg.data.domain_tags) == (mode, tags)
        assert cfg.model.name_or_path == "meta-llama/Llama-2-7b-hf"


def test_table5_and_table6_cells():
    for key in ("full", "intra_doc", "anchor", "anchor_tag"):
        cfg = load_config(f"llama2_128k_interleaved_{key}")
        assert cfg.data.interleave_chunks and cfg.attention.mode == MODES[key][0]
    for model in ("llama3", "mistral_v03", "qwen15_1b8"):
        for key in ("full", "anchor", "anchor_tag"):
            cfg = load_config(f"{model}_128k_{key}")
            assert cfg.data.seq_len == 131072 and cfg.data.domain_tags == MODES[key][1]


def test_table5_slimpajama_64k_interleaved_rows():
    # Table 5, SlimPajama-64K: "Intra-Doc Attention + Interleaved Chunks" and "AnchorAttention + Interleaved Chunks"
    for key, mode, row in (("intra_doc", "intra_doc", "Intra-Doc Attention"), ("anchor", "anchor", "AnchorAttention")):
        cfg = load_config(f"llama2_64k_interleaved_{key}")
        assert cfg.data.interleave_chunks and not cfg.data.domain_tags and cfg.attention.mode == mode
        assert (cfg.data.seq_len, cfg.data.mixture) == (65536, "slimpajama")
        assert cfg.description.startswith(f"Table 5: Llama-2-7B, SlimPajama-64K, {row} + Interleaved Chunks")


def test_hidden_bases_are_not_listed():
    assert not any(n.startswith("_") for n in bundled_config_names())
    assert {"tiny_anchor", "tiny_full", "tiny_anchor_sp2", "tiny_anchor_zero3"} <= set(bundled_config_names())
