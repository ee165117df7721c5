"""`lctrain report` compares like with like, or says where it cannot: every run averaged over the same training steps
(the latest evaluated checkpoints all runs share; where they share none, each its own, warned and shown), perplexity
on other held-out text warned about, and rows labelled by the settings their results were scored with rather than by
a config.yaml rewritten since (a resume to more steps).

Hand-built results.json files beside real configs (test_report's `fake_evaluated`); the references are a loop over
the per-checkpoint results of the steps named here, and the warnings written out in full."""

import json
from pathlib import Path

import pytest
from test_report import LENGTHS, STEPS, fake_evaluated, loop_average, results_file, results_of
from typer.testing import CliRunner

from lctrain.cli import app
from lctrain.config import load_config
from lctrain.errors import UserError
from lctrain.reports.compare import compare, markdown, read_evaluated
from lctrain.rundir import RunDir


def names(steps) -> list[str]:
    return [f"step_{s}" for s in steps]


def rewrite(run: Path, change) -> None:
    """Edit `run`'s results.json in place with `change(results)`."""
    results = results_of(run)
    change(results)
    results_file(run).write_text(json.dumps(results))


def means(row: dict, metric: str) -> dict[str, float]:
    return {L: c["mean"] for L, c in row[metric].items()}


# (the runs as (mode, seed, evaluated steps), --last, the steps every run averages, {run index: steps it leaves out})
SHARED = [
    # the explorer's: hf_last 2 against hf_last 1; each run's own last checkpoints mixed step 3 into one row only
    ([("full", 0, [3, 4]), ("anchor", 0, [4])], None, [4], {0: [3]}),
    # hf_every 2 (steps 2, 4) against hf_every 1 (3, 4), two seeds in one row
    ([("full", 0, [2, 4]), ("full", 1, [3, 4]), ("anchor", 0, [3, 4])], None, [4], {0: [2], 1: [3], 2: [3]}),
    # seven evaluated against three: the default's five would take steps 80 and 90 of the first alone
    ([("full", 0, STEPS), ("anchor", 0, STEPS[-3:])], None, STEPS[-3:], {0: STEPS[-5:-3]}),
    # --last 2 within what both share: the runs' own last two, nothing to say
    ([("full", 0, STEPS), ("anchor", 0, STEPS[-3:])], 2, STEPS[-2:], {}),
    # --last 3 that each run evaluated, of which they share two
    ([("full", 0, [2, 4, 6]), ("anchor", 0, [3, 4, 6])], 3, [4, 6], {0: [2], 1: [3]}),
]


@pytest.mark.parametrize("runs, last, shared, left", SHARED)
def test_every_run_is_averaged_over_the_steps_all_of_them_evaluated(tmp_path, runs, last, shared, left):
    paths = [
        fake_evaluated(tmp_path, f"{mode}_{seed}_{i}", mode, seed=seed, steps=steps, shift=5 * (mode == "anchor"))
        for i, (mode, seed, steps) in enumerate(runs)
    ]
    report = compare([read_evaluated(p) for p in paths], last)
    ckpts = names(shared)
    assert report["checkpoints"] == ckpts
    by_path = {r["path"]: (row, r) for row in report["rows"] for r in row["runs"]}
    per_run = {}
    for p in paths:
        row, run = by_path[str(p)]
        assert run["checkpoints"] == ckpts
        per_run[p] = loop_average(results_of(p), ckpts)
    # the cells and the differences against the loop over the same steps of every run
    full, anchor = report["rows"]
    for metric, i in (("ruler", 0), ("perplexity", 1)):
        expected = {}
        for row in (full, anchor):
            values = [per_run[Path(r["path"])][i] for r in row["runs"]]
            expected[row["label"]] = {L: sum(v[L] for v in values) / len(values) for L in values[0]}
            assert means(row, metric) == pytest.approx(expected[row["label"]])
        differences = {L: d["difference"] for L, d in anchor["vs_reference"][metric].items()}
        assert differences == pytest.approx({L: expected["anchor"][L] - expected["full"][L] for L in differences})
    if not left:
        assert report["warnings"] == []
        return
    asked = f" ({len(shared)} of the --last {last} asked)" if last is not None and len(shared) < last else ""
    plural = "checkpoint" if len(shared) == 1 else "checkpoints"
    not_averaged = "; ".join(f"{paths[i]}: {', '.join(names(steps))}" for i, steps in left.items())
    warning = (
        f"warning: every run averaged over {', '.join(ckpts)}{asked}, the latest {plural} all the runs evaluated, so "
        f"that the rows compare the same training steps; not averaged: {not_averaged}"
    )
    assert report["warnings"] == [warning]
    md = markdown(report)
    assert f"**{warning}**" in md.split("## ")[0] and "| checkpoints averaged |" not in md


