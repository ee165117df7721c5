"""`lctrain eval` end to end on a fake run directory (tiny random Llama checkpoints hf/step_N/ with the built-in
tokenizer, config.yaml from write_resolved, a small prepared dataset): the report files, the checkpoint average
recomputed by hand from predictions.jsonl, held-out perplexity against HF's own loss, where generation stops (the
settled score, every end token of the generation config on both backends, the anchor), what an interrupted
evaluation keeps for the next, and bad input."""

import json
import math
import os
import shutil
import subprocess
import sys
import types

import numpy as np
import pytest
import torch
from eval_helpers import random_checkpoints, tiny_arch
from train_helpers import one_error_line
from transformers import AutoModelForCausalLM, GenerationConfig
from typer.testing import CliRunner

from lctrain.cli import app
from lctrain.config import load_config, write_resolved
from lctrain.errors import UserError
from lctrain.eval.generation import greedy_ids, plan_for
from lctrain.eval.kept import Kept
from lctrain.eval.perplexity import heldout_rows, perplexity
from lctrain.eval.ruler import PromptEncoder, Sample
from lctrain.eval.runner import (
    MAX_LENGTH,
    OFFLINE_LABEL,
    evaluate,
    greedy_generate,
    load_model,
    model_context,
    parse_lengths,
    resolve_target,
    too_short,
    until_answered,
)
from lctrain.eval.score import sample_score, settled
from lctrain.eval.tasks import generate, task_specs
from lctrain.export_record import EXPORT_RECORD
from lctrain.reports.compare import _exports_against, write_report
from lctrain.rundir import RunDir
from lctrain.tokenizer import load_tokenizer, resolve_anchor, text_encoder

STEPS = (30, 40)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    from lctrain.data.prepare import prepare

    root = tmp_path_factory.mktemp("evalrun")
    run = root / "run"
    # 20 windows of 256 tokens; 2 steps x 4 windows leave 12 held out
    cfg = load_config(
        None,
        tiny_arch()
        + [
            "data.seq_len=256",
            "data.token_budget=5120",
            f"data.output_dir={root / 'data'}",
            f"train.run_dir={run}",
            "train.steps=2",
            "train.global_batch=4",
            "eval.ppl_windows=2",
        ],
    )
    prepare(cfg)
    random_checkpoints(cfg, run, STEPS)
    return run


@pytest.fixture(scope="module")
def evaluated(run_dir):
    out = evaluate(resolve_target(run_dir), lengths=[512], tasks=["vt", "fwe"], samples=1)
    return out, json.loads((out / "results.json").read_text())


def test_report_files(evaluated, run_dir):
    out, results = evaluated
    assert out == run_dir / "eval"
    assert results["suite"] == OFFLINE_LABEL and OFFLINE_LABEL.endswith("(not comparable with published RULER numbers)")
    assert results["not_scored"] == [] and results["task_set"] == ["vt", "fwe"]
    assert results["checkpoints"] == [f"step_{s}" for s in STEPS]
    assert results["tasks"] == ["vt", "fwe"] and results["lengths"] == [512]
    # the checkpoints were built for 256-token windows: evaluating at 512 is extrapolation, and the report says so
    assert set(results["notes"]) == {f"step_{s}: max_position_embeddings" for s in STEPS}
    png = out / "ruler.png"
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"


def test_average_matches_predictions_by_hand(evaluated):
    out, results = evaluated
    preds = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    assert len(preds) == len(STEPS) * 2
    for p in preds:  # RULER's metric recomputed from the raw prediction
        found = sum(a.lower() in p["prediction"].lower() for a in p["answers"]) / len(p["answers"])
        assert p["score"] == found
    for task in results["tasks"]:
        # RULER rounds each task's score to two decimals (its summary.csv); the paper averages those
        per_ckpt = [
            round(100 * np.mean([p["score"] for p in preds if p["task"] == task and p["checkpoint"] == c]), 2)
            for c in results["checkpoints"]
        ]
        assert results["average"][task]["512"] == pytest.approx(np.mean(per_ckpt))
        for c, v in zip(results["checkpoints"], per_ckpt):
            assert results["scores"][c][task]["512"] == v


def test_perplexity_on_heldout_windows(evaluated, run_dir):
    from lctrain.data.store import open_packed
    from lctrain.train.data import micro_batch_rows

    _, results = evaluated
    ppl = results["perplexity"]
    cfg = load_config(str(run_dir / "config.yaml"))
    packed = open_packed(cfg.data.output_dir)
    trained = {
        r
        for s in range(cfg.train.steps)
        for r in micro_batch_rows(
            s,
            0,
            0,
            dp=1,
            micro_batch=cfg.train.global_batch,
            global_batch=cfg.train.global_batch,
            seed=cfg.seed,
            n=len(packed),
        )
    }
    rows, available = heldout_rows(len(packed), cfg.train.steps * cfg.train.global_batch, cfg.seed, 100)
    assert set(rows).isdisjoint(trained) and available == len(packed) - len(trained) > 0
    assert ppl["windows"] == 2 and set(ppl["per_checkpoint"]) == {f"step_{s}" for s in STEPS}
    # which windows, recorded: the first two that no training step read, of the run's own dataset
    assert ppl["rows"] == sorted(set(range(len(packed))) - trained)[:2]
    assert ppl["data_fingerprint"] == packed.manifest.data_fingerprint

    # independent reference: HF's own shifted loss with anchors and tags masked in the labels
    model = load_model(RunDir(run_dir).export(STEPS[0]), "cpu")
    nll, count = 0.0, 0
    for r in rows[:2]:
        w = packed[r]
        ids = torch.as_tensor(w["input_ids"], dtype=torch.long)[None]
        labels = ids.clone()
        start = 0
        for n, tags in zip(w["seg_lens"], w["tag_lens"]):
            labels[0, start : start + 1 + tags] = -100
            start += n
        with torch.no_grad():
            loss = model(input_ids=ids, labels=labels).loss
        k = int((labels[0, 1:] != -100).sum())
        nll, count = nll + float(loss) * k, count + k
    assert ppl["per_checkpoint"][f"step_{STEPS[0]}"] == pytest.approx(math.exp(nll / count), rel=1e-4)
    assert perplexity(model, packed, rows[:2]) == pytest.approx(math.exp(nll / count), rel=1e-4)
    # evaluated at 512 on 256-token windows: perplexity per length holds the whole window only, the same number
    assert ppl["window"] == 256
    assert ppl["per_length"] == {c: {"256": v} for c, v in ppl["per_checkpoint"].items()}


