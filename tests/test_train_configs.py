"""Every bundled config loads, validates, and can run on the layout it asks for."""

import numpy as np
import pytest
from transformers import AutoConfig

from lctrain.config import bundled_config_names, data_fingerprint, load_config
from lctrain.data.mixture import Mixture
from lctrain.model import default_rope_theta
from lctrain.parallel.layout import kv_replication, layout_of
from lctrain.train.data import BatchPlan
from lctrain.train.deepspeed_config import deepspeed_config
from lctrain.train.runplan import RunPlan
from lctrain.train.schedule import hf_checkpoint_steps

# (query heads, KV heads) of the paper's models, from their published config.json files (no hub access in tests).
HEADS = {
    "meta-llama/Llama-2-7b-hf": (32, 32),
    "meta-llama/Meta-Llama-3-8B": (32, 8),
    "mistralai/Mistral-7B-v0.3": (32, 8),
    "Qwen/Qwen1.5-1.8B": (16, 16),
}
SMOLLM2_HEADS = (9, 3)  # the example model's query and KV heads (lctrain/example_model.py)
MODES = {
    "full": ("full", False),
    "intra_doc": ("intra_doc", False),
    "intra_doc_reset": ("intra_doc_reset", False),
    "anchor": ("anchor", False),
    "anchor_tag": ("anchor", True),
}


@pytest.mark.parametrize("name", bundled_config_names())
def test_bundled_config_is_valid_and_runnable(name):
    cfg = load_config(name)
    assert cfg.name == name
    assert cfg.description and "\n" not in cfg.description
    layout = layout_of(cfg)
    ds = deepspeed_config(cfg, RunPlan.of(cfg, layout), gpu=True)
    assert ds["train_batch_size"] == cfg.train.global_batch
    assert BatchPlan.of(cfg, layout).grad_accum >= 1
    if cfg.model.arch is not None:
        arch = dict(cfg.model.arch)
        mc = AutoConfig.for_model(arch.pop("model_type"), **arch)
        heads, kv = mc.num_attention_heads, mc.num_key_value_heads
    elif name.startswith("smollm2_"):  # the bundled experiment (tests/test_experiment_extend.py), not a paper run
        heads, kv = SMOLLM2_HEADS
        assert cfg.data.tokenizer == cfg.model.name_or_path and cfg.data.sources is not None
        assert cfg.model.dtype == "bfloat16" and layout.world == 1
    else:
        heads, kv = HEADS[cfg.model.name_or_path]
        assert cfg.data.tokenizer == cfg.model.name_or_path
        assert cfg.data.source == "hub" and cfg.train.global_batch == 8 and cfg.train.lr == 2e-5
        assert cfg.model.dtype == "bfloat16" and layout.world == 8
        # Table 1's AdamW, decaying every parameter as the paper's released code does
        assert (cfg.train.weight_decay, cfg.train.betas, cfg.train.decay_norms_and_biases) == (0.1, (0.9, 0.95), True)
    # no run reads a window twice, and eval.ppl_windows are left for the held-out perplexity (Figure 4's curve,
    # report's Table 5 column): the windows the budget packs, counted apart from config.tokens_to_prepare
    assert cfg.data.token_budget // cfg.data.seq_len >= cfg.train.steps * cfg.train.global_batch + cfg.eval.ppl_windows
    kv_replication(heads, kv, cfg.parallel.sequence_parallel, name)


@pytest.mark.parametrize(
    "data, seq_len, mixture",
    [("64k", 65536, "slimpajama"), ("128k", 131072, "slimpajama"), ("upsampled128k", 131072, "upsampled")],
)
def test_table1_has_every_cell(data, seq_len, mixture):
    for key, (mode, tags) in MODES.items():
        cfg = load_config(f"llama2_{data}_{key}")
        assert (cfg.data.seq_len, cfg.data.mixture) == (seq_len, mixture)
        # Table 1's base by length, set explicitly: a pretrained model otherwise keeps its own (test_model.py)
        assert cfg.train.steps == 2000 and cfg.model.rope_theta == default_rope_theta(seq_len)
        # "2 billion token dataset"; at 128K the 2000 steps read 2000 x 8 x 131,072 tokens, so exactly those and
        # 8 windows held out for perplexity
        assert cfg.data.token_budget == (2_000_000_000 if seq_len == 65536 else 2_098_200_576)
        assert (cfg.attention.mode, cfg.data.domain_tags) == (mode, tags)
        assert cfg.model.name_or_path == "meta-llama/Llama-2-7b-hf"