def test_runs_that_share_no_step_are_each_averaged_over_their_own_and_the_tables_say_which(tmp_path):
    full = fake_evaluated(tmp_path, "full", "full", steps=[3, 4])
    anchor = fake_evaluated(tmp_path, "anchor", "anchor", steps=[5, 6], shift=5)
    for last, own in ((None, ([3, 4], [5, 6])), (1, ([4], [6]))):
        report = compare([read_evaluated(full), read_evaluated(anchor)], last)
        assert report["checkpoints"] is None
        each = "; ".join(f"{p}: {', '.join(names(steps))}" for p, steps in zip((full, anchor), own))
        assert report["warnings"] == [
            f"warning: the runs share no evaluated checkpoint, so each is averaged over its own latest ({each}): the "
            f"rows' differences mix training steps with what the rows compare; evaluate the same steps of every run"
        ]
        for row, run, steps in zip(report["rows"], (full, anchor), own):
            assert row["runs"][0]["checkpoints"] == names(steps)
            ruler, ppl = loop_average(results_of(run), names(steps))
            assert means(row, "ruler") == pytest.approx(ruler) and means(row, "perplexity") == pytest.approx(ppl)
    # the tables name each row's checkpoints, beside the labels that name the steps trained
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["report", str(full), str(anchor), "--out", str(out)], env={"COLUMNS": "300"})
    assert result.exit_code == 0, result.output
    md = (out / "report.md").read_text()
    assert md.split("## ")[0].count("**warning: the runs share no evaluated checkpoint") == 1
    heads = " | ".join(f"{L // 1024}K" for L in LENGTHS)
    assert f"| row | seeds | tokens per run | checkpoints averaged | {heads} |" in md
    assert "| full (train.steps=4) | 1 | " in md and "| step_3, step_4 | " in md
    assert f"| row | checkpoints averaged | {heads} |" in md and "| anchor (train.steps=6) | step_5, step_6 | " in md


def test_last_beyond_what_a_run_evaluated_is_refused(tmp_path):
    three = fake_evaluated(tmp_path, "three", "full", steps=[2, 3, 4])
    two = fake_evaluated(tmp_path, "two", "anchor", steps=[3, 4])
    with pytest.raises(UserError) as e:
        compare([read_evaluated(three), read_evaluated(two)], 3)
    assert str(e.value) == (
        f"{two}: --last 3 asks for more checkpoints than the 2 evaluated (step_3, step_4); use --last 2 or evaluate "
        f"more checkpoints"
    )
    # by default a run of fewer than five averages all the shared ones, without a word
    assert compare([read_evaluated(three), read_evaluated(two)])["warnings"][0].startswith(
        "warning: every run averaged over step_3, step_4, the latest checkpoints all the runs evaluated"
    )


FP_A, FP_B = "a" * 64, "b" * 64


def scored_on(run: Path, data: str, fingerprint: str | None) -> Path:
    """`run`'s results as `lctrain eval` records perplexity on the held-out dataset `data` (`--ppl-data`)."""
    rewrite(run, lambda r: r["perplexity"].update(data=data, data_fingerprint=fingerprint))
    return run


