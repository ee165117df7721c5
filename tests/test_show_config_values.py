"""`lctrain show-config` comments what a null or auto resolves to with what prepare, train and eval use (checked against
what they do, or the function they call), and refuses a random init's pad token outside the vocabulary, as train
does."""

import re

import pytest
import torch
import yaml
from train_helpers import set_args, show_config_refusal
from typer.testing import CliRunner

import lctrain.model
from lctrain.attention import make_batch
from lctrain.cli import app
from lctrain.config import load_config, settings
from lctrain.data.prepare import prepare
from lctrain.errors import UserError
from lctrain.eval.ruler import select_task_set
from lctrain.model import build_model
from lctrain.parallel.groups import pick_backend
from lctrain.rundir import RunDir
from lctrain.tokenizer import load_tokenizer

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the device show-config resolves for
# a few hundred tokens of the tiny demo's synthetic data: prepare runs in a second
SMALL_DATA = ["data.token_budget=4096", "data.synthetic.num_docs=20", "data.seq_len=256"]
# phi3 defaults to pad_token_id 32000, one past the 32,000 tokens of the demo's tokenizer
PHI3 = "{model_type: phi3, hidden_size: 64, intermediate_size: 128, num_hidden_layers: 1, num_attention_heads: 4"


def shown(overrides: list[str]) -> tuple[dict, str]:
    """What `lctrain show-config -c tiny_anchor --set ...` says a null or auto resolves to (the comment at the end of
    its key's line, by dotted key), and the text itself (the config's own values: a null or auto stays so)."""
    result = CliRunner().invoke(app, ["show-config", "-c", "tiny_anchor", *set_args(overrides)])
    assert result.exit_code == 0, result.output
    assert yaml.safe_load(result.stdout) == settings(load_config("tiny_anchor", overrides))
    path: list[str] = []
    comments = {}
    for line in result.stdout.splitlines():
        found = re.match(r"( *)(\w+):( .*)?$", line)
        if found:
            path[len(found[1]) // 2 :] = [found[2]]
            if "  # " in (found[3] or ""):
                comments[".".join(path)] = found[3].split("  # ", 1)[1]
    return comments, result.stdout


def test_shows_where_prepare_writes_and_train_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    values, _ = shown(SMALL_DATA)
    cfg = load_config("tiny_anchor", SMALL_DATA)
    assert values["data.output_dir"] == str(prepare(cfg))
    assert (tmp_path / values["data.output_dir"] / "manifest.json").is_file()
    assert values["train.run_dir"] == str(RunDir.of(cfg).path) == "runs/tiny_anchor"


def test_shows_the_tasks_eval_scores_and_the_backend_of_this_machine():
    values, out = shown(["eval.tasks=null", "eval.exclude=[cwe]"])
    names, _ = select_task_set(None, ["cwe"])
    listed, more = values["eval.tasks"].removeprefix("[").removesuffix("]").split(", ... ")  # a long list shortened
    assert names[: len(listed.split(", "))] == listed.split(", ") and int(more.removesuffix(" more")) > 0
    assert len(listed.split(", ")) + int(more.removesuffix(" more")) == len(names) == 12 and "cwe" not in names
    cfg = load_config("tiny_anchor")
    assert pick_backend(cfg) == ("nccl" if torch.cuda.is_available() else "gloo")
    assert f"  backend: auto  # {pick_backend(cfg)} on this machine (nccl with CUDA, else gloo)\n" in out


def test_shows_the_engine_build_model_runs_on_this_machine():
    values, out = shown(["attention.engine=auto"])
    built = build_model(load_config("tiny_anchor", ["attention.engine=auto"]), device=DEVICE)
    assert values["attention.engine"].startswith(f"{built.engine.name} on this machine (device {DEVICE}, ")
    assert "  engine: auto  # " in out


@pytest.mark.parametrize("parallel", [[], ["parallel.nproc_per_node=2", "parallel.sequence_parallel=2"]])
def test_shows_the_mlp_shards_a_training_forward_runs(monkeypatch, one_thread, parallel):
    """The count TiledMLP is called with on one rank's slice of a micro-batch, as the trainer cuts it."""
    overrides = ["model.tiled_mlp=auto", "model.arch.num_hidden_layers=1", *parallel]
    values, _ = shown(overrides)
    cfg = load_config("tiny_anchor", overrides)
    model = build_model(cfg).model
    calls = []

    def record(fn, mlp, x, shards, params):
        calls.append(shards)
        return fn(mlp, x)

    monkeypatch.setattr(lctrain.model, "tiled_mlp_apply", record)
    rows, length = cfg.train.micro_batch, cfg.data.seq_len
    batch = make_batch(torch.ones(rows, length, dtype=torch.long), [[length]] * rows, "full")
    ids = batch.shard(cfg.parallel.sequence_parallel, 0).input_ids
    with torch.no_grad():
        model.get_decoder().layers[0].mlp(model.get_input_embeddings()(ids))
    assert calls and int(values["model.tiled_mlp"]) == calls[0] == 2 * 1024 // cfg.parallel.sequence_parallel // 128


def test_show_config_and_train_refuse_a_pad_token_outside_the_vocabulary():
    arch = f"model.arch={PHI3}}}"
    expected = (
        "model.arch.pad_token_id = 32000 (the 'phi3' default) is outside the model's vocabulary of 32000 tokens "
        "(data.tokenizer 'builtin:mistral-7b-v0.1'); set model.arch.pad_token_id to a token id below 32000, or null"
    )
    assert show_config_refusal([arch]) == f"error: {expected}"
    cfg = load_config(None, [arch])
    with pytest.raises(UserError) as err:
        build_model(cfg, vocab_size=len(load_tokenizer(cfg.data.tokenizer)))  # as the trainer sizes it
    assert str(err.value) == expected


def test_a_pad_token_of_arch_vocab_size_is_refused_naming_it():
    arch = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1}
    cfg = load_config(None, [])
    cfg.model.arch = {**arch, "num_attention_heads": 4, "vocab_size": 32064, "pad_token_id": 32064}
    with pytest.raises(UserError, match=r"^model.arch.pad_token_id = 32064 is outside .* 32064 tokens \(model.arch.v"):
        build_model(cfg)