def test_table5_and_table6_cells():
    for key in ("full", "intra_doc", "anchor", "anchor_tag"):
        cfg = load_config(f"llama2_128k_interleaved_{key}")
        assert cfg.data.interleave_chunks and cfg.attention.mode == MODES[key][0]
        # Table 5's SlimPajama-128K block has only "Intra-Doc Attention + Interleaved Chunks"; the others are extras
        in_table = cfg.description.startswith("Table 5: Llama-2-7B, SlimPajama-128K, Intra-Doc Attention + Interleaved")
        assert in_table == (key == "intra_doc") and (in_table or cfg.description.startswith("Extra (not a row"))
    for model in ("llama3", "mistral_v03", "qwen15_1b8"):
        for key in ("full", "anchor", "anchor_tag"):
            cfg = load_config(f"{model}_128k_{key}")
            assert cfg.data.seq_len == 131072 and cfg.data.domain_tags == MODES[key][1]
            assert cfg.model.rope_theta == default_rope_theta(131072) == 1e7


def test_table5_slimpajama_64k_interleaved_rows():
    # Table 5, SlimPajama-64K: "Intra-Doc Attention + Interleaved Chunks" and "AnchorAttention + Interleaved Chunks"
    for key, mode, row in (("intra_doc", "intra_doc", "Intra-Doc Attention"), ("anchor", "anchor", "AnchorAttention")):
        cfg = load_config(f"llama2_64k_interleaved_{key}")
        assert cfg.data.interleave_chunks and not cfg.data.domain_tags and cfg.attention.mode == mode
        assert (cfg.data.seq_len, cfg.data.mixture) == (65536, "slimpajama")
        assert cfg.description.startswith(f"Table 5: Llama-2-7B, SlimPajama-64K, {row} + Interleaved Chunks")


# Paper Table 9, UpSampledMix-128K "Token Ratio", typed from the paper
TABLE9 = {
    "CommonCrawl": 58.14,
    "C4": 19.53,
    "GitHub": 6.61,
    "ArXiv": 5.86,
    "Book": 4.69,
    "Wikipedia": 3.51,
    "StackExchange": 1.64,
}


def test_upsampled_paper_configs_target_table9_shares():
    for key in MODES:
        cfg = load_config(f"llama2_upsampled128k_{key}")
        m = Mixture(
            cfg.data.mixture,
            10**9,
            cfg.data.short_doc_tokens,
            cfg.data.down_sample_ratio,
            np.random.default_rng(0),
            cfg.data.domain_shares,
        )
        total = sum(TABLE9.values())
        assert m.target_shares() == pytest.approx(
            {**{d: v / total for d, v in TABLE9.items()}, "other": 0.0}, rel=1e-12
        )
        assert m.targets.sum() == pytest.approx(10**9, rel=1e-12)


# Table 2 (section 4.3): Llama-2-7B, SlimPajama-64K, 1B tokens; NTK-aware and YaRN with s = 16 from 4K
TABLE2 = {
    "rope": [("1m", 1e6), ("5m", 5e6), ("10m", 1e7)],
    "yarn": [("1m", 1e6), ("5m", 5e6), ("10m", 1e7)],
    "ntk": [("10k", 1e4), ("1m", 1e6), ("5m", 5e6), ("10m", 1e7)],
}
SCALING = {
    "rope": None,
    "yarn": {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 4096},
    "ntk": {"rope_type": "ntk", "factor": 16.0},
}


