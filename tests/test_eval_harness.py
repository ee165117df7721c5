"""`lctrain eval --harness` (the paper's Table 7 through lm-evaluation-harness), offline: two tiny task definitions
with local data (a multiple-choice task scored by log-likelihood, a generation task with a stop string) on a run
with two tiny checkpoints. References: log-likelihoods from a plain full-sequence forward and log_softmax, greedy
text from a token-by-token argmax loop without a KV cache, the checkpoint average recomputed by hand, and the scale
of the printed scores from lm-eval's own metric functions (LongBench's among them)."""

import json
import shutil
import sys
from pathlib import Path

import pytest
import sentencepiece as spm
import torch
from eval_helpers import random_checkpoints, tiny_arch
from typer.testing import CliRunner

from lctrain.cli import app
from lctrain.config import load_config
from lctrain.errors import UserError

lm_eval = pytest.importorskip("lm_eval", reason="optional package lm-eval (lctrain's harness extra) not installed")

from lctrain.eval.harness import (  # noqa: E402
    HarnessSettings,
    average_over_checkpoints,
    checkpoint_lm,
    numeric_metrics,
    print_harness_report,
    resolve_tasks,
    run_harness,
)
from lctrain.eval.runner import load_model, resolve_target  # noqa: E402
from lctrain.rundir import RunDir  # noqa: E402
from lctrain.tokenizer import builtin_model_file, load_tokenizer  # noqa: E402

STEPS = (10, 20)
MC_DOCS = [
    {"question": "The sky on a clear day is", "choices": [" blue", " green", " made of cheese"], "label": 0},
    {"question": "Two plus two equals", "choices": [" four", " five"], "label": 0},
    {"question": "Water freezes at zero degrees", "choices": [" Celsius", " Fahrenheit", " Kelvin"], "label": 0},
    {"question": "Paris is the capital of", "choices": [" France", " Spain"], "label": 0},
]
GEN_DOCS = [{"prompt": f"Repeat the word {w}:", "answer": w} for w in ("apple", "river", "stone")]


def write_tasks(root):
    (root / "mc.jsonl").write_text("".join(json.dumps(d) + "\n" for d in MC_DOCS))
    (root / "gen.jsonl").write_text("".join(json.dumps(d) + "\n" for d in GEN_DOCS))
    (root / "tiny_mc.yaml").write_text(f"""task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {root / "mc.jsonl"}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
target_delimiter: ""
metric_list:
  - metric: acc
""")
    (root / "tiny_gen.yaml").write_text(f"""task: tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {root / "gen.jsonl"}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: answer
generation_kwargs:
  until: ["\\n", "."]
  max_gen_toks: 6
  do_sample: false
metric_list:
  - metric: exact_match
""")
    return root


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("harness")
    run = root / "run"
    random_checkpoints(load_config(None, tiny_arch() + ["data.seq_len=128", f"train.run_dir={run}"]), run, STEPS)
    write_tasks(root)
    return run


@pytest.fixture(scope="module")
def tiny(run_dir):
    tok = load_tokenizer(load_config(str(run_dir / "config.yaml")).data.tokenizer)
    return load_model(RunDir(run_dir).export(STEPS[0]), "cpu"), tok


def ids_of(tok, text: str) -> list[int]:
    """SentencePiece's own ids (the reference of the built-in tokenizer), without BOS."""
    return spm.SentencePieceProcessor(model_file=str(builtin_model_file("mistral-7b-v0.1"))).encode(text)


class Req:
    def __init__(self, *args):
        self.args = args


