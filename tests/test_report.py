"""`lctrain report`: the Table 5-style comparison of evaluated runs. Synthetic results.json beside real configs in run
directories (no training): the averages against a loop over the per-checkpoint results, the seed groups and their
spread against a hand computation, the reading of differences against that spread, bad input in one line, the command
end to end; and per-length perplexity against a direct loop over truncated windows on a tiny fp32 model."""

import json
import math
import random
from pathlib import Path

import pytest
import torch
from PIL import Image
from train_helpers import one_error_line
from transformers import AutoModelForCausalLM, LlamaConfig
from typer.testing import CliRunner

from lctrain.cli import app
from lctrain.config import data_fingerprint, load_config
from lctrain.errors import UserError
from lctrain.eval.perplexity import perplexity_by_length, perplexity_lengths
from lctrain.eval.ruler import PROMPT_START_ANCHOR, PROMPT_START_RULER
from lctrain.reports.compare import (
    BEYOND,
    UNKNOWN,
    WITHIN,
    _notes,
    compare,
    markdown,
    read_evaluated,
    reading,
    write_report,
)
from lctrain.rundir import RunDir

LENGTHS = [4096, 8192, 16384]
TASKS = ["niah_single_1", "vt", "fwe"]
STEPS = [60, 70, 80, 90, 100, 110, 120]  # seven evaluated checkpoints: the default takes the last five


def fake_evaluated(
    root: Path,
    name: str,
    mode: str,
    seed: int = 0,
    data_seed: int = 0,
    *,
    shift: float = 0.0,
    steps: list[int] = STEPS,
    lengths: list[int] = LENGTHS,
    tasks: list[str] = TASKS,
    extra: tuple[str, ...] = (),
    noise: str | None = None,
    eval_seed: int = 0,
    samples: int = 25,
    ppl_rows: list[int] | None = None,
    training: dict | None = None,
) -> Path:
    """A run directory with its config and an eval/results.json laid out as `lctrain eval` writes it; the scores are
    noise seeded by `noise` (default: the run's name and seeds) plus `shift`, perplexity per length for the lengths up
    to 8K (the held-out window)."""
    rd = RunDir(root / name)
    # a finished run by default: its last evaluation checkpoint at train.steps
    overrides = [f"name={name}", f"attention.mode={mode}", f"seed={seed}", f"data.seed={data_seed}"]
    overrides += [f"train.steps={steps[-1]}", *extra]
    rd.write_config(load_config(None, overrides))
    rng = random.Random(noise or f"{name}/{seed}/{data_seed}")
    ckpts = [f"step_{s}" for s in steps]
    scores = {c: {t: {str(L): round(rng.uniform(20, 80) + shift, 2) for L in lengths} for t in tasks} for c in ckpts}
    per_length = {c: {str(L): rng.uniform(5, 9) - shift / 10 for L in lengths if L <= 8192} for c in ckpts}
    results = {
        "suite": "RULER-style (not comparable with published RULER numbers)",
        "not_scored": [],
        "task_set": tasks,
        "target": str(rd.path),
        "kind": "run",
        **({"training": training} if training else {}),
        "checkpoints": ckpts,
        "tasks": tasks,
        "lengths": lengths,
        "samples_per_task": samples,
        "seed": eval_seed,
        "scores": scores,
        "perplexity": {
            "windows": 8,
            "rows": ppl_rows or list(range(8)),
            "per_checkpoint": {c: v[max(v, key=int)] for c, v in per_length.items()},
            "per_length": per_length,
        },
    }
    rd.eval_dir.mkdir(parents=True)
    (rd.eval_dir / "results.json").write_text(json.dumps(results))
    return rd.path


def results_file(run: Path) -> Path:
    return RunDir(run).eval_dir / "results.json"


def results_of(run: Path) -> dict:
    return json.loads(results_file(run).read_text())


