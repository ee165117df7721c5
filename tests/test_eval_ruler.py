"""`lctrain eval --ruler-data`: RULER's own prepared data, scored on a tiny hand-made directory in the layout RULER's
scripts/run.sh writes, with two tiny random Llama checkpoints.

References: the prompts are rebuilt here as RULER's scripts/pred/call_api.py builds them (input + answer_prefix) and
completed with Hugging Face's greedy `generate` at RULER's tokens_to_generate (fwe 50, qa 32); the expected answers
are cut from those completions so that every sample's metric is known by construction; task scores, checkpoint
averages and task means are recomputed below with plain loops from RULER's formulas. Also: the task sets of the
paper, missing task/length files named at the top of the report, and malformed data ending in one line."""

import json

import pytest
import torch
from train_helpers import export_by_hand, one_error_line
from typer.testing import CliRunner

from lctrain.cli import app
from lctrain.config import bundled_config_names, load_config, write_resolved
from lctrain.errors import UserError
from lctrain.eval.ruler import scan_task, select_task_set
from lctrain.eval.runner import evaluate, resolve_target
from lctrain.rundir import RunDir
from lctrain.tokenizer import load_tokenizer

RULER_13 = [
    "niah_single_1",
    "niah_single_2",
    "niah_single_3",
    "niah_multikey_1",
    "niah_multikey_2",
    "niah_multikey_3",
    "niah_multivalue",
    "niah_multiquery",
    "vt",
    "cwe",
    "fwe",
    "qa_1",
    "qa_2",
]
LLAMA2_SET = [t for t in RULER_13 if t not in ("niah_multikey_3", "cwe")]
TINY = [
    "model.arch.hidden_size=64",
    "model.arch.intermediate_size=128",
    "model.arch.num_hidden_layers=2",
    "model.arch.num_attention_heads=4",
    "model.arch.num_key_value_heads=2",
    "data.seq_len=512",
    "eval.ppl_windows=0",
]
STEPS = (10, 20)
NEW_TOKENS = {"fwe": 50, "qa_1": 32}
ABSENT = "zq-not-in-any-prediction-qz"


def _prompt(rec: dict) -> str:
    return rec["input"] + rec["answer_prefix"]


