"""devtools/gpu_check without a GPU: stage selection, the merged report, test-result judging, time limits that keep
partial benchmark results, and the loss comparison of the kill-and-resume check."""

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from devtools.gpu_check.cli import main
from devtools.gpu_check.junit import junit_summary
from devtools.gpu_check.report import merge_report, render_markdown
from devtools.gpu_check.result import STAGES, StageResult
from devtools.gpu_check.runner import Runner
from devtools.gpu_check.stages import STAGE_FNS, run_stage, select_stages
from devtools.gpu_check.stages.benchmarks import run_bench
from devtools.gpu_check.stages.end_to_end import compare_losses, read_losses
from devtools.gpu_check.stages.experiment import stage_experiment
from devtools.gpu_check.stages.gpu_tests import judge_tests
from lctrain.reports.compare import spread


def test_stage_selection():
    assert select_stages([]) == select_stages(["all"]) == list(STAGES)
    assert select_stages(["cli", "tests"]) == ["tests", "cli"]  # canonical order, whatever the order given
    with pytest.raises(SystemExit, match="unknown stage bench"):
        select_stages(["tests", "bench"])


def test_report_merges_stages_across_invocations(tmp_path):
    path = tmp_path / "gpu_check.json"
    first = StageResult("tests", seconds=12.0, columns=["result", "count"], rows=[["passed", 24]])
    merge_report(path, [first], {"gpu": "H100", "torch": "2.11"})
    train = StageResult(
        "train", seconds=99.0, targets=[dict(name="anchor step / full step", value=0.62, goal="<= 0.5", met=False)]
    )
    train.fail("slow")
    report = merge_report(path, [train, StageResult("install")], {"date": "today"})
    assert list(report["stages"]) == ["install", "tests", "train"]  # stage order, the earlier result kept
    assert report["meta"] == {"gpu": "H100", "torch": "2.11", "date": "today"}
    assert json.loads(path.read_text()) == report
    rerun = StageResult("tests", status="failed", seconds=5.0)
    report = merge_report(path, [rerun], {})
    assert report["stages"]["tests"]["status"] == "failed"  # the newest result of a stage replaces the older
    md = render_markdown(report)
    assert "| train | failed | 99 |" in md and "| anchor step / full step | 0.62 | <= 0.5 | NO |" in md
    assert "- slow" in md


JUNIT = "\n".join(
    [
        '<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" tests="4">',
        '<testcase classname="tests.test_a" name="test_ok" time="0.1"/>',
        '<testcase classname="tests.test_a" name="test_bad" time="0.1">'
        '<failure message="assert 1 == 2">trace</failure></testcase>',
        '<testcase classname="tests.test_a" name="test_fa" time="0">'
        '<skipped message="optional package flash-attn not installed"/></testcase>',
        '<testcase classname="tests.test_a" name="test_cuda" time="0"><skipped message="needs CUDA"/></testcase>',
        "</testsuite></testsuites>",
    ]
)


def test_judging_gpu_test_results(tmp_path):
    xml = tmp_path / "t.xml"
    xml.write_text(JUNIT)
    s = junit_summary(xml)
    assert s["passed"] == 1 and [f["test"] for f in s["failed"]] == ["tests.test_a::test_bad"]
    r = StageResult("tests")
    judge_tests(r, s)
    assert r.status == "failed"
    assert any("test_bad: assert 1 == 2" in n for n in r.notes)
    assert any(n.startswith("skipped on a GPU tests.test_a::test_cuda") for n in r.notes)  # not an excuse on a GPU
    assert any(n.startswith("skipped tests.test_a::test_fa") for n in r.notes)  # an optional package is
    ok = StageResult("tests")
    judge_tests(ok, {"passed": 3, "failed": [], "skipped": [{"test": "x", "reason": "optional package y"}]})
    assert ok.status == "passed"
    none = StageResult("tests")
    judge_tests(none, {"passed": 0, "failed": [], "skipped": []})
    assert none.status == "failed"


def test_a_timed_out_benchmark_keeps_its_rows_and_kills_its_processes(tmp_path):
    out = tmp_path / "bench.json"
    r = StageResult("attention")
    runner = Runner(r, tmp_path, limit=3.0)
    # writes one row, then a child process that would outlive a plain kill of its parent
    script = (
        f"import json, subprocess, sys, time; open({str(out)!r}, 'w').write(json.dumps({{'rows': [1]}}));"
        f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"
    )
    data = run_bench(runner, [sys.executable, "-c", script], out)
    assert data == {"rows": [1]}
    assert r.status == "failed" and "time limit (3 s)" in r.notes[0]
    assert runner.remaining() > -5  # returned at the limit, not after the sleeps


def test_a_stage_that_breaks_is_reported_and_the_next_one_runs(tmp_path, monkeypatch):
    def broken(run, args):
        raise RuntimeError("exit code 1: lctrain prepare")

    monkeypatch.setitem(STAGE_FNS, "cli", broken)
    result = run_stage("cli", SimpleNamespace(stage_limit=10), tmp_path)
    assert result.status == "error" and result.notes == ["RuntimeError: exit code 1: lctrain prepare"]
    assert (tmp_path / "cli.log").is_file()


