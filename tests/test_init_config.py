"""`lctrain init`: the written config loads, checks as `train` would, and holds the paper's recipe adapted to the
model: the Table 1 base for the length (the paper's numbers, written out here), the length, the mode, and the least
sharded layout that `lctrain plan`'s memory model says fits (every less sharded one does not). Bad input is one
line."""

import pytest
import yaml
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, PreTrainedTokenizerFast
from typer.testing import CliRunner

from lctrain.cli import app
from lctrain.config import load_config, with_overrides
from lctrain.costmodel import ModelShape
from lctrain.memory import WARN_FRACTION, Budget, plan_memory
from lctrain.model import model_shape
from lctrain.tokenizer import load_tokenizer
from lctrain.train.metrics import import_wandb
from lctrain.train.runplan import RunPlan
from lctrain.units import gb_to_bytes

# The paper, section 4.3: "1M for 32K, 5M for 64K, 10M for 128K, and 50M for 256K".
PAPER_BASE = {32768: 1e6, 65536: 5e6, 131072: 1e7, 262144: 5e7}


@pytest.mark.parametrize(
    "seq_len, lengths",
    [
        (131072, [4096, 8192, 16384, 32768, 65536, 131072]),  # Table 5
        (65536, [4096, 8192, 16384, 32768, 65536]),  # Table 2
        (49152, [4096, 8192, 16384, 32768, 49152]),  # a length that is not a power of two is evaluated too
        (4096, [4096]),
        (2048, [2048]),  # a CPU run's window: no prompt longer than it was trained on
    ],
)
def test_eval_lengths_run_up_to_the_training_length(tiny_dir, tmp_path, seq_len, lengths):
    out = tmp_path / "mine.yaml"
    r = run_init("--model", str(tiny_dir), "--seq-len", str(seq_len), "--gpus", "1", "--out", str(out))
    assert r.exit_code == 0, r.output
    assert load_config(str(out)).eval.lengths == lengths


def run_init(*args):
    return CliRunner().invoke(app, ["init", *args])


