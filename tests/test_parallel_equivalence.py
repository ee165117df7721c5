"""Multi-process training equals one process: Ulysses sequence parallelism, ZeRO-3, data parallelism.

The reference is a 1-process run in this process. The parallel runs go through the CLI, so `lctrain train` relaunches
itself under torchrun (or DeepSpeed's launcher) with 2 gloo processes. The model has 4 query heads and 1 KV head, so
sequence parallelism over 2 ranks also exercises the KV-head replication for grouped-query attention.
"""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from train_helpers import metric_records, prepared_workdir, reference_run, run_cli_train

from lctrain.rundir import RunDir

STEPS = 4
LR = 3e-3
ARCH = (
    "{model_type: llama, hidden_size: 64, intermediate_size: 128, num_hidden_layers: 2, num_attention_heads: 4, "
    "num_key_value_heads: 1, tie_word_embeddings: false}"
)


def overrides(data_dir: Path, run_dir: Path) -> list[str]:
    return [
        "data.seq_len=128",
        "data.token_budget=12000",
        f"data.output_dir={data_dir}",
        f"train.run_dir={run_dir}",
        f"train.steps={STEPS}",
        "train.global_batch=4",
        "train.micro_batch=1",
        "train.warmup_steps=0",
        f"train.lr={LR}",
        "train.grad_clip=0",
        "checkpoint.every_steps=4",
        "checkpoint.hf_every=2",
        "checkpoint.hf_last=4",
        f"model.arch={ARCH}",
    ]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return prepared_workdir(tmp_path_factory, "parallel", overrides)


@pytest.fixture(scope="module")
def reference(workdir):
    return reference_run(workdir, overrides)


def run_cli(workdir: Path, name: str, extra: list[str]) -> Path:
    return run_cli_train(overrides, workdir, name, extra)


# Tolerances, from what each quantity is:
# - losses are fp32 sums over the same tokens in another order and on other ranks: a few ulps of fp32 per step, so
#   1e-5 relative is ~100x the rounding; a wrong layout (a token attending across a slice boundary it should not,
#   a label shifted after slicing, a wrong position) changes the step-1 loss by far more.
# - ZeRO-3 reports a norm ~1e-4 off the norm of its own full gradients when it accumulates micro-batches
#   (deepspeed 0.19.8), which would also shift its clipping; clipping is off here.
# - weights: Adam divides each gradient element by its running RMS, so an element whose gradient is near zero can
#   move by up to 2 x lr per step on a rounding difference (its sign flips); that is why elementwise weight checks
#   at 1e-5 failed on some CPUs (a summation-order artefact, not a bug). The update as a whole is what a layout
#   bug changes: each tensor's distance to the 1-process weights must be < 1% of how far the last two steps moved
#   it, and no element may differ by more than Adam's 2 x lr per step bound. (Measured: correct layouts <= 3e-5 of
#   the movement; the wrong layout of the negative control below >= 0.8.)
LOSS_RTOL, GRAD_NORM_RTOL, UPDATE_RTOL = 1e-5, 1e-3, 1e-2


def weight_mismatches(run_dir: Path, ref_dir: Path) -> list[str]:
    """Tensors of the final HF checkpoint whose difference from the reference exceeds the bounds above."""
    a = load_file(RunDir(run_dir).export(STEPS) / "model.safetensors")
    b = load_file(RunDir(ref_dir).export(STEPS) / "model.safetensors")
    before = load_file(RunDir(ref_dir).export(STEPS - 2) / "model.safetensors")
    assert a.keys() == b.keys()
    bad = []
    for k in b:
        moved = float((b[k] - before[k]).norm())
        assert moved > 0, f"{k} did not move in the reference run: nothing would be compared"
        diff = float((a[k] - b[k]).norm())
        worst = float((a[k] - b[k]).abs().max())
        if diff > UPDATE_RTOL * moved or worst > 2 * LR * STEPS:
            bad.append(f"{k}: |a-b| = {diff:.3g} vs last-two-steps movement {moved:.3g}, max {worst:.3g}")
    return bad


def assert_matches(run_dir: Path, ref_dir: Path) -> None:
    got, want = metric_records(run_dir), metric_records(ref_dir)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    assert [r["valid_labels"] for r in got] == [r["valid_labels"] for r in want]
    torch.testing.assert_close(
        torch.tensor([r["loss"] for r in got]), torch.tensor([r["loss"] for r in want]), rtol=LOSS_RTOL, atol=0
    )
    torch.testing.assert_close(
        torch.tensor([r["grad_norm"] for r in got]),
        torch.tensor([r["grad_norm"] for r in want]),
        rtol=GRAD_NORM_RTOL,
        atol=0,
    )
    assert not weight_mismatches(run_dir, ref_dir)