def test_arch_vocab_size_is_what_every_command_sizes():
    """A named `model.arch.vocab_size` (the 32,000-token tokenizer's padded to a multiple of 64) is built by train and
    counted by show-config's shape; one below the tokenizer's is refused by both in the same line; none named is the
    tokenizer's."""
    padded = load_config(None, ["model.arch.vocab_size=32064"])
    built = build_model(padded, vocab_size=32000).model  # as the trainer builds it, with the dataset's vocabulary
    assert built.get_input_embeddings().num_embeddings == lctrain.model.model_shape(padded).vocab == 32064
    assert lctrain.model.model_shape(load_config(None, [])).vocab == len(load_tokenizer(padded.data.tokenizer))
    small = ["model.arch.vocab_size=1000"]
    expected = (
        "--set model.arch.vocab_size=1000: model.arch.vocab_size = 1000 is smaller than the vocabulary of "
        "data.tokenizer 'builtin:mistral-7b-v0.1' (32000 tokens), whose ids up to 31999 would have no embedding row; "
        "set model.arch.vocab_size to 32000 or more, or remove it (the tokenizer's is used)"
    )
    with pytest.raises(UserError) as err:
        build_model(load_config(None, small), vocab_size=32000)
    assert str(err.value) == expected
    assert show_config_refusal(small) == f"error: {expected}"


@pytest.mark.parametrize("ids", ["pad_token_id: null", "pad_token_id: 0, eos_token_id: 32000, bos_token_id: 40000"])
def test_a_pad_token_in_the_vocabulary_or_none_builds(ids):
    """bos/eos ids outside the vocabulary build (nothing is sized from them; training and eval use the tokenizer's)."""
    cfg = load_config(None, [f"model.arch={PHI3}, {ids}}}"])
    model = build_model(cfg, vocab_size=len(load_tokenizer(cfg.data.tokenizer))).model
    assert model.get_input_embeddings().num_embeddings == 32000


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["data.seq_len=65537"], "data.seq_len = 65537 is not divisible by parallel.sequence_parallel = 4"),
        (["train.global_batch=7"], "train.global_batch = 7 is not divisible by train.micro_batch x data-parallel"),
        (["model.rope_scaling={rope_type: foo}"], "model.rope_scaling.rope_type = 'foo' is unknown; expected one of"),
        (["model.rope_scaling={rope_type: yarn, factor: 0.5}"], "rope_type 'yarn' needs a factor >= 1"),
        (["model.rope_scaling={factor: 8}"], "model.rope_scaling = {'factor': 8} names no rope_type; give one of"),
        (
            ["parallel.num_nodes=8", "parallel.sequence_parallel=64"],
            "the model's 32 attention heads are not divisible by parallel.sequence_parallel = 64",
        ),
        (
            ["parallel.zero_stage=0", "parallel.overlap_comm=true"],
            "parallel.overlap_comm overlaps ZeRO's communication",
        ),
    ],
)
def test_show_config_refuses_what_train_and_plan_would_of_a_model_not_downloaded(overrides, expected):
    """show-config printed a paper config (its model a hub name, not downloaded) with a batch its layout cannot split
    or an unknown RoPE scaling, exit code 0: train refused the first, and the second only once the model loaded
    (config explorer)."""
    result = CliRunner().invoke(app, ["show-config", "-c", "llama2_64k_anchor", *set_args(overrides)])
    line = result.stderr.strip()
    assert result.exit_code == 2 and "\n" not in line and expected in line, result.output