def test_table2_grid():
    names = {n for n in bundled_config_names() if "_table2_" in n}
    assert names == {f"llama2_64k_table2_{kind}_{row}" for kind, rows in TABLE2.items() for row, _ in rows}
    for kind, rows in TABLE2.items():
        for row, base in rows:
            cfg = load_config(f"llama2_64k_table2_{kind}_{row}")
            assert (cfg.model.rope_theta, cfg.model.rope_scaling) == (base, SCALING[kind])
            assert (cfg.data.seq_len, cfg.data.mixture, cfg.attention.mode) == (65536, "slimpajama", "full")
            # 1B tokens at 8 x 65,536 = 524,288 tokens per step: 1907 steps, 999,817,216 tokens
            assert cfg.train.steps == 1907 and abs(1907 * 8 * 65536 - 1e9) < 8 * 65536 / 2
            # read from Table 1's SlimPajama-64K: one prepared dataset for both
            assert data_fingerprint(cfg.data) == data_fingerprint(load_config("llama2_64k_full").data)


def test_table4_rows_are_the_table2_models_and_yarn_10k():
    # Table 4 evaluates the Table 2 models at 128K, plus one row Table 2 lacks: YaRN at base 10K (64K score 50.09)
    cfg = load_config("llama2_64k_table4_yarn_10k")
    assert (cfg.model.rope_theta, cfg.model.rope_scaling) == (1e4, SCALING["yarn"])
    assert cfg.train.steps == 1907 and 131072 in cfg.eval.lengths
    assert data_fingerprint(cfg.data) == data_fingerprint(load_config("llama2_64k_table2_yarn_1m").data)


def test_table3_grid_and_figure4():
    bases = {"500": 500, "10k": 1e4, "200k": 2e5, "600k": 6e5, "900k": 9e5, "5m": 5e6, "1b": 1e9}
    assert {n for n in bundled_config_names() if "_table3_" in n} == {f"llama2_32k_table3_rope_{r}" for r in bases}
    for row, base in bases.items():
        cfg = load_config(f"llama2_32k_table3_rope_{row}")
        assert (cfg.model.rope_theta, cfg.model.rope_scaling, cfg.attention.mode) == (base, None, "full")
        assert cfg.data.seq_len == 32768 and max(cfg.eval.lengths) == 32768
        # 1B tokens at 8 x 32,768 = 262,144 tokens per step: 3815 steps, the budget what they read and 8 windows
        assert cfg.train.steps == 3815 and cfg.data.token_budget == (3815 * 8 + 8) * 32768 == 1_000_341_504
    fig4 = load_config("llama2_16k_fig4_full")
    assert (fig4.data.seq_len, fig4.attention.mode, fig4.data.mixture, fig4.model.rope_theta) == (
        16384,
        "full",
        "slimpajama",
        1e6,
    )
    assert fig4.eval.lengths == [16384]
    assert list(hf_checkpoint_steps(fig4.train.steps, fig4.checkpoint)) == list(range(100, 2001, 100))


def test_no_study_config_outside_the_paper():
    names = set(bundled_config_names())
    assert not any(("theta" in n or n.endswith(("_linear", "_ntk", "_yarn"))) for n in names)


def test_hidden_bases_are_not_listed():
    assert not any(n.startswith("_") for n in bundled_config_names())
    assert {"tiny_anchor", "tiny_full", "tiny_anchor_sp2", "tiny_anchor_zero3"} <= set(bundled_config_names())


@pytest.mark.parametrize(
    "stage, overlap, expected",
    [(3, None, True), (2, None, False), (1, None, False), (3, False, False), (2, True, True)],
)
def test_zero_overlaps_its_communication_as_deepspeed_does_unless_set(stage, overlap, expected):
    """ZeRO-3 ran every all-gather and reduce-scatter on the compute stream (overlap_comm was false for every stage,
    DeepSpeed's default for ZeRO-3 being true); DeepSpeed's throughput timer synchronised the device twice per
    micro-batch for figures nobody reads."""
    over = [f"parallel.zero_stage={stage}"] + ([] if overlap is None else [f"parallel.overlap_comm={overlap}"])
    cfg = load_config("tiny_anchor", over)
    ds = deepspeed_config(cfg, RunPlan.of(cfg, layout_of(cfg)), gpu=True)
    assert ds["zero_optimization"]["overlap_comm"] is expected
    assert ds["timers"] == {"throughput": {"enabled": False, "synchronized": False}}
