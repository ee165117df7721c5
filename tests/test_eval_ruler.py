"""`lctrain eval --ruler-data`: RULER's own prepared data, scored on a tiny hand-made directory in the layout RULER's
scripts/run.sh writes, with two tiny random Llama checkpoints.

References: the prompts are rebuilt here as RULER's scripts/pred/call_api.py builds them (input + answer_prefix) and
completed with Hugging Face's greedy `generate` at RULER's tokens_to_generate (fwe 50, qa 32); the expected answers
are cut from those completions so that every sample's metric is known by construction; task scores, checkpoint
averages and task means are recomputed below with plain loops from RULER's formulas. Prompts are encoded as RULER
encodes them (a chat template's special-token text is the token: against SentencePiece's control symbols and the
tokenizer's own ids), and data of exactly the model's length, counted as RULER's `length` counts (no BOS), is
neither noted as another tokenizer's nor as extrapolation. Also: the task sets of the paper, missing task/length files
named at the top of the report, and malformed data ending in one line."""

import json

import pytest
import sentencepiece as spm
import torch
from eval_helpers import random_checkpoints, tiny_arch
from train_helpers import one_error_line
from typer.testing import CliRunner

from lctrain.cli import app
from lctrain.config import bundled_config_names, load_config
from lctrain.errors import UserError
from lctrain.eval.ruler import (
    PROMPT_START_ANCHOR,
    PROMPT_START_RULER,
    PromptEncoder,
    scan_task,
    select_task_set,
)
from lctrain.eval.runner import OFFLINE_LABEL, evaluate, resolve_target, ruler_suite
from lctrain.rundir import RunDir
from lctrain.tokenizer import builtin_model_file, load_tokenizer, resolve_anchor, text_encoder

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
    sample 1 none (0). Each file records RULER's `length` (`tokenize`: the prompt without BOS, plus the generation
    budget), qa_1 one 30% above it, as data prepared with another tokenizer would."""
    root = tmp_path_factory.mktemp("rulerrun")
    run, data = root / "run", root / "synthetic"
    cfg = load_config(None, tiny_arch() + ["data.seq_len=512", "eval.ppl_windows=0", f"train.run_dir={run}"])
    models = random_checkpoints(cfg, run, STEPS, tok)
    for model in models.values():
        model.eval().set_attn_implementation("sdpa")  # as `lctrain eval` loads a checkpoint: one causal prompt

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
            counted = len(tok.tokenize(_prompt(rec))) + NEW_TOKENS[task]
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


class CharEncoder:
    """One token a character, after a one-token anchor: where each count lands is plain to see."""

    def encode_batch(self, texts):
        return [[0] * len(t) for t in texts]

    def prompted(self, ids):
        return [1, *ids]


def test_scan_task_limit_and_fields(tmp_path, tok):
    path = tmp_path / "validation.jsonl"
    recs = [
        {"index": 7, "input": f"in{i}", "outputs": [f"a{i}", f"b{i}"], "answer_prefix": " Answer:"} for i in range(3)
    ]
    path.write_text(json.dumps(recs[0]) + "\n\n" + "".join(json.dumps(r) + "\n" for r in recs[1:]))
    scanned = scan_task(path, "vt", 4096, 2, PromptEncoder(tok, resolve_anchor(tok)))
    samples = list(scanned)
    assert scanned.note is None and len(scanned) == 2 and [s.index for s in samples] == [1, 3]
    assert [s.prompt for s in samples] == ["in0 Answer:", "in1 Answer:"] and samples[1].answers == ("a1", "b1")
    assert {(s.max_new_tokens, s.metric) for s in samples} == {(30, "all")}
    assert samples[0].num_tokens == len(tok("in0 Answer:")["input_ids"])  # RULER's `tokenizer(prompt)`: BOS first
    qa = scan_task(path, "qa_2", 4096, None, CharEncoder())
    assert len(list(qa)) == 3 and {(s.max_new_tokens, s.metric) for s in qa} == {(32, "part")}
    # measured as RULER's `length` measures it: the prompt's 11 characters without the anchor, and qa's 32 tokens
    assert scan_task(path, "qa_2", 43, None, CharEncoder()).note is None
    assert scan_task(path, "qa_2", 42, None, CharEncoder()).note == (
        "prompts plus generation reach 43 tokens with this tokenizer, over 42: the data was prepared with another "
        "tokenizer"
    )
    # counted in batches: every count still lands on its own sample
    many = [{"input": "w" * (i + 1), "outputs": ["a"], "answer_prefix": "?"} for i in range(19)]
    path.write_text("".join(json.dumps(r) + "\n" for r in many))
    scanned = scan_task(path, "vt", 4096, None, CharEncoder())
    assert scanned.num_tokens == tuple(i + 3 for i in range(19)) == tuple(len(s.prompt) + 1 for s in scanned)


def _write_task(root, length: int, task: str, records: list[dict]) -> None:
    folder = root / str(length) / "data" / task
    folder.mkdir(parents=True)
    (folder / "validation.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


@pytest.fixture(scope="module")
def v3():
    return load_tokenizer("builtin:mistral-7b-v0.3")


NIAH = (
    "A special magic number is hidden within the following text. Make sure to memorize it. I will quiz you about "
    "the number afterwards.\nThe grass is green. The sky is blue. One of the special magic numbers for quiet-lake "
    "is: 7261. The sun is yellow.\nWhat is the special magic number for quiet-lake mentioned in the provided text?"
)
NIAH_PREFIX = " The special magic number for quiet-lake mentioned in the provided text is"


def test_a_chat_templates_special_tokens_are_the_tokens(v3, tmp_path):
    """RULER's meta-chat template (scripts/data/template.py: "[INST] {task_template} [/INST]") prepared for
    Mistral-7B-v0.3: `[INST]` and `[/INST]` are control symbols of its SentencePiece model, and RULER's prediction,
    `tokenizer(prompts)`, reads them as those tokens. So does eval, with one BOS, also when the prompt spells it."""
    sp = spm.SentencePieceProcessor(model_file=str(builtin_model_file("mistral-7b-v0.3")))
    inst, end, bos = sp.piece_to_id("[INST]"), sp.piece_to_id("[/INST]"), sp.bos_id()
    assert sp.is_control(inst) and sp.is_control(end) and (bos, inst, end) == (1, 3, 4)
    rec = {"index": 0, "input": f"[INST] {NIAH} [/INST]", "outputs": ["7261"], "answer_prefix": NIAH_PREFIX}
    rec["length"] = len(v3.tokenize(_prompt(rec))) + 128
    _write_task(tmp_path, 4096, "niah_single_1", [rec])
    encoder = PromptEncoder(v3, resolve_anchor(v3))
    suite = ruler_suite(tmp_path, ["niah_single_1"], None, None, encoder)
    (sample,) = suite.sources[0]
    ids = encoder.encode(sample.prompt, specials=True)
    assert ids[:2] == [bos, inst] and ids.count(bos) == 1 and ids.count(inst) == ids.count(end) == 1
    assert ids == v3(sample.prompt)["input_ids"]
    assert sample.num_tokens == len(ids) and suite.notes == {}
    assert encoder.encode("<s>" + sample.prompt, specials=True) == ids
    # the training data's encoder (and the offline suite's) spells the same text out, as SentencePiece does
    spelled = text_encoder(v3).prompted(resolve_anchor(v3)).encode(sample.prompt, specials=True)
    assert spelled == [bos, *sp.encode(sample.prompt)] and inst not in spelled and end not in spelled


@pytest.mark.real_model
def test_a_chat_templates_special_tokens_are_the_tokens_of_a_byte_level_bpe(model_dir):
    """SmolLM2's ChatML: `<|im_start|>`/`<|im_end|>` are its tokens 1 and 2. Its tokenizer puts nothing before a
    text, so RULER's `tokenizer(prompt)` starts with the template itself, and so does the prompt here (scores
    comparable with RULER's); with `anchored` the anchor `<|endoftext|>` comes first, once, also before a prompt
    that starts with it."""
    from transformers import AutoTokenizer

    smol = AutoTokenizer.from_pretrained(str(model_dir))
    anchor = resolve_anchor(smol)
    start, stop = smol.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    assert (anchor.token, anchor.id, start, stop) == ("<|endoftext|>", 0, 1, 2)
    prompt = f"<|im_start|>user\n{NIAH}<|im_end|>\n<|im_start|>assistant\n{NIAH_PREFIX}"
    as_ruler = PromptEncoder(smol, anchor)
    assert as_ruler.encode(prompt, specials=True) == smol(prompt)["input_ids"]
    assert as_ruler.prompt_start == PROMPT_START_RULER
    encoder = PromptEncoder(smol, anchor, anchored=True)
    ids = encoder.encode(prompt, specials=True)
    assert ids == [0, *smol(prompt)["input_ids"]] and ids[:2] == [0, start]
    assert ids.count(start) == 2 and ids.count(stop) == 1 and ids.count(0) == 1
    assert encoder.encode("<|endoftext|>" + prompt, specials=True) == ids
    assert encoder.prompt_start == PROMPT_START_ANCHOR


def _sized(tok, total: int, task: str = "vt", budget: int = 30) -> dict:
    """A vt record whose prompt plus generation budget is `total` tokens as RULER counts them (`tokenize`)."""
    prefix = " Answer: According to the chain(s) of variable assignment in the text above, 1 variables are assigned"
    question = "\nQuestion: Find all variables that are assigned the value 64019 in the text above."

    def record(pad: int) -> dict:
        text = "VAR QPE = 64019\n" + "The grass is green. The sky is blue." * 8 + " go" * pad + question
        return {"index": 0, "input": text, "outputs": ["QPE"], "answer_prefix": prefix}

    rec = record(0)
    rec = record(total - budget - len(tok.tokenize(_prompt(rec))))
    rec["length"] = len(tok.tokenize(_prompt(rec))) + budget
    assert rec["length"] == total
    return rec


def test_data_of_the_models_length_is_neither_foreign_nor_extrapolated(ruler_run, tok, tmp_path, one_thread):
    """RULER's `length` counts a prompt without the BOS its prediction puts first: a sample of exactly the
    checkpoint's 512 positions (max_position_embeddings) read with that BOS is 513 tokens, the last generated one
    never read back, so it takes positions 0-511: no note that the data is another tokenizer's, none of
    extrapolation."""
    run, _, _ = ruler_run
    ckpt = RunDir(run).export(10)
    assert json.loads((ckpt / "config.json").read_text())["max_position_embeddings"] == 512
    _write_task(tmp_path / "synthetic", 512, "vt", [_sized(tok, 512)])
    out = evaluate(resolve_target(ckpt), ruler_data=str(tmp_path / "synthetic"), out=tmp_path / "o")
    results = json.loads((out / "results.json").read_text())
    (pred,) = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    assert pred["tokens"] == 512 - 30 + 1 and results["notes"] == {}


def test_files_short_of_samples_are_noted_and_the_samples_scored_recorded(ruler_run, tok, tmp_path, one_thread):
    """--samples 3 over RULER files of 1 and 2 samples scored 1 and 2 in silence and recorded 3 samples per task, which
    `report` compares: each short file is noted, and what was scored recorded, per task and length where it differs."""
    run, _, _ = ruler_run
    root = tmp_path / "synthetic"
    _write_task(root, 256, "vt", [_sized(tok, 200)])
    _write_task(root, 512, "vt", [_sized(tok, 300), _sized(tok, 400)])
    out = evaluate(resolve_target(RunDir(run).export(10)), ruler_data=str(root), samples=3, out=tmp_path / "o")
    results = json.loads((out / "results.json").read_text())
    predictions = (out / "predictions.jsonl").read_text().splitlines()
    assert len(predictions) == 1 + 2
    assert results["samples_per_task"] == {"vt": {"256": 1, "512": 2}}
    for length, n in ((256, 1), (512, 2)):
        path = root / str(length) / "data" / "vt" / "validation.jsonl"
        assert results["notes"][f"vt at {length}"] == f"{n} sample(s) in {path}, fewer than --samples 3"
    out = evaluate(resolve_target(RunDir(run).export(10)), ruler_data=str(root), lengths=[512], out=tmp_path / "all")
    results = json.loads((out / "results.json").read_text())
    assert results["samples_per_task"] == 2 and results["notes"] == {}  # all of the file, as RULER scores it


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
        ('{"input": "x", "outputs": ["a"], "length": "long"}\n', "'length' must be a positive integer"),
        ('{"input": "x", "outputs": ["a"], "length": 0}\n', "validation.jsonl:1: 'length' must be a positive integer"),
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
    assert results["suite"] == OFFLINE_LABEL and OFFLINE_LABEL.endswith("(not comparable with published RULER numbers)")
    assert results["tasks"] == ["vt"] and [e["task"] for e in results["not_scored"]] == ["qa_1", "qa_2"]
    assert "--squad FILE" in results["not_scored"][0]["why"] and "--hotpotqa FILE" in results["not_scored"][1]["why"]