def test_report_of_the_evaluated_run(evaluated, run_dir, tmp_path):
    _, results = evaluated
    report = write_report([run_dir], tmp_path / "report")
    (row,) = report["rows"]
    assert row["label"] == "anchor" and row["seeds"] == 1 and row["runs"][0]["checkpoints"] == results["checkpoints"]
    # both of the run's checkpoints (fewer than the paper's 5): the average `lctrain eval` reported
    assert row["ruler"]["512"]["mean"] == pytest.approx(results["task_mean"]["average"]["512"])
    assert row["perplexity"]["256"]["mean"] == pytest.approx(results["perplexity"]["average"])
    assert (tmp_path / "report" / "report.png").read_bytes()[:4] == b"\x89PNG"


def test_perplexity_data_of_another_anchor_is_scored_with_a_note(run_dir, tmp_path):
    import shutil

    from lctrain.data.manifest import AnchorRecord
    from lctrain.data.store import read_manifest, write_manifest
    from lctrain.eval.perplexity import select_heldout

    cfg = load_config(str(run_dir / "config.yaml"))
    other = tmp_path / "other"
    shutil.copytree(cfg.data.output_dir, other)
    m = read_manifest(other)
    anchor = {"anchor": AnchorRecord(token="</s>", id=2), "tokenizer": m.tokenizer.model_copy(update={"anchor_id": 2})}
    write_manifest(other, m.model_copy(update=anchor))
    target = resolve_target(str(run_dir))
    heldout = select_heldout(target, str(other), load_tokenizer(cfg.data.tokenizer))
    assert heldout.rows and f"{other} starts its segments with </s>, the model's data.anchor is <s>" in heldout.note
    assert select_heldout(target, str(cfg.data.output_dir), load_tokenizer(cfg.data.tokenizer)).note == ""


def test_no_heldout_windows_says_so():
    assert heldout_rows(10, 10, 0, 5) == ([], 0)
    assert heldout_rows(10, 40, 0, 5) == ([], 0)


def test_model_dir_and_out(run_dir, tmp_path):
    out = evaluate(
        resolve_target(RunDir(run_dir).export(STEPS[1])), lengths=[512], tasks=["vt"], samples=1, out=tmp_path / "o"
    )
    results = json.loads((out / "results.json").read_text())
    assert results["kind"] == "model" and results["checkpoints"] == [f"step_{STEPS[1]}"]
    assert results["perplexity"]["note"].startswith("skipped")


def test_a_model_directory_without_a_tokenizer_needs_one_named(run_dir, tmp_path):
    """No tokenizer files and no config: the schema's default tokenizer is another model's (Mistral's 32,000 ids
    for SmolLM2 scored 0 where its own scored 100: eval explorer), so it is refused; named, it is used."""
    bare = tmp_path / "bare"
    bare.mkdir()
    export = RunDir(run_dir).export(STEPS[1])
    for f in export.iterdir():
        if f.is_file() and not f.name.startswith(("tokenizer", "special_tokens", "export")):
            shutil.copy(f, bare / f.name)
    runner = CliRunner()
    r = runner.invoke(app, ["eval", str(bare), "--lengths", "512", "--tasks", "vt", "--samples", "1"])
    line = one_error_line(r)
    assert line == (
        f"error: {bare}: no tokenizer (tokenizer.json, tokenizer.model, tokenizer_config.json); copy the model's "
        f"tokenizer files into it, or name its tokenizer: --set data.tokenizer=DIR_OR_HUB_NAME"
    )
    tokenizer = load_config(str(run_dir / "config.yaml")).data.tokenizer
    args = ["eval", str(bare), "--lengths", "512", "--tasks", "vt", "--samples", "1", "--out", str(tmp_path / "o")]
    # a --config's tokenizer is a default's or another model's, not one named for this model
    r = runner.invoke(app, [*args, "-c", "tiny_anchor"])
    assert one_error_line(r).startswith(f"error: {bare}: no tokenizer")
    r = runner.invoke(app, [*args, "--set", f"data.tokenizer={tokenizer}"])
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "o" / "results.json").read_text())["checkpoints"] == ["bare"]


def test_a_run_is_scored_on_its_latest_checkpoints_the_papers_five(tmp_path):
    """The paper averages RULER over its last five checkpoints (§4.2); a run with more exports (a wider hf_last, an
    `lctrain export` of an earlier step) had every one averaged, unlike `lctrain report` (eval explorer)."""
    run = tmp_path / "run"
    steps = [2, 4, 6, 8, 10, 12, 14]
    random_checkpoints(load_config(None, tiny_arch()), run, steps)
    assert [c for c, _ in resolve_target(run).checkpoints] == [f"step_{s}" for s in steps[-5:]]
    assert [c for c, _ in resolve_target(run, last=7).checkpoints] == [f"step_{s}" for s in steps]
    assert [c for c, _ in resolve_target(run, last=1).checkpoints] == ["step_14"]
    with pytest.raises(UserError, match=r"^--last 8: .* has 7 evaluation checkpoint\(s\) \(step_2, .*, step_14\); use"):
        resolve_target(run, last=8)
    with pytest.raises(UserError, match="^--last 0: average over at least 1 checkpoint"):
        resolve_target(run, last=0)
    with pytest.raises(UserError, match=r"is a model directory \(one checkpoint\), not a run directory"):
        resolve_target(RunDir(run).export(14), last=1)
    # `lctrain report` names unscored exports newer than the first scored (a stale evaluation), not those eval left out
    scored = {"checkpoints": [f"step_{s}" for s in steps[-5:]]}
    assert _exports_against(RunDir(run), run / "eval" / "results.json", scored) == ([], [])
    stale = {"checkpoints": [f"step_{s}" for s in steps[:-1]]}
    assert _exports_against(RunDir(run), run / "eval" / "results.json", stale) == (["step_14"], [])