@pytest.fixture
def tiny_dir(tmp_path):
    d = tmp_path / "my-tiny"
    LlamaConfig(
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=1000,
        rope_theta=10000.0,
        max_position_embeddings=2048,
    ).save_pretrained(d)
    # a model directory as save_pretrained leaves it, with its tokenizer (a tiny word-level one: quick to load)
    words = Tokenizer(models.WordLevel({"<unk>": 0, "<s>": 1, "</s>": 2, "hello": 3}, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(
        tokenizer_object=words, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    ).save_pretrained(d)
    return d


def fits(cfg, shape, gpu_mem_gb=80, host_mem_gb=512):
    budget = Budget(int(WARN_FRACTION * gb_to_bytes(gpu_mem_gb)), int(WARN_FRACTION * gb_to_bytes(host_mem_gb)), "")
    return budget.fits(plan_memory(cfg, shape, gpu=True))


def assert_least_sharded_that_fits(cfg, shape):
    """The layout is the least sharded that fits with whole-layer checkpointing, and the checkpointing selective
    exactly when that fits on it (or on it at ZeRO-2, from ZeRO-1)."""
    assert fits(cfg, shape)
    whole = with_overrides(cfg, ["model.checkpointing=full"], "whole layers")
    selective = with_overrides(cfg, ["model.checkpointing=selective"], "selective")
    if cfg.model.checkpointing == "selective" and cfg.parallel.zero_stage == 2:
        at_one = with_overrides(whole, ["parallel.zero_stage=1"], "ZeRO-1")
        if fits(at_one, shape):  # the layout was ZeRO-1, raised to 2 for selective checkpointing
            assert not fits(with_overrides(selective, ["parallel.zero_stage=1"], "ZeRO-1"), shape)
            whole = at_one
    elif cfg.model.checkpointing == "full":
        assert not fits(selective, shape)
        if cfg.parallel.zero_stage == 1:
            assert not fits(with_overrides(selective, ["parallel.zero_stage=2"], "ZeRO-2"), shape)
    p = whole.parallel
    world = p.nproc_per_node * p.num_nodes
    for zero in range(1, 4):
        for sp in (1, 2, 4, 8):
            less = zero < p.zero_stage or (zero == p.zero_stage and sp < p.sequence_parallel)
            if less and world % sp == 0 and shape.heads % sp == 0 and not p.offload_optimizer:
                other = with_overrides(
                    whole, [f"parallel.zero_stage={zero}", f"parallel.sequence_parallel={sp}"], "less sharded"
                )
                assert not fits(other, shape), (zero, sp)


@pytest.mark.parametrize(
    "model, seq_len, zero, checkpointing, comment",
    [
        ("meta-llama/Llama-3.2-1B", 65536, 1, "selective", "the backward does not rerun attention"),
        ("meta-llama/Llama-2-7b-hf", 57344, 2, "selective", "selective at ZeRO-2 (ZeRO-1 fits only whole layers)"),
        ("meta-llama/Llama-2-7b-hf", 65536, 1, "full", "GB per GPU, over the 72.0 GB planned at ZeRO-2"),
    ],
)
def test_selective_checkpointing_where_it_fits(model, seq_len, zero, checkpointing, comment, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "c.yaml"
    r = run_init("--model", model, "--seq-len", str(seq_len), "--gpus", "8", "--out", str(out))
    assert r.exit_code == 0, r.output
    cfg = load_config(str(out))
    assert (cfg.parallel.zero_stage, cfg.model.checkpointing) == (zero, checkpointing)
    assert comment in out.read_text() and f"ZeRO-{zero}," in r.output
    assert_least_sharded_that_fits(cfg, model_shape(cfg))


def test_a_local_model_directory(tiny_dir, tmp_path):
    out = tmp_path / "cfg" / "mine.yaml"
    r = run_init("--model", str(tiny_dir), "--seq-len", "65536", "--gpus", "8", "--out", str(out))
    assert r.exit_code == 0, r.output
    assert f"wrote {out}" in r.output
    cfg = load_config(str(out))
    assert cfg.model.name_or_path == str(tiny_dir.resolve()) and cfg.data.tokenizer == str(tiny_dir.resolve())
    assert cfg.model.arch is None
    assert cfg.model.rope_theta == PAPER_BASE[65536]
    assert cfg.data.seq_len == 65536 and cfg.attention.mode == "anchor"
    assert cfg.eval.lengths == [4096, 8192, 16384, 32768, 65536]  # Table 2's lengths for its 64K models
    assert cfg.parallel.nproc_per_node * cfg.parallel.num_nodes == 8
    assert cfg.train.lr == 2e-5 and cfg.train.global_batch == 8 and cfg.train.steps == 2000
    assert cfg.data.token_budget == (2000 * 8 + 8) * 65536  # 8 windows held out for perplexity
    RunPlan.of(cfg)
    shape = model_shape(cfg)
    assert shape == ModelShape(4, 256, 8, 4, 32, 688, 1000)  # read from the directory's config.json
    assert_least_sharded_that_fits(cfg, shape)
    text = out.read_text()
    assert "# the paper's base for 65,536-token windows" in text and "own is 10,000" in text


def test_a_known_hub_name_without_network(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "qwen.yaml"
    r = run_init(
        "--model", "Qwen/Qwen2.5-7B", "--seq-len", "131072", "--gpus", "8", "--mode", "full", "--out", str(out)
    )
    assert r.exit_code == 0, r.output
    cfg = load_config(str(out))
    assert cfg.model.name_or_path == "Qwen/Qwen2.5-7B" and cfg.data.tokenizer == "Qwen/Qwen2.5-7B"
    assert cfg.model.rope_theta == PAPER_BASE[131072]  # the model's own is 1e6
    assert cfg.data.seq_len == 131072 and cfg.attention.mode == "full"
    # Qwen2.5-7B's config.json: 28 layers, hidden 3584, 28 / 4 heads, intermediate 18944, vocabulary 152064
    shape = model_shape(cfg)
    assert shape == ModelShape(28, 3584, 28, 4, 128, 18944, 152064)
    assert_least_sharded_that_fits(cfg, shape)
    RunPlan.of(cfg)


def test_an_own_base_above_the_rule_is_kept_and_a_scaled_rope_is_named(tiny_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "l31.yaml"
    r = run_init("--model", "meta-llama/Llama-3.1-8B", "--seq-len", "16384", "--gpus", "8", "--out", str(out))
    assert r.exit_code == 0, r.output
    assert load_config(str(out)).model.rope_theta == PAPER_BASE[32768]  # 1M: above Llama-3.1's own 500,000
    assert "rope_type 'llama3' scaling is kept" in out.read_text()
    d = tmp_path / "high"
    LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, rope_theta=2e7
    ).save_pretrained(d)
    out2 = tmp_path / "high.yaml"
    args = ["--model", str(d), "--seq-len", "32768", "--gpus", "1", "--out", str(out2), "--tokenizer", str(tiny_dir)]
    assert run_init(*args).exit_code == 0
    assert load_config(str(out2)).model.rope_theta == 2e7


def test_several_nodes_and_the_batch(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "two_nodes.yaml"
    r = run_init("--model", "meta-llama/Llama-2-7b-hf", "--seq-len", "65536", "--gpus", "16", "--out", str(out))
    assert r.exit_code == 0, r.output
    cfg = load_config(str(out))
    assert (cfg.parallel.nproc_per_node, cfg.parallel.num_nodes) == (8, 2)
    dp = 16 // cfg.parallel.sequence_parallel
    assert cfg.train.global_batch % dp == 0 and cfg.train.global_batch >= 8
    assert cfg.train.global_batch * cfg.train.steps == 8 * 2000  # the paper's tokens
    assert yaml.safe_load(out.read_text())["parallel"]["num_nodes"] == 2


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "nobody/no-such-model-xyz", "--seq-len", "65536", "--gpus", "8"], "not in the Hugging Face cache"),
        (["--model", "{empty}", "--seq-len", "65536", "--gpus", "8"], "has no config.json"),
        (["--model", "Qwen/Qwen2.5-7B", "--seq-len", "65536", "--gpus", "0"], "--gpus 0"),
        (["--model", "Qwen/Qwen2.5-7B", "--seq-len", "65536", "--gpus", "12"], "multiple of --gpus-per-node"),
        (["--model", "Qwen/Qwen2.5-7B", "--seq-len", "1000", "--gpus", "8"], "--seq-len 1000"),
        (["--model", "Qwen/Qwen2.5-7B", "--seq-len", "65536", "--gpus", "8", "--mode", "x"], "--mode x"),
        (["--model", "Qwen/Qwen2.5-7B", "--seq-len", "4194304", "--gpus", "1", "--gpu-mem", "8"], "no layout fits"),
        (
            ["--model", "Qwen/Qwen2.5-7B", "--seq-len", "65536", "--gpus", "8", "--data", "{empty}/c.jsonl"],
            "--data {empty}/c.jsonl: no such file or directory",
        ),
    ],
)
def test_bad_input_is_one_line(args, message, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (tmp_path / "empty").mkdir()
    args = [a.replace("{empty}", str(tmp_path / "empty")) for a in args] + ["--out", str(tmp_path / "o.yaml")]
    r = run_init(*args)
    assert r.exit_code == 2
    lines = r.output.strip().splitlines()
    message = message.replace("{empty}", str(tmp_path / "empty"))
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], r.output
    assert not (tmp_path / "o.yaml").exists()


def test_your_own_corpus_is_written_as_the_local_source(tiny_dir, tmp_path, monkeypatch):
    """`--data` makes the config prepare that corpus: what `prepare -c` and `train -c` then read without --set."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.jsonl").write_text('{"text": "one"}\n')
    r = run_init("--model", str(tiny_dir), "--seq-len", "8192", "--gpus", "1", "--out", "mine.yaml", "--data", "corpus")
    assert r.exit_code == 0, r.output
    cfg = load_config("mine.yaml")
    assert (cfg.data.source, cfg.data.path) == ("local", "corpus")
    assert "# your corpus (--data)" in (tmp_path / "mine.yaml").read_text()


def test_an_existing_file_is_kept_without_force(tiny_dir, tmp_path):
    out = tmp_path / "mine.yaml"
    out.write_text("keep me")
    args = ["--model", str(tiny_dir), "--seq-len", "32768", "--gpus", "1", "--out", str(out)]
    r = run_init(*args)
    assert r.exit_code == 2 and "--force" in r.output and out.read_text() == "keep me"
    assert run_init(*args, "--force").exit_code == 0 and load_config(str(out)).data.seq_len == 32768


def test_a_directory_without_a_tokenizer_needs_one_named(tiny_dir, tmp_path):
    """A model directory with only config.json (weights saved without the tokenizer): init does not write a
    tokenizer `prepare` cannot load; --tokenizer names one, written as a path that loads from anywhere."""
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text((tiny_dir / "config.json").read_text())
    out = tmp_path / "bare.yaml"
    r = run_init("--model", str(bare), "--seq-len", "32768", "--gpus", "1", "--out", str(out))
    lines = r.output.strip().splitlines()
    assert r.exit_code == 2 and len(lines) == 1 and "holds no tokenizer" in lines[0] and "--tokenizer" in lines[0]
    assert not out.exists()
    for given, want in [
        ("HuggingFaceTB/SmolLM2-135M", "HuggingFaceTB/SmolLM2-135M"),
        (str(tiny_dir), str(tiny_dir.resolve())),
    ]:
        r = run_init(
            *["--model", str(bare), "--seq-len", "32768", "--gpus", "1", "--out", str(out), "--force"],
            *["--tokenizer", given],
        )
        assert r.exit_code == 0, r.output
        cfg = load_config(str(out))
        assert cfg.data.tokenizer == want and "# --tokenizer" in out.read_text()
    assert len(load_tokenizer(cfg.resolve_source(cfg.data.tokenizer))) == 4  # what prepare loads
    r = run_init(
        "--model",
        str(bare),
        "--seq-len",
        "32768",
        "--gpus",
        "1",
        "--out",
        str(out),
        "--force",
        "--tokenizer",
        str(tmp_path),
    )
    assert r.exit_code == 2 and r.output.strip().startswith(f"error: --tokenizer {tmp_path}: tokenizer")


@pytest.mark.parametrize("installed", [False, True])
def test_wandb_only_when_installed(installed, tiny_dir, tmp_path, monkeypatch):
    """train's preflight refuses a wandb mode whose package is missing: init writes offline only when it is there."""
    import importlib.util

    import lctrain.init_config as init_config

    monkeypatch.setattr(init_config, "installed", lambda package: installed if package == "wandb" else None)
    out = tmp_path / "w.yaml"
    r = run_init("--model", str(tiny_dir), "--seq-len", "32768", "--gpus", "1", "--out", str(out))
    assert r.exit_code == 0, r.output
    cfg = load_config(str(out))
    if installed:
        assert cfg.logging.wandb == "offline"
    else:
        assert cfg.logging.wandb == "disabled" and "pip install 'lctrain[wandb]'" in out.read_text()
        if importlib.util.find_spec("wandb") is None:
            with pytest.raises(Exception, match="needs Weights & Biases"):
                import_wandb(load_config(str(out), ["logging.wandb=offline"]))