def loop_average(results: dict, ckpts: list[str]) -> tuple[dict, dict]:
    """The independent reference: for each length, the mean over checkpoints of the mean over tasks."""
    ruler, ppl = {}, {}
    for L in map(str, results["lengths"]):
        per_ckpt = [sum(results["scores"][c][t][L] for t in results["tasks"]) / len(results["tasks"]) for c in ckpts]
        ruler[L] = sum(per_ckpt) / len(per_ckpt)
        if L in results["perplexity"]["per_length"][ckpts[0]]:
            ppl[L] = sum(results["perplexity"]["per_length"][c][L] for c in ckpts) / len(ckpts)
    return ruler, ppl


def test_averages_over_the_last_checkpoints_match_a_loop(tmp_path):
    full = fake_evaluated(tmp_path, "full", "full")
    anchor = fake_evaluated(tmp_path, "anchor", "anchor", shift=5)
    for last, expected in ((None, STEPS[-5:]), (2, STEPS[-2:]), (7, STEPS)):
        report = compare([read_evaluated(full), read_evaluated(anchor)], last)
        assert [row["label"] for row in report["rows"]] == ["full", "anchor"]
        for row, run in zip(report["rows"], (full, anchor)):
            ckpts = [f"step_{s}" for s in expected]
            assert row["runs"][0]["checkpoints"] == ckpts
            ruler, ppl = loop_average(results_of(run), ckpts)
            assert {L: c["mean"] for L, c in row["ruler"].items()} == pytest.approx(ruler)
            assert {L: c["mean"] for L, c in row["perplexity"].items()} == pytest.approx(ppl)
            assert all(c["n"] == 1 and c["std"] is None for c in row["ruler"].values())
    assert report["lengths"] == {"ruler": LENGTHS, "perplexity": [4096, 8192]}


def test_fewer_checkpoints_than_five_average_all_of_them(tmp_path):
    run = fake_evaluated(tmp_path, "short", "anchor", steps=[90, 100, 110])
    row = compare([read_evaluated(run)])["rows"][0]
    assert row["runs"][0]["checkpoints"] == ["step_90", "step_100", "step_110"]
    ruler, _ = loop_average(results_of(run), ["step_90", "step_100", "step_110"])
    assert {L: c["mean"] for L, c in row["ruler"].items()} == pytest.approx(ruler)


def hand_spread(values: list[float]) -> tuple[float, float]:
    m = sum(values) / len(values)
    return m, math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1))


def test_seed_replicates_are_one_row_with_their_spread(tmp_path):
    steps_tokens = ["train.global_batch=4", "data.seq_len=512"]
    full = [fake_evaluated(tmp_path, f"full_s{s}", "full", seed=s, extra=steps_tokens) for s in (0, 1, 2)]
    anchor = [
        fake_evaluated(tmp_path, "anchor_a", "anchor", seed=0, data_seed=0, shift=3, extra=steps_tokens),
        fake_evaluated(tmp_path, "anchor_b", "anchor", seed=0, data_seed=1, shift=3, extra=steps_tokens),
    ]
    report = compare([read_evaluated(p) for p in (full[0], anchor[0], full[1], anchor[1], full[2])])
    assert [(row["label"], row["seeds"]) for row in report["rows"]] == [("full", 3), ("anchor", 2)]
    assert report["rows"][0]["training_tokens"] == STEPS[-1] * 4 * 512
    ckpts = [f"step_{s}" for s in STEPS[-5:]]
    for row, runs in zip(report["rows"], (full, anchor)):
        assert [r["path"] for r in row["runs"]] == [str(p) for p in runs]
        per_seed = [loop_average(results_of(p), ckpts) for p in runs]
        for metric, i in (("ruler", 0), ("perplexity", 1)):
            for L, cell in row[metric].items():
                values = [s[i][L] for s in per_seed]
                m, sd = hand_spread(values)
                assert cell["mean"] == pytest.approx(m) and cell["std"] == pytest.approx(sd)
                assert (cell["min"], cell["max"]) == pytest.approx((min(values), max(values)))
                assert cell["n"] == len(values)
    for metric in ("ruler", "perplexity"):
        for L, d in report["rows"][1]["vs_reference"][metric].items():
            ref, cell = report["rows"][0][metric][L], report["rows"][1][metric][L]
            assert d["difference"] == pytest.approx(cell["mean"] - ref["mean"])
            apart = cell["min"] > ref["max"] or ref["min"] > cell["max"]
            assert d["reading"] == (BEYOND if apart else WITHIN)