def test_last_chooses_what_eval_scores_and_averages(run_dir, tmp_path):
    r = CliRunner().invoke(
        app,
        [
            "eval",
            str(run_dir),
            "--last",
            "1",
            "--lengths",
            "512",
            "--tasks",
            "vt",
            "--samples",
            "1",
            "--out",
            str(tmp_path / "o"),
        ],
    )
    assert r.exit_code == 0, r.output
    assert (
        f"note: evaluating the latest 1 of the run's 2 checkpoints (step_{STEPS[1]}) and averaging over them (--last "
        f"1); step_{STEPS[0]} left out: --last 2 evaluates every one"
    ) in " ".join(r.output.split())
    results = json.loads((tmp_path / "o" / "results.json").read_text())
    assert results["checkpoints"] == [f"step_{STEPS[1]}"]


def test_parse_lengths():
    assert parse_lengths("4k,8K,4096,128k") == [4096, 8192, 131072]
    with pytest.raises(UserError, match="not a length"):
        parse_lengths("4k,abc")
    # the ceiling: 16384k = 2^24 tokens, beyond any model's context
    assert parse_lengths("16384k") == [MAX_LENGTH] == [2**24]
    for text in ("16385k", str(2**24 + 1), "999999999"):
        with pytest.raises(UserError, match=r"beyond any model's context; use lengths of at most 16384k"):
            parse_lengths(text, "--eval-lengths")


def test_bad_input_exits_2_with_one_line(run_dir, tmp_path):
    runner = CliRunner()
    empty = tmp_path / "emptyrun"
    write_resolved(load_config(None), empty)
    dataset = tmp_path / "dataset"  # prepare writes its config.yaml beside the manifest
    write_resolved(load_config(None), dataset)
    (dataset / "manifest.json").write_text("{}")
    cases = [
        ([str(dataset)], "neither a run directory"),
        ([str(tmp_path / "missing")], "no such run or model directory"),
        ([str(empty)], "no evaluation checkpoints"),
        ([str(run_dir), "--exclude", "niah_multikey_3,nope"], "unknown task(s) nope"),
        ([str(run_dir), "--lengths", "4k,x"], "not a length"),
        ([str(tmp_path)], "neither a run directory"),
        ([str(run_dir), "--device", "foo"], "--device foo: not a device"),
        ([str(run_dir), "--lengths", "999999999"], "--lengths '999999999': 999,999,999 tokens is beyond any model's"),
        ([str(run_dir), "--lengths", "256k"], "--lengths 262144: more than 4x the 256 positions step_30 was made"),
        ([str(run_dir), "--out", str(RunDir(run_dir).export(STEPS[0]))], "a model directory (it holds config.json)"),
        ([str(run_dir), "--anchor-prompts"], "--anchor-prompts: the offline suite's prompts start with the anchor"),
        ([str(run_dir), "--ruler-prompts"], "--ruler-prompts: the offline suite's prompts start with the anchor, as"),
        ([str(run_dir), "-c", "tiny_anchor"], "is a run directory, evaluated under its own config.yaml; change its"),
    ]
    for args, message in cases:
        r = runner.invoke(app, ["eval", *args])
        assert r.exit_code == 2, (args, r.output)
        lines = r.output.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], r.output


def test_resolve_target_orders_steps(tmp_path):
    run = tmp_path / "r"
    write_resolved(load_config(None), run)
    for s in (100, 20, 3):
        RunDir(run).export(s).mkdir(parents=True)
        (RunDir(run).export(s) / "config.json").write_text("{}")
    (run / "hf" / "step_x").mkdir()
    assert [c for c, _ in resolve_target(run).checkpoints] == ["step_3", "step_20", "step_100"]


