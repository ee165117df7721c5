"""The hostile inputs campaign (issue 22): cases none of the earlier tests tried, by class (config values and
combinations, command-line arguments of every command, sources and files, environment variables, run-directory
states, interrupted operations). Each ends in one `error:` line naming what is wrong and what to do, or does the right
thing; docs/troubleshooting.md lists them with what each does. Cases that only parse or check run in the default
suite; those that tokenize a corpus, train or load a model are slow-marked."""

import codecs
import json
import re
import shutil
from pathlib import Path

import pytest
from train_helpers import one_error_line, set_args
from transformers import GPT2Config
from typer.testing import CliRunner

from lctrain.cli import app
from lctrain.config import load_config
from lctrain.data.manifest import MANIFEST
from lctrain.rundir import RunDir

ARCH = (
    "{model_type: llama, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 1, num_attention_heads: 2, "
    "num_key_value_heads: 1, tie_word_embeddings: true}"
)
LAUNCHER = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _line(text: str) -> str:
    return json.dumps({"text": text})


@pytest.fixture(scope="module")
def w(tmp_path_factory) -> Path:
    """The files the cases name: hostile sources, a fake run (config, an export's config.json, metrics) and a
    directory that looks like a prepared dataset."""
    w = tmp_path_factory.mktemp("hostile")
    files = {
        "empty.jsonl": b"",
        "blank_lines.jsonl": b"\n   \n\t\n",
        "latin1.jsonl": '{"text": "caf\xe9 au lait"}\n'.encode("latin-1") * 50,
        "numbers.jsonl": "\n".join(json.dumps({"text": v}) for v in (5, None, ["a"], {"x": 1})).encode(),
        "binary.jsonl": bytes(range(256)) * 100,
        "fake.parquet": b"PAR1 nonsense",
        "empty_text.jsonl": ((_line("") + "\n") * 50).encode(),
        "crlf.jsonl": ((_line("word " * 30) + "\r\n") * 50).encode(),
        "utf16.jsonl": codecs.BOM_UTF16_LE + ((_line("word " * 30) + "\n") * 50).encode("utf-16-le"),
        "other_field.jsonl": ((json.dumps({"content": "word " * 30}) + "\n") * 50).encode(),
        "array.jsonl": (json.dumps([_line("a")]) + "\n").encode(),
        "huge_line.jsonl": (_line("word " * 2_000_000) + "\n").encode(),
        "plain.txt": b"some text\n",
        "dup.yaml": b"base: tiny_anchor\nseed: 1\nseed: 2\n",
        "typo.yaml": b"base: tiny_anchor\ntrian:\n  steps: 3\n",
        "bench_not_json.json": b"not json",
        "bench_empty.json": b"{}",
        "afile": b"x",
    }
    for name, content in files.items():
        (w / name).write_bytes(content)
    (w / "emptydir").mkdir()
    run = RunDir(w / "run")
    run.write_config(load_config(None, [f"model.arch={ARCH}", "data.seq_len=64"]))
    run.export(2).mkdir(parents=True)
    (run.export(2) / "config.json").write_text("{}")
    for step in (1, 2):
        run.append_metrics({"step": step, "loss": 3.0 - step})
    GPT2Config(n_embd=32, n_layer=1, n_head=2).save_pretrained(w / "gpt2")  # learned positions, no RoPE
    data = w / "dataset"
    data.mkdir()
    (data / MANIFEST).write_text("{}")
    (data / "config.yaml").write_text("base: tiny_anchor\n")
    return w


def src(name: str) -> list[str]:
    return ["prepare"] + set_args(
        [
            "data.source=local",
            "data.path={w}/" + name,
            "data.seq_len=64",
            "data.token_budget=640",
            "train.steps=1",
            "data.output_dir={w}/out/" + name,
        ]
    )


def train(*extra: str) -> list[str]:
    base = [f"model.arch={ARCH}", "data.seq_len=64", "train.steps=1", "data.output_dir={w}/data", "train.run_dir={w}/r"]
    return ["train"] + set_args(base + list(extra))


