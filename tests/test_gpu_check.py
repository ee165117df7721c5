"""devtools/gpu_check without a GPU: stage selection, the merged report, test-result judging, time limits that keep
partial benchmark results, and the loss comparison of the kill-and-resume check."""

import json
import sys
import time
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import pytest

import devtools.gpu_check.cli as gpu_check_cli
from devtools.gpu_check.cli import main
from devtools.gpu_check.junit import junit_summary
from devtools.gpu_check.report import merge_report, render_markdown
from devtools.gpu_check.result import STAGES, StageResult
from devtools.gpu_check.runner import Runner
from devtools.gpu_check.stages import STAGE_FNS, run_stage, select_stages
from devtools.gpu_check.stages.benchmarks import run_bench
from devtools.gpu_check.stages.end_to_end import compare_losses, read_losses
from devtools.gpu_check.stages.experiment import stage_experiment, training_seconds
from devtools.gpu_check.stages.gpu_tests import judge_tests
from lctrain.reports.compare import spread


def test_stage_selection():
    assert select_stages([]) == select_stages(["all"]) == list(STAGES)
    # the order given is the priority under --total-limit: a stage named first is not starved by a later one
    assert select_stages(["peer_tuned", "attention", "install", "peer_tuned"]) == ["install", "peer_tuned", "attention"]
    assert select_stages(["cli", "tests"]) == ["cli", "tests"]
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


@pytest.mark.slow  # 3-7 s in CI: slow-marked to keep `make test` under its 5 minutes
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


def test_a_total_limit_shares_its_time_and_skips_what_no_longer_fits(tmp_path, monkeypatch, capsys):
    """One device call: each stage gets what is left of --total-limit; a stage left with too little is skipped, and a
    skip never replaces an earlier invocation's result."""
    limits = {}

    def stage(run, args):
        limits[run.result.stage] = run.limit
        time.sleep(0.3 if run.result.stage == "tests" else max(run.remaining(), 0))  # the second uses all it has

    monkeypatch.setattr(gpu_check_cli, "MIN_STAGE_S", 0.2)
    for name in ("tests", "attention", "train"):
        monkeypatch.setitem(STAGE_FNS, name, stage)
    assert main(["--out", str(tmp_path), "--stage-limit", "0.3", "train"]) == 0  # an earlier invocation
    assert main(["--out", str(tmp_path), "--total-limit", "1.5", "tests", "attention", "train"]) == 1
    assert limits["tests"] == pytest.approx(1.5, abs=0.05) and 0.2 <= limits["attention"] <= 1.5 - 0.3
    assert "[gpu_check] train: skipped in 0 s" in capsys.readouterr().out
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert {s: r["status"] for s, r in report["stages"].items()} == dict.fromkeys(
        ("tests", "attention", "train"), "passed"
    )
    assert main(["--out", str(tmp_path / "fresh"), "--total-limit", "0.1", "train"]) == 1
    fresh = json.loads((tmp_path / "fresh" / "gpu_check.json").read_text())["stages"]["train"]
    assert fresh["status"] == "skipped" and fresh["notes"] == ["skipped: 0 s left of --total-limit 0"]


