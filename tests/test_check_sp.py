"""`lctrain check sp`: one process and DeepSpeed-Ulysses over 2 gloo processes give the same logits (Table 8).

The 2-process run goes through the CLI, which launches its workers under torchrun as training does. The model has 4
query heads and 1 KV head, so the run also exercises the KV-head replication of grouped-query attention.
"""

import json
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest
import torch
from train_helpers import clean_env, one_error_line, set_args
from typer.testing import CliRunner

from lctrain.attention import make_batch
from lctrain.cli import app
from lctrain.config import load_config
from lctrain.diagnostics.check_sp import allowed_processes, logit_diff, synthetic_window
from lctrain.errors import UserError

SEQ_LEN, HIDDEN, INTERMEDIATE, LAYERS = 128, 64, 128, 2
ARCH = (
    f"{{model_type: llama, hidden_size: {HIDDEN}, intermediate_size: {INTERMEDIATE}, num_hidden_layers: {LAYERS}, "
    f"num_attention_heads: 4, num_key_value_heads: 1, tie_word_embeddings: false}}"
)
OVERRIDES = [f"data.seq_len={SEQ_LEN}", f"model.arch={ARCH}", "model.dtype=float32", "parallel.launcher=torchrun"]

# The bound: Ulysses changes only which process computes what, so the two runs may differ by the order of fp32
# reductions alone. Reordering a sum of n terms moves it by at most about n·u·Σ|terms| (u = 2^-24, Higham's γ_n);
# per layer five reductions (q/k/v, attention over at most L keys, o_proj, two MLP matmuls counted as one chain
# each) of at most n = max(hidden, intermediate, L) terms, plus lm_head, relative to the logits' magnitude.
FP32_U = 2.0**-24
REDUCTIONS = 5 * LAYERS + 1
INNER = max(HIDDEN, INTERMEDIATE, SEQ_LEN)