def _records(task: str, length: int) -> list[dict]:
    filler = " ".join(f"The grass is green and the sky is blue number {i}." for i in range(length // 64))
    if task == "fwe":
        return [
            {
                "index": i,
                "input": f"Read the following coded text and track the frequency of each coded word. "
                f"{filler} ....\nQuestion: What are the three most frequently appeared words in the above coded text?",
                "answer_prefix": " Answer: According to the coded text above, the three most frequently appeared "
                f"words (set {i}) are:",
            }
            for i in range(2)
        ]
    return [
        {
            "index": i,
            "input": f"Answer the question based on the given documents.\n\nDocument 1:\n{filler}\n\n"
            f"Question: what is item {i}?",
            "answer_prefix": " Answer:",
        }
        for i in range(2)
    ]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("builtin:mistral-7b-v0.1")


@pytest.fixture(scope="module")
def ruler_run(tmp_path_factory, tok, one_thread):
    """A run with checkpoints step_10/step_20 and RULER data for fwe at 256 and 512 (run.sh's
    <L>/data/<task>/ layout) and qa_1 at 512 only (prepare.py's <L>/<task>/ layout); vt has no data anywhere.

    Expected answers, cut from step_10's greedy completions: fwe sample 0 holds two of its three expected strings
    (string_match_all 2/3), sample 1 none (0); qa_1 sample 0 one of two acceptable answers (string_match_part 1),
    sample 1 none (0). qa_1 records a `length` 30% above the tokenizer's count, as data prepared with another
    tokenizer would."""
    from lctrain.model import build_model

    root = tmp_path_factory.mktemp("rulerrun")
    run, data = root / "run", root / "synthetic"
    cfg = load_config(None, TINY + [f"train.run_dir={run}"])
    write_resolved(cfg, run)
    models = {}
    for step in STEPS:
        cfg.seed = step
        model = build_model(cfg, vocab_size=len(tok)).model.eval()
        export_by_hand(model, tok, run, step)
        model.set_attn_implementation("sdpa")  # as `lctrain eval` loads a checkpoint: one causal prompt
        models[f"step_{step}"] = model

    def complete(model, prompt, n):
        ids = tok(prompt, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=n,
                do_sample=False,
                use_cache=True,
                pad_token_id=tok.eos_token_id,
            )
        return tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)

    files = {
        ("fwe", 256): data / "256" / "data" / "fwe",
        ("fwe", 512): data / "512" / "data" / "fwe",
        ("qa_1", 512): data / "512" / "qa_1",
    }
    completions = {}
    for (task, length), folder in files.items():
        recs = _records(task, length)
        for i, rec in enumerate(recs):
            done = {c: complete(m, _prompt(rec), NEW_TOKENS[task]) for c, m in models.items()}
            completions[(task, length, i)] = done
            first = " ".join(done["step_10"].split())  # RULER's post-processing changes no visible character
            assert len(first) >= 8, done
            if task == "fwe":
                rec["outputs"] = [first[:4], first[-4:], ABSENT] if i == 0 else [ABSENT]
            else:
                rec["outputs"] = [ABSENT, first[:6]] if i == 0 else [ABSENT + "-2"]
            counted = len(tok(_prompt(rec))["input_ids"]) + NEW_TOKENS[task]
            rec["length"] = round(1.3 * counted) if task == "qa_1" else counted
        folder.mkdir(parents=True)
        (folder / "validation.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return run, data, completions


def _matches(pred: str, ref: str) -> float:
    return 1.0 if ref.lower() in pred.lower() else 0.0


def _ruler_task_score(task: str, preds: list[str], refs: list[list[str]]) -> float:
    """RULER's string_match_part (qa) / string_match_all (the rest), written out as loops."""
    total = 0.0
    for pred, ref in zip(preds, refs):
        if task.startswith("qa"):
            total += max(_matches(pred, r) for r in ref)
        else:
            total += sum(_matches(pred, r) for r in ref) / len(ref)
    return round(total / len(preds) * 100, 2)


@pytest.fixture(scope="module")
def scored(ruler_run, one_thread):
    run, data, _ = ruler_run
    # a wide console: rich would wrap the long paths of the report
    result = CliRunner().invoke(
        app,
        ["eval", str(run), "--ruler-data", str(data), "--tasks", "fwe,vt,qa_1", "--lengths", "256,512,1k"],
        env={"COLUMNS": "400"},
    )
    assert result.exit_code == 0, result.output
    return result.output, json.loads((run / "eval" / "results.json").read_text())


def test_prompts_and_generation_are_rulers(ruler_run, scored):
    run, _, completions = ruler_run
    preds = [json.loads(line) for line in (run / "eval" / "predictions.jsonl").read_text().splitlines()]
    assert len(preds) == len(STEPS) * len(completions)
    cut = 0
    for p in preds:
        # RULER's `index` need not be unique (niah stores a character offset there): samples are keyed by line
        full = completions[(p["task"], p["length"], p["index"] - 1)][p["checkpoint"]]
        # RULER's whole budget, or its start where the score had settled (every answer found: it scores 1 either way)
        assert full.startswith(p["prediction"])
        if p["prediction"] != full:
            cut += 1
            assert p["score"] == 1.0 and _ruler_task_score(p["task"], [p["prediction"]], [p["answers"]]) == 100.0
    assert 0 < cut < len(preds)


def test_scores_against_rulers_formulas(ruler_run, scored):
    run, data, completions = ruler_run
    _, results = scored
    assert results["suite"].startswith("RULER (NVIDIA/RULER data in")
    assert results["tasks"] == ["fwe", "qa_1"] and results["lengths"] == [256, 512]
    files = {
        ("fwe", 256): data / "256/data/fwe/validation.jsonl",
        ("fwe", 512): data / "512/data/fwe/validation.jsonl",
        ("qa_1", 512): data / "512/qa_1/validation.jsonl",
    }
    expected: dict = {}
    for (task, length), path in files.items():
        refs = [json.loads(line)["outputs"] for line in path.read_text().splitlines()]
        for c in results["checkpoints"]:
            preds = [completions[(task, length, i)][c] for i in range(len(refs))]
            expected.setdefault(c, {}).setdefault(task, {})[str(length)] = _ruler_task_score(task, preds, refs)
    # by construction, step_10: fwe (2/3 + 0) / 2, qa (1 + 0) / 2
    assert expected["step_10"]["fwe"] == {"256": 33.33, "512": 33.33}
    assert expected["step_10"]["qa_1"] == {"512": 50.0}
    assert results["scores"] == expected
    for task, per_len in results["average"].items():
        for L, v in per_len.items():
            assert v == pytest.approx(sum(expected[c][task][L] for c in expected) / len(expected), abs=1e-9)
    mean = results["task_mean"]["average"]
    avg = results["average"]
    assert mean["256"] == pytest.approx(avg["fwe"]["256"], abs=1e-9)
    assert mean["512"] == pytest.approx((avg["fwe"]["512"] + avg["qa_1"]["512"]) / 2, abs=1e-9)
    assert results["overall"] == pytest.approx((mean["256"] + mean["512"]) / 2, abs=1e-9)


def test_missing_data_heads_the_report(scored):
    output, results = scored
    assert results["not_scored"] == [
        {"task": None, "length": 1024, "why": f"no directory {results['ruler_data']}/1024"},
        {
            "task": "vt",
            "length": None,
            "why": f"no data at any length (expected {results['ruler_data']}/<length>/data/vt/validation.jsonl)",
        },
        {
            "task": "qa_1",
            "length": 256,
            "why": f"no file (expected {results['ruler_data']}/<length>/data/qa_1/validation.jsonl)",
        },
    ]
    assert list(results)[:2] == ["suite", "not_scored"]
    lines = output.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("RULER (NVIDIA/RULER data in"))
    assert lines[head + 1] == "task set: 3 of RULER's 13 tasks"
    assert lines[head + 2].startswith("NOT SCORED: 3 parts of the task set")
    assert lines[head + 3].strip().startswith("every task at 1K: no directory")
    assert lines[head + 4].strip().startswith("vt: no data at any length")
    assert lines[head + 5].strip().startswith("qa_1 at 256: no file")
    assert head + 5 < next(i for i, line in enumerate(lines) if "averaged over 2 checkpoints" in line)


def test_tokenizer_mismatch_is_noted(scored):
    _, results = scored
    assert set(results["notes"]) >= {"qa_1 at 512"}
    assert "prepared with another tokenizer" in results["notes"]["qa_1 at 512"]
    assert not any(k.startswith("fwe at") for k in results["notes"])


def test_scan_task_limit_and_fields(tmp_path, tok):
    path = tmp_path / "validation.jsonl"
    recs = [
        {"index": 7, "input": f"in{i}", "outputs": [f"a{i}", f"b{i}"], "answer_prefix": " Answer:"} for i in range(3)
    ]
    path.write_text(json.dumps(recs[0]) + "\n\n" + "".join(json.dumps(r) + "\n" for r in recs[1:]))
    scanned = scan_task(path, "vt", 4096, 2, lambda texts: [len(tok(t)["input_ids"]) for t in texts])
    samples = list(scanned)
    assert scanned.note is None and len(scanned) == 2 and [s.index for s in samples] == [1, 3]
    assert [s.prompt for s in samples] == ["in0 Answer:", "in1 Answer:"] and samples[1].answers == ("a1", "b1")
    assert {(s.max_new_tokens, s.metric) for s in samples} == {(30, "all")}
    assert samples[0].num_tokens == len(tok("in0 Answer:")["input_ids"])
    qa = scan_task(path, "qa_2", 4096, None, lambda texts: [1] * len(texts))
    assert len(list(qa)) == 3 and {(s.max_new_tokens, s.metric) for s in qa} == {(32, "part")}
    assert scan_task(path, "qa_2", 20, None, lambda texts: [1] * len(texts)).note == (
        "prompts plus generation reach 33 tokens with this tokenizer, over 20: the data was prepared with another "
        "tokenizer"
    )
    # counted in batches: every count still lands on its own sample
    many = [{"input": "w" * (i + 1), "outputs": ["a"], "answer_prefix": "?"} for i in range(19)]
    path.write_text("".join(json.dumps(r) + "\n" for r in many))
    scanned = scan_task(path, "vt", 4096, None, lambda texts: [len(t) for t in texts])
    assert scanned.num_tokens == tuple(i + 2 for i in range(19)) == tuple(len(s.prompt) for s in scanned)


def test_task_sets_of_the_paper():
    assert select_task_set(None, []) == (RULER_13, [])
    assert select_task_set(None, ["cwe", "niah_multikey_3"]) == (LLAMA2_SET, ["niah_multikey_3", "cwe"])
    assert select_task_set(["vt", "qa_2", "fwe"], []) == (["vt", "fwe", "qa_2"], [])
    with pytest.raises(UserError, match="unknown task.*nope"):
        select_task_set(None, ["nope"])
    with pytest.raises(UserError, match="no task left"):
        select_task_set(["vt"], ["vt"])


def test_bundled_configs_carry_the_papers_sets():
    paper = [n for n in bundled_config_names() if n.split("_")[0] in ("llama2", "llama3", "mistral", "qwen15")]
    assert len(paper) > 30
    for name in paper:
        ev = load_config(name).eval
        want = LLAMA2_SET if name.startswith("llama2_") else RULER_13
        assert select_task_set(ev.tasks, ev.exclude)[0] == want, name


def test_config_task_names_are_checked():
    with pytest.raises(UserError, match="exclude: unknown task.*cwx"):
        load_config(None, ["eval.exclude=[cwx]"])
    with pytest.raises(UserError, match="eval.squad_path"):
        load_config(None, ["eval.qa_path=squad.json"])
    assert load_config(None, ["eval.qa_path=null"]).eval.squad_path is None  # run dirs written before the split


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"input": "x", "outputs": ["a"]}\n{"input": "y", "outputs": ["b"\n', "validation.jsonl:2: not valid JSON"),
        ('{"outputs": ["a"]}\n', "validation.jsonl:1: no text field 'input'"),
        ('{"input": "x", "outputs": "a"}\n', "validation.jsonl:1: 'outputs' must be a non-empty list of strings"),
        ('{"input": "x", "outputs": []}\n', "validation.jsonl:1: 'outputs' must be a non-empty list of strings"),
        ('["x", "a"]\n', "validation.jsonl:1: a list, not a JSON object"),
        ('{"input": "x", "outputs": ["a"], "answer_prefix": 3}\n', "'answer_prefix' must be a string"),
        ('{"input": "x", "outputs": ["a"], "length": "long"}\n', "'length' must be an integer"),
        (b'{"input": "\xff", "outputs": ["a"]}\n', "validation.jsonl: not UTF-8 text"),
    ],
)
def test_malformed_data_is_one_line(ruler_run, tmp_path, content, message):
    run, _, _ = ruler_run
    folder = tmp_path / "synthetic" / "4096" / "data" / "vt"
    folder.mkdir(parents=True)
    path = folder / "validation.jsonl"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    line = one_error_line(
        CliRunner().invoke(
            app,
            [
                "eval",
                str(RunDir(run).export(10)),
                "--ruler-data",
                str(tmp_path / "synthetic"),
                "--out",
                str(tmp_path / "o"),
            ],
        )
    )
    assert message in line and str(path) in line