OK = None  # the command succeeds
# (id, class, command with {w} for the fixture directory, environment, the error line's pattern or OK)
CASES = [
    # ---- config values and combinations
    (
        "seq-len-fraction",
        "config",
        ["show-config", "--set", "data.seq_len=64.5"],
        {},
        r"data.seq_len = 64.5: .*integer",
    ),
    (
        "steps-zero",
        "config",
        ["show-config", "--set", "train.steps=0"],
        {},
        r"train.steps = 0: .*greater than or equal",
    ),
    ("name-escapes-runs", "config", ["show-config", "--set", "name=../../x"], {}, r"name = '../../x': the name is one"),
    ("tokenizer-empty", "config", ["show-config", "--set", "data.tokenizer="], {}, r"no value after '='"),
    (
        "model-path-empty",
        "config",
        ["show-config", "--set", "model.name_or_path="],
        {},
        r"--set 'model.name_or_path=': no value after '=' \(an unset shell variable\?\); to clear the key write "
        r"model.name_or_path=null",
    ),
    (
        "split-empty",  # a key that cannot be null is not told to write null
        "config",
        ["show-config", "--set", "data.hub_split="],
        {},
        r"--set 'data.hub_split=': no value after '=' \(an unset shell variable\?\); data.hub_split takes a value "
        r"\(its default: 'train'\)",
    ),
    ("mode-upper-case", "config", ["show-config", "--set", "attention.mode=ANCHOR"], {}, r"attention.mode = 'ANCHOR'"),
    ("eval-length-4k-string", "config", ["show-config", "--set", "eval.lengths=[4k]"], {}, r"eval.lengths\[0\] = '4k'"),
    (
        "lr-underflows-to-zero",
        "config",
        ["show-config", "--set", "train.lr=1e-400"],
        {},
        r"train.lr = .*greater than 0",
    ),
    ("keep-negative", "config", ["show-config", "--set", "checkpoint.keep=-1"], {}, r"checkpoint.keep = -1"),
    (
        "rope-theta-nan",
        "config",
        ["show-config", "--set", "model.rope_theta=.nan"],
        {},
        r"rope_theta = nan: not a finite",
    ),
    (
        "duplicate-yaml-key",
        "config",
        ["show-config", "-c", "{w}/dup.yaml"],
        {},
        r"dup.yaml:3: .*key 'seed' appears twice",
    ),
    ("misspelt-section", "config", ["show-config", "-c", "{w}/typo.yaml"], {}, r"typo.yaml: unknown key 'trian'"),
    ("seq-len-one", "config", ["show-config", "--set", "data.seq_len=1"], {}, r"data.seq_len = 1: .*greater than or"),
    ("set-without-value", "config", ["show-config", "--set", "data"], {}, r"--set 'data': expected KEY=VALUE"),
    ("set-into-a-value", "config", ["show-config", "--set", "data.seq_len.x=3"], {}, r"'seq_len' is a value, not a"),
    ("config-binary-file", "config", ["prepare", "--config", "{w}/binary.jsonl"], {}, r"binary.jsonl: not UTF-8 text"),
    ("batch-indivisible", "config", train("train.global_batch=3", "train.micro_batch=2"), {}, r"not divisible by"),
    ("micro-over-global", "config", train("train.micro_batch=4", "train.global_batch=2"), {}, r"not divisible by"),
    ("bfloat16-zero-0", "config", train("model.dtype=bfloat16"), {}, r"bfloat16 needs parallel.zero_stage >= 1"),
    ("float16-on-cpu", "config", train("model.dtype=float16"), {}, r"float16 trains through DeepSpeed's fp16 .* CUDA"),
    (
        "sp-not-dividing-length",
        "config",
        train("parallel.sequence_parallel=3", "parallel.nproc_per_node=3"),
        {},
        r"data.seq_len = 64 is not divisible by parallel.sequence_parallel = 3",
    ),
    # ---- command-line arguments
    ("eval-length-zero", "cli", ["eval", "{w}/run", "--lengths", "0"], {}, r"--lengths '0': '0' is not a length"),
    ("eval-length-word", "cli", ["eval", "{w}/run", "--lengths", "abc"], {}, r"'abc' is not a length"),
    ("eval-samples-zero", "cli", ["eval", "{w}/run", "--samples", "0"], {}, r"--samples 0: need at least 1"),
    ("eval-samples-negative", "cli", ["eval", "{w}/run", "--samples", "-1"], {}, r"--samples -1: need at least 1"),
    ("eval-backend", "cli", ["eval", "{w}/run", "--backend", "foo"], {}, r"--backend foo: choose hf .* or vllm"),
    ("eval-task-unknown", "cli", ["eval", "{w}/run", "--tasks", "nosuch"], {}, r"--tasks: unknown task\(s\) nosuch"),
    ("eval-harness-batch", "cli", ["eval", "{w}/run", "--harness", "x", "--harness-batch", "0"], {}, r"batch 0"),
    ("eval-device-index", "cli", ["eval", "{w}/run", "--device", "cuda:abc"], {}, r"--device cuda:abc: not a device"),
    ("eval-ppl-data-empty", "cli", ["eval", "{w}/run", "--ppl-data", "{w}/emptydir"], {}, r"no prepared dataset here"),
    ("eval-lengths-empty", "cli", ["eval", "{w}/run", "--lengths", ""], {}, r"--lengths '': '' is not a length"),
    ("eval-tasks-empty", "cli", ["eval", "{w}/run", "--tasks", " , "], {}, r"--tasks ' , ': names nothing"),
    ("config-empty-name", "cli", ["train", "-c", ""], {}, r"config '': an empty name \(an unset shell variable\?\)"),
    ("sp-modes-empty", "cli", ["check", "sp", "--modes", ""], {}, r"--modes '': unknown mode \(none given\)"),
    ("inspect-an-empty-dir", "cli", ["inspect", "{w}/emptydir"], {}, r"emptydir: no prepared dataset here"),
    ("eval-ruler-data-empty", "cli", ["eval", "{w}/run", "--ruler-data", "{w}/emptydir"], {}, r"no length directories"),
    (
        "eval-out-a-file",
        "cli",
        ["eval", "{w}/run", "--out", "{w}/afile"],
        {},
        r"afile: File exists; fix the path or choose",
    ),
    ("eval-dataset-dir", "cli", ["eval", "{w}/dataset"], {}, r"dataset: neither a run directory"),
    ("rope-samples-zero", "cli", ["diagnose", "rope", "tiny_anchor", "--samples", "0"], {}, r"need samples >= 1"),
    ("rope-shifts-words", "cli", ["diagnose", "rope", "tiny_anchor", "--shifts", "a,b"], {}, r"--shifts a,b: expected"),
    ("rope-cases-unknown", "cli", ["diagnose", "rope", "tiny_anchor", "--cases", "foo"], {}, r"--cases foo: expected"),
    ("rope-delta2-negative", "cli", ["diagnose", "rope", "tiny_anchor", "--delta2", "-1"], {}, r"delta2 >= 0"),
    ("rope-shift-batch-zero", "cli", ["diagnose", "rope", "tiny_anchor", "--shift-batch", "0"], {}, r"shift-batch >="),
    ("rope-seq-len-zero", "cli", ["diagnose", "rope", "tiny_anchor", "--seq-len", "0"], {}, r"need 2 <= seq_len"),
    ("sp-nproc-zero", "cli", ["check", "sp", "--nproc", "0"], {}, r"--nproc 0: .*at least 2 processes"),
    ("sp-modes-unknown", "cli", ["check", "sp", "--modes", "bogus"], {}, r"unknown mode bogus"),
    ("sp-dtype-int8", "cli", ["check", "sp", "--dtype", "int8"], {}, r"model.dtype = 'int8' is not allowed"),
    ("sp-window-negative", "cli", ["check", "sp", "--window", "-1"], {}, r"--window -1: a window index is 0 or more"),
    ("inspect-a-file", "cli", ["inspect", "{w}/afile"], {}, r"afile: no prepared dataset here"),
    ("estimate-tflops-zero", "cli", ["estimate", "--tflops", "0"], {}, r"--tflops 0.0: expected the achieved TFLOP/s"),
    ("estimate-tflops-nan", "cli", ["estimate", "--tflops", "nan"], {}, r"--tflops nan: expected the achieved TFLOP/s"),
    ("estimate-gpus-negative", "cli", ["estimate", "--tflops", "100", "--gpus", "-3"], {}, r"--gpus -3: must be at"),
    ("estimate-bench-not-json", "cli", ["estimate", "--from-bench", "{w}/bench_not_json.json"], {}, r"not valid JSON"),
    ("estimate-bench-empty", "cli", ["estimate", "--from-bench", "{w}/bench_empty.json"], {}, r"no positive 'tflops_"),
    ("estimate-steps-zero", "cli", ["estimate", "--measure", "--steps", "0"], {}, r"--steps 0 --warmup 2: need at"),
    ("plan-nproc-zero", "cli", ["plan", "--nproc", "0"], {}, r"parallel.nproc_per_node = 0"),
    ("plan-gpu-mem-negative", "cli", ["plan", "--gpu-mem", "-1"], {}, r"--gpu-mem = -1.0: expected a memory size"),
    ("plan-host-mem-nan", "cli", ["plan", "--host-mem", "nan"], {}, r"--host-mem = nan: expected a memory size"),
    ("plot-metric-unknown", "cli", ["plot", "{w}/run", "--metric", "nosuch", "--out", "{w}/c.png"], {}, r"--metric no"),
    ("plot-out-not-png", "cli", ["plot", "{w}/run", "--out", "{w}/c.txt"], {}, r"--out .*c.txt: the curves are a PNG"),
    (
        "plot-dataset-dir",
        "cli",
        ["plot", "{w}/dataset", "--out", "{w}/c.png"],
        {},
        r"dataset: a prepared dataset \(it holds manifest.json\), not a run directory",
    ),
    (
        "init-seq-len-zero",
        "cli",
        ["init", "--model", "meta-llama/Llama-2-7b-hf", "--seq-len", "0", "--gpus", "8"],
        {},
        r"--seq-len 0: expected a multiple of 1024",
    ),
    (
        "init-gpus-zero",
        "cli",
        ["init", "--model", "meta-llama/Llama-2-7b-hf", "--seq-len", "65536", "--gpus", "0"],
        {},
        r"--gpus 0: expected at least 1 GPU",
    ),
    (
        "init-mode-unknown",
        "cli",
        ["init", "--model", "meta-llama/Llama-2-7b-hf", "--seq-len", "65536", "--gpus", "8", "--mode", "foo"],
        {},
        r"--mode foo: expected one of",
    ),
    (
        "init-out-exists",
        "cli",
        ["init", "--model", "meta-llama/Llama-2-7b-hf", "--seq-len", "65536", "--gpus", "8", "--out", "{w}/afile"],
        {},
        r"afile exists; choose another --out or pass --force",
    ),
    (
        "init-nodes-uneven",
        "cli",
        ["init", "--model", "meta-llama/Llama-2-7b-hf", "--seq-len", "65536", "--gpus", "12"],
        {},
        r"--gpus 12: more than one node needs a multiple",
    ),
    (
        "init-gpu-mem-zero",
        "cli",
        ["init", "--model", "meta-llama/Llama-2-7b-hf", "--seq-len", "65536", "--gpus", "8", "--gpu-mem", "0"],
        {},
        r"--gpu-mem = 0.0: expected a memory size in GB, > 0 and at most 1,000,000",
    ),
    ("resume-a-file", "cli", ["resume", "{w}/afile"], {}, r"afile: not a run directory \(no config.yaml\)"),
    ("resume-a-dataset", "run-dir", ["resume", "{w}/dataset"], {}, r"a prepared dataset .*, not a run directory"),
    # ---- the commands of the offline example and the headline comparison (second round)
    ("example-text-dot", "args", ["example-text", "."], {}, r"\.: a directory; give the file to write"),
    ("example-text-a-dir", "args", ["example-text", "emptydir"], {}, r"emptydir: a directory; give the file"),
    ("example-text-bogus-kind", "args", ["example-text", "x.jsonl", "--kinds", "bogus"], {}, r"kinds are prose, code"),
    ("example-model-a-file", "args", ["example-model", "afile"], {}, r"afile exists and is not a directory"),
    ("example-model-a-users-dir", "args", ["example-model", "run"], {}, r"run is not empty and holds no example model"),
    (
        "experiment-checkpoints-0",
        "args",
        ["experiment", "extend", "--out", "e", "--checkpoints", "0"],
        {},
        r"--checkpoints 0: evaluate at least 1",
    ),
    (
        "experiment-eval-lengths-0",
        "args",
        ["experiment", "extend", "--out", "e", "--eval-lengths", "0"],
        {},
        r"--eval-lengths '0': '0' is not a length",
    ),
    (
        "experiment-seeds-0",
        "args",
        ["experiment", "extend", "--out", "e", "--seeds", "0"],
        {},
        r"--seeds 0: run at least 1 seed",
    ),
    (
        "experiment-device-tpu",
        "args",
        ["experiment", "extend", "--out", "e", "--device", "tpu"],
        {},
        r"--device tpu: choose auto, cuda or cpu",
    ),
    (
        "experiment-out-a-file",
        "args",
        ["experiment", "extend", "--out", "afile/x", "--steps", "1"],
        {},
        r"afile/x: cannot create the directory \(Not a directory\): afile is a file",
    ),
    ("report-nothing-there", "args", ["report", "emptydir"], {}, r"emptydir: neither an evaluated run directory"),
    ("report-not-evaluated", "args", ["report", "run"], {}, r"run: not evaluated yet .*lctrain eval run"),
    ("report-last-0", "args", ["report", "run", "--last", "0"], {}, r"--last 0: average over at least 1 checkpoint"),
    (
        "train-a-model-without-rope",
        "config",
        ["train", "--set", "model.name_or_path={w}/gpt2", "--set", "model.arch=null"],
        {},
        r"model.name_or_path = '.*gpt2': model type 'gpt2' has no RoPE .*lctrain extends RoPE models",
    ),
    (
        "plan-an-arch-without-rope",
        "config",
        ["plan", "--set", "model.arch={model_type: gpt2, n_embd: 32, n_layer: 1, n_head: 2}"],
        {},
        r"model.arch: model type 'gpt2' has no RoPE",
    ),
    # ---- sources and files
    ("src-empty-file", "sources", src("empty.jsonl"), {}, r"yielded 0 tokens in 0 usable documents"),
    ("src-blank-lines", "sources", src("blank_lines.jsonl"), {}, r"skipped: 3 blank_line"),
    ("src-latin1", "sources", src("latin1.jsonl"), {}, r"latin1.jsonl: not UTF-8 text: none of its 50 lines"),
    ("src-text-not-string", "sources", src("numbers.jsonl"), {}, r"skipped: 4 no_text"),
    ("src-binary", "sources", src("binary.jsonl"), {}, r"binary.jsonl: not UTF-8 JSON Lines: .* hold NUL bytes"),
    ("src-fake-parquet", "sources", src("fake.parquet"), {}, r"fake.parquet: unreadable as parquet"),
    ("src-empty-dir", "sources", src("emptydir"), {}, r"emptydir': no .jsonl, .json, .*files under"),
    ("src-empty-texts", "sources", src("empty_text.jsonl"), {}, r"skipped: 50 empty_text"),
    ("src-utf16", "sources", src("utf16.jsonl"), {}, r"utf16.jsonl: UTF-16 text \(it starts with a UTF-16 byte"),
    (
        "src-other-field",
        "sources",
        src("other_field.jsonl"),
        {},
        r"other_field.jsonl: record 1 has no 'text' field \(it has: .*text_field: ",
    ),
    ("src-json-array-lines", "sources", src("array.jsonl"), {}, r"array.jsonl: one JSON array of 1 string, not"),
    ("src-txt", "sources", src("plain.txt"), {}, r"unsupported file type"),
    (
        "src-device",
        "sources",
        ["prepare", "--set", "data.source=local", "--set", "data.path=/dev/null"],
        {},
        r"data.path = '/dev/null': unsupported file type",
    ),
    ("src-crlf", "sources", src("crlf.jsonl"), {}, OK),
    ("src-10mb-line", "sources", src("huge_line.jsonl"), {}, OK),
    ("out-dir-is-file", "sources", ["prepare", "--set", "data.output_dir={w}/afile"], {}, r"is not a directory"),
    # ---- environment
    ("env-world-size-word", "env", train(), {"WORLD_SIZE": "abc", "RANK": "0"}, r"RANK, WORLD_SIZE are set but"),
    ("env-local-rank-alone", "env", train(), {"LOCAL_RANK": "3"}, r"LOCAL_RANK is set but RANK, WORLD_SIZE not"),
    (
        "env-rank-beyond-world",
        "env",
        train(),
        {"RANK": "2", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"},
        r"RANK=2 with WORLD_SIZE=2: launcher variables must be",
    ),
    (
        "env-port-word",
        "env",
        train(),
        {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "http"},
        r"MASTER_PORT='http': launcher variables must be non-negative integers",
    ),
    ("env-cuda-visible-garbage", "env", ["plan"], {"CUDA_VISIBLE_DEVICES": "garbage"}, OK),
    ("env-hf-home-a-file", "env", ["show-config"], {"HF_HOME": "{w}/afile"}, OK),
    ("env-cache-a-file", "env", src("crlf.jsonl"), {"LCTRAIN_CACHE": "{w}/afile"}, OK),
]
# The cases that tokenize a corpus or build a model: over the default suite's budget.
SLOW = {"sources", "env-cache-a-file", "env-cuda-visible-garbage", "env-hf-home-a-file", "eval-out-a-file"}


def _params():
    for case_id, cls, args, env, expected in CASES:
        marks = (pytest.mark.slow,) if cls in SLOW or case_id in SLOW else ()
        yield pytest.param(args, env, expected, id=f"{cls}-{case_id}", marks=marks)


@pytest.mark.parametrize("args, env, expected", list(_params()))
def test_hostile_case(w, monkeypatch, args, env, expected):
    for key in LAUNCHER:
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value.replace("{w}", str(w)))
    monkeypatch.chdir(w)
    result = CliRunner().invoke(app, [a.replace("{w}", str(w)) for a in args])
    if expected is OK:
        assert result.exit_code == 0 and "Traceback" not in result.output, result.output
    else:
        line = one_error_line(result)
        assert re.search(expected, line), line


