"""What a run prints: the plain step lines a log file gets (checked against metrics.jsonl), the start banner and the
end summary (checked against known values)."""

import gzip
import json
import logging
import re
import warnings
from collections import Counter
from pathlib import Path

import pytest
from train_helpers import TINY_ARCH, prepared_workdir
from transformers.utils import logging as hf_logging

from lctrain.config import load_config
from lctrain.model import ConfigChange
from lctrain.parallel.layout import ParallelLayout
from lctrain.rundir import RunDir
from lctrain.train.metrics import quiet_libraries
from lctrain.train.report import (
    PlannedMemory,
    RunEnd,
    RunStart,
    banner,
    duration,
    eta_seconds,
    step_line,
    summary,
)

STEPS, LOG_EVERY = 4, 2


def overrides(data_dir: Path, run_dir: Path) -> list[str]:
    return [
        "data.seq_len=128",
        "data.token_budget=12000",
        f"data.output_dir={data_dir}",
        f"train.run_dir={run_dir}",
        f"train.steps={STEPS}",
        "train.global_batch=2",
        "train.micro_batch=1",
        "train.warmup_steps=2",
        "checkpoint.every_steps=4",
        "checkpoint.hf_every=4",
        "checkpoint.hf_last=4",
        f"logging.log_every={LOG_EVERY}",
        "logging.profile.start=2",
        "logging.profile.steps=2",
        "logging.profile.memory=true",
        f"model.arch={TINY_ARCH}",
    ]


# An independent reading of the plain line: key=value pairs, numbers as printed.
LINE = re.compile(
    r"^step=(?P<step>\d+)/(?P<total>\d+) loss=(?P<loss>\S+) lr=(?P<lr>\S+) grad_norm=(?P<grad_norm>\S+) "
    r"tokens_per_s=(?P<tokens_per_s>\S+) mfu=(?P<mfu>\S+)% peak_mem_gb=(?P<peak_mem_gb>\S+) eta=(?P<eta>\S+)$"
)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, one_thread):
    """The tiny run trained in this process with stdout captured (not a terminal): (run dir, its stdout)."""
    from lctrain.train.command import train

    root = prepared_workdir(tmp_path_factory, "report", overrides)
    capture = pytest.MonkeyPatch()
    out = root / "stdout.txt"
    with open(out, "w") as f:
        capture.setattr("sys.stdout", f)
        try:
            run_dir = train(load_config(None, overrides(root / "data", root / "run")))
        finally:
            capture.undo()
    return Path(run_dir), out.read_text()


def test_a_log_file_gets_one_plain_line_per_log_every_with_the_metrics(trained):
    run_dir, out = trained
    records = {r["step"]: r for r in RunDir(run_dir).read_metrics()}
    assert sorted(records) == list(range(1, STEPS + 1))
    lines = [m.groupdict() for m in map(LINE.match, out.splitlines()) if m]
    assert [int(p["step"]) for p in lines] == list(range(LOG_EVERY, STEPS + 1, LOG_EVERY))
    assert "━" not in out  # no progress bar in a file
    for p in lines:
        r = records[int(p["step"])]
        assert int(p["total"]) == STEPS
        assert float(p["loss"]) == pytest.approx(r["loss"], abs=5e-5)
        assert float(p["lr"]) == pytest.approx(r["lr"], rel=1e-3)
        assert float(p["grad_norm"]) == pytest.approx(r["grad_norm"], abs=5e-5)
        assert float(p["tokens_per_s"]) == pytest.approx(r["tokens_per_s"], abs=0.5)
        assert float(p["mfu"]) == pytest.approx(100 * r["mfu"], abs=0.05)
        assert float(p["peak_mem_gb"]) == pytest.approx(r["peak_mem_gb"], abs=0.005)
    assert lines[-1]["eta"] == "0:00:00"


def test_the_run_prints_a_banner_and_a_summary_of_its_records(trained):
    run_dir, out = trained
    last = RunDir(run_dir).read_metrics()[-1]
    assert out.index("lctrain train tiny_anchor: 4 steps, from step 0") < out.index("step=2/4") < out.index("done:")
    assert "batch        2 x 128 = 256 tokens per step (micro-batch 1, 2 accumulation steps)" in out
    assert "rope_parameters.rope_theta: 10000.0 -> 1000000.0 (model.rope_theta)" in out
    # as the last step line prints it, while metrics.jsonl keeps every digit
    loss = f"{last['loss']:.4f}"
    assert f"final loss   {loss} at step 4 of 4" in out and f"step=4/4 loss={loss} " in out
    assert last["loss"] != float(loss)
    assert f"checkpoint   {run_dir / 'checkpoints' / 'step_4'}" in out
    assert f"hf exports   {run_dir / 'hf'}/ (step_4)" in out
    assert f"next         lctrain eval {run_dir}; lctrain plot {run_dir}" in out