def test_no_usable_data_is_one_line(ruler_run, tmp_path):
    run, data, _ = ruler_run
    model = str(RunDir(run).export(10))
    (tmp_path / "empty").mkdir()
    cases = [
        ([model, "--ruler-data", str(tmp_path / "nowhere")], "no such directory"),
        ([model, "--ruler-data", str(tmp_path / "empty")], "no length directories"),
        ([model, "--ruler-data", str(data), "--tasks", "cwe"], "no RULER data for tasks cwe"),
        ([model, "--ruler-data", str(data), "--lengths", "8k"], "no RULER data"),
    ]
    for args, message in cases:
        assert message in one_error_line(CliRunner().invoke(app, ["eval", *args, "--out", str(tmp_path / "o")]))


def test_offline_suite_says_it_is_not_ruler_and_names_missing_qa(ruler_run, tmp_path, one_thread):
    run, _, _ = ruler_run
    out = evaluate(
        resolve_target(RunDir(run).export(10)),
        lengths=[512],
        tasks=["vt", "qa_1", "qa_2"],
        samples=1,
        out=tmp_path / "o",
    )
    results = json.loads((out / "results.json").read_text())
    assert results["suite"] == "RULER-style (not comparable with published RULER numbers)"
    assert results["tasks"] == ["vt"] and [e["task"] for e in results["not_scored"]] == ["qa_1", "qa_2"]
    assert "--squad FILE" in results["not_scored"][0]["why"] and "--hotpotqa FILE" in results["not_scored"][1]["why"]