def rounding_bound(ref_max_abs: float) -> float:
    return REDUCTIONS * INNER * FP32_U * ref_max_abs


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("check_sp")
    cmd = [
        sys.executable,
        "-m",
        "lctrain.cli",
        "check",
        "sp",
        "--nproc",
        "2",
        "--modes",
        "full,anchor",
        "--out",
        str(out),
    ] + set_args(OVERRIDES + [f"data.output_dir={out / 'no_data'}"])
    # CPU processes over gloo even where a GPU is visible (one GPU cannot hold two nccl ranks)
    proc = subprocess.run(
        cmd, env=clean_env(CUDA_VISIBLE_DEVICES=""), capture_output=True, text=True, timeout=300, cwd=out
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| full | sdpa | float32 |" in proc.stdout and "| anchor | sdpa | float32 |" in proc.stdout, proc.stdout
    return json.loads((out / "check_sp.json").read_text())


@pytest.mark.slow  # over 20 s on 2 cores: make test-slow
def test_ulysses_over_two_processes_matches_one_process_in_full_and_anchor(result):
    assert result["world"] == 2 and result["backend"] == "gloo" and result["dtype"] == "float32"
    assert result["seq_len"] == SEQ_LEN and result["documents"] >= 2
    assert [r["mode"] for r in result["modes"]] == ["full", "anchor"]
    for r in result["modes"]:
        # each rank computed half of the window: a zero difference means the all-to-all carried the other half
        assert r["shard_tokens"] == SEQ_LEN // 2
        assert r["ref_max_abs"] > 0
        assert r["max_abs"] <= rounding_bound(r["ref_max_abs"]), r
        assert 0 <= r["mean_abs"] <= r["max_abs"]


@pytest.mark.slow  # over 20 s on 2 cores: make test-slow
def test_a_layout_without_the_all_to_all_fails_the_bound(result):
    """The negative control: what Ulysses would compute if the all-to-all were missing (each rank attending only
    within its own slice, true positions) against the 1-process logits, compared by the same function and bound."""
    from lctrain.model import build_model, model_shape
    from lctrain.tokenizer import anchor_token_id, load_tokenizer

    cfg = load_config(None, OVERRIDES + ["attention.mode=full"])
    vocab = model_shape(cfg).vocab
    win = synthetic_window(SEQ_LEN, vocab, anchor_token_id(load_tokenizer(cfg.data.tokenizer)), 2, seed=cfg.seed)
    lm = build_model(cfg, vocab_size=vocab).model.eval()
    ids = torch.as_tensor(win["input_ids"])[None]
    half = SEQ_LEN // 2
    whole = make_batch(ids, [[SEQ_LEN]], "full")
    # Each slice on its own: a one-segment window of `half` tokens that keeps its true positions.
    slices = [
        replace(make_batch(ids[:, s : s + half], [[half]], "full"), position_ids=whole.position_ids[:, s : s + half])
        for s in (0, half)
    ]
    with torch.inference_mode():
        ref = lm(**whole.model_kwargs(), use_cache=False).logits
        cut = torch.cat([lm(**b.model_kwargs(), use_cache=False).logits for b in slices], dim=1)
    wrong = logit_diff(ref, cut)
    assert wrong["max_abs"] > 100 * rounding_bound(wrong["ref_max_abs"]), wrong
    assert wrong["worst_token"] >= half  # only the second slice lost context
    assert logit_diff(ref, ref)["max_abs"] == 0


def test_logit_diff_matches_an_elementwise_loop():
    gen = torch.Generator().manual_seed(0)
    ref = torch.randn(2, 5, 7, generator=gen)
    got = ref + torch.randn(2, 5, 7, generator=gen) * 1e-3
    got[1, 3, 4] += 0.5
    diffs = [abs(float(ref[b, t, v]) - float(got[b, t, v])) for b in range(2) for t in range(5) for v in range(7)]
    for chunk in (1, 3, 100):
        d = logit_diff(ref, got, chunk_tokens=chunk)
        assert d["max_abs"] == pytest.approx(max(diffs), rel=1e-6)
        assert d["mean_abs"] == pytest.approx(sum(diffs) / len(diffs), rel=1e-6)
        assert d["ref_max_abs"] == pytest.approx(float(ref.abs().max()))
        assert d["worst_token"] == 1 * 5 + 3
    bf = logit_diff(ref.bfloat16(), got.bfloat16())
    assert bf["max_abs"] == pytest.approx(float((ref.bfloat16().float() - got.bfloat16().float()).abs().max()))
    with pytest.raises(ValueError, match="shapes differ"):
        logit_diff(ref, got[:, :4])


@pytest.mark.parametrize("sp", [2, 4])
def test_synthetic_window_has_anchored_documents_across_every_slice_boundary(sp):
    L, vocab, anchor = 256, 50, 7
    win = synthetic_window(L, vocab, anchor, sp, seed=3)
    lens = win["seg_lens"].tolist()
    assert sum(lens) == L and len(lens) == 8 and min(lens) >= 1
    starts = [sum(lens[:i]) for i in range(len(lens))]
    assert [t for t in range(L) if win["input_ids"][t] == anchor] == starts
    assert not any(s % (L // sp) == 0 for s in starts[1:])
    assert 0 <= win["input_ids"].min() and win["input_ids"].max() < vocab
    assert win["seg_doc"].tolist() == list(range(8)) and not win["tag_lens"].any()
    again, other = synthetic_window(L, vocab, anchor, sp, seed=3), synthetic_window(L, vocab, anchor, sp, seed=4)
    assert all(np.array_equal(win[k], again[k]) for k in win)
    assert not np.array_equal(win["input_ids"], other["input_ids"])
    assert len(synthetic_window(4, vocab, anchor, 2, seed=0)["seg_lens"]) == 3  # only 3 cut points off boundaries


def test_the_window_comes_from_the_prepared_dataset_when_there_is_one(tmp_path):
    import pyarrow as pa

    from lctrain.data.prepare import prepare
    from lctrain.diagnostics.check_sp import pick_window

    overrides = OVERRIDES + [
        "data.token_budget=3000",
        f"data.output_dir={tmp_path / 'data'}",
        "parallel.sequence_parallel=2",
        "parallel.nproc_per_node=2",
    ]
    cfg = load_config(None, overrides)
    prepare(cfg)
    with pa.memory_map(str(tmp_path / "data" / "data" / "shard-00000.arrow")) as f:  # the store, read directly
        rows = pa.ipc.open_stream(f).read_all().to_pylist()
    win, source, vocab = pick_window(cfg, 1)
    for key in ("input_ids", "seg_lens", "seg_doc", "tag_lens"):
        assert win[key].tolist() == list(rows[1][key]), key
    manifest = json.loads((tmp_path / "data" / "manifest.json").read_text())
    assert vocab == manifest["tokenizer"]["vocab_size"] and "window 1" in source
    line = one_error_line(run_cli(["--window", "100000"], overrides))
    assert "--window 100000" in line and "windows" in line


def test_the_processes_default_to_the_configs_sequence_parallel(monkeypatch):
    """A config of SP 4 was checked on 2 processes, silently, where --nproc was not given."""
    from lctrain.diagnostics.check_sp import check_config

    monkeypatch.setattr("lctrain.diagnostics.check_sp.allowed_processes", lambda: 8)
    sp4 = load_config(None, OVERRIDES + ["parallel.sequence_parallel=4", "parallel.nproc_per_node=4"])
    assert check_config(sp4, None, None).parallel.sequence_parallel == 4
    assert check_config(sp4, 2, None).parallel.sequence_parallel == 2  # --nproc given: it
    assert check_config(load_config(None, OVERRIDES), None, None).parallel.sequence_parallel == 2
    monkeypatch.setattr("lctrain.diagnostics.check_sp.allowed_processes", lambda: 2)
    with pytest.raises(UserError, match=r"^4 processes \(--nproc's default: the config's parallel.sequence_parallel"):
        check_config(sp4, None, None)


def test_a_window_of_one_document_is_said_not_to_tell_the_modes_apart(tmp_path, monkeypatch, capsys):
    from lctrain.data.prepare import prepare
    from lctrain.diagnostics import check_sp as module
    from lctrain.diagnostics.check_sp import check_sp, pick_window

    monkeypatch.setattr(module, "allowed_processes", lambda: 2)
    cfg = load_config(None, OVERRIDES + ["data.token_budget=3000", f"data.output_dir={tmp_path / 'data'}"])
    prepare(cfg)
    one = next(row for row in range(20) if len(pick_window(cfg, row)[0]["seg_lens"]) == 1)
    assert pick_window(cfg, one)[1].endswith(f"window {one}: 1 segment(s)")

    class Stop(Exception):
        pass

    def stop(*args, **kwargs):
        raise Stop

    monkeypatch.setattr(module, "run_on_ranks", stop)
    for modes, said in ((None, True), (["full"], False)):
        capsys.readouterr()
        with pytest.raises(Stop):
            check_sp(cfg, modes=modes, window=one, out=str(tmp_path / "out"))
        note = f"note: window {one} is one document: every mode attends as full attention does there"
        assert (note in capsys.readouterr().out) == said


def run_cli(args: list[str], overrides=OVERRIDES):
    return CliRunner().invoke(app, ["check", "sp"] + args + set_args(overrides))


def test_more_processes_than_the_machine_allows_ends_in_one_line():
    line = one_error_line(run_cli(["--nproc", str(allowed_processes() + 1)]))
    assert f"this machine has {allowed_processes()}" in line


@pytest.mark.parametrize(
    "args, overrides, message",
    [
        (["--nproc", "1"], OVERRIDES, "at least 2 processes"),
        (["--modes", "full,sliding"], OVERRIDES, "unknown mode sliding"),
        (["--dtype", "float64"], OVERRIDES, "model.dtype"),
        (
            [],
            OVERRIDES
            + [
                "model.arch={model_type: llama, hidden_size: 48, intermediate_size: 64, num_hidden_layers: 1, "
                "num_attention_heads: 3, num_key_value_heads: 1, head_dim: 16}"
            ],
            "3 attention heads",
        ),
        ([], OVERRIDES + ["data.seq_len=127"], "data.seq_len = 127 is not divisible"),
    ],
)
def test_bad_input_ends_in_one_line(args, overrides, message, monkeypatch):
    monkeypatch.setattr("lctrain.diagnostics.check_sp.allowed_processes", lambda: 8)  # the same errors on any machine
    assert message in one_error_line(run_cli(args, overrides))


WEIGHTS_SCRIPT = """
import os, sys, deepspeed, torch
from lctrain.compat.deepspeed import disable_cpu_shm_comm_op
from lctrain.errors import UserError
from lctrain.diagnostics.check_sp import _check_same_weights
from lctrain.parallel.groups import end_process_groups
disable_cpu_shm_comm_op()
deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
rank = torch.distributed.get_rank()
torch.manual_seed(0)
_check_same_weights(torch.nn.Linear(4, 3))
torch.manual_seed(rank)
try:
    _check_same_weights(torch.nn.Linear(4, 3))
except UserError as e:
    print(f"rank {rank} refused: {e}")
end_process_groups()  # as every lctrain rank: gloo's threads left to the exit abort it now and then
sys.stdout.flush()  # and without the interpreter's teardown, where native threads still aborted a rank now and then
sys.stderr.flush()
os._exit(0)
"""


@pytest.mark.slow  # a 2-process launch of its own (~15 s) for a guard the main run passes through every time
def test_weights_that_differ_between_ranks_are_refused(tmp_path):
    script = tmp_path / "weights.py"
    script.write_text(WEIGHTS_SCRIPT)
    from lctrain.parallel.groups import free_port

    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--nnodes",
        "1",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
        str(script),
    ]
    proc = subprocess.run(cmd, env=clean_env(CUDA_VISIBLE_DEVICES=""), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("refused: the model's weights differ between the processes") == 2, proc.stdout