class FakeVllm(types.ModuleType):
    """vLLM's documented greedy semantics (token-id prompts, per-prompt SamplingParams, stop_token_ids, output
    token_ids in prompt order) on the checkpoint's own weights, by a cache-free argmax loop: the stand-in for vLLM,
    which needs a GPU, to check what lctrain sends it and does with its answers."""

    def __init__(self, refuse: bool = False):
        super().__init__("vllm")
        self.calls = []
        fake = self

        class SamplingParams:
            def __init__(self, temperature, max_tokens, stop_token_ids, detokenize):
                assert temperature == 0.0 and detokenize is False
                self.max_tokens, self.stop_token_ids = max_tokens, stop_token_ids

        class LLM:
            def __init__(self, model, dtype, max_model_len, seed, skip_tokenizer_init, gpu_memory_utilization):
                if refuse:
                    raise ValueError(
                        "The model's max seq len (131072) is larger than the maximum number of tokens "
                        "that can be stored in KV cache (52000).\nmore"
                    )
                assert skip_tokenizer_init and 0 < gpu_memory_utilization <= 1
                fake.calls.append(max_model_len)
                self.model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()

            def generate(self, prompts, params, use_tqdm):
                outs = []
                for prompt, sp in zip(prompts, params, strict=True):
                    ids, new = list(prompt["prompt_token_ids"]), []
                    with torch.no_grad():
                        while len(new) < sp.max_tokens:
                            nxt = int(self.model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
                            ids.append(nxt)
                            new.append(nxt)
                            if nxt in sp.stop_token_ids:
                                break
                    outs.append(types.SimpleNamespace(outputs=[types.SimpleNamespace(token_ids=new)]))
                return outs

        self.LLM, self.SamplingParams = LLM, SamplingParams


@pytest.mark.slow  # a whole second evaluation (10-19 s): the default suite is at its 5-minute budget
def test_vllm_backend_gives_the_hf_backends_answers(evaluated, run_dir, tmp_path, monkeypatch):
    fake = FakeVllm()
    monkeypatch.setitem(sys.modules, "vllm", fake)
    out = evaluate(
        resolve_target(run_dir), lengths=[512], tasks=["vt", "fwe"], samples=1, backend="vllm", out=tmp_path / "vllm"
    )
    results = json.loads((out / "results.json").read_text())
    assert results["generation_backend"] == "vllm" and "vLLM" in results["generation_memory"]["step_30"]
    hf_out, hf_results = evaluated
    assert results["scores"] == hf_results["scores"]

    def read(path):
        return [
            {k: r[k] for k in ("checkpoint", "task", "index", "prediction")}  # noqa: E731
            for r in map(json.loads, path.read_text().splitlines())
        ]

    assert read(out / "predictions.jsonl") == read(hf_out / "predictions.jsonl")
    assert len(fake.calls) == len(STEPS)


def test_vllm_backend_errors_are_one_line(run_dir, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", FakeVllm(refuse=True))
    with pytest.raises(UserError, match="vLLM cannot serve .* use --backend hf"):
        evaluate(resolve_target(run_dir), lengths=[512], tasks=["vt"], samples=1, backend="vllm", out=tmp_path / "a")
    monkeypatch.setitem(sys.modules, "vllm", None)
    with monkeypatch.context() as no_work:  # refused before any sample is made
        no_work.setattr("lctrain.eval.runner.generate", lambda *a, **k: pytest.fail("samples were made"))
        with pytest.raises(UserError, match="pip install vllm"):
            evaluate(resolve_target(run_dir), lengths=[512], tasks=["vt"], backend="vllm", out=tmp_path / "b")
    with pytest.raises(UserError, match="--backend tgi: choose hf"):
        evaluate(resolve_target(run_dir), lengths=[512], tasks=["vt"], samples=1, backend="tgi", out=tmp_path / "c")


@pytest.mark.parametrize("backend", ["hf", "vllm"])
def test_both_backends_end_at_every_end_token_of_the_generation_config(run_dir, tmp_path, monkeypatch, backend):
    """A checkpoint whose generation_config lists two end tokens, as Llama-3-Instruct's does (`<|end_of_text|>` and
    `<|eot_id|>`): a RULER sample's answer ends at the second, where the tokenizer's EOS alone ran the whole budget
    (a random model repeats its first token)."""
    monkeypatch.setitem(sys.modules, "vllm", FakeVllm())
    ckpt = tmp_path / "ckpt"
    shutil.copytree(RunDir(run_dir).export(STEPS[0]), ckpt)
    (ckpt / EXPORT_RECORD).unlink()  # the generation_config below is not the export's
    tok = load_tokenizer(str(RunDir(run_dir).export(STEPS[0])))
    prompt = "The special magic number for the quiet lake is 7261. What is the special magic number?"
    model = load_model(ckpt, "cpu")
    ids = PromptEncoder(tok, resolve_anchor(tok)).encode(prompt, specials=True)
    ref = greedy_ids(model, ids, 30, plan_for(model, 256), eos=[tok.eos_token_id])
    GenerationConfig(eos_token_id=[tok.eos_token_id, ref[0]]).save_pretrained(ckpt)
    folder = tmp_path / "synthetic" / "256" / "data" / "vt"
    folder.mkdir(parents=True)
    (folder / "validation.jsonl").write_text(json.dumps({"input": prompt, "outputs": ["\u2603"]}) + "\n")
    out = evaluate(resolve_target(ckpt), ruler_data=str(tmp_path / "synthetic"), backend=backend, out=tmp_path / "o")
    (pred,) = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    assert pred["prediction"] == tok.decode(ref[:1], skip_special_tokens=True)
    assert len(ref) == 30 and tok.decode(ref, skip_special_tokens=True) != pred["prediction"]


def test_an_answer_that_reaches_the_anchor_ends_there(run_dir, tmp_path):
    """A checkpoint made to answer "lake blue", the anchor, then "stone" over and over (its layers add nothing to the
    embedding and its own output matrix maps each token to the next): its prediction is "lake blue", where the same
    generation with EOS alone among its stop ids runs to the whole budget."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(RunDir(run_dir).export(STEPS[0]), ckpt)
    (ckpt / EXPORT_RECORD).unlink()  # the weights below are not the export's
    tok = load_tokenizer(str(ckpt))
    anchor = resolve_anchor(tok)
    lake, blue, stone = tok.convert_tokens_to_ids(["\u2581lake", "\u2581blue", "\u2581stone"])
    assert anchor.id not in (tok.eos_token_id, lake, blue, stone)
    prompt = "The special magic number for the quiet lake is 7261. What is the special magic number?"
    ids = PromptEncoder(tok, anchor).encode(prompt, specials=True)
    model = load_model(ckpt, "cpu")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        # a row scores highest the token whose embedding it is, as a tied output matrix scores the token itself
        embedding = model.model.embed_tokens.weight
        head = torch.zeros_like(embedding)
        head[lake], head[blue], head[anchor.id] = embedding[ids[-1]], embedding[lake], embedding[blue]
        head[stone] = embedding[anchor.id] + embedding[stone]
    model.lm_head.weight = torch.nn.Parameter(head)
    model.config.tie_word_embeddings = False
    model.save_pretrained(ckpt)
    free = greedy_ids(model, ids, 30, plan_for(model, 256), eos=[tok.eos_token_id])
    assert free == [lake, blue, anchor.id] + [stone] * 27
    folder = tmp_path / "synthetic" / "256" / "data" / "vt"
    folder.mkdir(parents=True)
    (folder / "validation.jsonl").write_text(json.dumps({"input": prompt, "outputs": ["\u2603"]}) + "\n")
    out = evaluate(resolve_target(ckpt), ruler_data=str(tmp_path / "synthetic"), out=tmp_path / "o")
    (pred,) = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    assert pred["prediction"] == tok.decode(free[:3], skip_special_tokens=True) == "lake blue"
    assert tok.decode(free, skip_special_tokens=True) == "lake blue" + " stone" * 27


def test_settled_needs_every_answer_before_the_last_character():
    assert not settled("all", ["1234", "abc"], "the numbers are 1234 and ab")
    assert not settled("all", ["1234"], "the number is 1234")  # the end may still be rewritten by the next token
    assert settled("all", ["1234"], "the number is 1234.")
    assert settled("part", ["Paris", "France"], "It is in paris, ")
    assert not settled("all", ["Paris"], "  ")


def test_generation_stops_once_the_score_is_settled_with_the_full_lengths_score(run_dir):
    """Against the continuation without the stop (the RULER-length reference): a sample whose answer appears early
    gets a prefix of it, one token past the answer, scoring what the whole reference scores; one whose answer never
    appears gets the whole reference; the vLLM path's cut (`until_answered`) gives the same prediction."""
    ckpt = RunDir(run_dir).export(STEPS[0])
    tok = load_tokenizer(str(ckpt))
    encoder = text_encoder(tok)
    model = load_model(ckpt, "cpu")
    plan = plan_for(model, 256)
    ends = [tok.eos_token_id]
    prompt = "The special magic number for the quiet lake is 7261. What is the special magic number?"
    ref = greedy_ids(model, encoder.encode(prompt, specials=True), 64, plan, eos=ends)
    text = tok.decode(ref, skip_special_tokens=True)
    k = next(k for k in range(1, len(ref)) if tok.decode(ref[:k], skip_special_tokens=True).strip()[:-1])
    answer = tok.decode(ref[:k], skip_special_tokens=True).strip()[:-1]  # appears k tokens in
    early = Sample("niah_single_1", 256, 0, prompt, (answer,), 64, "all", 0)
    never = Sample("niah_single_1", 256, 1, prompt, ("\u2603 not generated",), 64, "all", 0)
    got = greedy_generate(model, tok, encoder, early, plan, ends)
    assert text.startswith(got) and len(got) < len(text)
    assert sample_score("all", early.answers, got) == sample_score("all", early.answers, text) == 1.0
    assert tok.decode(until_answered(tok, early, ref), skip_special_tokens=True) == got
    assert greedy_generate(model, tok, encoder, never, plan, ends) == text
    assert until_answered(tok, never, ref) == ref


def test_the_vllm_cut_is_the_first_settled_prefix_wherever_the_answer_lies():
    """until_answered bisects: against a token-by-token scan, for the answer at every position and for none."""

    class Words:
        def decode(self, ids, skip_special_tokens=True):
            return "".join(ids)

    new = [f" w{i}" for i in range(20)]
    for at in range(20):
        tokens = new[:at] + [" 7261"] + new[at + 1 :]
        sample = Sample("niah_single_1", 256, 0, "", ("7261",), 20, "all", 0)
        first = next((k for k in range(1, 21) if settled("all", ("7261",), "".join(tokens[:k]))), 20)
        assert until_answered(Words(), sample, tokens) == tokens[:first]
        assert first == (at + 2 if at < 19 else 20)  # one token past the answer; at the end, not trusted: all of it
    assert until_answered(Words(), Sample("qa_1", 256, 0, "", ("absent",), 20, "part", 0), new) == new


def test_an_unfinished_run_is_noted_and_recorded(evaluated, run_dir, tmp_path):
    # the fixture's run is finished: its exports reach train.steps (2)
    assert evaluated[1]["training"] == {"steps": STEPS[-1], "train_steps": 2, "finished": True}
    assert "unfinished run" not in evaluated[1]["notes"]
    # the same run planned for 100 steps: killed at step 47 (its metrics), after its last export (step_40)
    metrics = RunDir(run_dir).metrics_file
    metrics.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, 48)))
    try:
        target = resolve_target(run_dir, overrides=["train.steps=100"])
        out = evaluate(target, lengths=[512], tasks=["vt"], samples=1, out=tmp_path / "e")
    finally:
        metrics.unlink()
    results = json.loads((out / "results.json").read_text())
    assert results["training"] == {"steps": 47, "train_steps": 100, "finished": False}
    assert results["notes"]["unfinished run"] == (
        f"trained 47 of its 100 steps (train.steps), last evaluation checkpoint step_40: not the finished run's "
        f"scores; `lctrain resume {run_dir}`, then evaluate again"
    )