def cell(values):
    return {"mean": sum(values) / len(values), "min": min(values), "max": max(values), "n": len(values)}


def test_reading_against_the_seed_spread():
    assert reading(cell([50, 52, 54]), cell([53, 55])) == WITHIN  # ranges overlap: not a finding
    assert reading(cell([50, 52, 54]), cell([54.5, 56])) == BEYOND
    assert reading(cell([60]), cell([50, 52])) == UNKNOWN  # one seed: no spread to read against
    assert reading(cell([60, 61]), cell([50])) == UNKNOWN


def test_the_tables_say_how_to_read_a_difference(tmp_path):
    # scores in [20, 80]: anchor's are 200 above full's at every length (beyond any spread); intra_doc's two seeds
    # repeat full's, 0.01 higher (their ranges overlap); a single-seed intra_doc_reset row has no spread
    runs = [fake_evaluated(tmp_path, f"full_{s}", "full", seed=s) for s in (0, 1)]
    runs += [fake_evaluated(tmp_path, f"anchor_{s}", "anchor", seed=s, shift=200) for s in (0, 1)]
    runs += [
        fake_evaluated(tmp_path, f"intra_{s}", "intra_doc", seed=s, shift=0.01, noise=f"full_{s}/{s}/0") for s in (0, 1)
    ]
    runs += [fake_evaluated(tmp_path, "reset", "intra_doc_reset")]
    report = compare([read_evaluated(p) for p in runs])
    anchor, intra, reset = report["rows"][1:]
    for metric in ("ruler", "perplexity"):
        assert {d["reading"] for d in anchor["vs_reference"][metric].values()} == {BEYOND}
        assert {d["reading"] for d in intra["vs_reference"][metric].values()} == {WITHIN}
        assert {d["reading"] for d in reset["vs_reference"][metric].values()} == {UNKNOWN}
    assert all(d["difference"] == pytest.approx(0.01) for d in intra["vs_reference"]["ruler"].values())
    out = tmp_path / "out"
    write_report(runs, out, left_out=["anchor_s1 (train failed; OUT/experiment.json records why)"])
    md = (out / "report.md").read_text()
    assert "(beyond seed spread)" in md and "(within seed spread)" in md and "(single seed: spread unknown)" in md
    assert "difference from full" in md
    # a run an experiment could not train is named in the report itself, which may be read without its log
    assert "**warning: left out of this report: anchor_s1 (train failed; OUT/experiment.json records why)**" in md


def test_repeated_modes_are_labelled_by_what_differs(tmp_path):
    a = fake_evaluated(tmp_path, "a", "anchor", extra=("train.lr=0.001",))
    b = fake_evaluated(tmp_path, "b", "anchor", extra=("train.lr=0.0002",))
    c = fake_evaluated(tmp_path, "c", "full", extra=("train.lr=0.001",))
    report = compare([read_evaluated(p) for p in (a, b, c)])
    assert [row["label"] for row in report["rows"]] == [
        "anchor (train.lr=0.001)",
        "anchor (train.lr=0.0002)",
        "full (train.lr=0.001)",
    ]
    assert report["other_differences"] == ["train.lr"]


def test_an_eval_dir_or_results_file_is_accepted(tmp_path):
    run = fake_evaluated(tmp_path, "r", "anchor")
    for given in (run, RunDir(run).eval_dir, RunDir(run).eval_dir / "results.json"):
        ev = read_evaluated(given)
        assert ev.path == run and ev.cfg.attention.mode == "anchor"