def test_train_stage_rows_and_issue_20_targets():
    from devtools.gpu_check.stages.benchmarks import TARGETS, TRAIN_CHECKPOINTING, train_rows

    assert TRAIN_CHECKPOINTING == ("full", "selective")
    assert TARGETS["full_mfu"] == 0.45 and TARGETS["anchor_mfu"] == 0.40
    result = StageResult("train")
    rows = [
        {
            "mode": "full",
            "engine": "sdpa",
            "step_s": 4.0,
            "tokens_per_s": 1.0,
            "mfu": 0.46,
            "mfu_full_square": 0.9,
            "hfu": 0.6,
        },
        {
            "mode": "anchor",
            "engine": "varlen",
            "step_s": 1.0,
            "tokens_per_s": 4.0,
            "mfu": 0.3,
            "mfu_full_square": 0.5,
            "hfu": 0.4,
        },
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


def _stage_with(monkeypatch, stage_fn, data_by_name: dict, **args):
    """Run a benchmark stage on canned JSON (by output name) in place of its scripts; returns its result and the
    scripts' arguments."""
    from devtools.gpu_check.stages import benchmarks

    calls = []

    def fake(run, script, options, name=None):
        calls.append((name or script, options))
        return data_by_name.get(name or script)

    monkeypatch.setattr(benchmarks, "run_script", fake)
    result = StageResult("stage")
    stage_fn(SimpleNamespace(result=result, remaining=lambda: 500.0), SimpleNamespace(**args))
    return result, calls


def test_peer_stage_rows_and_torchtitan_targets(monkeypatch):
    from devtools.gpu_check.stages.benchmarks import stage_peer

    def ratio(mode, name, ours, theirs):
        return dict(
            seq_len=65536,
            mode=mode,
            peer=name,
            lctrain_tokens_per_s=ours,
            peer_tokens_per_s=theirs,
            ratio=ours / theirs,
            runs=2,
        )

    ratios = [ratio("full", "torchtitan", 10.0, 10.5), ratio("document", "torchtitan", 30.0, 20.0)]
    ratios.append(ratio("document", "transformers", 30.0, 3.0))
    rows = [dict(peer="transformers", seq_len=65536, mode="full", error="exit 1: out of memory")]
    data = {"bench_peer_64k": {"rows": rows, "ratios": ratios}}
    result, calls = _stage_with(monkeypatch, partial(stage_peer, length=65536), data, peer_rounds=2)
    assert calls[0][1][:4] == ["--lengths", "65536", "--rounds", "2"]
    assert result.columns[:3] == ["L", "mode", "peer"] and len(result.rows) == 3
    assert result.rows[1][5] == 1.5
    met = {t["name"]: t["met"] for t in result.targets}
    assert met == {
        "lctrain / torchtitan tokens/s, full at 64K": False,  # goal: no slower
        "lctrain / torchtitan tokens/s, document at 64K": True,  # goal: >= 1.2x
    }
    assert result.notes == ["transformers L=65536 full: exit 1: out of memory"]

    data = {"bench_peer_64k_tuned": {"rows": [], "ratios": ratios[:2]}}
    result, calls = _stage_with(monkeypatch, partial(stage_peer, length=65536, tuned=True), data, peer_rounds=1)
    options = calls[0][1]
    assert options[options.index("--peers") + 1 : options.index("--peers") + 3] == ["lctrain", "torchtitan"]
    assert "--titan-compile" in options and options[options.index("--checkpointing") + 1] == "selective"
    assert [t["name"] for t in result.targets] == [
        "lctrain / torchtitan tokens/s, full at 64K, each tuned",
        "lctrain / torchtitan tokens/s, document at 64K, each tuned",
    ]
    # the options bench_peer gets on the GPU pass its own checks (the lctrain items against lctrain's config)
    from lctrain.bench.peer import parse_args

    parsed = parse_args(["--device", "cuda", *options[: options.index("--timeout")]])
    assert (parsed.checkpointing, parsed.lctrain_set, parsed.titan_compile) == (
        "selective",
        ["model.fused_kernels=liger"],
        True,
    )


def test_fused_stage_compares_each_variant_with_none(monkeypatch):
    from devtools.gpu_check.stages.benchmarks import FUSED_VARIANTS, stage_fused

    def results(full_s, anchor_s):
        return {
            "results": [
                dict(
                    mode="full", engine="sdpa", step_s=full_s, tokens_per_s=1.0, mfu=0.3, mfu_full_square=0.5, hfu=0.4
                ),
                dict(
                    mode="anchor",
                    engine="varlen",
                    step_s=anchor_s,
                    tokens_per_s=1.0,
                    mfu=0.2,
                    mfu_full_square=0.4,
                    hfu=0.25,
                ),
            ]
        }

    data = {"bench_train_fused_none": results(4.0, 2.0), "bench_train_fused_compile": results(3.0, 1.0)}
    data["bench_train_fused_compile"]["results"][1]["kernels"] = [
        {"name": "flash_fwd", "count": 16, "total_ms": 400.0, "share": 0.4},
        {"name": "nvjet_gemm", "count": 96, "total_ms": 250.0, "share": 0.25},
    ]
    result, calls = _stage_with(monkeypatch, stage_fused, data, train_seq_len=65536)
    assert [name for name, _ in calls] == [f"bench_train_fused_{v}" for v in FUSED_VARIANTS]
    assert "--fused-kernels" not in calls[0][1] and calls[1][1][-3:] == [
        "--fused-kernels",
        "liger",
        "--fused-optimizer",
    ]
    assert result.columns[0] == "fused kernels" and [row[:2] for row in result.rows][2] == ["compile", "full"]
    assert all(options[options.index("--profile") + 1] == "8" for _, options in calls)
    assert result.notes == [
        "compile / none step time, full: 0.750",
        "compile / none step time, anchor: 0.500",
        "compile, anchor: kernels by self time: flash_fwd 40.0%, nvjet_gemm 25.0%",
    ]


def test_memory_stage_rows_keep_the_out_of_memory_length(monkeypatch):
    from devtools.gpu_check.stages.benchmarks import stage_memory

    ok = dict(
        seq_len=131072,
        oom=False,
        step_s=9.0,
        tokens_per_s=1.0,
        max_allocated_gb=70.0,
        predicted_device_gb=73.5,
        device_predicted_over_allocated=1.05,
        host_peak_rss_gb=100.0,
        predicted_host_gb=110.0,
    )
    data = {"bench_memory": {"layers": 32, "results": [ok, dict(seq_len=262144, oom=True)]}}
    result, _ = _stage_with(monkeypatch, stage_memory, data, memory_steps=2)
    assert result.rows[1][:3] == [262144, "out of memory", None] and result.rows[0][1] == 9.0
    assert [t["met"] for t in result.targets] == [True, True]  # 5% off the plan; 128K trained


def drift_json(d_logit_grows: bool) -> dict:
    """A rope_drift.json as `diagnose rope` writes it, cut to what the stage reads: shifts (0, 16, 2000)."""

    def case(d, share, ratio, logits, seconds):
        return {"D": d, "first_token_share": share, "first_token_vs_others": ratio, "D_logit": logits}, seconds

    cases = {
        "fp32": case([0.01, 0.0, 0.02], 0.02, 3.0, [0.001, 0.002], 30.0),
        "bf16": case([20.0, 0.0, 25.0], 0.2, 40.0, [30.0, 45.0 if d_logit_grows else 20.0], 10.0),
        "random": case([2.0, 0.0, 2.1], 0.01, 2.0, [5.0, 4.0], 11.0),
    }
    return {
        "shifts": [0, 16, 2000],
        "delta2": 16,
        "samples": 50,
        "seq_len": 4096,
        "logit_lengths": [64, 8192],
        "cases": {k: v for k, (v, _) in cases.items()},
        "timing": {k: {"seconds": s} for k, (_, s) in cases.items()},
    }


@pytest.mark.parametrize("d_logit_grows", [True, False])
def test_rope_real_stage_runs_the_papers_setting_on_the_example_model(tmp_path, monkeypatch, d_logit_grows):
    ran = []

    def fake_run(self, cmd, cwd=None, check=True):
        ran.append(cmd[cmd.index("lctrain.cli") + 1 :])
        if "diagnose" in cmd:
            out = Path(cmd[cmd.index("--out") + 1])
            (out / "rope_drift.json").write_text(json.dumps(drift_json(d_logit_grows)))
        return 0

    monkeypatch.setattr(Runner, "run", fake_run)
    (tmp_path / "rope_real").mkdir()
    result = run_stage("rope_real", SimpleNamespace(stage_limit=10, rope_real_samples=50), tmp_path)
    assert result.status == "passed", result.notes
    work = tmp_path / "rope_real"
    assert ran[0] == ["example-model", str(work / "smollm2")]
    assert ran[1] == ["example-text", str(work / "code.jsonl"), "--kinds", "code"]
    diagnose = ran[2]
    assert diagnose[:3] == ["diagnose", "rope", str(work / "smollm2")]
    options = dict(zip(diagnose, diagnose[1:]))  # each option with the word after it
    assert options["--samples"] == "50" and options["--seq-len"] == "4096" and options["--max-len"] == "8192"
    assert options["--device"] == "cuda" and options["--text"] == str(work / "code.jsonl")
    assert "--vary-delta2" in diagnose and "--shifts" not in diagnose  # the paper's 19 shifts, the default
    assert [row[0] for row in result.rows] == ["fp32", "bf16", "random"]
    assert result.rows[1][1:] == [20.0, 25.0, 0.2, 40.0, 45.0 if d_logit_grows else 20.0, 10.0]
    met = {t["name"].split(" (")[0]: (t["value"], t["met"]) for t in result.targets}
    assert met == {
        "bf16 D / fp32 D at Δ1=0": (2000.0, True),
        "bf16 D / random-init D at Δ1=0": (10.0, True),
        "bf16 D(Δ1=2000) / D(Δ1=0)": (1.25, True),
        "bf16 first token / mean other token in D(0)": (40.0, True),
        "bf16 D_logit(T=8192) / D_logit(T=64)": (1.5, True) if d_logit_grows else (0.667, False),
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
    runner = SimpleNamespace(result=result, run=fake_run, log=tmp_path / "experiment.log", remaining=lambda: 3600.0)
    stage_experiment(runner, args)
    (cmd,) = commands
    assert cmd[cmd.index("--device") + 1] == "cuda" and cmd[cmd.index("--train-seconds") + 1] == "45.0"
    assert "eval.tasks=[niah_single_1,niah_multikey_1]" in cmd and "eval.samples_per_task=3" in cmd
    assert result.columns == ["row", "seeds", "tokens per run", "RULER 8192", "ppl 8192", "ppl 32768"]
    assert result.rows == [
        ["full", 2, 2_621_440, "55 ± 7.07", "3.25 ± 0.354", "4.25 ± 0.354"],
        ["anchor", 2, 2_621_440, "70 ± 0", "2.5 ± 0", "3.5 ± 0"],
    ]
    assert result.data["steps"] == 20 and result.status == "passed"


def test_the_experiment_trains_for_what_the_stage_has_left():
    """The H200 run of 2026-11-26 stopped at its limit: 332 s left after rope_real, 30 s of training asked. The
    stage now sizes training from the time left, and refuses at once what cannot fit."""
    args = SimpleNamespace(
        experiment_train_seconds=45.0,
        experiment_seeds=1,
        experiment_checkpoints=3,
        experiment_tasks="niah_single_1,niah_multikey_1",
        experiment_samples=3,
    )
    assert training_seconds(args, 570.0) == 45.0  # a call of its own
    alone = 60 + 15 + 3 * (50 + 54)
    assert training_seconds(args, alone + 3 * 20) == pytest.approx(20.0)
    with pytest.raises(ValueError, match="needs about 417 s .* has 332 s: run it in a call of its own"):
        training_seconds(args, 332.0)
    with pytest.raises(ValueError, match="6 runs"):
        training_seconds(SimpleNamespace(**{**vars(args), "experiment_seeds": 2}), 570.0)