def reference_logprob(model, ids: list[int], n_cont: int) -> tuple[float, bool]:
    """log P of the last n_cont ids given the ones before, from one forward over the whole sequence."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].double()
    total, greedy = 0.0, True
    for pos in range(len(ids) - n_cont, len(ids)):
        logp = torch.log_softmax(logits[pos - 1], dim=-1)
        total += float(logp[ids[pos]])
        greedy &= int(logp.argmax()) == ids[pos]
    return total, greedy


def reference_greedy(model, tok, ids: list[int], max_new: int, stops: list[str]) -> str:
    ids = list(ids)
    start = len(ids)
    with torch.no_grad():
        for _ in range(max_new):
            nxt = int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
            ids.append(nxt)
            if nxt == tok.eos_token_id:
                break
    text = tok.decode(ids[start:], skip_special_tokens=True)
    cuts = [i for i in (text.find(s) for s in stops) if i >= 0]
    return text[: min(cuts)] if cuts else text


def test_loglikelihood_matches_a_plain_forward(tiny):
    model, tok = tiny
    lm = checkpoint_lm(model, tok, max_length=128, batch_size=3)
    reqs = [Req(d["question"], c) for d in MC_DOCS for c in d["choices"]]
    got = lm.loglikelihood(reqs)
    for req, (lp, greedy) in zip(reqs, got):
        whole = ids_of(tok, req.args[0] + req.args[1])
        n_ctx = len(ids_of(tok, req.args[0]))
        ref_lp, ref_greedy = reference_logprob(model, [tok.bos_token_id] + whole, len(whole) - n_ctx)
        assert lp == pytest.approx(ref_lp, abs=1e-4) and greedy == ref_greedy


def test_a_contexts_trailing_space_goes_to_the_continuation(tiny):
    """A context ending in a space is scored as lm-eval's models score it, the space moved into the continuation:
    split after the context's ids, the joined text's "▁blue" took the place of the context's space token, and every
    continuation was left no token (score 0, whatever the choice)."""
    model, tok = tiny
    lm = checkpoint_lm(model, tok, max_length=128)
    trailing = lm.loglikelihood([Req("The quiet lake is ", "blue"), Req("The quiet lake is \n", "stone")])
    moved = lm.loglikelihood([Req("The quiet lake is", " blue"), Req("The quiet lake is", " \nstone")])
    assert trailing == moved
    whole = ids_of(tok, "The quiet lake is blue")
    ref, _ = reference_logprob(model, [tok.bos_token_id] + whole, len(whole) - len(ids_of(tok, "The quiet lake is")))
    assert trailing[0][0] == pytest.approx(ref, abs=1e-4) and ref < 0


def test_loglikelihood_keeps_the_last_max_length_tokens(tiny):
    model, tok = tiny
    lm = checkpoint_lm(model, tok, max_length=16)
    context, continuation = "one two three four five six seven eight nine ten eleven twelve", " thirteen"
    ((lp, _),) = lm.loglikelihood([Req(context, continuation)])
    whole = [tok.bos_token_id] + ids_of(tok, context + continuation)
    n_cont = len(whole) - 1 - len(ids_of(tok, context))
    ref, _ = reference_logprob(model, whole[-17:], n_cont)
    assert lp == pytest.approx(ref, abs=1e-4)


def test_a_continuation_longer_than_max_length_is_one_line(tiny, run_dir):
    model, tok = tiny
    with pytest.raises(UserError, match="longer than the harness max length 4"):
        checkpoint_lm(model, tok, max_length=4).loglikelihood([Req("one", " two three four five six seven")])
    result = CliRunner().invoke(
        app,
        [
            "eval",
            str(run_dir),
            "--harness",
            "tiny_mc",
            "--harness-tasks",
            str(run_dir.parent),
            "--harness-max-len",
            "0",
        ],
    )
    assert result.exit_code == 2 and "--harness-max-len 0: need at least 2 tokens" in result.output


def test_generation_is_greedy_and_stops(tiny):
    model, tok = tiny
    lm = checkpoint_lm(model, tok, max_length=128)
    stops = ["\n", "."]
    reqs = [Req(d["prompt"], {"until": stops, "max_gen_toks": 6}) for d in GEN_DOCS]
    for req, text in zip(reqs, lm.generate_until(reqs)):
        ids = [tok.bos_token_id] + ids_of(tok, req.args[0])
        assert text == reference_greedy(model, tok, ids, 6, stops)
        assert not any(s in text for s in stops)


def test_long_prompts_lose_their_middle(tiny):
    model, tok = tiny
    lm = checkpoint_lm(model, tok, max_length=24)
    prompt = " ".join(f"w{i}" for i in range(60))
    ids = [tok.bos_token_id] + ids_of(tok, prompt)
    room = 24 - 4
    kept = ids[: room // 2] + ids[-(room - room // 2) :]
    (text,) = lm.generate_until([Req(prompt, {"until": [], "max_gen_toks": 4})])
    assert text == reference_greedy(model, tok, kept, 4, [])


@pytest.mark.slow  # 3-7 s in CI: slow-marked to keep `make test` under its 5 minutes
def test_run_scores_every_checkpoint_and_averages(run_dir, capsys):
    tasks_dir = run_dir.parent
    target = resolve_target(run_dir)
    out = run_dir / "harness"
    report = run_harness(target, HarnessSettings(["tiny_mc", "tiny_gen"], include_path=str(tasks_dir)), out, "cpu")
    assert json.loads((out / "harness.json").read_text()) == report
    assert report["checkpoints"] == [f"step_{s}" for s in STEPS]
    tok = load_tokenizer(target.cfg.data.tokenizer)
    for step in STEPS:
        model = load_model(RunDir(run_dir).export(step), "cpu")
        correct = 0
        for d in MC_DOCS:
            scores = []
            for c in d["choices"]:
                whole = ids_of(tok, d["question"] + c)
                n_ctx = len(ids_of(tok, d["question"]))
                scores.append(reference_logprob(model, [tok.bos_token_id] + whole, len(whole) - n_ctx)[0])
            correct += max(range(len(scores)), key=scores.__getitem__) == d["label"]
        assert report["per_checkpoint"][f"step_{step}"]["tiny_mc"]["acc"] == pytest.approx(correct / len(MC_DOCS))
        exact = [
            reference_greedy(model, tok, [tok.bos_token_id] + ids_of(tok, d["prompt"]), 6, ["\n", "."]) == d["answer"]
            for d in GEN_DOCS
        ]
        assert report["per_checkpoint"][f"step_{step}"]["tiny_gen"]["exact_match"] == pytest.approx(
            sum(exact) / len(GEN_DOCS)
        )
    for task in ("tiny_mc", "tiny_gen"):
        for metric, value in report["average"][task].items():
            per = [report["per_checkpoint"][f"step_{s}"][task][metric] for s in STEPS]
            assert value == pytest.approx(sum(per) / len(per))
    assert "tiny_mc" in capsys.readouterr().out


def test_cli_harness(run_dir):
    result = CliRunner().invoke(
        app,
        [
            "eval",
            str(run_dir),
            "--harness",
            "tiny_mc",
            "--harness-tasks",
            str(run_dir.parent),
            "--harness-limit",
            "2",
            "--out",
            str(run_dir / "cli"),
        ],
    )
    assert result.exit_code == 0, result.output
    report = json.loads((run_dir / "cli" / "harness.json").read_text())
    assert report["limit"] == 2 and set(report["average"]) == {"tiny_mc"}


def test_metrics_and_average_by_hand():
    raw = {
        "hellaswag": {"alias": "hellaswag", "acc,none": 0.5, "acc_stderr,none": 0.01, "acc_norm,none": 0.6},
        "longbench_fewshot": {"score,none": 0.625, "score_stderr,none": "N/A"},
    }
    assert numeric_metrics(raw) == {"hellaswag": {"acc": 0.5, "acc_norm": 0.6}, "longbench_fewshot": {"score": 0.625}}
    avg = average_over_checkpoints({"a": {"t": {"acc": 0.5}}, "b": {"t": {"acc": 0.7, "f1": 0.2}}})
    assert avg == {"t": {"acc": pytest.approx(0.6), "f1": pytest.approx(0.2)}}


def test_the_table_prints_the_harness_fractions_in_percent(tmp_path, capsys):
    """lm-eval scores a perfect answer 1.0 with LongBench's metrics as with accuracy and exact match; the table shows
    percent, the scale of the paper's Table 7 (LongBench ICL 65.38, HellaSwag 70.78)."""
    longbench = pytest.importorskip(
        "lm_eval.tasks.longbench.metrics", reason="lm-eval's longbench extra not installed", exc_type=ImportError
    )
    from lm_eval.api.metrics import exact_match_hf_evaluate, mean

    trec = {"answers": ["Location"], "all_classes": ["Location", "Human", "Number"]}
    triviaqa = {"answers": ["the Eiffel Tower"]}
    perfect = [
        longbench.get_classification_with_score(trec, ["Location"])["score"],
        longbench.get_qa_f1_with_score(triviaqa, ["Eiffel Tower"])["score"],
    ]
    assert perfect == [1.0, 1.0]
    partial = [
        longbench.get_classification_with_score(trec, ["Human"])["score"],
        longbench.get_qa_f1_with_score(triviaqa, ["the Eiffel Tower in Paris"])["score"],  # F1 of 2/4 and 2/2 tokens
    ]

    def harness_results(icl: list[float], choices_right: list[float], answers: list[str]) -> dict:
        return {
            "longbench_fewshot": {"score,none": mean(icl), "score_stderr,none": "N/A"},
            "hellaswag": {"acc,none": mean(choices_right), "acc_norm,none": mean(choices_right)},
            "tiny_gen": {"exact_match,none": exact_match_hf_evaluate(answers, ["apple", "river"])["exact_match"]},
        }

    per_checkpoint = {
        "step_10": numeric_metrics(harness_results(perfect, [1.0, 1.0, 1.0, 0.0], ["apple", "river"])),
        "step_20": numeric_metrics(harness_results(partial, [1.0, 0.0, 0.0, 0.0], ["apple", "stone"])),
    }
    report = {
        "checkpoints": list(per_checkpoint),
        "tasks": ["longbench", "hellaswag", "tiny_gen"],
        "average": average_over_checkpoints(per_checkpoint),
    }
    print_harness_report(report, tmp_path)
    rows = {line.split()[1]: line for line in capsys.readouterr().out.splitlines() if line.startswith("│ ")}
    icl = (mean(perfect) + mean(partial)) / 2
    assert icl == pytest.approx((1 + 1 + 0 + 2 / 3) / 4)
    assert "ICL" in rows["longbench_fewshot"] and f"{100 * icl:.2f}" in rows["longbench_fewshot"]
    assert f"{100 * (0.75 + 0.25) / 2:.2f}" in rows["hellaswag"]
    assert f"{100 * (1.0 + 0.5) / 2:.2f}" in rows["tiny_gen"]


