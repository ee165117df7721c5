"""Results that are no longer the run's: `lctrain train --force` starts over owning nothing of the old run (its eval/
and tensorboard/ go with its checkpoints, a user's own files and symlinks stay), and `lctrain report` tells results
evaluated from other exports than the run now holds: exports written since (a warning naming them, the run marked),
an export written again (refused in one line), results from before the exports were recorded (nothing new said).

The references are the files on disk: the directory listings, and each export's export.json hashed here."""

import hashlib
import json
import shutil
from pathlib import Path

import pytest
from train_helpers import export_by_hand, one_error_line, prepared_workdir, set_args
from typer.testing import CliRunner

from lctrain.cli import app
from lctrain.config import load_config, write_resolved
from lctrain.eval.runner import evaluate, resolve_target
from lctrain.experiments.extend import evaluated_with
from lctrain.reports.compare import compare, markdown, read_evaluated
from lctrain.rundir import RunDir

TINY = [
    "model.arch.hidden_size=64",
    "model.arch.intermediate_size=128",
    "model.arch.num_hidden_layers=2",
    "model.arch.num_attention_heads=4",
    "model.arch.num_key_value_heads=2",
]
STEPS = (1, 2)  # the evaluated exports of a 2-step run


def record_digest(export: Path) -> str:
    """The reference: SHA-256 of the export's export.json, as JSON with sorted keys, from the file itself."""
    record = json.loads((export / "export.json").read_text())
    return hashlib.sha256(json.dumps(record, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def build_export(run: Path, step: int, seed: int) -> Path:
    """A tiny random model exported as `run`'s hf/step_`step`, its weights drawn with `seed`."""
    from lctrain.model import build_model
    from lctrain.tokenizer import load_tokenizer

    cfg = RunDir(run).read_config()
    cfg.seed = seed
    tok = load_tokenizer(cfg.data.tokenizer)
    return export_by_hand(build_model(cfg, vocab_size=len(tok)).model, tok, run, step)


@pytest.fixture(scope="module")
def evaluated_run(tmp_path_factory):
    """A 2-step run (config, prepared data, exports hf/step_1 and hf/step_2 of distinct weights) that `lctrain eval`
    scored: eval/results.json."""
    from lctrain.data.prepare import prepare

    root = tmp_path_factory.mktemp("stale")
    run = root / "run"
    cfg = load_config(
        None,
        TINY
        + [
            "data.seq_len=256",
            "data.token_budget=5120",
            f"data.output_dir={root / 'data'}",
            f"train.run_dir={run}",
            f"train.steps={STEPS[-1]}",
            "train.global_batch=4",
            "eval.ppl_windows=1",
        ],
    )
    prepare(cfg)
    write_resolved(cfg, run)
    for step in STEPS:
        build_export(run, step, seed=step)
    evaluate(resolve_target(run), lengths=[256], tasks=["vt"], samples=1)
    return run


@pytest.fixture
def run(evaluated_run, tmp_path):
    """A copy of the evaluated run, for a test to change."""
    copy = tmp_path / "run"
    shutil.copytree(evaluated_run, copy)
    return copy


def results_of(run: Path) -> dict:
    return json.loads((run / "eval" / "results.json").read_text())


def report_cli(run: Path, tmp_path: Path):
    return CliRunner().invoke(app, ["report", str(run), "--out", str(tmp_path / "report")], env={"COLUMNS": "300"})


# ------------------------------------------------------------ train --force


def test_clear_outputs_removes_eval_and_tensorboard_and_keeps_the_users_files(tmp_path):
    rd = RunDir(tmp_path / "run")
    rd.write_config(load_config(None))
    rd.export(2).mkdir(parents=True)
    (rd.eval_dir / "harness").mkdir(parents=True)
    for name in ("results.json", "predictions.jsonl", "ruler.png", "harness/harness.json"):
        (rd.eval_dir / name).write_text("old run")
    rd.tensorboard_dir.mkdir()
    (rd.tensorboard_dir / "events.out.tfevents.1.host.1.0").write_bytes(b"old run")
    (rd.path / "notes.md").write_text("mine")
    rd.clear_outputs()
    assert sorted(p.name for p in rd.path.iterdir()) == ["config.yaml", "notes.md"]
    assert (rd.path / "notes.md").read_text() == "mine"


def test_a_symlinked_eval_dir_is_kept_with_the_files_it_points_to(tmp_path):
    shared = tmp_path / "shared_results"
    shared.mkdir()
    (shared / "results.json").write_text("{}")
    rd = RunDir(tmp_path / "run")
    rd.write_config(load_config(None))
    rd.eval_dir.symlink_to(shared, target_is_directory=True)
    rd.clear_outputs()
    assert rd.eval_dir.is_symlink() and (shared / "results.json").read_text() == "{}"


def tiny_training(data_dir: Path, run_dir: Path) -> list[str]:
    return TINY + [
        "data.seq_len=128",
        "data.token_budget=6000",
        f"data.output_dir={data_dir}",
        f"train.run_dir={run_dir}",
        "train.steps=2",
        "train.global_batch=1",
        "train.micro_batch=1",
        "checkpoint.hf_every=1",
        "checkpoint.hf_last=1",
    ]


@pytest.mark.slow  # two trainings and an evaluation: over the 2 s of a default test
@pytest.mark.usefixtures("one_thread")
def test_train_force_leaves_no_eval_or_tensorboard_of_the_old_run(tmp_path_factory):
    pytest.importorskip("tensorboard")
    workdir = prepared_workdir(tmp_path_factory, "force", tiny_training)
    run = workdir / "run"
    settings = set_args(tiny_training(workdir / "data", run))
    first = CliRunner().invoke(app, ["train", *settings, "--set", "logging.tensorboard=true"])
    assert first.exit_code == 0, first.output
    assert any((run / "tensorboard").iterdir())
    evaluate(resolve_target(run), lengths=[256], tasks=["vt"], samples=1)
    assert (run / "eval" / "results.json").is_file()
    again = CliRunner().invoke(app, ["train", *settings, "--set", "train.lr=0.02", "--force"])
    assert again.exit_code == 0, again.output
    assert not (run / "eval").exists() and not (run / "tensorboard").exists()
    assert [p.name for p in RunDir(run).exports()] == ["step_2"]  # the new run's
    line = one_error_line(CliRunner().invoke(app, ["report", str(run)]))
    assert "not evaluated yet" in line


# ------------------------------------------------------------ results.json: which exports were scored


def test_results_record_the_digest_of_each_scored_export(evaluated_run):
    results = results_of(evaluated_run)
    assert results["checkpoints"] == [f"step_{s}" for s in STEPS]
    expected = {f"step_{s}": record_digest(evaluated_run / "hf" / f"step_{s}") for s in STEPS}
    assert results["export_records"] == expected
    assert len(set(expected.values())) == len(STEPS)  # distinct weights, distinct records


def test_a_current_evaluation_reports_with_no_warning(run, tmp_path):
    report = compare([read_evaluated(run)])
    assert report["warnings"] == []
    (row,) = report["rows"]
    assert row["not_evaluated"] == [] and row["runs"][0]["exports_not_evaluated"] == []
    result = report_cli(run, tmp_path)
    assert result.exit_code == 0, result.output
    assert "warning" not in result.output


# ------------------------------------------------------------ exports written since the evaluation


def test_an_extended_run_is_warned_naming_the_new_export_and_marked(run, tmp_path):
    # what `lctrain resume RUN --set train.steps=3` leaves: config.yaml at 3 steps, hf/step_3 written after the eval
    rd = RunDir(run)
    rd.write_config(rd.read_config(["train.steps=3"]))
    build_export(run, 3, seed=3)
    assert sorted(p.name for p in (run / "hf").iterdir()) == ["step_1", "step_2", "step_3"]
    report = compare([read_evaluated(run)])
    results = run / "eval" / "results.json"
    (row,) = report["rows"]
    assert report["warnings"] == [
        f"warning: {run}: hf/step_3 not scored by {results} (exported since the evaluation, or left out of it), yet "
        f"a seed of row {row['label']}: evaluate again (lctrain eval {run}), or leave it out"
    ]
    assert row["not_evaluated"] == [str(run)] and row["runs"][0]["exports_not_evaluated"] == ["step_3"]
    assert f"| {row['label']} | 1 (1 with exports not evaluated) |" in markdown(report)
    result = report_cli(run, tmp_path)
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[0] == report["warnings"][0]  # at the top, before the tables
    md = (tmp_path / "report" / "report.md").read_text()
    assert f"**{report['warnings'][0]}**" in md.split("## ")[0]


def test_an_export_gone_since_the_evaluation_is_warned(run):
    shutil.rmtree(run / "hf" / "step_1")
    report = compare([read_evaluated(run)])
    results = run / "eval" / "results.json"
    assert report["warnings"] == [
        f"warning: {run}: hf/step_1, scored by {results}, no longer there (deleted, or the run started over): those "
        f"scores cannot be checked against the run's exports"
    ]


# ------------------------------------------------------------ an export written again


def test_a_retrained_export_is_refused_naming_the_run_and_checkpoint(run, tmp_path):
    # hf/step_2 written again with other weights (train --force into the run, eval/ kept; or export --force)
    before = record_digest(run / "hf" / "step_2")
    shutil.rmtree(run / "hf" / "step_2")
    build_export(run, 2, seed=99)
    assert record_digest(run / "hf" / "step_2") != before == results_of(run)["export_records"]["step_2"]
    line = one_error_line(report_cli(run, tmp_path))
    assert line == (
        f"error: {run}: hf/step_2 is not the export {run / 'eval' / 'results.json'} scored (its export.json changed "
        f"since: trained again with --force, or exported again); evaluate it again: lctrain eval {run}"
    )
    assert not (tmp_path / "report").exists()
    # `lctrain experiment extend` agrees: the evaluation is not current, so its rerun evaluates the run again
    assert evaluated_with(RunDir(run), None) is None


def test_results_given_as_a_file_kept_elsewhere_are_checked_against_the_run(run, tmp_path):
    # eval/ moved aside, the run trained again (its exports rewritten): the kept results.json names the run
    kept = tmp_path / "kept" / "results.json"
    kept.parent.mkdir()
    results = results_of(run)
    results["target"] = str(run)
    kept.write_text(json.dumps(results))
    shutil.rmtree(run / "eval")
    shutil.rmtree(run / "hf" / "step_1")
    build_export(run, 1, seed=42)
    line = one_error_line(CliRunner().invoke(app, ["report", str(kept), "--out", str(tmp_path / "r")]))
    assert f"{run}: hf/step_1 is not the export {kept} scored" in line and "evaluate it again" in line


def test_an_export_without_a_record_when_scored_is_not_checked(run):
    results = results_of(run)
    results["export_records"]["step_2"] = None  # scored unchecked: `lctrain eval` warned of it then
    (run / "eval" / "results.json").write_text(json.dumps(results))
    shutil.rmtree(run / "hf" / "step_2")
    build_export(run, 2, seed=99)
    assert compare([read_evaluated(run)])["warnings"] == []


# ------------------------------------------------------------ results written before the record


def test_old_results_without_the_record_give_no_new_warning(run, tmp_path):
    results = results_of(run)
    del results["export_records"]
    (run / "eval" / "results.json").write_text(json.dumps(results))
    # an export written again, one deleted: nothing recorded to check them against, nothing said
    shutil.rmtree(run / "hf" / "step_2")
    build_export(run, 2, seed=99)
    shutil.rmtree(run / "hf" / "step_1")
    report = compare([read_evaluated(run)])
    assert report["warnings"] == [] and report["rows"][0]["not_evaluated"] == []
    result = report_cli(run, tmp_path)
    assert result.exit_code == 0 and "warning" not in result.output, result.output
