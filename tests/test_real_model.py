"""lctrain on a real pretrained model (SmolLM2-135M, `real_model.py`), offline: its tokenizer rebuilt exactly, `prepare`
with it, training that starts at the model's own loss at its own RoPE base, an export that keeps every setting the
user did not change, and `eval` and `diagnose rope` on the result. References are plain transformers and tokenizers,
no lctrain code. The documents are Python's own reference documentation (`pydoc_data.topics`): English prose with
numbers and code, shipped with every Python."""

import json
import re
import subprocess
import sys
from pydoc_data.topics import topics

import pytest
import torch
from tokenizers import Tokenizer, pre_tokenizers
from train_helpers import clean_env, metric_records, set_args
from transformers import AutoModelForCausalLM, AutoTokenizer

from lctrain.config import load_config
from lctrain.data.store import open_packed
from lctrain.diagnostics.probe_text import probe_sequences
from lctrain.eval.runner import eval_anchor
from lctrain.model import config_changes, load_hf_config, used_values
from lctrain.rundir import RunDir

pytestmark = pytest.mark.real_model

SEQ_LEN = 512
STEPS = 2
OWN_THETA = 1e5  # SmolLM2-135M's RoPE base
# the prose topics, each one document, in a fixed order
DOCUMENTS = [topics[k] for k in sorted(topics) if len(topics[k]) > 4000][:12]
LONG_DOCUMENT = "\n\n".join(DOCUMENTS)
WINDOWS = 2  # each step reads all of them (global batch 2, one window per micro-step)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(str(model_dir))


def overrides(model_dir, tmp, *extra):
    return [
        "name=smollm2",
        "model.arch=null",
        f"model.name_or_path={model_dir}",
        "model.rope_theta=null",  # the model's own
        "model.dtype=float32",
        f"data.tokenizer={model_dir}",
        "data.source=local",
        f"data.path={tmp / 'docs.jsonl'}",
        f"data.seq_len={SEQ_LEN}",
        "data.shuffle_buffer_tokens=0",
        "data.num_workers=1",
        f"data.output_dir={tmp / 'data'}",
        "attention.mode=anchor",
        "attention.engine=sdpa",
        f"train.steps={STEPS}",
        "train.micro_batch=1",
        "train.lr=1e-6",
        "train.warmup_steps=0",
        f"train.run_dir={tmp / 'run'}",
        "checkpoint.hf_last=1",
        "checkpoint.every_steps=1000",
        *extra,
    ]


def test_tokenizer_splits_digits_like_smollm2(tokenizer):
    """The rebuilt tokenizer against the GGUF conversion's byte-level BPE run on a regex split at every digit."""
    byte_level = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
    byte_level.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)

    def reference(text):
        return [i for piece in re.split(r"(\d)", text) if piece for i in byte_level.encode(piece).ids]

    text = "In 1999,  42 cats ate 3.14159 pies; x  12\n  2024-11-20 v2.0 1e5 0x1F " + DOCUMENTS[0][:3000]
    assert tokenizer(text, add_special_tokens=False).input_ids == reference(text)
    # what the GGUF conversion alone gives differs where whitespace runs before a number
    assert tokenizer("a  12").input_ids != byte_level.encode("a  12").ids
    assert tokenizer.convert_ids_to_tokens(tokenizer("a  12").input_ids) == ["a", "ĠĠ", "1", "2"]