def test_a_wrong_sequence_layout_fails_the_comparison(reference, workdir, monkeypatch):
    """The negative control for the tolerances: the 1-process run with what a broken Ulysses layout computes (each
    half of a window attending only to itself, as if the all-to-all were missing) must fail every check."""
    import lctrain.train.trainer as trainer

    real = trainer.make_batch

    def halves_only(input_ids, seg_lens, mode, seg_doc=None, tag_lens=None, **kw):
        half = input_ids.shape[1] // 2
        cut_lens, cut_docs, cut_tags = [], [], []
        for b, lens in enumerate(seg_lens):
            docs, tags = list(seg_doc[b]), list(tag_lens[b])
            start, new_lens, new_docs, new_tags = 0, [], [], []
            for n, d, t in zip(list(lens), docs, tags):
                if start < half < start + n:  # split the segment at the slice boundary into two documents
                    new_lens += [half - start, start + n - half]
                    new_docs += [d, max(docs) + 1]
                    new_tags += [min(t, half - start - 1), 0]
                else:
                    new_lens.append(n), new_docs.append(d), new_tags.append(t)
                start += n
            cut_lens.append(new_lens), cut_docs.append(new_docs), cut_tags.append(new_tags)
        return real(input_ids, cut_lens, mode, seg_doc=cut_docs, tag_lens=cut_tags, **kw)

    monkeypatch.setattr(trainer, "make_batch", halves_only)  # where the trainer looks it up
    from lctrain.config import load_config
    from lctrain.train.command import train

    wrong = train(load_config(None, overrides(workdir / "data", workdir / "wrong_layout")))
    with pytest.raises(AssertionError):
        torch.testing.assert_close(
            torch.tensor([r["loss"] for r in metric_records(wrong)][:1]),
            torch.tensor([r["loss"] for r in metric_records(reference)][:1]),
            rtol=LOSS_RTOL,
            atol=0,
        )
    assert weight_mismatches(wrong, reference)


@pytest.mark.slow  # over 20 s on 2 cores: make test-slow
def test_ulysses_sp2_with_zero3_matches_one_process(reference, workdir):
    run_dir = run_cli(
        workdir,
        "sp2_zero3",
        [
            "parallel.nproc_per_node=2",
            "parallel.sequence_parallel=2",
            "parallel.zero_stage=3",
            "parallel.launcher=torchrun",
            # profiled on both ranks: the profiler changes no number, and a launched rank exits cleanly after it
            "logging.profile.start=2",
            "logging.profile.steps=1",
            "logging.profile.ranks=all",
        ],
    )
    traces = sorted(p.name for p in (RunDir(run_dir).profile_dir / "steps_2-2").glob("*.pt.trace.json.gz"))
    assert traces == ["rank0.pt.trace.json.gz", "rank1.pt.trace.json.gz"]
    checkpoint = RunDir(run_dir).checkpoint(4)
    assert json.loads((checkpoint / "trainer_state.json").read_text())["sp"] == 2
    assert len(list(checkpoint.glob("zero_pp_rank_*_optim_states.pt"))) == 2
    assert_matches(run_dir, reference)


@pytest.mark.slow  # over 20 s on 2 cores: make test-slow
def test_data_parallel_zero2_under_deepspeed_launcher_matches_one_process(reference, workdir):
    run_dir = run_cli(
        workdir, "dp2_zero2", ["parallel.nproc_per_node=2", "parallel.zero_stage=2", "parallel.launcher=deepspeed"]
    )
    assert_matches(run_dir, reference)


def bf16_zero2(data_dir: Path, run_dir: Path) -> list[str]:
    return [*overrides(data_dir, run_dir), "model.dtype=bfloat16", "parallel.zero_stage=2", "checkpoint.hf_last=0"]


@pytest.mark.slow  # ~35 s: a 1-process run and two 2-rank runs
def test_bf16_data_parallel_reduces_in_fp32_as_one_process(workdir):
    """bf16 gradients reduced across ranks in bf16 (DeepSpeed's default without sequence parallelism) left 2 ranks
    off the 1-process run (measured: 3e-4 of the gradient norm, 2e-5 of the loss); `parallel.reduce_dtype` float32,
    the default, keeps them on it (measured: equal). Tolerance: fp32 rounding of the same sums in another order,
    1e-6, a twentieth of the loss's bf16 difference."""
    from lctrain.config import load_config
    from lctrain.train.command import train

    one = train(load_config(None, bf16_zero2(workdir / "data", workdir / "bf16_one")))
    want = torch.tensor([[r["loss"], r["grad_norm"]] for r in metric_records(one)])
    off = {}
    for dtype in ("float32", "bfloat16"):
        extra = ["parallel.nproc_per_node=2", f"parallel.reduce_dtype={dtype}"]
        run = run_cli_train(bf16_zero2, workdir, f"bf16_two_{dtype}", extra)
        got = torch.tensor([[r["loss"], r["grad_norm"]] for r in metric_records(run)])
        off[dtype] = ((got - want).abs() / want).max().item()
    assert off["float32"] <= 1e-6 < 1e-5 < off["bfloat16"], off
