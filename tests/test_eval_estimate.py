"""`lctrain estimate`: the FLOP model against a hand computation (per 1B tokens, per step, for the whole run), the
rate's default (a device's peak: the datasheet numbers written out here), the synthetic fallback flagged, benchmark
JSON input, and bad options."""

import json

import pytest
from eval_helpers import tiny_arch
from typer.testing import CliRunner

from lctrain.cli import app
from lctrain.config import load_config, with_overrides
from lctrain.errors import UserError
from lctrain.reports.estimate import estimate, read_bench

ARCH = tiny_arch() + ["model.arch.vocab_size=32064"]  # the 32K tokenizer's, padded to a multiple of 64


def test_hand_computed_full_attention_hours(tmp_path):
    r = estimate(
        load_config(None, ARCH + ["data.seq_len=1024", f"data.output_dir={tmp_path / 'none'}"]), tflops=50.0, gpus=2
    )
    assert r["synthetic"] and "SYNTHETIC" in r["segment_source"]
    L, d, layers, heads, hd, kv, ffn, vocab = 1024, 64, 2, 4, 16, 2, 128, 32064
    params = layers * (2 * d * heads * hd + 2 * d * kv * hd + 3 * d * ffn) + d * vocab
    # model FLOPs (lctrain.costmodel): training = 3 forward passes, for the matmuls and attention alike
    flops = 2 * params * L * 3 + 4 * heads * hd * layers * 3 * L * (L + 1) / 2
    hours = (1e9 / L) * flops / (50e12 * 2) / 3600
    assert r["modes"]["full"]["hours_per_1b_tokens"] == pytest.approx(hours)
    assert r["modes"]["anchor"]["speedup_vs_full"] >= 1.0
    # model.tiled_mlp: TiledMLP reruns every MLP's forward in the backward, 2 FLOPs per MLP weight per token more
    tiled = estimate(
        load_config(None, ARCH + ["data.seq_len=1024", f"data.output_dir={tmp_path / 'none'}", "model.tiled_mlp=4"]),
        tflops=50.0,
        gpus=2,
    )
    extra = 2 * layers * 3 * d * ffn * L
    assert tiled["modes"]["full"]["flops_per_window"] == pytest.approx(flops + extra)
    # activation checkpointing reruns each layer's forward but its down projection (torch stops once the backward
    # has what it needs; tests/test_activation_checkpointing.py counts it): attention too under `full`, not under
    # `selective`
    rerun = 2 * layers * (2 * d * heads * hd + 2 * d * kv * hd + 2 * d * ffn) * L
    attention_forward = 4 * heads * hd * layers * L * (L + 1) / 2
    for mode, more in (("selective", rerun), ("full", rerun + attention_forward), ("none", 0)):
        cfg = load_config(None, ARCH + ["data.seq_len=1024", f"data.output_dir={tmp_path / 'none'}"])
        cfg = with_overrides(cfg, [f"model.checkpointing={mode}"], "test")
        row = estimate(cfg, tflops=50.0, gpus=2)["modes"]["full"]
        assert row["flops_per_window"] == pytest.approx(flops + more), mode
        share = (4 * heads * hd * layers * 3 * L * (L + 1) / 2 + (attention_forward if mode == "full" else 0)) / (
            flops + more
        )
        assert row["attention_share"] == pytest.approx(share), mode


def hand_flops():
    """Model FLOPs of one window of the ARCH model at 1024 tokens in full attention without checkpointing: training =
    3 forward passes, for the matmuls and attention alike (lctrain.costmodel)."""
    L, d, layers, heads, hd, kv, ffn, vocab = 1024, 64, 2, 4, 16, 2, 128, 32064
    params = layers * (2 * d * heads * hd + 2 * d * kv * hd + 3 * d * ffn) + d * vocab
    return 2 * params * L * 3 + 4 * heads * hd * layers * 3 * L * (L + 1) / 2


def small(tmp_path, *more):
    settings = ["data.seq_len=1024", f"data.output_dir={tmp_path / 'none'}", "model.checkpointing=none", *more]
    return load_config(None, ARCH + settings)