def test_bad_input_is_one_line(tmp_path):
    good = fake_evaluated(tmp_path, "good", "full")
    RunDir(tmp_path / "untested").write_config(load_config(None, ["name=untested"]))
    other_lengths = fake_evaluated(tmp_path, "other_lengths", "anchor", lengths=[4096, 32768])
    other_tasks = fake_evaluated(tmp_path, "other_tasks", "anchor", tasks=["vt"])
    twin = fake_evaluated(tmp_path, "twin", "full")  # same experiment, same seeds as `good`
    (tmp_path / "empty").mkdir()
    damaged = fake_evaluated(tmp_path, "damaged", "anchor")
    results = results_of(damaged)
    del results["scores"]["step_120"]["vt"]
    (RunDir(damaged).eval_dir / "results.json").write_text(json.dumps(results))
    (tmp_path / "notresults.json").write_text("[]")
    cases = [
        ([str(damaged)], f"{RunDir(damaged).eval_dir / 'results.json'}: the results of step_80"),
        ([str(tmp_path / "notresults.json")], "not the results.json of `lctrain eval` (no checkpoints, scores"),
        ([str(tmp_path / "untested")], f"{tmp_path / 'untested'}: not evaluated yet"),
        ([str(tmp_path / "empty")], "neither an evaluated run directory"),
        (
            [str(good), str(other_lengths)],
            f"different lengths: {results_file(good)}: 4096, 8192, 16384; {results_file(other_lengths)}: 4096, 32768",
        ),
        (
            [str(good), str(other_tasks)],
            f"different tasks: {results_file(good)}: niah_single_1, vt, fwe; {results_file(other_tasks)}: vt",
        ),
        ([str(good), "--last", "8"], "--last 8 asks for more checkpoints than the 7 evaluated"),
        ([str(good), "--last", "0"], "--last 0: average over at least 1 checkpoint"),
        ([str(good), str(twin)], "the same experiment with the same seeds (seed 0, data.seed 0)"),
    ]
    for args, expected in cases:
        out = tmp_path / "never"
        line = one_error_line(CliRunner().invoke(app, ["report", *args, "--out", str(out)]))
        assert expected in line, line
        assert not out.exists()
    with pytest.raises(UserError, match="give at least one evaluated run"):
        write_report([], tmp_path / "never")


def test_command_end_to_end(tmp_path, monkeypatch):
    runs = [fake_evaluated(tmp_path, f"full_{s}", "full", seed=s) for s in (0, 1)]
    runs += [fake_evaluated(tmp_path, "anchor", "anchor", shift=2)]
    out = tmp_path / "table5"
    wide = {"COLUMNS": "200"}  # rich wraps table cells to the terminal's width
    result = CliRunner().invoke(app, ["report", *map(str, runs), "--out", str(out), "--last", "3"], env=wide)
    assert result.exit_code == 0, result.output
    assert f"wrote {out}/report.json, report.md, report.png" in result.output
    assert "single seed: spread unknown" in result.output and "mean ± std over seeds" in result.output
    written = json.loads((out / "report.json").read_text())
    assert written == json.loads(json.dumps(write_report(runs, tmp_path / "again", last=3)))
    assert [r["checkpoints"] for r in written["rows"][0]["runs"]] == [[f"step_{s}" for s in STEPS[-3:]]] * 2
    md = (out / "report.md").read_text()
    assert "| full | 2 |" in md and "| anchor | 1 |" in md
    assert Image.open(out / "report.png").size[0] > 1.5 * Image.open(out / "report.png").size[1]  # two panels
    monkeypatch.chdir(tmp_path)
    assert CliRunner().invoke(app, ["report", str(runs[2])]).exit_code == 0
    assert (tmp_path / "report" / "report.md").is_file()  # the default --out


TINY_LLAMA = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
)
WINDOW = {"input_ids": None, "seg_lens": [20, 30, 14], "seg_doc": [0, 1, 2], "tag_lens": [1, 1, 0]}