def test_an_interrupted_evaluation_leaves_the_earlier_results_and_predictions_as_a_pair(evaluated, monkeypatch):
    """Predictions are written as they are made, into a partial file renamed with results.json at the end: Ctrl-C
    mid-way cut predictions.jsonl to the new run's first lines beside the old results.json."""
    from lctrain.eval import runner

    out, _ = evaluated
    before = {name: (out / name).read_bytes() for name in ("results.json", "predictions.jsonl")}

    def stopped_mid_way(tgt, suite, tokenizer, encoder, device, heldout, kept, backend="hf", anchor_id=None):
        kept.predictions.write_text('{"checkpoint": "step_2"}\n')
        raise KeyboardInterrupt

    monkeypatch.setattr(runner, "score_checkpoints", stopped_mid_way)
    with pytest.raises(KeyboardInterrupt):
        evaluate(resolve_target(out.parent), lengths=[512], tasks=["vt"], samples=3)
    assert {name: (out / name).read_bytes() for name in before} == before


@pytest.mark.slow  # 3-7 s in CI: slow-marked to keep `make test` under its 5 minutes
def test_an_interrupted_evaluation_resumes_with_what_it_had_and_ends_as_an_uninterrupted_one(
    run_dir, tmp_path, monkeypatch, capsys
):
    """Stopped at its third answer (the first checkpoint's two answers and its perplexity made), an evaluation run
    again under the same settings makes only the rest (the first checkpoint is not even loaded) and writes what an
    uninterrupted one writes; under other settings it starts over."""
    from lctrain.eval import runner

    args = dict(lengths=[512], tasks=["vt", "fwe"], samples=1)
    whole = evaluate(resolve_target(run_dir), out=tmp_path / "whole", **args)
    answers, calls = runner._hf_answers, []

    def stops_at_the_third(*a):
        answer = answers(*a)

        def counted(batch):  # one sample per batch here: one task at one length
            calls.append(batch)
            if len(calls) == 3:
                raise KeyboardInterrupt
            return answer(batch)

        return counted

    monkeypatch.setattr(runner, "_hf_answers", stops_at_the_third)
    with pytest.raises(KeyboardInterrupt):
        evaluate(resolve_target(run_dir), out=tmp_path / "cut", **args)
    monkeypatch.setattr(runner, "_hf_answers", answers)
    assert not (tmp_path / "cut" / "results.json").exists()
    for f in (run_dir / "hf").rglob("*"):  # as a copy of the run directory has them: the same files, later times
        os.utime(f, ns=(f.stat().st_atime_ns, f.stat().st_mtime_ns + 10**9))
    load, loaded = runner.load_model, []
    monkeypatch.setattr(runner, "load_model", lambda path, device: loaded.append(path.name) or load(path, device))
    capsys.readouterr()
    cut = evaluate(resolve_target(run_dir), out=tmp_path / "cut", **args)
    assert "2 answers and the perplexity of 1 checkpoint(s) kept" in capsys.readouterr().out
    assert loaded == [f"step_{STEPS[1]}"]
    read = lambda d: json.loads((d / "results.json").read_text())  # noqa: E731
    for key in ("scores", "average", "perplexity", "overall"):
        assert read(cut)[key] == read(whole)[key], key
    assert (cut / "predictions.jsonl").read_text() == (whole / "predictions.jsonl").read_text()
    assert not (cut / "eval.resume.json").exists() and not (cut / "predictions.jsonl.partial").exists()

    monkeypatch.setattr(runner, "_hf_answers", stops_at_the_third)
    calls.clear()
    with pytest.raises(KeyboardInterrupt):
        evaluate(resolve_target(run_dir), out=tmp_path / "other", **args)
    monkeypatch.setattr(runner, "_hf_answers", answers)
    loaded.clear()
    evaluate(resolve_target(run_dir), out=tmp_path / "other", **{**args, "samples": 2})  # other settings: all again
    assert loaded == [f"step_{s}" for s in STEPS]


