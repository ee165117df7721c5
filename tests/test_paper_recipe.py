"""The paper's data and optimizer recipe end to end: domain token shares realized by `prepare`, the warning when
training would re-read windows (prepare and train), and AdamW's parameter groups."""

import numpy as np
import pytest
import sentencepiece as spm

from lctrain.config import DOMAINS, load_config
from lctrain.data.prepare import prepare
from lctrain.data.store import open_packed
from lctrain.data.synthetic import generate
from lctrain.model import build_model
from lctrain.parallel.groups import init_topology
from lctrain.tokenizer import builtin_model_file
from lctrain.train.command import preflight
from lctrain.train.trainer import param_groups

SHARES = {"CommonCrawl": 0.35, "C4": 0.25, "GitHub": 0.15, "Wikipedia": 0.15, "StackExchange": 0.1}
SYNTHETIC = dict(seed=0, median_words=10, max_words=200, long_doc_fraction=0.01)


@pytest.fixture(scope="module")
def shares_run(tmp_path_factory):
    """64 windows of 512 tokens from the synthetic source (all 7 domains), upsampled to SHARES; 20 steps of 4
    windows want 80 windows, 16 more than there are."""
    out = tmp_path_factory.mktemp("shares") / "data"
    cfg = load_config(
        None,
        [
            "data.mixture=upsampled",
            "data.down_sample_ratio=1.0",
            f"data.domain_shares={SHARES}",
            "data.seq_len=512",
            "data.token_budget=32768",
            "data.synthetic.num_docs=3000",
            *(f"data.synthetic.{k}={v}" for k, v in SYNTHETIC.items() if k != "seed"),
            f"data.output_dir={out}",
            "data.num_workers=1",
            "train.steps=20",
            "train.global_batch=4",
            "train.micro_batch=1",
        ],
    )
    return cfg, open_packed(prepare(cfg))


def test_prepared_token_shares_approach_the_targets(shares_run):
    cfg, data = shares_run
    tokens = np.zeros(len(DOMAINS))
    for w in range(len(data)):
        row = data[w]
        np.add.at(tokens, row["seg_domain"].astype(int), row["seg_lens"])
    realized = tokens / tokens.sum()
    # A domain stops at the first document that fills its share, and the last window cuts one document: each share
    # is within about one document of its target. The longest document read, from the reference tokenizer:
    builtin = cfg.data.tokenizer.removeprefix("builtin:")
    reference = spm.SentencePieceProcessor(model_file=str(builtin_model_file(builtin)))
    docs = [generate(index=i, **SYNTHETIC)[0] for i in range(data.manifest.source["documents_read"])]
    longest = max(len(ids) for ids in reference.encode(docs)) + 1  # + its anchor
    tolerance = longest / tokens.sum()
    assert tolerance < 0.02
    for i, name in enumerate(DOMAINS):
        assert abs(realized[i] - SHARES.get(name, 0.0)) <= tolerance, (name, realized[i], tolerance)
    assert data.manifest.stats["domains"]["C4"]["target_tokens_share"] == pytest.approx(0.25, rel=1e-12)


def test_prepare_and_train_say_when_steps_re_read_windows(shares_run, capsys):
    cfg, _ = shares_run
    # 20 x 4 = 80 windows wanted, 64 there: 16 x 512 = 8,192 tokens more; 64 // 4 = 16 steps read fresh windows
    line = (
        "warning: 20 steps x 4 windows x 512 tokens = 40,960 tokens, 8,192 more than the data has (64 windows, "
        "32,768 tokens): the last 4 steps re-read windows; set data.token_budget=45056 (and prepare again) or "
        "lower train.steps"
    )
    prepare(cfg)  # already prepared: says so, and warns again
    preflight(cfg)
    out, err = capsys.readouterr()
    assert err.count(line) == 2 and line not in out  # a warning: on stderr
    enough = cfg.model_copy(deep=True)
    enough.train.steps = 16
    preflight(enough)
    assert "warning" not in "".join(capsys.readouterr())


ARCH = {
    "model_type": "llama",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "attention_bias": True,
    "mlp_bias": True,
}


def tiny_config(extra: list[str] = ()):
    return load_config(
        None,
        ["data.seq_len=64", "model.dtype=float32", f"model.arch={ARCH}", "model.arch.tie_word_embeddings=false"]
        + list(extra),
    )


def group_names(model, decay_all: bool) -> list[tuple[float, set[str]]]:
    names = {id(p): n for n, p in model.named_parameters()}
    return [(g["weight_decay"], {names[id(p)] for p in g["params"]}) for g in param_groups(model, 0.1, decay_all)]


@pytest.mark.parametrize("decay_all", [False, True])
def test_param_groups(decay_all):
    model = build_model(tiny_config(), vocab_size=100).model
    # Llama's norms and biases by name: the decoder layers' two RMSNorms, the final norm, every projection's bias
    vectors = {"model.norm.weight"}
    for layer in range(2):
        prefix = f"model.layers.{layer}."
        vectors |= {prefix + "input_layernorm.weight", prefix + "post_attention_layernorm.weight"}
        vectors |= {f"{prefix}self_attn.{p}.bias" for p in ("q_proj", "k_proj", "v_proj", "o_proj")}
        vectors |= {f"{prefix}mlp.{p}.bias" for p in ("gate_proj", "up_proj", "down_proj")}
    every = {n for n, _ in model.named_parameters()}
    assert vectors < every and "model.embed_tokens.weight" in every and "lm_head.weight" in every

    assert group_names(model, decay_all) == [(0.1, every - vectors), (0.1 if decay_all else 0.0, vectors)]
    model.model.embed_tokens.weight.requires_grad_(False)  # frozen parameters are not the optimizer's
    assert "model.embed_tokens.weight" not in group_names(model, decay_all)[0][1]


def test_param_groups_of_parameters_zero3_partitioned_at_load():
    """A ZeRO-3 run from pretrained weights loads them partitioned (`HfDeepSpeedConfig`: deepspeed.zero.Init), every
    parameter a 1-D shard: all went to the norms' group, so `decay_norms_and_biases: false` silently trained the
    matrices without weight decay, and DeepSpeed, which drops an empty group, made a checkpoint of ZeRO-1/2 fail to
    load at ZeRO-3 (IndexError in the scheduler's state; SmolLM2-135M). The groups are those of the whole model."""
    import deepspeed
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(["parallel.zero_stage=3"])
    init_topology(cfg)
    whole = build_model(cfg, vocab_size=100).model
    zero3 = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
    with deepspeed.zero.Init(config_dict_or_path=zero3):
        partitioned = AutoModelForCausalLM.from_config(whole.config)
    assert all(p.ndim == 1 for p in partitioned.parameters())  # the case: no parameter shows its own shape
    assert group_names(partitioned, decay_all=False) == group_names(whole, decay_all=False)