def test_per_length_perplexity_against_truncated_windows():
    torch.manual_seed(0)
    arch = LlamaConfig(**TINY_LLAMA, vocab_size=97, max_position_embeddings=64)
    # as `lctrain eval` loads a checkpoint: stock sdpa attention, fp32 on a CPU
    model = AutoModelForCausalLM.from_config(arch, attn_implementation="sdpa", dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(0)
    windows = [dict(WINDOW, input_ids=torch.randint(0, 97, (64,), generator=gen).tolist()) for _ in range(2)]
    lengths = perplexity_lengths(64, [16, 40, 128])
    assert lengths == [16, 40, 64]  # 128 does not fit a 64-token window; the window itself always counts
    got = perplexity_by_length(model, windows, [0, 1], lengths)
    for L in lengths:
        nll, count = 0.0, 0
        for w in windows:
            ids = torch.as_tensor(w["input_ids"][:L])[None]
            labels = ids.clone()
            start = 0
            for n, tags in zip(w["seg_lens"], w["tag_lens"]):
                labels[0, start : start + 1 + tags] = -100  # each segment's anchor and tag: not predictable
                start += n
            with torch.no_grad():
                logits = model(input_ids=ids).logits[0, :-1]
            per = torch.nn.functional.cross_entropy(logits, labels[0, 1:], reduction="none", ignore_index=-100)
            nll, count = nll + float(per.sum()), count + int((labels[0, 1:] != -100).sum())
        assert got[L] == pytest.approx(math.exp(nll / count), rel=1e-5)


def test_an_unfinished_run_is_warned_marked_and_counted_by_its_trained_tokens(tmp_path, monkeypatch):
    # 10 steps of 1 x 4096 tokens: the finished seeds export steps 8-10; seed 1 was killed at step 7 (its metrics
    # reached 7, its last export is step_6); seed 2's results predate the training record: its checkpoints tell
    shape = ("train.steps=10", "train.global_batch=1", "data.seq_len=4096")
    done = fake_evaluated(tmp_path, "full_s0", "full", seed=0, steps=[8, 9, 10], extra=shape)
    killed = fake_evaluated(
        tmp_path,
        "full_s1",
        "full",
        seed=1,
        steps=[4, 5, 6],
        extra=shape,
        training={"steps": 7, "train_steps": 10, "finished": False},
    )
    old = fake_evaluated(tmp_path, "full_s2", "full", seed=2, steps=[4, 5, 6], extra=shape)
    anchor = fake_evaluated(tmp_path, "anchor", "anchor", steps=[8, 9, 10], extra=shape)
    report = compare([read_evaluated(p) for p in (done, killed, old, anchor)])
    full, anchor_row = report["rows"]
    assert full["unfinished"] == [str(killed), str(old)] and anchor_row["unfinished"] == []
    assert [r["training_tokens"] for r in full["runs"]] == [10 * 4096, 7 * 4096, 6 * 4096]
    assert full["training_tokens"] == 6 * 4096 and anchor_row["training_tokens"] == 40960
    # the killed seeds evaluated other steps than the rest: said first (test_report_comparability), each row's shown
    assert report["warnings"][0].startswith("warning: the runs share no evaluated checkpoint")
    assert report["warnings"][1:] == [
        f"warning: {killed} is unfinished (trained 7 of its 10 steps), yet a seed of row full: resume it and "
        f"evaluate again, or leave it out",
        f"warning: {old} is unfinished (trained 6 of its 10 steps), yet a seed of row full: resume it and "
        f"evaluate again, or leave it out",
    ]
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["report", *map(str, (done, killed, old, anchor))], env={"COLUMNS": "300"})
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[0] == report["warnings"][0]  # at the top, before the tables
    md = (tmp_path / "report" / "report.md").read_text()
    assert (
        "| full | 3 (2 unfinished) | 24,576, 28,672, 40,960 | step_8, step_9, step_10; step_4, step_5, step_6 |" in md
    )
    assert "| anchor | 1 | 40,960 | step_8, step_9, step_10 |" in md
    assert report["warnings"][1] in md.split("## ")[0]


