"""`lctrain estimate --measure` (the paper's Figure 6 measured): real training runs per length and mode, their step
times read back from each run's metrics.jsonl by hand, the FLOP model's prediction beside them, no checkpoints
written, and bad options."""

import json
import statistics

import pytest
from eval_helpers import tiny_arch
from typer.testing import CliRunner

from lctrain.cli import app
from lctrain.config import load_config
from lctrain.reports.estimate import estimate
from lctrain.rundir import RunDir

TINY = tiny_arch(layers=1) + [
    "train.global_batch=2",
    "train.micro_batch=2",
]


def set_args(items):
    return [a for item in items for a in ("--set", item)]


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    work = tmp_path_factory.mktemp("fig6")
    result = CliRunner().invoke(
        app,
        [
            "estimate",
            "--measure",
            "--lengths",
            "128,256",
            "--modes",
            "full,anchor",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--tflops",
            "0.5",
            "--out",
            str(work),
        ]
        + set_args(TINY),
    )
    assert result.exit_code == 0, result.output
    return work, json.loads((work / "figure6.json").read_text())


def test_every_point_is_a_real_run_timed_from_its_metrics(measured):
    work, res = measured
    assert [(p["seq_len"], p["mode"]) for p in res["points"]] == [
        (128, "full"),
        (128, "anchor"),
        (256, "full"),
        (256, "anchor"),
    ]
    for p in res["points"]:
        run = work / f"{p['mode']}_{p['seq_len']}"
        records = [json.loads(line) for line in RunDir(run).metrics_file.read_text().splitlines()]
        assert [r["step"] for r in records] == [1, 2, 3]
        step_time = statistics.fmean(r["step_time_s"] for r in records[1:])
        tokens = 2 * p["seq_len"]
        assert p["tokens_per_step"] == tokens and p["steps_timed"] == 2
        assert p["days_per_1b_tokens"] == pytest.approx(1e9 * step_time / tokens / 86400)
        assert not RunDir(run).checkpoints.exists() and not RunDir(run).exports_dir.exists()
        assert p["ratio"] == pytest.approx(p["days_per_1b_tokens"] / p["predicted_days_per_1b_tokens"])
    assert (work / "figure6.png").stat().st_size > 0


def test_prediction_is_the_flop_model_on_the_data_each_point_trained_on(measured):
    work, res = measured
    for p in res["points"]:
        L = p["seq_len"]
        flop_model = estimate(
            load_config(
                None,
                TINY + [f"data.seq_len={L}", f"data.output_dir={work / f'data_{L}'}", f"data.token_budget={3 * 2 * L}"],
            ),
            tflops=0.5,
            gpus=1,
        )
        assert not flop_model["synthetic"]
        assert p["predicted_days_per_1b_tokens"] == pytest.approx(
            flop_model["modes"][p["mode"]]["hours_per_1b_tokens"] / 24
        )


@pytest.mark.parametrize(
    "args,message",
    [
        (["--steps", "0"], "at least 1 timed step"),
        (["--modes", "full,sparse"], "choose from"),
        (["--from-bench", "x.json"], "do not apply"),
        (["--lengths", "12q"], "is not a length"),
    ],
)
def test_bad_options_are_one_line(tmp_path, args, message):
    result = CliRunner().invoke(app, ["estimate", "--measure", "--out", str(tmp_path)] + args)
    assert result.exit_code == 2 and message in result.output