def test_loss_comparison_and_torn_metrics(tmp_path):
    rd = tmp_path / "run"
    rd.mkdir()
    (rd / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n{"step": 3, "lo')
    assert read_losses(rd) == {1: 2.0, 2: 1.5}
    assert read_losses(tmp_path / "missing") == {}
    c = compare_losses({1: 2.0, 2: 1.5, 3: 1.0}, {2: 1.5, 3: 1.01})
    assert c["steps"] == 2 and c["identical"] == 1 and c["max_rel_diff"] == pytest.approx(0.01)


def test_the_command_line_runs_the_chosen_stages_into_the_report(tmp_path, monkeypatch, capsys):
    def tests_stage(run, args):
        run.result.columns, run.result.rows = ["result", "count"], [["passed", 3]]

    monkeypatch.setitem(STAGE_FNS, "tests", tests_stage)
    monkeypatch.setitem(STAGE_FNS, "cli", lambda run, args: run.result.fail("resumed losses differ"))
    assert main(["--out", str(tmp_path), "cli", "tests"]) == 1  # a failed stage fails the check
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert list(report["stages"]) == ["tests", "cli"] and report["stages"]["cli"]["status"] == "failed"
    assert "torch" in report["meta"]
    md = (tmp_path / "gpu_check.md").read_text()
    assert "| tests | passed |" in md and "- resumed losses differ" in md and md in capsys.readouterr().out
    assert main(["--out", str(tmp_path), "tests"]) == 0


def test_train_stage_rows_and_issue_20_targets():
    from devtools.gpu_check.stages.benchmarks import TARGETS, TRAIN_CHECKPOINTING, train_rows

    assert TRAIN_CHECKPOINTING == ("full", "selective")
    assert TARGETS["full_mfu"] == 0.45 and TARGETS["anchor_mfu"] == 0.40
    result = SimpleNamespace(rows=[], targets=[])
    rows = [
        {"mode": "full", "engine": "sdpa", "step_s": 4.0, "tokens_per_s": 1.0, "mfu": 0.46, "mfu_full_square": 0.9},
        {"mode": "anchor", "engine": "varlen", "step_s": 1.0, "tokens_per_s": 4.0, "mfu": 0.3, "mfu_full_square": 0.5},
    ]
    train_rows(result, "selective", rows, 65536)
    assert [row[:2] for row in result.rows] == [["selective", "full"], ["selective", "anchor"]]
    assert result.rows[1][4] == 0.25
    met = {t["name"]: t["met"] for t in result.targets}
    assert met == {
        "anchor step / full step, 1B at 64K, selective checkpointing": True,
        "full-attention MFU (strict), 1B at 64K, selective checkpointing": True,
        "anchor-attention MFU (strict), 1B at 64K, selective checkpointing": False,
    }


def test_experiment_stage_sizes_the_driver_and_reports_its_table(tmp_path):
    """The stage asks `lctrain experiment extend` for CUDA, throughput sizing and the cut-down evaluation, then
    shows the report's rows: mean (± std over seeds) per metric and length, lengths as `lctrain report` lists them."""

    def row(mode, ruler, ppl):
        return {
            "label": mode,
            "seeds": len(ruler),
            "training_tokens": 2_621_440,
            "ruler": {"8192": spread(ruler)},
            "perplexity": {"8192": spread(ppl), "32768": spread([p + 1 for p in ppl])},
        }

    report = {
        "lengths": {"ruler": [8192], "perplexity": [8192, 32768]},
        "rows": [row("full", [50.0, 60.0], [3.0, 3.5]), row("anchor", [70.0, 70.0], [2.5, 2.5])],
    }
    commands = []

    def fake_run(cmd, cwd=None, check=True):
        commands.append(cmd)
        out = Path(cmd[cmd.index("--out") + 1])
        (out / "report").mkdir(parents=True)
        state = {"steps": 20, "tokens_per_run": 2_621_440, "sizing": {"tokens_per_s": 1e5}, "prepared": {}}
        (out / "experiment.json").write_text(json.dumps(state))
        (out / "report" / "report.json").write_text(json.dumps(report))
        return 0

    args = SimpleNamespace(
        work=str(tmp_path),
        experiment_train_seconds=45.0,
        experiment_seeds=2,
        experiment_checkpoints=3,
        experiment_tasks="niah_single_1,niah_multikey_1",
        experiment_samples=3,
    )
    result = StageResult("experiment")
    stage_experiment(SimpleNamespace(result=result, run=fake_run, log=tmp_path / "experiment.log"), args)
    (cmd,) = commands
    assert cmd[cmd.index("--device") + 1] == "cuda" and cmd[cmd.index("--train-seconds") + 1] == "45.0"
    assert "eval.tasks=[niah_single_1,niah_multikey_1]" in cmd and "eval.samples_per_task=3" in cmd
    assert result.columns == ["row", "seeds", "tokens per run", "RULER 8192", "ppl 8192", "ppl 32768"]
    assert result.rows == [
        ["full", 2, 2_621_440, "55 ± 7.07", "3.25 ± 0.354", "4.25 ± 0.354"],
        ["anchor", 2, 2_621_440, "70 ± 0", "2.5 ± 0", "3.5 ± 0"],
    ]
    assert result.data["steps"] == 20 and result.status == "passed"