def test_runs_evaluated_differently_are_refused_naming_the_setting_and_results(tmp_path):
    good = fake_evaluated(tmp_path, "good", "full")
    cases = [
        (dict(eval_seed=1), "different eval seeds (the offline suite's needles)", "0", "1", "same eval.seed"),
        (dict(samples=10), "different samples per task", "25", "10", "same --samples"),
    ]
    for i, (change, what, a, b, fix) in enumerate(cases):
        other = fake_evaluated(tmp_path, f"other{i}", "anchor", **change)
        with pytest.raises(UserError) as e:
            compare([read_evaluated(good), read_evaluated(other)])
        assert str(e.value) == (
            f"runs evaluated with {what}: {results_file(good)}: {a}; {results_file(other)}: {b}; evaluate them with "
            f"the {fix}"
        )
    fewer = fake_evaluated(tmp_path, "fewer", "anchor")
    results = results_of(fewer)
    results["perplexity"]["windows"] = 4
    results_file(fewer).write_text(json.dumps(results))
    with pytest.raises(UserError, match=r"different numbers of perplexity windows: .*: 8; .*fewer/eval.*: 4; "):
        compare([read_evaluated(good), read_evaluated(fewer)])
    # results written before the prompt's start was recorded all started with the anchor
    assert "prompt_start" not in results_of(good)
    anchored = fake_evaluated(tmp_path, "anchored", "anchor")
    results = results_of(anchored)
    results_file(anchored).write_text(json.dumps({**results, "prompt_start": PROMPT_START_ANCHOR}))
    compare([read_evaluated(good), read_evaluated(anchored)])
    results_file(anchored).write_text(json.dumps({**results, "prompt_start": PROMPT_START_RULER}))
    with pytest.raises(UserError) as e:
        compare([read_evaluated(good), read_evaluated(anchored)])
    assert str(e.value) == (
        f"runs evaluated with different prompt starts: {results_file(good)}: anchor; {results_file(anchored)}: the "
        f"tokenizer's own (as RULER); evaluate them with the same --anchor-prompts"
    )


def test_the_footnote_names_the_results_file_read(tmp_path):
    run = fake_evaluated(tmp_path, "r", "anchor")
    copy = tmp_path / "elsewhere.json"
    copy.write_text(results_file(run).read_text())
    md = markdown(compare([read_evaluated(copy)]))
    assert f"- averaged: anchor: {copy} (seed 0, data.seed 0): 5 checkpoints step_80, step_90, step_100" in md


def test_notes_when_runs_score_other_windows_or_train_on_other_data(tmp_path):
    # seeds 0 and 1 of both modes: each seed's windows are its own, shared across modes
    runs = [
        fake_evaluated(tmp_path, f"{m}_{s}", m, seed=s, ppl_rows=[s, 5, 9]) for m in ("full", "anchor") for s in (0, 1)
    ]
    notes = _notes(compare([read_evaluated(p) for p in runs]))
    spread = "its runs scored different held-out windows (they depend on seed and train.steps): its spread mixes"
    assert [n for n in notes if "differ in their text" in n] == [
        f"rows also differ in their text: perplexity of full: {spread} text with seed",
        f"rows also differ in their text: perplexity of anchor: {spread} text with seed",
    ]
    same = [fake_evaluated(tmp_path, f"same_{m}", m, ppl_rows=[1, 2]) for m in ("full", "anchor")]
    other_data = fake_evaluated(tmp_path, "reset", "intra_doc", data_seed=3, ppl_rows=[1, 3])
    report = compare([read_evaluated(p) for p in (*same, other_data)])
    fingerprints = [data_fingerprint(load_config(str(RunDir(p).config_file)).data)[:12] for p in (same[0], other_data)]
    assert fingerprints[0] != fingerprints[1]
    first, second = (f"{fp}: {', '.join(map(str, ps))}" for fp, ps in zip(fingerprints, (same, [other_data])))
    assert report["data_notes"] == [
        f"runs trained on 2 prepared datasets (data fingerprints {'; '.join(sorted([first, second]))})",
        "perplexity: the rows scored different held-out windows: their differences mix text with attention mode",
    ]
    assert compare([read_evaluated(p) for p in same])["data_notes"] == []
    # two seeds of one mode and three of another, every run on the same windows: the rows' means are over one text
    seeds = [
        fake_evaluated(tmp_path, f"seeds_{m}_{s}", m, seed=s, ppl_rows=[7, 21])
        for m, n in (("full", 2), ("anchor", 3))
        for s in range(n)
    ]
    assert compare([read_evaluated(p) for p in seeds])["data_notes"] == []
    # one seed each, and not the same one: the rows' difference is seed's as much as the mode's
    lone = [fake_evaluated(tmp_path, f"lone_{m}", m, seed=s, ppl_rows=[7, 21]) for m, s in (("full", 0), ("anchor", 1))]
    assert compare([read_evaluated(p) for p in lone])["data_notes"] == [
        "the rows trained from different seeds (full: 0; anchor: 1): a seed sets the initial weights and the order the "
        "windows are read in, so their differences mix seed with what the rows differ in; train every row with the "
        "same seeds"
    ]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """A small prepared dataset (256-token windows, some of one document, some of several) and the overrides of a
    run trained on it, 2 steps of 1 window."""
    from lctrain.data.prepare import prepare

    out = tmp_path_factory.mktemp("report_data") / "data"
    data = ["data.seq_len=256", "data.token_budget=6000", f"data.output_dir={out}"]
    prepare(load_config(None, data))
    return out, (*data, "train.global_batch=1", "train.micro_batch=1")