def test_the_campaign_has_fifty_distinct_cases():
    ids = [c[0] for c in CASES]
    assert len(set(ids)) == len(ids) >= 50


@pytest.mark.slow  # trains and resumes the tiny model (~15 s)
def test_leftovers_of_interrupted_writes_and_a_torn_metrics_line(tmp_path):
    """An export and a checkpoint interrupted while being written (their .tmp- directories) and a metrics record
    torn by a kill: resume removes the leftovers and continues, eval sees only complete exports."""
    over = [
        f"model.arch={ARCH}",
        "data.seq_len=64",
        "data.token_budget=2000",
        "data.synthetic.num_docs=100",
        f"data.output_dir={tmp_path / 'data'}",
        f"train.run_dir={tmp_path / 'run'}",
        "train.steps=2",
        "train.global_batch=2",
        "train.micro_batch=1",
        "checkpoint.hf_every=2",
    ]
    for command in ("prepare", "train"):
        assert CliRunner().invoke(app, [command] + set_args(over)).exit_code == 0
    rd = RunDir(tmp_path / "run")
    (rd.exports_dir / ".tmp-step_3").mkdir()
    (rd.checkpoints / ".tmp-step_3").mkdir()
    with open(rd.metrics_file, "a") as f:
        f.write('{"step": 3, "lo')
    rd.config_file.write_text(rd.config_file.read_text().replace("steps: 2\n", "steps: 3\n", 1))
    result = CliRunner().invoke(app, ["resume", str(rd.path)])
    assert result.exit_code == 0, result.output
    assert [r["step"] for r in rd.read_metrics()] == [1, 2, 3]
    assert not (rd.checkpoints / ".tmp-step_3").exists()
    assert [p.name for p in rd.exports()] == ["step_2", "step_3"]
    shutil.rmtree(rd.path / "hf" / "step_3")