def test_perplexity_on_other_held_out_text_is_warned_naming_the_datasets(tmp_path):
    full = scored_on(fake_evaluated(tmp_path, "full", "full"), "/data/a", FP_A)
    anchor = scored_on(fake_evaluated(tmp_path, "anchor", "anchor"), "other/b", FP_B)
    report = compare([read_evaluated(full), read_evaluated(anchor)])
    warning = (
        f"warning: perplexity scored on 2 different held-out datasets (data fingerprints aaaaaaaaaaaa (/data/a): "
        f"{full}; bbbbbbbbbbbb (other/b): {anchor}): its columns compare other text as well as the runs; score every "
        f"run on one dataset: lctrain eval RUN --ppl-data DIR"
    )
    assert report["warnings"] == [warning]
    assert f"**{warning}**" in markdown(report).split("## ")[0]
    # the same window rows of another dataset are other text
    assert report["data_notes"] == [
        "perplexity: the rows scored different held-out windows: their differences mix text with attention mode"
    ]
    assert [r["perplexity_data"] for row in report["rows"] for r in row["runs"]] == ["/data/a", "other/b"]


def test_one_held_out_dataset_or_none_to_compare_is_not_warned(tmp_path):
    full = scored_on(fake_evaluated(tmp_path, "full", "full"), "/work/prepared/a", FP_A)
    # the same dataset named from another directory: its fingerprint, not its path, tells
    same = scored_on(fake_evaluated(tmp_path, "same", "anchor"), "prepared/a", FP_A)
    # results from before the fingerprint was recorded, and results without perplexity per length
    older = scored_on(fake_evaluated(tmp_path, "older", "intra_doc"), "/data/b", None)
    unscored = scored_on(fake_evaluated(tmp_path, "unscored", "intra_doc_reset"), "/data/c", "c" * 64)
    rewrite(unscored, lambda r: r["perplexity"].update(per_length={}))
    for runs in ((full, same), (full, older), (full, unscored)):
        assert compare([read_evaluated(p) for p in runs])["warnings"] == [], runs
    # nor are other windows noted where the text is the same: one dataset, or one not recorded (the rows alone)
    for runs in ((full, same), (full, older)):
        assert compare([read_evaluated(p) for p in runs])["data_notes"] == [], runs


def resumed_after_evaluation(run: Path, steps: int, exported: list[int]) -> None:
    """What `lctrain resume RUN --set train.steps=STEPS` leaves after the evaluation: config.yaml rewritten with the
    new train.steps, the exports of the new steps beside the scored ones."""
    rd = RunDir(run)
    rd.write_config(load_config(str(rd.config_file), [f"train.steps={steps}"]))
    for step in exported:
        rd.export(step).mkdir(parents=True)


def test_rows_are_labelled_by_the_settings_the_results_were_scored_with(tmp_path):
    done = {"steps": 4, "train_steps": 4, "finished": True}
    full = fake_evaluated(tmp_path, "full", "full", steps=[3, 4], training=done)
    intra = fake_evaluated(tmp_path, "intra", "intra_doc", steps=[3, 4], training=done)
    resumed_after_evaluation(intra, 6, [5, 6])
    assert RunDir(intra).read_config().train.steps == 6
    report = compare([read_evaluated(full), read_evaluated(intra)])
    # both scored runs trained 4 steps: no train.steps in the labels, no claimed difference
    assert [row["label"] for row in report["rows"]] == ["full", "intra_doc"]
    assert report["other_differences"] == [] and "rows also differ in: " not in markdown(report)
    assert [(r["steps"], r["train_steps"], r["finished"]) for r in report["rows"][1]["runs"]] == [(4, 4, True)]
    # what the resume added is said, as before
    assert report["warnings"] == [
        f"warning: {intra}: hf/step_5, hf/step_6 not scored by {results_file(intra)} (exported since the evaluation, "
        f"or left out of it), yet a seed of row intra_doc: evaluate again (lctrain eval {intra}), or leave it out"
    ]
    # results that record no training (older ones) are labelled by config.yaml, the only record there is
    rewrite(intra, lambda r: r.pop("training"))
    report = compare([read_evaluated(full), read_evaluated(intra)])
    assert [row["label"] for row in report["rows"]] == ["full (train.steps=4)", "intra_doc (train.steps=6)"]


def test_a_damaged_training_record_is_one_line(tmp_path):
    run = fake_evaluated(tmp_path, "run", "anchor", training={"steps": 4, "train_steps": 0, "finished": True})
    with pytest.raises(UserError) as e:
        read_evaluated(run)
    assert (
        str(e.value) == f"{results_file(run)}: its training record is damaged (train_steps 0); run `lctrain eval` again"
    )