def windows_read_by_hand(cfg, steps: int) -> tuple[set[int], set[int]]:
    """The rows the trainer's batch plan hands out over `steps` steps, and those of them holding several documents
    (counted from each window's seg_doc)."""
    from lctrain.data.store import open_packed
    from lctrain.train.data import BatchPlan

    packed = open_packed(data_dir_of(cfg))
    plan = BatchPlan(cfg.train.global_batch, cfg.train.micro_batch, 1)
    rows = {
        r
        for s in range(steps)
        for m in range(plan.grad_accum)
        for r in plan.rows(s, m, 0, seed=cfg.seed, n=len(packed))
    }
    return rows, {r for r in rows if len(set(packed[r]["seg_doc"].tolist())) > 1}


def data_dir_of(cfg):
    from lctrain.config import data_dir

    return data_dir(cfg)


def test_the_windows_trained_on_say_whether_the_modes_could_differ(tmp_path, prepared):
    _, overrides = prepared
    steps = [1, 2]
    by_seed = {s: windows_read_by_hand(load_config(None, [*overrides, f"seed={s}"]), 2) for s in range(40)}
    single = next(s for s, (_, multi) in by_seed.items() if not multi)
    mixed = next(s for s, (_, multi) in by_seed.items() if multi)

    def runs(seed, modes=("full", "anchor")):
        return [
            fake_evaluated(tmp_path, f"{m}_{seed}", m, seed=seed, steps=steps, extra=overrides, ppl_rows=[0])
            for m in modes
        ]

    pair = runs(single)
    notes = compare([read_evaluated(p) for p in pair])["mode_notes"]
    assert notes == [
        f"attention modes: none of the {len(by_seed[single][0])} windows the runs trained on held more than one "
        f"document, so the modes trained identically on them (one mask, the same positions): the rows' differences "
        f"are not the masks'"
    ]
    report = compare([read_evaluated(p) for p in runs(mixed, ("intra_doc", "intra_doc_reset"))])
    read, multi = by_seed[mixed]
    assert report["mode_notes"][0] == (
        f"attention modes: {len(multi)} of the {len(read)} windows the runs trained on held more than one document "
        f"(only there do the modes' masks and positions differ)"
    )
    assert report["rows"][0]["runs"][0]["trained_windows"] == {"read": len(read), "multi_document": len(multi)}
    assert report["mode_notes"][1].startswith(  # the default config's fp32
        "intra_doc and intra_doc_reset: one computation in fp32 on these windows"
    )
    bf16 = [
        fake_evaluated(tmp_path, f"{m}_bf16", m, seed=mixed, steps=steps, extra=(*overrides, "model.dtype=bfloat16"))
        for m in ("intra_doc", "intra_doc_reset")
    ]
    assert compare([read_evaluated(p) for p in bf16])["mode_notes"][1:] == []  # bf16 rounds reset's positions apart
    # one mode: nothing counted; a dataset not here: said, not guessed
    assert compare([read_evaluated(pair[0])])["mode_notes"] == []
    elsewhere = fake_evaluated(tmp_path, "elsewhere", "anchor", extra=("data.output_dir=/nonexistent/data",))
    notes = compare([read_evaluated(pair[0]), read_evaluated(elsewhere)])["mode_notes"]
    assert notes[0].startswith("attention modes: the windows")
    assert f"{elsewhere} trained on are not counted (its prepared dataset /nonexistent/data is not here)" in notes[0]


