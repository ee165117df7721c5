"""The held-out loss during training (`train.heldout_every`, lctrain/train/heldout.py).

Against `lctrain eval`'s perplexity of the same step's export (a Hugging Face model in one process, eager
attention, its own loop over the windows): equal in fp32 for a run that trains in anchor mode; logged at the steps
due and in their step lines; two launched ranks (data-parallel ZeRO-3 with an uneven share of windows, and Ulysses
sequence parallel) give the one-process number.
"""

import math
from pathlib import Path

import pytest
from train_helpers import TINY_ARCH, losses, metric_records, prepared_workdir, run_cli_train

from lctrain.config import load_config
from lctrain.data.store import open_packed
from lctrain.eval.perplexity import heldout_rows, perplexity
from lctrain.rundir import RunDir
from lctrain.train.heldout import replica_rows

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS = 4


def overrides(data_dir: Path, run_dir: Path) -> list[str]:
    return [
        "data.seq_len=128",
        "data.token_budget=6000",
        f"data.output_dir={data_dir}",
        f"train.run_dir={run_dir}",
        f"train.steps={STEPS}",
        "train.global_batch=2",
        "train.micro_batch=1",
        "train.warmup_steps=0",
        "train.lr=3e-3",
        "train.heldout_every=3",
        "eval.ppl_windows=3",
        "attention.mode=anchor",
        "model.dtype=float32",
        "checkpoint.hf_every=1",
        "checkpoint.hf_last=1",
        "logging.log_every=2",
        f"model.arch={TINY_ARCH}",
    ]


@pytest.mark.parametrize("n", range(1, 10))
@pytest.mark.parametrize("dp", [1, 2, 3, 4])
def test_each_window_counted_once_and_every_replica_as_many_passes(n, dp):
    rows = [10 * i + 7 for i in range(n)]
    shares = [replica_rows(rows, dp, d) for d in range(dp)]
    assert sorted(r for share in shares for r, counted in share if counted) == rows
    assert {len(share) for share in shares} == {-(-n // dp)}
    assert all(r in rows for share in shares for r, _ in share)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return prepared_workdir(tmp_path_factory, "heldout", overrides)


@pytest.fixture(scope="module")
def one_process(workdir):
    from lctrain.train.command import train

    return train(load_config(None, overrides(workdir / "data", workdir / "one")))


def eval_perplexity(run: Path) -> float:
    """`lctrain eval`'s held-out perplexity of the run's last export, by its own functions."""
    from transformers import AutoModelForCausalLM

    cfg = RunDir(run).read_config()
    packed = open_packed(workdir_data(run))
    rows, _ = heldout_rows(len(packed), cfg.windows_read(), cfg.seed, cfg.eval.ppl_windows)
    assert len(rows) == 3
    model = AutoModelForCausalLM.from_pretrained(RunDir(run).export(STEPS), attn_implementation="eager")
    return perplexity(model.eval(), packed, rows)


def workdir_data(run: Path) -> Path:
    return run.parent / "data"


@pytest.mark.slow  # trains, then loads the export (~6 s)
def test_the_logged_score_is_evals_perplexity_of_the_export(one_process):
    records = metric_records(one_process)
    assert [r["step"] for r in records if "heldout_loss" in r] == [3, 4]  # every 3 steps and the last
    last = records[-1]
    assert last["heldout_ppl"] == pytest.approx(math.exp(last["heldout_loss"]))
    assert 0 < last["heldout_time_s"] and "heldout_time_s" not in records[1]
    assert last["heldout_ppl"] == pytest.approx(eval_perplexity(one_process), rel=1e-5)
    assert records[2]["heldout_loss"] > last["heldout_loss"]  # the model learns at lr 3e-3


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout",
    [
        ["parallel.zero_stage=3"],  # 2 replicas, 3 windows: one scores a window again, uncounted
        ["parallel.sequence_parallel=2", "parallel.zero_stage=1"],
    ],
    ids=["dp2_zero3", "sp2"],
)
def test_two_ranks_score_what_one_process_does(workdir, one_process, layout):
    extra = ["parallel.nproc_per_node=2", "parallel.launcher=torchrun", *layout]
    run = run_cli_train(overrides, workdir, "_".join(layout).replace("=", "").replace(".", ""), extra)
    assert losses(run) == pytest.approx(losses(one_process), rel=1e-4)
    ranks = [r["heldout_loss"] for r in metric_records(run) if "heldout_loss" in r]
    alone = [r["heldout_loss"] for r in metric_records(one_process) if "heldout_loss" in r]
    assert ranks == pytest.approx(alone, rel=1e-4)


@pytest.mark.slow  # trains (~4 s)
def test_a_run_without_held_out_windows_says_so_and_logs_none(workdir, capsys):
    from lctrain.train.command import train

    run = workdir / "none_held"
    train(load_config(None, [*overrides(workdir / "data", run), "eval.ppl_windows=0", "train.steps=1"]))
    assert (
        "warning: train.heldout_every: no held-out window to score (eval.ppl_windows = 0, " in capsys.readouterr().err
    )
    assert ["heldout_loss" in r for r in metric_records(run)] == [False]