def test_config_changes_keep_the_models_own(model_dir):
    """No change to a setting the config leaves null: the base stays 1e5 and 8K positions are not lowered to the
    training length; a longer training length raises them, an explicit base replaces the model's."""
    pretrained = ["model.arch=null", f"model.name_or_path={model_dir}", "model.rope_theta=null"]
    for extra, want in [
        (["data.seq_len=512"], {}),
        (["data.seq_len=16384"], {"max_position_embeddings": (8192, 16384)}),
        (["data.seq_len=512", "model.rope_theta=1000000"], {"rope_parameters.rope_theta": (OWN_THETA, 1e6)}),
        (["data.seq_len=512", "model.dtype=bfloat16"], {"dtype": ("float32", "bfloat16")}),
    ]:
        cfg = load_config(None, [*pretrained, *extra])
        changes = config_changes(load_hf_config(cfg), cfg, vocab_size=None, attn_implementation="sdpa")
        assert {c.key: (c.old, c.new) for c in changes} == {
            **want,
            "use_cache": (True, False),
            "attn_implementation": (None, "sdpa"),
        }
    cfg = load_config(None, [*pretrained, "data.seq_len=512", f"data.tokenizer={model_dir}"])
    used, notes = used_values(cfg, "cpu")
    # the model's and tokenizer's values (where the run goes, the tasks, backend and engine: test_show_config_values)
    assert {k: v for k, v in used.items() if k.startswith(("model.", "data.anchor"))} == {
        "model.rope_theta": OWN_THETA,
        "model.rope_scaling": {"rope_type": "default"},
        "model.max_position_embeddings": 8192,
        "data.anchor": "<|endoftext|>",
        "model.checkpointing": "none",
    }
    assert any("attn_implementation: None -> 'lctrain_sdpa'" in n for n in notes)


def test_prepare_encodes_documents_with_the_models_tokenizer(model_dir, tokenizer, tmp_path):
    from lctrain.data.prepare import prepare

    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCUMENTS))
    data = open_packed(prepare(load_config(None, overrides(model_dir, tmp_path, f"data.token_budget={SEQ_LEN * 20}"))))
    assert data.manifest.anchor.model_dump() == {"token": "<|endoftext|>", "id": 0}
    body = []
    for w in range(len(data)):
        row = data[w]
        for start, n in zip([0, *row["seg_lens"].cumsum()[:-1]], row["seg_lens"]):
            assert row["input_ids"][start] == 0  # every segment opens with the anchor
            body += row["input_ids"][start + 1 : start + n].tolist()
    expected = [i for d in DOCUMENTS for i in tokenizer(d, add_special_tokens=False).input_ids]
    assert len(body) > 19 * (SEQ_LEN - 8) and body == expected[: len(body)]


@pytest.fixture(scope="module")
def trained(model_dir, tmp_path_factory):
    """`lctrain prepare` and `lctrain train` (a subprocess each, as a user runs them) from the model's weights."""
    tmp = tmp_path_factory.mktemp("real")
    # one long document: every window is one segment, [anchor] + text, which plain causal attention scores alike
    (tmp / "docs.jsonl").write_text(json.dumps({"text": LONG_DOCUMENT}) + "\n")
    items = overrides(model_dir, tmp, f"data.token_budget={SEQ_LEN * WINDOWS}", f"train.global_batch={WINDOWS}")
    out = {}
    for command in ("prepare", "train"):
        proc = subprocess.run(
            [sys.executable, "-m", "lctrain.cli", command, *set_args(items)],
            env=clean_env(),
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        out[command] = proc.stdout
    return tmp, out


def test_prepare_says_the_anchor(trained, tokenizer):
    tmp, out = trained
    said = " ".join(out["prepare"].split())
    assert "anchor: <|endoftext|> (id 0; auto: the byte-level BPE document separator; its BOS <|im_start|>" in said
    data = open_packed(tmp / "data")
    expected = tokenizer(LONG_DOCUMENT, add_special_tokens=False).input_ids
    assert [data[w]["input_ids"].tolist() for w in range(WINDOWS)] == [
        [0, *expected[w * (SEQ_LEN - 1) : (w + 1) * (SEQ_LEN - 1)]] for w in range(WINDOWS)
    ]


def reference_loss(model_dir, windows, theta=None):
    """Plain transformers: the model's mean next-token loss over `windows` (equal lengths), at its own RoPE base or
    at `theta`."""
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    if theta is not None:
        config = model.config
        config.rope_parameters = {**config.rope_parameters, "rope_theta": theta}
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), config=config, dtype=torch.float32)
    with torch.no_grad():
        return sum(float(model(torch.tensor([w]), labels=torch.tensor([w])).loss) for w in windows) / len(windows)


