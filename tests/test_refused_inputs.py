"""Inputs that used to end in a library's traceback or in a number that is no result, each now one line and exit
code 2 before any work: a launcher's variables without the rendezvous address, an empty eval.lengths, a device this
machine does not have, a harness limit of no documents, an infinite memory size for `plan`, and perplexity data
prepared with another tokenizer than the model's (the two Mistral tokenizers that mistral-common ships); and a
missing input, whose refusal prepare says alone."""

import json

import pytest
from train_helpers import one_error_line, set_args
from transformers import AutoTokenizer
from typer.testing import CliRunner

from lctrain.cli import app
from lctrain.config import load_config
from lctrain.data.prepare import prepare
from lctrain.data.store import open_packed
from lctrain.eval.perplexity import check_same_tokenizer
from lctrain.parallel.groups import check_launcher_env
from lctrain.rundir import RunDir
from lctrain.tokenizer import load_tokenizer, tokenizer_fingerprint

TINY = [
    "data.seq_len=128",
    "data.token_budget=6000",
    "train.steps=2",
    "train.global_batch=2",
    "checkpoint.hf_last=2",
    "checkpoint.hf_every=2",
    "model.arch={model_type: llama, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 1, "
    "num_attention_heads: 2, num_key_value_heads: 1, tie_word_embeddings: true}",
]
V3 = "builtin:mistral-7b-v0.3"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A 2-step run (tokenizer mistral-7b-v0.1) with its export hf/step_2, and a dataset prepared with v0.3."""
    root = tmp_path_factory.mktemp("refused")
    over = TINY + [f"data.output_dir={root / 'data'}", f"train.run_dir={root / 'run'}"]
    prepare(load_config(None, over))
    prepare(load_config(None, TINY + [f"data.output_dir={root / 'data_v3'}", f"data.tokenizer={V3}"]))
    result = CliRunner().invoke(app, ["train"] + set_args(over))
    assert result.exit_code == 0, result.output
    return root


def cli(*args: str) -> str:
    return one_error_line(CliRunner().invoke(app, list(args)))


def test_launcher_variables_without_the_rendezvous_address(run, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.setenv("MASTER_PORT", "29500")
    line = cli("train", *set_args(TINY + [f"train.run_dir={run / 'new'}", f"data.output_dir={run / 'data'}"]))
    assert "but MASTER_ADDR is not" in line and "torchrun" in line
    assert not (run / "new").exists()
    assert "but MASTER_ADDR is not" in cli("resume", str(run / "run"))


def test_srun_tasks_without_a_launcher(run, monkeypatch):
    """`srun --ntasks=2 lctrain train`: SLURM sets no RANK or WORLD_SIZE, so each task trained the whole run alone."""
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "2")
    monkeypatch.setenv("SLURM_PROCID", "1")
    line = cli("train", *set_args(TINY + [f"train.run_dir={run / 'srun'}", f"data.output_dir={run / 'data'}"]))
    assert line.startswith("error: this is task 1 of 2 that srun started, and each would train the whole run")
    assert not (run / "srun").exists()
    assert cli("resume", str(run / "run")) == line
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "1")  # one task: lctrain starts its own processes, as documented
    check_launcher_env()
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "2")  # tasks that run a launcher: its variables are set
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "localhost")
    monkeypatch.setenv("MASTER_PORT", "29500")
    check_launcher_env()


def test_a_launcher_of_another_world_size_than_the_config(run, monkeypatch):
    """torchrun --nproc-per-node 2 with a config of one process: refused before anything is written (it trained on
    2 while config.yaml recorded 1), naming the settings that match the launcher."""
    for key, value in dict(
        RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500"
    ).items():
        monkeypatch.setenv(key, value)
    line = cli("train", *set_args(TINY + [f"train.run_dir={run / 'other'}", f"data.output_dir={run / 'data'}"]))
    assert line.endswith(
        "tiny_anchor.yaml: the launcher started 2 processes (WORLD_SIZE) where the config asks for "
        "parallel.nproc_per_node x parallel.num_nodes = 1 x 1 = 1; make them match: --set parallel.nproc_per_node=2 "
        "--set parallel.num_nodes=1 (the run directory records the layout it trains on)"
    )
    assert not (run / "other").exists()
    assert "the launcher started 2 processes" in cli("resume", str(run / "run"), "--set", "train.steps=3")


def test_empty_eval_lengths(run):
    line = cli("eval", str(run / "run"), "--set", "eval.lengths=[]")
    assert "eval.lengths" in line and "Traceback" not in line


def test_a_device_this_machine_lacks(run):
    import torch

    if torch.backends.mps.is_available():
        pytest.skip("this machine has MPS")
    assert "--device mps: Apple's MPS is not available" in cli("eval", str(run / "run"), "--device", "mps")


@pytest.mark.parametrize("limit", ["0", "-1", "nan"])
def test_a_harness_limit_of_no_documents(run, limit):
    line = cli("eval", str(run / "run"), "--harness", "hellaswag", "--harness-limit", limit)
    assert line.startswith(f"error: --harness-limit {float(limit)}: give a number of documents")


@pytest.mark.parametrize("option", ["--gpu-mem", "--host-mem"])
@pytest.mark.parametrize("value", ["inf", "nan", "0"])
def test_plan_memory_sizes_that_are_no_size(option, value):
    assert f"{option} = {float(value)}: expected a memory size in GB" in cli("plan", option, value)


def test_perplexity_data_of_another_tokenizer_is_refused(run):
    line = cli("eval", str(run / "run"), "--ppl-data", str(run / "data_v3"), "--lengths", "256")
    v3 = tokenizer_fingerprint(load_tokenizer(V3))
    v1 = tokenizer_fingerprint(load_tokenizer("builtin:mistral-7b-v0.1"))
    assert v1 != v3
    assert f"prepared with tokenizer mistral-7b-v0.3 (vocabulary 32768, fingerprint {v3})" in line
    assert f"uses another (vocabulary 32000, fingerprint {v1})" in line
    assert not (RunDir(run / "run").eval_dir / "results.json").exists()


def test_the_fingerprint_is_the_same_from_the_source_and_from_the_export(run):
    manifest = json.loads((run / "data" / "manifest.json").read_text())
    export = AutoTokenizer.from_pretrained(str(RunDir(run / "run").export(2)))
    assert manifest["tokenizer"]["fingerprint"] == tokenizer_fingerprint(export)
    check_same_tokenizer(open_packed(run / "data"), export, RunDir(run / "run").export(2))  # accepted


def test_a_missing_input_is_the_only_line_prepare_says(tmp_path):
    """A config whose steps would re-read windows warns so, but not ahead of its refusal: an input that is not there
    gets one line, the refusal (the warning is about a dataset that will not be built)."""
    missing = tmp_path / "corpus.jsonl"
    over = TINY + ["data.source=local", f"data.path={missing}", "train.steps=100", f"data.output_dir={tmp_path / 'd'}"]
    result = CliRunner().invoke(app, ["prepare", *set_args(over)])
    assert (
        result.output.strip() == one_error_line(result) == f"error: data.path = '{missing}': no such file or directory"
    )
