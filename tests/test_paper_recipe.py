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


@pytest.mark.parametrize("decay_all", [False, True])
def test_param_groups(decay_all):
    arch = {
        "model_type": "llama",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "attention_bias": True,
        "mlp_bias": True,
    }
    cfg = load_config(
        None, ["data.seq_len=64", "model.dtype=float32", f"model.arch={arch}", "model.arch.tie_word_embeddings=false"]
    )
    model = build_model(cfg, vocab_size=100).model
    names = {id(p): n for n, p in model.named_parameters()}
    # Llama's norms and biases by name: the decoder layers' two RMSNorms, the final norm, every projection's bias
    vectors = {"model.norm.weight"}
    for layer in range(2):
        prefix = f"model.layers.{layer}."
        vectors |= {prefix + "input_layernorm.weight", prefix + "post_attention_layernorm.weight"}
        vectors |= {f"{prefix}self_attn.{p}.bias" for p in ("q_proj", "k_proj", "v_proj", "o_proj")}
        vectors |= {f"{prefix}mlp.{p}.bias" for p in ("gate_proj", "up_proj", "down_proj")}
    every = set(names.values())
    assert vectors < every and "model.embed_tokens.weight" in every and "lm_head.weight" in every

    groups = param_groups(model, 0.1, decay_all)
    assert [g["weight_decay"] for g in groups] == [0.1, 0.1 if decay_all else 0.0]
    assert {names[id(p)] for p in groups[0]["params"]} == every - vectors
    assert {names[id(p)] for p in groups[1]["params"]} == vectors
    model.model.embed_tokens.weight.requires_grad_(False)  # frozen parameters are not the optimizer's
    assert "model.embed_tokens.weight" not in {names[id(p)] for p in param_groups(model, 0.1, decay_all)[0]["params"]}
