"""`lctrain init`: the written config loads, checks as `train` would, and holds the paper's recipe adapted to the
model: the Table 1 base for the length (the paper's numbers, written out here), the length, the mode, the RULER tasks
the bundled configs of the model leave out, and the first layout in init's order that `lctrain plan`'s memory model
says fits (every earlier one does not). Bad input is one line."""

import math
import shlex

import pytest
import yaml
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import Gemma2Config, LlamaConfig, MistralConfig, PreTrainedTokenizerFast
from typer.testing import CliRunner

from lctrain.cli import app
from lctrain.config import bundled_config_names, load_config, with_overrides
from lctrain.costmodel import ModelShape
from lctrain.init_config import _sp_sizes
from lctrain.memory import DEVICE_RUNTIME_BYTES, WARN_FRACTION, Budget, plan_memory
from lctrain.model import model_shape
from lctrain.tokenizer import load_tokenizer
from lctrain.train.metrics import import_wandb
from lctrain.train.runplan import RunPlan
from lctrain.units import GB, gb_to_bytes

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
    save_tiny_tokenizer(d)
    return d


def save_tiny_tokenizer(d):
    """A model directory as save_pretrained leaves it, with its tokenizer (a tiny word-level one: quick to load)."""
    words = Tokenizer(models.WordLevel({"<unk>": 0, "<s>": 1, "</s>": 2, "hello": 3}, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(
        tokenizer_object=words, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    ).save_pretrained(d)


def fits(cfg, shape, gpu_mem_gb=80, host_mem_gb=512):
    budget = Budget(int(WARN_FRACTION * gb_to_bytes(gpu_mem_gb)), int(WARN_FRACTION * gb_to_bytes(host_mem_gb)), "")
    return budget.fits(plan_memory(cfg, shape, gpu=True))


def in_order(world, heads, per_node):
    """init's documented order of layouts on `world` GPUs, `per_node` a node, as (tiled_mlp, offload_activations,
    offload_optimizer, zero_stage, sequence_parallel, global_batch): without the model's memory savers before with
    them (tiled MLP, then activation offload, then both), no optimizer offload before it, sequence-parallel groups
    within a node before those across nodes, the lowest ZeRO stage, then the sequence-parallel sizes by the batch
    they give (the paper's 8 windows, else the next multiple of the replicas) and then by size."""
    batch = {sp: math.ceil(8 / (world // sp)) * (world // sp) for sp in (1, 2, 4, 8, 16) if world % sp == 0}
    sps = sorted((sp for sp in batch if heads % sp == 0), key=lambda sp: (batch[sp], sp))
    tiers = [[sp for sp in sps if sp <= per_node], [sp for sp in sps if sp > per_node]]
    savers = [(0, False), ("auto", False), (0, True), ("auto", True)]
    return [
        (t, a, o, z, sp, batch[sp])
        for t, a in savers
        for o in (False, True)
        for tier in tiers
        for z in (1, 2, 3)
        for sp in tier
    ]


def layout_overrides(tiled, activations, offload, zero, sp, batch):
    return [
        f"model.tiled_mlp={tiled}",
        f"model.offload_activations={str(activations).lower()}",
        f"parallel.offload_optimizer={str(offload).lower()}",
        f"parallel.zero_stage={zero}",
        f"parallel.sequence_parallel={sp}",
        f"train.global_batch={batch}",
        f"train.steps={2000 * 8 // batch}",
    ]


def assert_first_that_fits(cfg, shape, gpu_mem_gb=80):
    """The layout is the first in init's order that fits with whole-layer checkpointing, found by trying each; the
    checkpointing is selective exactly when it fits on that layout, on it at ZeRO-2 from ZeRO-1, or then on a larger
    sequence-parallel group within the node that keeps the batch (the first of those that fits, in that order)."""
    assert fits(cfg, shape, gpu_mem_gb)
    p = cfg.parallel
    whole = with_overrides(cfg, ["model.checkpointing=full"], "whole layers")
    order = in_order(p.nproc_per_node * p.num_nodes, shape.heads, p.nproc_per_node)
    first = next(o for o in order if fits(with_overrides(whole, layout_overrides(*o), "in order"), shape, gpu_mem_gb))
    tiled, activations, offload, zero, sp, batch = first
    larger = sorted({o[4] for o in order if sp < o[4] <= p.nproc_per_node and o[5] == batch})
    zeros = [zero, 2] if zero == 1 else [zero]
    tries = [(s, z) for s in [sp, *larger] for z in zeros]
    laid = with_overrides(whole, layout_overrides(*first), "first")
    on = [
        (s, z)
        for s, z in tries
        if fits(
            with_overrides(
                laid,
                ["model.checkpointing=selective", f"parallel.zero_stage={z}", f"parallel.sequence_parallel={s}"],
                "selective",
            ),
            shape,
            gpu_mem_gb,
        )
    ]
    want = (*on[0], "selective") if on else (sp, zero, "full")
    m = cfg.model
    assert (m.tiled_mlp, m.offload_activations, p.offload_optimizer) == (tiled, activations, offload)
    assert (p.sequence_parallel, p.zero_stage, m.checkpointing, cfg.train.global_batch) == (*want, batch)


def comments(text):
    """The YAML's comments as one line, so that a phrase wrapped over two lines is found."""
    return " ".join(line.split("#", 1)[1].strip() for line in text.splitlines() if "#" in line)


@pytest.mark.parametrize(
    "model, seq_len, gpus, zero, sp, checkpointing, comment",
    [
        ("meta-llama/Llama-3.2-1B", 65536, 8, 1, 1, "selective", "the backward does not rerun attention"),
        # bf16's ZeRO-1 keeps an fp32 gradient of every parameter (lctrain.memory.runs_bf16_optimizer): ZeRO-2 has
        # room for the attention outputs
        (
            "meta-llama/Llama-2-7b-hf",
            32768,
            8,
            2,
            1,
            "selective",
            "selective at ZeRO-2 (ZeRO-1 fits only whole layers)",
        ),
        (
            "meta-llama/Meta-Llama-3-8B",
            65536,
            4,
            3,
            4,
            "selective",
            "selective at sequence parallel 4 (sequence parallel 2 fits only whole layers)",
        ),
        # 72.0 GB is init's budget, 90% of the 80 GB: not a plan; sequence parallel 4 is the largest 4 GPUs give
        (
            "meta-llama/Llama-2-7b-hf",
            262144,
            4,
            3,
            4,
            "full",
            "needs 85.6 GB per GPU, over init's budget of 72.0 GB per GPU (90% of 80 GB per GPU",
        ),
    ],
)
def test_selective_checkpointing_where_it_fits(
    model, seq_len, gpus, zero, sp, checkpointing, comment, tmp_path, monkeypatch
):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "c.yaml"
    r = run_init("--model", model, "--seq-len", str(seq_len), "--gpus", str(gpus), "--out", str(out))
    assert r.exit_code == 0, r.output
    cfg = load_config(str(out))
    p = cfg.parallel
    assert (p.zero_stage, p.sequence_parallel, cfg.model.checkpointing) == (zero, sp, checkpointing)
    assert comment in comments(out.read_text()) and f"ZeRO-{zero}, sequence parallel {sp}," in r.output
    # the parallel section says the layout moved from the first that fits, and to what
    moved = comment.removeprefix("selective at ").split(" (")[0] if comment.startswith("selective at ") else None
    then = "the first where selective checkpointing fits (model.checkpointing)"
    assert (f"then {moved}, {then}" in comments(out.read_text())) if moved else then not in out.read_text()
    assert_first_that_fits(cfg, model_shape(cfg))


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
    assert (cfg.train.heldout_every, cfg.eval.ppl_windows) == (100, 8)  # scored while training too
    RunPlan.of(cfg)
    shape = model_shape(cfg)
    assert shape == ModelShape(4, 256, 8, 4, 32, 688, 1000)  # read from the directory's config.json
    assert_first_that_fits(cfg, shape)
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
    assert_first_that_fits(cfg, shape)
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


def test_several_nodes_keep_the_papers_batch(tmp_path, monkeypatch):
    """16 GPUs at 64K: SP=1 would make 16 replicas and a 16-window step, twice the paper's tokens per step at its
    learning rate; SP=2 keeps its 8 windows x 2000 steps."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "two_nodes.yaml"
    r = run_init("--model", "meta-llama/Llama-2-7b-hf", "--seq-len", "65536", "--gpus", "16", "--out", str(out))
    assert r.exit_code == 0, r.output
    cfg = load_config(str(out))
    assert (cfg.parallel.nproc_per_node, cfg.parallel.num_nodes) == (8, 2)
    assert (cfg.parallel.sequence_parallel, cfg.train.global_batch, cfg.train.steps) == (2, 8, 2000)
    assert "8 windows per step x 2000 steps (the paper's batch)" in r.output
    # on the disk while the last checkpoint is written: 3 checkpoints of bf16 weights, fp32 master weights and moments
    # (ZeRO-1/2: 14 bytes a parameter) and the 4 exports (2 bytes) before it; Llama-2-7B's 6,738,415,616 parameters
    assert cfg.parallel.zero_stage in (1, 2) and cfg.model.dtype == "bfloat16"
    assert f"{(3 * 14 + 4 * 2) * 6_738_415_616 / 1e9:,.1f} GB of checkpoints and exports on the disk" in r.output
    assert yaml.safe_load(out.read_text())["parallel"]["num_nodes"] == 2
    assert_first_that_fits(cfg, model_shape(cfg))


def test_a_sequence_parallel_group_within_a_node_before_one_across_nodes(tmp_path, monkeypatch):
    """Llama-3-8B at 64K on 2 nodes of 8 x 40 GB: ZeRO-2 fits only with SP 16, whose all-to-alls cross the nodes in
    every layer; ZeRO-3 fits at SP 8, within each node (plan explorer: init chose SP 16)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "l3.yaml"
    model = ["--model", "meta-llama/Meta-Llama-3-8B", "--seq-len", "65536", "--gpus", "16", "--gpu-mem", "40"]
    r = run_init(*model, "--out", str(out))
    assert r.exit_code == 0, r.output
    cfg = load_config(str(out))
    assert (cfg.parallel.nproc_per_node, cfg.parallel.num_nodes, cfg.parallel.sequence_parallel) == (8, 2, 8)
    assert cfg.parallel.zero_stage == 3
    across = with_overrides(cfg, ["parallel.zero_stage=2", "parallel.sequence_parallel=16"], "across nodes")
    assert fits(with_overrides(across, ["model.checkpointing=full"], "whole layers"), model_shape(cfg), 40)
    assert_first_that_fits(cfg, model_shape(cfg), 40)


def test_a_batch_that_cannot_stay_the_papers_is_said_in_the_summary(tiny_dir, tmp_path):
    """3 GPUs form no sequence-parallel group of 2: 3 replicas, so 9 windows per step, 1777 steps."""
    out = tmp_path / "three.yaml"
    r = run_init("--model", str(tiny_dir), "--seq-len", "8192", "--gpus", "3", "--out", str(out))
    assert r.exit_code == 0, r.output
    cfg = load_config(str(out))
    assert (cfg.parallel.sequence_parallel, cfg.train.global_batch, cfg.train.steps) == (1, 9, 1777)
    line = r.output.strip()
    assert len(line.splitlines()) == 1
    assert f"9 windows per step x 1777 steps ({9 * 8192:,} tokens per step at the paper's lr 2e-05" in line
    assert "multiple of 3 data-parallel replicas" in line


def test_one_gpu_at_128k_takes_the_tiled_mlp_when_nothing_fits_without(tmp_path, monkeypatch):
    """The user's case: Llama-2-7B at 128K on one 80 GB GPU fits with the tiled MLP and the optimizer on the host
    (plan: 70.07 GB), which init once refused; every layout before it in init's order does not fit."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "one.yaml"
    r = run_init("--model", "meta-llama/Llama-2-7b-hf", "--seq-len", "131072", "--gpus", "1", "--out", str(out))
    assert r.exit_code == 0, r.output
    cfg = load_config(str(out))
    assert (cfg.model.tiled_mlp, cfg.model.offload_activations) == ("auto", False)
    assert (cfg.parallel.zero_stage, cfg.parallel.offload_optimizer, cfg.model.checkpointing) == (1, True, "full")
    shape = model_shape(cfg)
    assert_first_that_fits(cfg, shape)
    device = plan_memory(cfg, shape, gpu=True).total("device") + DEVICE_RUNTIME_BYTES
    assert f"tiled MLP, {device / GB:.1f} GB planned per GPU" in r.output and f"{device / GB:.2f}" == "70.07"
    assert "nothing fit without the tiled MLP" in comments(out.read_text())


def test_activation_offload_when_the_tiled_mlp_is_not_enough(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "long.yaml"
    args = ["--model", "meta-llama/Llama-2-7b-hf", "--seq-len", "262144", "--gpus", "1", "--out", str(out)]
    r = run_init(*args)
    assert r.exit_code == 0, r.output
    cfg = load_config(str(out))
    assert cfg.model.offload_activations and "activations offloaded to the host" in r.output
    assert_first_that_fits(cfg, model_shape(cfg))


def test_the_refusal_names_what_was_tried(tmp_path, monkeypatch):
    """Qwen2.5-7B's 28 heads split over 1, 2 and 4 GPUs only, whatever the GPU count."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    args = ["--model", "Qwen/Qwen2.5-7B", "--seq-len", "4194304", "--gpus", "8", "--out", str(tmp_path / "q.yaml")]
    r = run_init(*args)
    assert r.exit_code == 2 and len(r.output.strip().splitlines()) == 1, r.output
    # 4 savers x 2 optimizer placements x 3 ZeRO stages x 3 sequence-parallel sizes
    assert "tried 72 (ZeRO 1-3 x sequence parallel 1, 2, 4 x optimizer offload or not" in r.output
    assert "without and with tiled MLP and activation offload" in r.output and "up to 8" not in r.output
    assert "the nearest (ZeRO-" in r.output


def test_sequence_parallel_sizes_are_the_divisors_the_heads_allow(tmp_path):
    """Any divisor of the GPUs, the heads and the window, not only powers of two; a refusal for want of GPUs names
    the next size the heads allow (25 heads on 8 GPUs: sequence parallel 1 only, 5 on 10)."""
    # those keeping the paper's 8 windows per step first (3 and 6), then the nearest batch
    assert _sp_sizes(ModelShape(4, 768, 12, 12, 64, 2048, 32000), 6, 6144) == [3, 6, 2, 1]
    d = tmp_path / "odd"
    LlamaConfig(
        hidden_size=3200,
        intermediate_size=8640,
        num_hidden_layers=26,
        num_attention_heads=25,
        num_key_value_heads=25,
        vocab_size=32000,
        max_position_embeddings=4096,
    ).save_pretrained(d)
    args = ["--model", str(d), "--tokenizer", "builtin:mistral-7b-v0.1", "--seq-len", "204800", "--gpus", "8"]
    r = run_init(*args, "--gpu-mem", "10", "--host-mem", "64", "--out", str(tmp_path / "o.yaml"))
    assert r.exit_code == 2 and "x sequence parallel 1 x" in r.output, r.output
    assert "use more GPUs (--gpus, a multiple of 5: the next sequence-parallel size the model's 25 heads allow)" in (
        " ".join(r.output.split())
    )


def test_ruler_exclusions_are_the_bundled_configs_of_the_model(tmp_path, monkeypatch):
    """The paper (section 4.2) leaves two RULER tasks out for Llama-2-7B only; init writes what the bundled configs
    of each model leave out, so its averages compare with theirs."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for model, bundled in [
        ("meta-llama/Llama-2-7b-hf", "llama2_64k_anchor"),
        ("meta-llama/Meta-Llama-3-8B", "llama3_128k_anchor"),
        ("Qwen/Qwen2.5-7B", None),
    ]:
        out = tmp_path / f"{model.split('/')[1]}.yaml"
        assert run_init("--model", model, "--seq-len", "65536", "--gpus", "8", "--out", str(out)).exit_code == 0
        want = load_config(bundled).eval.exclude if bundled else []
        assert load_config(str(out)).eval.exclude == want, model
    assert load_config("llama2_64k_anchor").eval.exclude == ["niah_multikey_3", "cwe"]
    text = comments((tmp_path / "Llama-2-7b-hf.yaml").read_text())
    assert "left out of RULER's average as in the bundled configs of this model (llama2_128k_anchor and" in text


def test_a_downloaded_llama2_directory_leaves_out_what_the_paper_does(tmp_path):
    """A local Llama-2-7B (its config.json) is meta-llama/Llama-2-7b-hf by its shape and positions: the paper's two
    tasks left out, where a name match alone gave it all 13 with a comment saying no bundled config trains it."""
    d = tmp_path / "Llama-2-7b-local"
    LlamaConfig(
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        vocab_size=32000,
        rope_theta=10000.0,
        max_position_embeddings=4096,
    ).save_pretrained(d)
    out = tmp_path / "local.yaml"
    r = run_init(*llama2_init_args(d, out))
    assert r.exit_code == 0, r.output
    assert load_config(str(out)).eval.exclude == ["niah_multikey_3", "cwe"]
    (d / "config.json").write_text(
        (d / "config.json").read_text().replace('"rope_theta": 10000.0', '"rope_theta": 1e5')
    )
    other = tmp_path / "other.yaml"
    assert run_init(*llama2_init_args(d, other)).exit_code == 0
    assert load_config(str(other)).eval.exclude == []  # another base: not the paper's model


def llama2_init_args(model, out):
    return [
        "--model",
        str(model),
        "--tokenizer",
        "builtin:mistral-7b-v0.1",
        "--seq-len",
        "65536",
        "--gpus",
        "8",
        "--out",
        str(out),
    ]


def test_a_tokenizer_with_ids_past_the_models_embedding_is_refused(tiny_dir, tmp_path):
    """The 32,000-token built-in tokenizer for a 1,000-row model: init, and show-config of a config naming it,
    refuse in one line as prepare and train do, not after tokenizing the corpus."""
    out = tmp_path / "mine.yaml"
    r = run_init(
        "--model",
        str(tiny_dir),
        "--tokenizer",
        "builtin:mistral-7b-v0.1",
        "--seq-len",
        "4096",
        "--gpus",
        "1",
        "--out",
        str(out),
    )
    lines = r.output.strip().splitlines()
    assert r.exit_code == 2 and len(lines) == 1 and not out.exists(), r.output
    assert lines[0] == (
        f"error: --tokenizer builtin:mistral-7b-v0.1: its ids reach 31,999, past the 1,000 embedding rows of --model "
        f"{tiny_dir.resolve()}; pass the model's own tokenizer"
    )
    assert run_init("--model", str(tiny_dir), "--seq-len", "4096", "--gpus", "1", "--out", str(out)).exit_code == 0
    shown = show_config(out, "data.tokenizer=builtin:mistral-7b-v0.1")
    assert shown.exit_code == 2, shown.output  # train's refusal: the model's own tokenizer gives its ids other words
    assert shown.output.startswith("error: data.tokenizer = 'builtin:mistral-7b-v0.1' is not the tokenizer of model.")


def test_the_bundled_configs_of_a_model_agree_on_the_ruler_exclusions():
    excludes = {}
    for name in bundled_config_names():
        cfg = load_config(name)
        excludes.setdefault(cfg.model.name_or_path, set()).add(tuple(cfg.eval.exclude))
    assert all(len(v) == 1 for v in excludes.values()), excludes


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
            ["--model", "Qwen/Qwen2.5-7B", "--seq-len", "65536", "--gpus", "8", "--gpu-mem", "inf"],
            "--gpu-mem = inf: expected a memory size in GB",
        ),
        (
            ["--model", "Qwen/Qwen2.5-7B", "--seq-len", "65536", "--gpus", "8", "--host-mem", "nan"],
            "--host-mem = nan: expected a memory size in GB",
        ),
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


def test_the_header_command_writes_the_same_config_again(tiny_dir, tmp_path, monkeypatch):
    """The header's command carries every option the plan read: run as written (the memory sizes among them, which
    changed the layout here), it writes the same file; without --gpu-mem it planned for 80 GB."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my corpus").mkdir()
    (tmp_path / "my corpus" / "a.jsonl").write_text('{"text": "one"}\n')
    args = ["--model", str(tiny_dir), "--seq-len", "131072", "--gpus", "2", "--gpu-mem", "3", "--host-mem", "64"]
    r = run_init(*args, "--data", "my corpus", "--out", "first.yaml")
    assert r.exit_code == 0, r.output
    first = (tmp_path / "first.yaml").read_text()
    command = first.splitlines()[0].removeprefix("# Written by `").removesuffix("`:")
    words = shlex.split(command)
    assert words[:2] == ["lctrain", "init"] and "--gpu-mem" in words
    r = run_init(*words[2:], "--out", "again.yaml")
    assert r.exit_code == 0, r.output
    assert (tmp_path / "again.yaml").read_text() == first
    r = run_init(*args[:6], "--data", "my corpus", "--out", "d.yaml")
    assert r.exit_code == 0, r.output
    sp = [load_config(name).parallel.sequence_parallel for name in ("d.yaml", "first.yaml")]
    assert sp == [1, 2]


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


TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 1000,
    "max_position_embeddings": 512,
}


def show_config(path, *overrides):
    sets = [arg for o in overrides for arg in ("--set", o)]
    return CliRunner().invoke(app, ["show-config", "-c", str(path), *sets])


@pytest.mark.parametrize("cap", [None, 50.0])
def test_gemma2_gets_an_engine_transformers_runs_it_with(cap, tmp_path):
    """transformers runs no sdpa for Gemma-2 (its attention soft-caps), and auto is sdpa on a CPU and in full mode:
    init writes flex and says why; show-config passes on this CPU, and with the CPU's reference engine shows the
    changes train makes (the layers' window removed). A soft-capping model is said to be refused by train."""
    d = tmp_path / "gemma2"
    Gemma2Config(
        **TINY, head_dim=16, query_pre_attn_scalar=16, sliding_window=256, attn_logit_softcapping=cap
    ).save_pretrained(d)
    save_tiny_tokenizer(d)
    out = tmp_path / "g.yaml"
    r = run_init("--model", str(d), "--seq-len", "1024", "--gpus", "1", "--mode", "full", "--out", str(out))
    assert r.exit_code == 0, r.output
    assert load_config(str(out)).attention.engine == "flex"
    said = comments(out.read_text())
    assert "flex, not auto: transformers runs no sdpa for model type 'gemma2'" in said
    assert "layer_types: ['sliding_attention', 'full_attention'] -> ['full_attention', 'full_attention']" in said
    assert ("train refuses it until the model's config.json sets attn_logit_softcapping: null" in said) == bool(cap)
    reference = show_config(out, "attention.engine=reference")
    if cap is not None:  # as the comment says
        assert reference.exit_code != 0 and "set attn_logit_softcapping: null" in reference.output
        return
    shown = show_config(out)
    assert shown.exit_code == 0, shown.output
    assert reference.exit_code == 0, reference.output
    assert "layer_types: ['sliding_attention', 'full_attention'] -> ['full_attention', 'full_attention']" in (
        reference.output
    )


def test_the_window_train_removes_is_said_in_the_comments(tmp_path):
    d = tmp_path / "mistral"
    MistralConfig(**TINY, sliding_window=256).save_pretrained(d)
    save_tiny_tokenizer(d)
    out = tmp_path / "m.yaml"
    r = run_init("--model", str(d), "--seq-len", "1024", "--gpus", "1", "--out", str(out))
    assert r.exit_code == 0, r.output
    said = comments(out.read_text())
    assert "train changes the model's config so (show-config lists them" in said
    assert "sliding_window: 256 -> None (shorter than data.seq_len = 1024)" in said
    assert "max_position_embeddings: 512 -> 1024 (raised to data.seq_len = 1024)" in said
    assert "attn_implementation" not in said  # the machine's: show-config says it there
    assert load_config(str(out)).attention.engine == "auto"  # Mistral runs sdpa
    shown = show_config(out)
    assert shown.exit_code == 0 and "sliding_window: 256 -> None" in shown.output, shown.output
