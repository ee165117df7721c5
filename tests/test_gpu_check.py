"""devtools/gpu_check.py without a GPU: stage selection, the merged report, test-result judging, time limits that
keep partial benchmark results, and the loss comparison of the kill-and-resume check."""

import json
import sys
from types import SimpleNamespace

import pytest


@pytest.fixture(scope="module")
def gc():
    from devtools import gpu_check

    return gpu_check


def test_stage_selection(gc):
    assert gc.select_stages([]) == gc.select_stages(["all"]) == list(gc.STAGES)
    assert gc.select_stages(["cli", "tests"]) == ["tests", "cli"]  # canonical order, whatever the order given
    with pytest.raises(SystemExit, match="unknown stage bench"):
        gc.select_stages(["tests", "bench"])


def test_report_merges_stages_across_invocations(gc, tmp_path):
    path = tmp_path / "gpu_check.json"
    first = gc.StageResult("tests", seconds=12.0, columns=["result", "count"], rows=[["passed", 24]])
    gc.merge_report(path, [first], {"gpu": "H100", "torch": "2.11"})
    train = gc.StageResult(
        "train", seconds=99.0, targets=[dict(name="anchor step / full step", value=0.62, goal="<= 0.5", met=False)]
    )
    train.fail("slow")
    report = gc.merge_report(path, [train, gc.StageResult("install")], {"date": "today"})
    assert list(report["stages"]) == ["install", "tests", "train"]  # stage order, the earlier result kept
    assert report["meta"] == {"gpu": "H100", "torch": "2.11", "date": "today"}
    assert json.loads(path.read_text()) == report
    rerun = gc.StageResult("tests", status="failed", seconds=5.0)
    report = gc.merge_report(path, [rerun], {})
    assert report["stages"]["tests"]["status"] == "failed"  # the newest result of a stage replaces the older
    md = gc.render_markdown(report)
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


def test_judging_gpu_test_results(gc, tmp_path):
    xml = tmp_path / "t.xml"
    xml.write_text(JUNIT)
    s = gc.junit_summary(xml)
    assert s["passed"] == 1 and [f["test"] for f in s["failed"]] == ["tests.test_a::test_bad"]
    r = gc.StageResult("tests")
    gc.judge_tests(r, s)
    assert r.status == "failed"
    assert any("test_bad: assert 1 == 2" in n for n in r.notes)
    assert any(n.startswith("skipped on a GPU tests.test_a::test_cuda") for n in r.notes)  # not an excuse on a GPU
    assert any(n.startswith("skipped tests.test_a::test_fa") for n in r.notes)  # an optional package is
    ok = gc.StageResult("tests")
    gc.judge_tests(ok, {"passed": 3, "failed": [], "skipped": [{"test": "x", "reason": "optional package y"}]})
    assert ok.status == "passed"
    none = gc.StageResult("tests")
    gc.judge_tests(none, {"passed": 0, "failed": [], "skipped": []})
    assert none.status == "failed"


def test_a_timed_out_benchmark_keeps_its_rows_and_kills_its_processes(gc, tmp_path):
    out = tmp_path / "bench.json"
    r = gc.StageResult("attention")
    runner = gc.Runner(r, tmp_path, limit=3.0)
    # writes one row, then a child process that would outlive a plain kill of its parent
    script = (
        f"import json, subprocess, sys, time; open({str(out)!r}, 'w').write(json.dumps({{'rows': [1]}}));"
        f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"
    )
    data = gc.run_bench(runner, [sys.executable, "-c", script], out)
    assert data == {"rows": [1]}
    assert r.status == "failed" and "time limit (3 s)" in r.notes[0]
    assert runner.remaining() > -5  # returned at the limit, not after the sleeps


def test_a_stage_that_breaks_is_reported_and_the_next_one_runs(gc, tmp_path, monkeypatch):
    def broken(run, args):
        raise RuntimeError("exit code 1: lctrain prepare")

    monkeypatch.setitem(gc.STAGE_FNS, "cli", broken)
    result = gc.run_stage("cli", SimpleNamespace(stage_limit=10), tmp_path)
    assert result.status == "error" and result.notes == ["RuntimeError: exit code 1: lctrain prepare"]
    assert (tmp_path / "cli.log").is_file()


def test_loss_comparison_and_torn_metrics(gc, tmp_path):
    rd = tmp_path / "run"
    rd.mkdir()
    (rd / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n{"step": 3, "lo')
    assert gc.read_losses(rd) == {1: 2.0, 2: 1.5}
    assert gc.read_losses(tmp_path / "missing") == {}
    c = gc.compare_losses({1: 2.0, 2: 1.5, 3: 1.0}, {2: 1.5, 3: 1.01})
    assert c["steps"] == 2 and c["identical"] == 1 and c["max_rel_diff"] == pytest.approx(0.01)