def test_rows_that_differ_beyond_the_mode_are_labelled_by_it(tmp_path):
    full = fake_evaluated(tmp_path, "full", "full", extra=("model.rope_theta=10000",))
    anchor = fake_evaluated(tmp_path, "anchor", "anchor")
    report = compare([read_evaluated(p) for p in (full, anchor)])
    theta = load_config(None).model.rope_theta
    assert [row["label"] for row in report["rows"]] == [
        "full (model.rope_theta=10000.0)",
        f"anchor (model.rope_theta={theta})",
    ]
    assert "## RULER, mean over tasks (higher is better): difference from full (model.rope_theta=10000.0)" in markdown(
        report
    )


def test_perplexity_windows_short_because_training_read_them_say_so(tmp_path):
    good = fake_evaluated(tmp_path, "good", "full")
    none = fake_evaluated(tmp_path, "none", "anchor")
    results = results_of(none)
    results["perplexity"].update(windows=0, rows=[], heldout_available=0, data="/d", per_length={})
    results_file(none).write_text(json.dumps(results))
    reads = load_config(str(RunDir(none).config_file)).windows_read()
    with pytest.raises(UserError) as e:
        compare([read_evaluated(good), read_evaluated(none)])
    assert str(e.value) == (
        f"runs evaluated with different numbers of perplexity windows: {results_file(good)}: 8; {results_file(none)}: "
        f"0, as its training reads {reads:,} windows (train.steps x train.global_batch), which leave 0 of /d unread: "
        f"score them on the same held-out windows, evaluating each with `lctrain eval RUN --ppl-data DIR` (a dataset "
        f"prepared apart from their training data), or prepare a larger data.token_budget and train again"
    )


def test_the_notes_state_the_perplexity_convention(tmp_path):
    md = markdown(compare([read_evaluated(fake_evaluated(tmp_path, "r", "anchor"))]))
    assert "- perplexity: every mode scored with plain causal attention over each held-out window" in md


def test_the_report_records_what_every_run_was_evaluated_with(tmp_path):
    """report.json and its notes name the evaluation settings the runs share (samples per task, eval seed, prompt
    start, perplexity windows): a reader of the report alone could not tell 25 samples per task from 2."""
    runs = [fake_evaluated(tmp_path, f"{m}", m, samples=7, eval_seed=3) for m in ("full", "anchor")]
    for run in runs:  # as `lctrain eval` records it
        results = results_of(run)
        results_file(run).write_text(json.dumps({**results, "prompt_start": PROMPT_START_ANCHOR}))
    report = write_report(runs, tmp_path / "out")
    recorded = results_of(runs[0])
    assert report["evaluation"] == {
        "suite": recorded["suite"],
        "prompt_start": PROMPT_START_ANCHOR,
        "seed": 3,
        "samples_per_task": 7,
        "lengths": LENGTHS,
        "tasks": TASKS,
        "perplexity_windows": 8,
    }
    assert json.loads((tmp_path / "out" / "report.json").read_text())["evaluation"] == report["evaluation"]
    assert _notes(report)[0] == (
        f"suite: {recorded['suite']}; tasks: {', '.join(TASKS)}; 7 samples per task; eval seed 3; prompts start with "
        f"{PROMPT_START_ANCHOR}; perplexity over 8 held-out windows"
    )
    # RULER files of different sizes (results.json: samples per task and length, as scored)
    uneven = {**report, "evaluation": {**report["evaluation"], "samples_per_task": {"vt": {"4096": 3, "8192": 5}}}}
    assert "; 3-5 samples per task and length; eval seed 3;" in _notes(uneven)[0]
    # a report written before the settings were recorded still reads
    assert _notes({k: v for k, v in report.items() if k != "evaluation"})[0] == (
        f"suite: {recorded['suite']}; tasks: {', '.join(TASKS)}"
    )