def test_the_profiled_steps_leave_a_trace_a_table_and_a_log_line(trained):
    run_dir, out = trained
    where = run_dir / "profile" / "steps_2-3"
    assert sorted(p.name for p in where.iterdir()) == ["rank0.pt.trace.json.gz", "rank0.top.txt"]
    events = json.loads(gzip.decompress((where / "rank0.pt.trace.json.gz").read_bytes()))["traceEvents"]
    names = Counter(e.get("name") for e in events)
    # two steps of two micro-batches each: step 1 (the profiler's warm-up) and step 4 are not in it
    assert (names["lctrain.forward"], names["lctrain.backward"], names["lctrain.optimizer"]) == (4, 4, 4)
    assert names["[memory]"] > 0  # logging.profile.memory
    assert "aten::mm" in (where / "rank0.top.txt").read_text()
    assert [r["profiled"] for r in RunDir(run_dir).read_metrics()] == [True, True, True, False]  # step 1: warm-up
    line = next(li for li in out.splitlines() if li.startswith("profile of "))
    assert line.startswith(f"profile of 2-3: {where}/ (rank 0; Chrome traces for ui.perfetto.dev); most self time: ")
    assert out.index("step=2/4") < out.index(line) < out.index("step=4/4")  # after its last step's line


def test_step_line_formats_a_record():
    record = {
        "step": 30,
        "loss": 6.123456,
        "lr": 2e-5,
        "grad_norm": None,
        "tokens_per_s": 12345.6,
        "mfu": 0.4321,
        "peak_mem_gb": 71.234,
    }
    assert step_line(record, 100, 3725.4) == (
        "step=30/100 loss=6.1235 lr=2.000e-05 grad_norm=n/a tokens_per_s=12346 mfu=43.2% peak_mem_gb=71.23 eta=1:02:05"
    )
    assert "mfu=n/a%" in step_line({**record, "mfu": None}, 100, None)
    # a step that scored the held-out loss (train.heldout_every) says it after the training loss
    held = step_line({**record, "heldout_loss": 6.54321, "heldout_ppl": 693.6}, 100, None)
    assert held.startswith("step=30/100 loss=6.1235 heldout_loss=6.5432 lr=2.000e-05 ")
    # five significant digits whatever the value (the loss has four decimals): a column of norms lines up
    norms = [(1.0030182, "1.0030"), (0.98419, "0.98419"), (44.368, "44.368"), (447.918, "447.92"), (17232.4, "17232")]
    for norm, text in norms:
        assert f" grad_norm={text} " in step_line({**record, "grad_norm": norm}, 100, None)


@pytest.mark.parametrize(
    "seconds, text",
    [(0, "0:00:00"), (59.6, "0:01:00"), (3725, "1:02:05"), (86400 + 3 * 3600 + 4 * 60 + 5, "1d 03:04:05")],
)
def test_duration(seconds, text):
    assert duration(seconds) == text


def test_eta_is_the_mean_pace_times_the_steps_left():
    assert eta_seconds(30.0, 3, 7) == 70.0
    assert eta_seconds(5.0, 0, 7) is None


def start(**kw) -> RunStart:
    values = dict(
        name="llama2_64k_anchor",
        run_dir=Path("runs/llama2_64k_anchor"),
        model="meta-llama/Llama-2-7b-hf",
        params=6_738_415_616,
        dense_params=6_607_343_616,
        rope={"rope_theta": 5_000_000.0, "rope_type": "default"},
        max_positions=65536,
        changes=[ConfigChange("rope_parameters.rope_theta", 10000.0, 5000000.0, "model.rope_theta")],
        anchor_token="<s>",
        anchor_id=1,
        mode="anchor",
        engine="ulysses_varlen",
        seq_len=65536,
        global_batch=8,
        tokens_per_step=8 * 65536,
        micro_batch=1,
        grad_accum=1,
        layout=ParallelLayout(world=8, sp=8),
        zero_stage=3,
        device="cuda",
        steps=2000,
        start_step=0,
        planned=PlannedMemory(device_gb=61.83, host_gb=120.04),
        disk_peak_gb=296.49,
        disk_free_gb=1204.3,
    )
    return RunStart(**{**values, **kw})