def test_a_task_without_its_extra_names_the_module(tmp_path, monkeypatch):
    """lm-eval's LongBench metrics, imported as a task loads, re-raise a missing jieba as an ImportError of their own
    (`pip install lm_eval["longbench"]`); the error names the module and the install, not the dataset download."""
    shutil.copy(Path(lm_eval.__file__).parent / "tasks" / "longbench" / "metrics.py", tmp_path / "metrics.py")
    (tmp_path / "lb_probe.yaml").write_text(
        "task: lb_probe\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: no-such.jsonl\n"
        "test_split: test\noutput_type: generate_until\ndoc_to_text: x\ndoc_to_target: y\n"
        "process_results: !function metrics.get_qa_f1_with_score\nmetric_list:\n  - metric: score\n"
    )
    monkeypatch.setitem(sys.modules, "jieba", None)
    with pytest.raises(UserError) as err:
        resolve_tasks(["lb_probe"], str(tmp_path))
    message = str(err.value)
    assert "a task needs the Python module jieba, which is not installed" in message
    assert "pip install 'lctrain[harness]'" in message and 'lm_eval["longbench"]' in message
    assert "dataset" not in message


@pytest.mark.slow  # over 20 s on 2 cores: make test-slow
def test_bad_input_is_one_line(run_dir, tmp_path, monkeypatch):
    with pytest.raises(UserError, match="not a task or group of lm-evaluation-harness; did you mean tiny_mc"):
        resolve_tasks(["tiny_mcc"], str(run_dir.parent))
    with pytest.raises(UserError, match="not a directory"):
        resolve_tasks(["tiny_mc"], str(tmp_path / "nowhere"))
    (tmp_path / "hub_task.yaml").write_text(
        "task: hub_task\ndataset_path: lctrain-no-such-org/no-such-dataset\n"
        "test_split: test\noutput_type: generate_until\ndoc_to_text: x\n"
        "doc_to_target: y\n"
    )
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(UserError, match="a task's dataset could not be loaded"):
        resolve_tasks(["hub_task"], str(tmp_path))
    monkeypatch.setitem(sys.modules, "lm_eval", None)
    with pytest.raises(UserError, match=r"pip install 'lctrain\[harness\]'"):
        resolve_tasks(["hellaswag"], None)