def test_answers_kept_by_an_earlier_way_of_answering_are_made_again(tmp_path):
    """Before --ruler-data prompts were encoded as RULER encodes them and the anchor ended a generation, the resume
    state held the settings alone: what it kept under the same settings is not what an evaluation answers now, and is
    made again; what today's evaluation keeps is reused."""
    settings = {"suite": "RULER (NVIDIA/RULER data in /d)", "lengths": [4096], "samples": None, "backend": "hf"}
    answer = {"checkpoint": "step_10", "task": "vt", "length": 4096, "index": 1, "prediction": "QPE", "score": 1.0}
    partial = tmp_path / "predictions.jsonl.partial"
    # eval.resume.json as lctrain wrote it before: {"key": settings, "perplexity": ...}
    (tmp_path / "eval.resume.json").write_text(json.dumps({"key": settings, "perplexity": {"step_10": {"4096": 3.5}}}))
    partial.write_text(json.dumps(answer) + "\n")
    redone = Kept.read(tmp_path, partial, settings)
    assert redone.answers == {} and redone.perplexity == {} and partial.read_text() == ""

    partial.write_text(json.dumps(answer) + "\n")
    redone.add_perplexity("step_10", {4096: 3.5})
    reused = Kept.read(tmp_path, partial, settings)
    assert reused.answers == {("step_10", "vt", 4096, 1): answer} and reused.perplexity == {"step_10": {4096: 3.5}}


def test_a_run_without_exports_but_with_a_checkpoint_is_told_to_export_it(tmp_path):
    """Trained with checkpoint.hf_last=0: nothing to evaluate, but its resume checkpoint can be exported."""
    from lctrain.train.checkpoint import STATE_FILE

    run = tmp_path / "run dir"
    write_resolved(load_config(None), run)
    RunDir(run).exports_dir.mkdir()
    step = RunDir(run).checkpoint(4)
    step.mkdir(parents=True)
    (step / STATE_FILE).write_text('{"step": 4}')
    r = CliRunner().invoke(app, ["eval", str(run)])
    assert r.exit_code == 2 and r.output.strip().endswith(f"; `lctrain export '{run}'` writes one of step_4"), r.output


# ---------------------------------------------------------------- what an evaluation refuses before any work


@pytest.fixture
def no_work(monkeypatch):
    """Sample generation and model loading made to fail the test: a refusal must come before either."""

    def forbidden(*args, **kwargs):
        raise AssertionError("work started before the refusal")

    monkeypatch.setattr("lctrain.eval.runner.generate", forbidden)
    monkeypatch.setattr("lctrain.eval.runner.load_model", forbidden)


def one_line_refusal(args: list[str]) -> str:
    r = CliRunner().invoke(app, ["eval", *args])
    lines = r.output.strip().splitlines()
    assert r.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: "), r.output
    return lines[0]


def test_lengths_beyond_4x_the_models_context_are_refused_before_any_work(run_dir, tmp_path, no_work):
    """The run trained 256-token windows: its exports' max_position_embeddings is 256, so 4 x 256 = 1024 is the
    longest length evaluated; one token more is refused, naming where the length came from."""
    assert json.loads((RunDir(run_dir).export(STEPS[0]) / "config.json").read_text())["max_position_embeddings"] == 256
    out = tmp_path / "out"
    expected = "more than 4x the 256 positions step_30 was made for"
    line = one_line_refusal([str(run_dir), "--lengths", "512,1025", "--out", str(out)])
    assert line.startswith(f"error: --lengths 1025: {expected}") and line.endswith("use --lengths of at most 1024")
    line = one_line_refusal([str(run_dir), "--set", "eval.lengths=[4096,512]", "--out", str(out)])
    assert line.startswith(f"error: eval.lengths 4096: {expected}")
    assert line.endswith("use --lengths (or eval.lengths) of at most 1024")
    assert not out.exists()  # no lock, no report: nothing was started


def test_a_ppl_data_that_is_no_dataset_is_refused_before_any_work(run_dir, tmp_path, no_work):
    """--ppl-data of a path the user typed was refused only after the task samples were made, telling them to run
    prepare 'with the same config' (a config they did not name)."""
    line = one_line_refusal([str(run_dir), "--ppl-data", str(tmp_path / "nowhere"), "--out", str(tmp_path / "o")])
    assert line == (
        f"error: {tmp_path / 'nowhere'}: no prepared dataset here; --ppl-data takes a dataset directory 'lctrain "
        f"prepare' wrote, whole: prepare it again with its config"
    )


def test_ruler_data_beyond_4x_the_models_context_is_refused_once_read(run_dir, tmp_path, no_work):
    """RULER's data brings its lengths: a directory the evaluation would score past 4 x 256 is refused, naming it,
    before any model loads; one without data for the task set is not scored, so not refused."""
    data = tmp_path / "synthetic"
    for length in (1024, 2048):
        folder = data / str(length) / "data" / "vt"
        folder.mkdir(parents=True)
        (folder / "validation.jsonl").write_text(json.dumps({"input": "x y z", "outputs": ["x"]}) + "\n")
    (data / "4096").mkdir()
    r = CliRunner().invoke(
        app, ["eval", str(run_dir), "--ruler-data", str(data), "--tasks", "vt", "--out", str(tmp_path)]
    )
    line = r.output.strip().splitlines()[-1]  # after the bar of the data read
    assert r.exit_code == 2 and line.startswith(
        f"error: --ruler-data {data}: length 2048: more than 4x the 256 positions step_30 was made"
    )
    assert line.endswith("use --lengths of at most 1024")