def test_training_starts_at_the_models_own_loss(trained, model_dir, tokenizer):
    """The first step (all windows) has the model's own mean loss on them, at its own RoPE base; the 1e6 base lctrain
    used to set silently gives a visibly different one."""
    tmp, out = trained
    first = metric_records(tmp / "run")[0]
    assert first["valid_labels"] == WINDOWS * (SEQ_LEN - 1)
    expected = tokenizer(LONG_DOCUMENT, add_special_tokens=False).input_ids
    windows = [[0, *expected[w * (SEQ_LEN - 1) : (w + 1) * (SEQ_LEN - 1)]] for w in range(WINDOWS)]
    own = reference_loss(model_dir, windows)
    raised = reference_loss(model_dir, windows, theta=1e6)
    print(f"first-step loss {first['loss']:.6f}; the model's own {own:.6f}; at base 1e6 {raised:.6f}")
    assert first["loss"] == pytest.approx(own, rel=1e-5)
    assert abs(raised - own) > 0.01
    assert "model config changes:" in out["train"] and "anchor       <|endoftext|> (id 0)" in out["train"]


def test_export_keeps_every_setting_not_changed(trained, model_dir):
    tmp, _ = trained
    run = tmp / "run"
    changes = {c["key"].split(".")[0]: c for c in json.loads((RunDir(run).model_changes_file).read_text())}
    assert set(changes) == {"use_cache", "attn_implementation"}
    original = json.loads((model_dir / "config.json").read_text())
    exported = json.loads((run / "hf" / f"step_{STEPS}" / "config.json").read_text())
    differ = {k for k in original.keys() | exported.keys() if original.get(k) != exported.get(k)}
    # training's use_cache: false is not exported: the export generates with its KV cache, as the model did; the one
    # key added is the base at the top level, where transformers 4.x reads it (compat.transformers.legacy_rope_keys)
    assert differ == {"rope_theta"} and exported["use_cache"] is changes["use_cache"]["from"] is True
    assert exported["rope_parameters"] == {"rope_theta": OWN_THETA, "rope_type": "default"}
    assert exported["rope_theta"] == OWN_THETA and "rope_theta" not in original
    assert json.loads((run / "anchor.json").read_text()) == {"token": "<|endoftext|>", "id": 0}
    assert json.loads((run / "hf" / f"step_{STEPS}" / "anchor.json").read_text()) == {"token": "<|endoftext|>", "id": 0}


def test_eval_and_diagnose_start_prompts_with_the_anchor(trained, tokenizer):
    tmp, _ = trained
    run = tmp / "run"
    ckpt = run / "hf" / f"step_{STEPS}"
    cfg = load_config(str(run / "config.yaml"))
    assert eval_anchor(ckpt, cfg, tokenizer).record() == {"token": "<|endoftext|>", "id": 0}
    env = clean_env()
    proc = subprocess.run(
        [sys.executable, "-m", "lctrain.cli", "eval", str(run), "--lengths", "512", "--tasks", "niah_single_1"]
        + ["--samples", "1", "--device", "cpu"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((run / "eval" / "results.json").read_text())
    assert results["anchor"] == {"token": "<|endoftext|>", "id": 0} and results["checkpoints"] == [ckpt.name]
    assert results["prompt_start"] == "anchor"  # the offline suite's prompts, as the training documents
    text = tmp / "docs.jsonl"
    probe = probe_sequences(text, tokenizer, 256, 1, vocab_size=len(tokenizer), anchor="<|endoftext|>")
    assert probe.sequences[0][0] == 0
    diag = tmp / "diag"
    proc = subprocess.run(
        [sys.executable, "-m", "lctrain.cli", "diagnose", "rope", str(ckpt), "--text", str(text)]
        + ["--samples", "1", "--seq-len", "64", "--max-len", "128", "--shifts", "0,16", "--out", str(diag)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    drift = json.loads((diag / "rope_drift.json").read_text())
    # the paper's Figure 1 on a real model: bf16 breaks relative positions, fp32 keeps them
    assert max(drift["cases"]["bf16"]["D"]) > 100 * max(drift["cases"]["fp32"]["D"])