def test_banner_of_a_paper_run():
    assert banner(start()) == "\n".join(
        [
            "lctrain train llama2_64k_anchor: 2000 steps, from step 0",
            "  model        meta-llama/Llama-2-7b-hf: 6.7B parameters (6.6B counted for MFU)",
            "  rope         base 5,000,000, rope_type default; max positions 65,536",
            "  anchor       <s> (id 1)",
            "  attention    anchor, engine ulysses_varlen",
            "  batch        8 x 65,536 = 524,288 tokens per step (micro-batch 1, 1 accumulation step)",
            "  parallel     world 8 = dp 1 x sp 8, ZeRO stage 3, cuda",
            "  memory plan  61.8 GB per device, 120.0 GB host (`lctrain plan` itemises it)",
            "  disk plan    296.5 GB at the run's peak, 1,204.3 GB free (`lctrain plan` says what)",
            "  run dir      runs/llama2_64k_anchor",
            "  model config changes:",
            "    rope_parameters.rope_theta: 10000.0 -> 5000000.0 (model.rope_theta)",
        ]
    )


def test_banner_of_a_resumed_cpu_run_with_scaling():
    text = banner(
        start(
            start_step=400,
            rope={"rope_theta": 500000.5, "rope_type": "yarn", "factor": 16.0},
            changes=[],
            planned=PlannedMemory(device_gb=None, host_gb=3.31),
            device="cpu",
        )
    )
    assert text.splitlines()[0] == "lctrain train llama2_64k_anchor: 2000 steps, resuming at step 400"
    assert "  rope         base 500,000.5, rope_type yarn (factor 16.0); max positions 65,536" in text
    assert "  memory plan  3.3 GB host (`lctrain plan` itemises it)" in text
    assert text.endswith("  model config: as given, no changes")


def end(**kw) -> RunEnd:
    run = Path("runs/x")
    values = dict(
        run_dir=run,
        last={"step": 60, "loss": 6.010263452315494, "tokens": 245760},
        steps=60,
        start_step=20,
        tokens_per_step=4096,
        wall_s=200.0,
        peak_mem_gb=1.7178,
        checkpoint=run / "checkpoints" / "step_60",
        exports=[run / "hf" / "step_50", run / "hf" / "step_60"],
        metrics_file=run / "metrics.jsonl",
        start_over="lctrain train --config runs/x/config.yaml --set train.lr=0.0001 --force",
    )
    return RunEnd(**{**values, **kw})


def test_summary_of_a_finished_resumed_run():
    assert summary(end()) == "\n".join(
        [
            "done: runs/x",
            "  final loss   6.0103 at step 60 of 60",
            "  tokens       245,760 seen (163,840 in this session)",
            "  time         0:03:20 wall, 819 tokens/s",
            "  peak memory  1.72 GB",
            "  checkpoint   runs/x/checkpoints/step_60",
            "  hf exports   runs/x/hf/ (step_50, step_60)",
            "  metrics      runs/x/metrics.jsonl",
            "  next         lctrain eval runs/x; lctrain plot runs/x",
        ]
    )


def test_summary_of_a_stopped_run_and_of_no_step():
    stopped = summary(end(last={"step": 30, "loss": 7.5, "tokens": 122880}, exports=[], checkpoint=None))
    assert "  final loss   7.5000 at step 30 of 60" in stopped
    assert "  hf exports   none" in stopped and "  checkpoint   none" in stopped
    assert stopped.endswith("  next         lctrain resume runs/x")
    assert summary(end(last=None)) == "no step trained: runs/x is at step 20 of 60"


def test_deepspeeds_deprecated_collectives_are_not_shown_but_other_deprecations_are():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_libraries(is_main=True)
        for name in ("all_gather_into_tensor", "reduce_scatter_tensor"):
            warnings.warn(f"`torch.distributed.{name}` is deprecated. Please use ... instead.", FutureWarning, 1)
        warnings.warn("`torch.distributed.something_else` is deprecated.", FutureWarning, stacklevel=1)
    assert [str(w.message) for w in caught] == ["`torch.distributed.something_else` is deprecated."]


def test_ranks_other_than_0_keep_only_errors_of_the_libraries():
    verbosity, progress = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    loggers = [logging.getLogger(name) for name in ("DeepSpeed", "torch.distributed")]
    levels = [lg.level for lg in loggers]
    try:
        with warnings.catch_warnings(record=True) as caught:
            quiet_libraries(is_main=False)
            warnings.warn("a library's warning", UserWarning, stacklevel=1)
            assert caught == []
            assert hf_logging.get_verbosity() == logging.ERROR
            assert [lg.level for lg in loggers] == [logging.ERROR, logging.ERROR]
            assert not hf_logging.is_progress_bar_enabled()
    finally:
        hf_logging.set_verbosity(verbosity)
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
        if progress:
            hf_logging.enable_progress_bar()