def test_a_length_at_4x_the_models_context_is_evaluated(run_dir, tmp_path):
    out = evaluate(resolve_target(run_dir), lengths=[1024], tasks=["vt"], samples=1, out=tmp_path / "e")
    results = json.loads((out / "results.json").read_text())
    assert results["lengths"] == [1024] and set(results["average"]["vt"]) == {"1024"}


def test_model_context_counts_rope_scaling(tmp_path):
    """What each config.json says its model was made for, by hand: Llama-2 4K; a YaRN config keeping Llama-2's 4096
    with factor 16 (the paper's Table 2 'YaRN' free row, 64K); Llama-3.1's llama3 scaling (factor 8 of 8192, under
    its own 131072); transformers 5's rope_parameters; and configs that say nothing usable."""
    cases = [
        ({"max_position_embeddings": 4096}, 4096),
        (
            {
                "max_position_embeddings": 4096,
                "rope_scaling": {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 4096},
            },
            65536,
        ),
        (
            {
                "max_position_embeddings": 131072,
                "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192},
            },
            131072,
        ),
        ({"max_position_embeddings": 32768, "rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, 131072),
        ({"max_position_embeddings": 8192, "rope_scaling": None, "rope_parameters": {"rope_theta": 1e6}}, 8192),
        ({"max_position_embeddings": 8192, "rope_scaling": "linear"}, 8192),
        ({"hidden_size": 64}, None),
        ([], None),
    ]
    for i, (config, expected) in enumerate(cases):
        model = tmp_path / str(i)
        model.mkdir()
        (model / "config.json").write_text(json.dumps(config))
        assert model_context(model) == expected, config
    (tmp_path / "torn").mkdir()
    (tmp_path / "torn" / "config.json").write_text('{"max_position_embeddings": 40')
    assert model_context(tmp_path / "torn") is None and model_context(tmp_path / "nowhere") is None


def test_a_length_whose_cache_cannot_fit_is_refused_before_any_sample(run_dir, tmp_path, monkeypatch, no_work):
    """The generation plan's own estimate (`generation.plan_generation`) made before the model loads: 1024 tokens
    of this model's fp32 KV cache (2 layers x K and V x 2 KV heads x 16 dims x 4 bytes x 1024, 512 KiB) do not fit
    in a quarter of that."""
    import lctrain.eval.generation as generation

    cache = 2 * 2 * 2 * 16 * 4 * 1024
    monkeypatch.setattr(generation, "free_memory", lambda device: (cache // 4, None))
    line = one_line_refusal([str(run_dir), "--lengths", "1024", "--tasks", "vt", "--out", str(tmp_path / "o")])
    assert "a 1024-token prompt does not fit for generation" in line and "(--lengths)" in line
    assert not (tmp_path / "o").exists()


def test_a_model_directory_is_refused_as_out(run_dir, tmp_path, no_work):
    """--out a model's folder (config.json and weights) wrote the report among the model's files."""
    export = RunDir(run_dir).export(STEPS[0])
    before = sorted(p.name for p in export.iterdir())
    line = one_line_refusal([str(run_dir), "--lengths", "512", "--out", str(export)])
    assert line == (
        f"error: --out {export}: a model directory (it holds config.json); the evaluation would write its report "
        f"among the model's files: pick another directory for --out (by default {run_dir}/eval)"
    )
    assert sorted(p.name for p in export.iterdir()) == before
    base = tmp_path / "base model"
    base.mkdir()
    (base / "config.json").write_text("{}")
    (base / "pytorch_model.bin").write_bytes(b"weights")
    assert "--out" in one_line_refusal([str(export), "--lengths", "512", "--out", str(base)])
    assert sorted(p.name for p in base.iterdir()) == ["config.json", "pytorch_model.bin"]


def test_too_short_agrees_with_the_generator_at_the_boundary():
    """`too_short` against the generator it anticipates (`tasks.generate`, which refuses a length whose samples do
    not fit with an empty haystack): the same verdict at every length around each task's shortest."""
    tokenizer = load_tokenizer(load_config(None).data.tokenizer)
    encoder = text_encoder(tokenizer).prompted(resolve_anchor(tokenizer))
    specs = {t: s for t, s in task_specs(0).items() if t in ("niah_single_1", "niah_multikey_1", "vt", "cwe", "fwe")}

    def count(text):
        return len(encoder.encode(text, specials=True))

    for name, spec in specs.items():
        (shortest, need) = too_short({name: spec}, [16], 3, 0, encoder)[name]
        assert shortest == 16 and need > 16
        verdicts = set()
        for length in range(need - 12, need + 12):
            refused = name in too_short({name: spec}, [length], 3, 0, encoder)
            try:
                generate(spec, length, 3, 0, count)
                generated = True
            except UserError as e:
                assert "too short" in str(e)
                generated = False
            assert refused != generated, (name, length)
            verdicts.add(refused)
        assert verdicts == {True, False}, name  # the boundary lies in the lengths tried


def test_lengths_too_short_for_a_task_are_refused_before_any_sample(run_dir, tmp_path, no_work):
    line = one_line_refusal([str(run_dir), "--set", "eval.lengths=[100,512]", "--tasks", "vt,fwe"])
    assert line.startswith("error: eval.lengths 100,512: too short for the prompt and generation of vt (")
    assert "fwe (" in line and line.endswith("or --exclude vt,fwe")
    assert "use --lengths (or eval.lengths) of at least" in line


def test_the_runner_loads_without_training_code():
    """`lctrain.train.checkpoint` (DeepSpeed's and torch's imports) is imported only for the hint of a run without
    exports: importing the runner leaves it out."""
    code = (
        "import sys, lctrain.eval.runner; print(sorted({'lctrain.train.checkpoint', 'deepspeed'} & set(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_heldout_dataset_is_marked_as_read_while_scored(run_dir, tmp_path, monkeypatch):
    """While an evaluation scores perplexity on a prepared dataset, `prepare --force` of it is refused (it would
    replace the windows under the scoring), as while a training reads it; the mark goes with the evaluation."""
    from lctrain import lifetime
    from lctrain.eval import runner

    data = RunDir(run_dir).read_config().data.output_dir
    out = tmp_path / "marked"
    seen = []

    def scoring(tgt, suite, tokenizer, encoder, device, heldout, kept, backend="hf", anchor_id=None):
        seen.append([r["reader"] for r in lifetime.readers(heldout.path)])
        with pytest.raises(UserError, match="reads it now; wait for it to finish"):
            lifetime.refuse_while_read(heldout.path, "rebuilding it here")
        raise KeyboardInterrupt

    monkeypatch.setattr(runner, "score_checkpoints", scoring)
    with pytest.raises(KeyboardInterrupt):
        evaluate(resolve_target(run_dir), out=out, lengths=[512], tasks=["vt"], samples=1)
    assert seen == [[f"the evaluation into {out}"]]
    assert lifetime.readers(data) == []


# ------------------------------------------------------------------ models transformers runs no sdpa for

# a tiny Gemma-2 with attention soft-capping low enough to change its logits; transformers builds it with eager
# attention only (no sdpa: it would drop the soft-capping)
TINY_GEMMA2 = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "query_pre_attn_scalar": 8,
    "max_position_embeddings": 1024,
    "sliding_window": 16,
    "attn_logit_softcapping": 1.0,
    "final_logit_softcapping": 30.0,
    "initializer_range": 0.5,
}


@pytest.fixture(scope="module")
def gemma2_export(tmp_path_factory):
    """A Gemma-2 evaluation export (weights, the built-in tokenizer, its record) and the model it holds."""
    from train_helpers import export_by_hand
    from transformers import Gemma2Config

    tok = load_tokenizer("builtin:mistral-7b-v0.1")
    config = Gemma2Config(vocab_size=len(tok), pad_token_id=0, bos_token_id=1, eos_token_id=2, **TINY_GEMMA2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32).eval()
    return export_by_hand(model, tok, tmp_path_factory.mktemp("gemma2") / "run", 1), model


def test_a_gemma2_export_loads_with_eager_attention_and_its_own_logits(gemma2_export, capsys):
    from lctrain.eval import runner

    path, model = gemma2_export
    runner._EAGER_SAID.discard("gemma2")
    loaded = load_model(path, "cpu")
    assert loaded.config._attn_implementation == "eager"
    ids = torch.randint(3, 1000, (1, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = model(input_ids=ids).logits
        torch.testing.assert_close(loaded(input_ids=ids).logits, theirs, rtol=0, atol=0)
        # the soft-capping matters: the same weights without it give other logits
        uncapped = copy_without_softcap(model)
        assert (uncapped(input_ids=ids).logits - theirs).abs().max() > 1e-2
    load_model(path, "cpu")  # said once per model type
    err = capsys.readouterr().err
    assert err.count("note: model type 'gemma2' is evaluated with transformers' eager attention") == 1
    assert "attn_logit_softcapping = 1.0" in err


def copy_without_softcap(model):
    import copy

    config = copy.deepcopy(model.config)
    config.attn_logit_softcapping = None
    plain = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    plain.load_state_dict(model.state_dict())
    return plain.eval()


def test_a_gemma2_export_is_evaluated(gemma2_export, tmp_path):
    path, _ = gemma2_export
    out = evaluate(resolve_target(path), lengths=[512], tasks=["vt"], samples=1, out=tmp_path / "o")
    results = json.loads((out / "results.json").read_text())
    assert results["kind"] == "model" and results["checkpoints"] == ["step_1"]


def test_sdpa_refused_at_load_falls_back_to_eager(run_dir, monkeypatch, capsys):
    """A model class lctrain cannot look up (remote code) that transformers refuses sdpa for is loaded eager."""
    from lctrain.eval import runner

    real = AutoModelForCausalLM.from_pretrained.__func__

    def refuse_sdpa(cls, path, *args, attn_implementation=None, **kwargs):
        if attn_implementation == "sdpa":
            raise ValueError("LlamaForCausalLM does not support an attention implementation through sdpa yet")
        return real(cls, path, *args, attn_implementation=attn_implementation, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", classmethod(refuse_sdpa))
    runner._EAGER_SAID.discard("llama")
    model = load_model(RunDir(run_dir).export(STEPS[0]), "cpu")
    assert model.config._attn_implementation == "eager"
    assert "model type 'llama' is evaluated with transformers' eager attention (transformers runs no sdpa" in (
        capsys.readouterr().err
    )


def test_a_llama_export_keeps_sdpa(run_dir):
    assert load_model(RunDir(run_dir).export(STEPS[0]), "cpu").config._attn_implementation == "sdpa"


@pytest.mark.parametrize(
    "given, anchored",
    [
        ([], False),
        (["--set", "eval.anchor_prompts=true"], True),
        (["--set", "eval.anchor_prompts=true", "--ruler-prompts"], False),
        (["--anchor-prompts"], True),
    ],
    ids=["ruler", "config", "flag-over-config", "flag"],
)
def test_ruler_prompts_start_with_the_anchor_as_the_config_or_the_flag_says(
    run_dir, tmp_path, monkeypatch, given, anchored
):
    """eval.anchor_prompts, which the flags override: the encoder of RULER's data is made as they say."""
    from lctrain.eval import ruler

    data = tmp_path / "synthetic" / "256" / "data" / "vt"
    data.mkdir(parents=True)
    (data / "validation.jsonl").write_text(json.dumps({"input": "x y z", "outputs": ["x"]}) + "\n")
    made = []

    class Made(Exception):
        pass

    def encoder(tokenizer, anchor, anchored=False):
        made.append(anchored)
        raise Made

    monkeypatch.setattr(ruler, "PromptEncoder", encoder)
    args = [str(run_dir), "--ruler-data", str(tmp_path / "synthetic"), "--tasks", "vt", "--out", str(tmp_path / "o")]
    r = CliRunner().invoke(app, ["eval", *args, *given])
    assert isinstance(r.exception, Made), r.output
    assert made == [anchored]