def test_step_and_run_time_for_the_configs_batch_and_steps(tmp_path):
    """A step is train.global_batch windows over all GPUs; the run, train.steps of them."""
    cfg = small(tmp_path, "train.global_batch=4", "train.steps=500")
    row = estimate(cfg, tflops=50.0, gpus=2)["modes"]["full"]
    step = 4 * hand_flops() / (50e12 * 2)
    assert row["step_s"] == pytest.approx(step)
    assert row["run_hours"] == pytest.approx(500 * step / 3600)
    assert row["hours_per_1b_tokens"] == pytest.approx(step * 1e9 / (4 * 1024) / 3600)
    args = ["estimate", "--tflops", "50", "--gpus", "2", "--set", "train.global_batch=4", "--set", "train.steps=500"]
    r = CliRunner().invoke(app, args + ["--set", f"data.output_dir={tmp_path / 'none'}"])
    assert r.exit_code == 0 and "s / step" in r.output and "hours / 500 steps" in r.output, r.output
    assert "4 windows per step" in r.output


def test_the_rate_defaults_to_a_devices_peak(tmp_path, monkeypatch):
    """Without --tflops or --from-bench: --gpu NAME's dense bf16 peak, else logging.peak_tflops, else this machine's
    GPU from the hardware table, else its CPU's measured matmul rate (the datasheets' numbers written out here)."""
    import torch

    import lctrain.hardware as hardware

    def hours(tflops):
        return (1e9 / 1024) * hand_flops() / (tflops * 1e12 * 2) / 3600

    cfg = small(tmp_path)
    r = estimate(cfg, gpu="H100 80GB HBM3", gpus=2)  # SXM5: 989 dense bf16 TFLOP/s
    assert r["modes"]["full"]["tflops_per_gpu"] == 989
    assert r["modes"]["full"]["hours_per_1b_tokens"] == pytest.approx(hours(989))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "NVIDIA A100-SXM4-80GB")
    r = estimate(cfg, gpus=2)
    assert r["modes"]["full"]["tflops_per_gpu"] == 312 and "A100-SXM4-80GB's dense bf16 peak" in r["rate_source"]
    r = estimate(small(tmp_path, "logging.peak_tflops=123"), gpus=2)
    assert r["modes"]["full"]["hours_per_1b_tokens"] == pytest.approx(hours(123))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "NVIDIA Mystery 9000")
    with pytest.raises(UserError, match="GPU 'NVIDIA Mystery 9000' is not in lctrain's hardware table"):
        estimate(cfg, gpus=2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(hardware, "_cpu_matmul_peak", lambda dtype: 7e12 if dtype == "float32" else None)
    r = estimate(cfg, gpus=2)
    assert r["modes"]["full"]["hours_per_1b_tokens"] == pytest.approx(hours(7))
    assert r["rate_source"].startswith("this CPU's measured float32 matmul rate")
    for name, message in (("Mystery 9000", "is not in lctrain's hardware table"), ("A10G", "has no dense bf16 peak")):
        with pytest.raises(UserError, match=f"--gpu {name} {message}"):
            estimate(cfg, gpu=name, gpus=2)


def test_from_bench_per_mode(tmp_path):
    bench = tmp_path / "bench.json"
    bench.write_text(
        json.dumps(
            {
                "results": [{"mode": "full", "tflops_per_gpu": 100.0}, {"mode": "anchor", "tflops_per_gpu": 50.0}],
                "tflops_per_gpu": 80.0,
            }
        )
    )
    assert read_bench(bench) == {"*": 80.0, "full": 100.0, "anchor": 50.0}
    # a bench_train result: its rate on the FLOPs the device ran, which the prediction counts
    bench_train = tmp_path / "bench_train.json"
    rows = [{"mode": "full", "tflops_per_gpu": 100.0, "hardware_tflops_per_gpu": 130.0}]
    bench_train.write_text(json.dumps({"results": rows}))
    assert read_bench(bench_train) == {"full": 130.0}
    out = tmp_path / "est.json"
    r = estimate(
        load_config(None, ARCH + [f"data.output_dir={tmp_path / 'none'}"]), from_bench=str(bench), gpus=1, out=str(out)
    )
    assert r["modes"]["intra_doc"]["tflops_per_gpu"] == 80.0 and r["modes"]["anchor"]["tflops_per_gpu"] == 50.0
    assert json.loads(out.read_text())["modes"]["full"]["tflops_per_gpu"] == 100.0


def test_bad_input(tmp_path):
    with pytest.raises(UserError, match="--tflops and --from-bench: give at most one"):
        estimate(load_config(None, ARCH), tflops=1.0, from_bench="b.json", gpus=1)
    bad = tmp_path / "b.json"
    bad.write_text(json.dumps({"nothing": 1}))
    with pytest.raises(UserError, match="tflops_per_gpu"):
        read_bench(bad)
    with pytest.raises(UserError, match="--gpus 0: must be at least 1"):
        estimate(load_config(None, ARCH), tflops=10.0, gpus=0)
    for value in ("-3", "nan", "inf", "1e300"):
        r = CliRunner().invoke(app, ["estimate", "--tflops", value])
        refused = f"error: --tflops {float(value)}: expected the achieved TFLOP/s per GPU, > 0 and at most 1,000,000"
        assert r.exit_code == 2 and r.output.startswith(refused), r.output
    bad.write_text('{"tflops_per_gpu": NaN}')
    with pytest.raises(UserError, match="no positive 'tflops_per_gpu'"):
        read_bench(bad)
    # GPUs that train could not lay out: not a multiple of the sequence-parallel group, or of the batch's replicas
    for gpus, message in (
        ("3", "--gpus 3: not a multiple of parallel.sequence_parallel = 2"),
        ("6", "--gpus 6: "),
    ):
        r = CliRunner().invoke(app, ["estimate", "-c", "tiny_anchor_sp2", "--tflops", "10", "--gpus", gpus])
        assert r.exit_code == 2 and len(r.output.strip().splitlines()) == 1, r.output
        assert r.output.startswith(f"error: {message}"), r.output
    assert "not divisible by train.micro_batch x data-parallel size = 2 x 3" in r.output
    # a sequence-parallel size the heads cannot split, as train and plan refuse it (show-config too)
    sets = ["--set", "parallel.sequence_parallel=8", "--set", "parallel.nproc_per_node=8"]
    for command in (["estimate", "--tflops", "10"], ["show-config"]):
        r = CliRunner().invoke(app, [*command, "-c", "tiny_anchor_sp2", *sets])
        assert r.exit_code == 2 and len(r.output.strip().splitlines()) == 1, r.output
        assert "attention heads are not divisible by parallel.sequence_parallel = 8" in r.output, r.output
    r = CliRunner().invoke(app, ["estimate", "--tflops", "1", "--gpu", "H100 80GB HBM3"])
    assert r.exit_code == 2 and r.output.startswith("error: --tflops and --gpu: give at most one")
    # the measured run's options are not silently dropped from the FLOP estimate
    r = CliRunner().invoke(app, ["estimate", "--tflops", "100", "--lengths", "16k", "--steps", "5"])
    assert r.exit_code == 2 and r.output.startswith("error: --lengths, --steps apply with --measure")


def test_prepared_dataset_layout(tmp_path):
    from lctrain.data.prepare import prepare

    data = tmp_path / "data"
    prepare(load_config(None, ["data.seq_len=256", "data.token_budget=6000", f"data.output_dir={data}"]))
    r = estimate(load_config(None, ARCH + ["data.seq_len=256", f"data.output_dir={data}"]), tflops=50.0, gpus=1)
    assert not r["synthetic"] and r["segment_source"] == f"prepared dataset {data}"
    assert r["modes"]["full"]["speedup_vs_full"] == 1.0 <= r["modes"]["intra_doc"]["speedup_vs_full"]
    # a dataset prepared for another length is not this config's layout: fall back, and say why
    r = estimate(load_config(None, ARCH + ["data.seq_len=512", f"data.output_dir={data}"]), tflops=50.0, gpus=1)
    assert r["synthetic"] and "has seq_len 256, not 512" in r["segment_source"]
