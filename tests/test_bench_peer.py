"""scripts/bench_peer.py (lctrain.bench.peer): its CPU-side parts, the arguments, the A/B/A/B order, the document
positions the peers' masks read, the ratio and the tables; and, slow, a tiny run of lctrain and transformers in fresh
processes on the CPU. The torchtitan runner imports triton and runs on a GPU only (devtools/gpu_check `peer`).

References: the window layouts themselves (`lctrain.data.layouts`: anchors exactly at segment starts), medians and
ratios written out by hand, argparse's own exit on bad input.
"""

import dataclasses
import json
import statistics

import numpy as np
import pytest
from rich.console import Console

from lctrain.bench import peer
from lctrain.data.layouts import slimpajama_like_layouts

COMMON = dict(model="tiny", batch=1, dtype="float32", steps=1, warmup=0, checkpointing="none", device="cpu", seed=0)


def test_schedule_alternates_the_peers_within_each_length_and_mode():
    specs = peer.schedule(["lctrain", "torchtitan"], [32768, 65536], ["full", "document"], 2, **COMMON)
    assert [(s.seq_len, s.mode, s.peer) for s in specs[:8]] == [
        (32768, "full", "lctrain"),
        (32768, "full", "torchtitan"),
        (32768, "full", "torchtitan"),  # A/B/B/A: neither runs first every time
        (32768, "full", "lctrain"),
        (32768, "document", "torchtitan"),
        (32768, "document", "lctrain"),
        (32768, "document", "lctrain"),
        (32768, "document", "torchtitan"),
    ]
    one_round = peer.schedule(["lctrain", "torchtitan"], [65536], ["full", "document"], 1, **COMMON)
    assert [s.peer for s in one_round] == ["lctrain", "torchtitan", "torchtitan", "lctrain"]
    assert len(specs) == 2 * 2 * 2 * 2
    assert [(s.seq_len, s.mode) for s in specs[::4]] == [
        (32768, "full"),
        (32768, "document"),
        (65536, "full"),
        (65536, "document"),
    ]


def test_a_run_spec_survives_the_command_line_of_its_process():
    spec = peer.RunSpec(peer="transformers", seq_len=4096, mode="document", **{**COMMON, "checkpointing": "full"})
    assert peer.RunSpec.from_argv(spec.argv()) == spec
    tuned = dataclasses.replace(spec, lctrain_set=('model.arch={"a": 1}', "model.fused_kernels=liger"))
    assert peer.RunSpec.from_argv(tuned.argv()) == tuned
    assert spec.tokens == 4096


def test_document_positions_restart_exactly_at_the_anchors():
    ids, seg_lens = peer.windows(peer.RunSpec(peer="lctrain", seq_len=4096, mode="document", **COMMON))
    assert seg_lens == slimpajama_like_layouts(4096, 1, 0)
    positions = peer.document_positions(ids)
    want = np.concatenate([np.arange(n) for n in seg_lens[0]])  # each document counts from 0
    np.testing.assert_array_equal(positions[0], want)
    assert positions.shape == ids.shape


def test_document_ends_mark_the_last_token_of_every_document_but_the_window_s_last():
    """torchtitan 0.2 starts a document after every marked token: the marks must fall just before each anchor."""
    ids, seg_lens = peer.windows(peer.RunSpec(peer="torchtitan", seq_len=4096, mode="document", **COMMON))
    ends = peer.document_ends(ids)
    want = np.zeros(4096, dtype=ids.dtype)
    want[np.cumsum(seg_lens[0])[:-1] - 1] = 1  # the documents' last tokens, the window's own end excluded
    np.testing.assert_array_equal(ends[0], want)
    starts_after_marks = np.flatnonzero(np.concatenate([[1], ends[0][:-1]]))
    np.testing.assert_array_equal(starts_after_marks, np.flatnonzero(peer.document_positions(ids)[0] == 0))


def test_document_positions_refuse_a_window_without_a_leading_anchor():
    with pytest.raises(ValueError, match="start with the anchor"):
        peer.document_positions(np.array([[5, 1, 7]]))


def _row(length, mode, name, rate=None, error=None):
    row = {"seq_len": length, "mode": mode, "peer": name}
    if rate is not None:
        row.update(tokens_per_s=rate, step_s=length / rate, peak_gb=1.0)
    if error:
        row["error"] = error
    return row


def test_ratio_is_of_the_medians_and_skips_failed_runs():
    rows = [
        _row(8, "full", "lctrain", 100.0),
        _row(8, "full", "torchtitan", 50.0),
        _row(8, "full", "lctrain", 120.0),
        _row(8, "full", "torchtitan", error="exit 1: ModuleNotFoundError"),
        _row(8, "full", "lctrain", 300.0),
        _row(8, "full", "transformers", 60.0),
        _row(8, "document", "torchtitan", 10.0),
    ]
    summary = {(s["seq_len"], s["mode"], s["peer"]): s for s in peer.ratios(rows)}
    titan = summary[(8, "full", "torchtitan")]
    assert titan["lctrain_tokens_per_s"] == statistics.median([100.0, 120.0, 300.0]) == 120.0
    assert titan["ratio"] == 120.0 / 50.0 and titan["runs"] == 1
    assert summary[(8, "full", "transformers")]["ratio"] == 2.0
    assert summary[(8, "document", "torchtitan")]["ratio"] is None  # no lctrain run to compare with
    assert all(s["peer"] != "lctrain" for s in summary.values())


def test_tables_show_every_run_and_every_ratio():
    rows = [_row(8, "full", "lctrain", 100.0), _row(8, "full", "torchtitan", error="exit 1: no triton")]
    console = Console(width=200, record=True)
    console.print(peer.row_table(rows))
    console.print(peer.ratio_table(peer.ratios(rows + [_row(8, "full", "transformers", 40.0)])))
    text = console.export_text()
    assert "exit 1: no triton" in text and "2.50x" in text and "100" in text


def test_arguments_default_by_device_and_refuse_bad_values(capsys):
    args = peer.parse_args(["--device", "cpu"])
    assert (args.dtype, args.checkpointing, args.lengths, args.peers) == (
        "float32",
        "none",
        [32768, 65536],
        list(peer.PEERS),
    )
    assert peer.parse_args(["--device", "cuda", "--checkpointing", "none"]).dtype == "bfloat16"
    assert peer.parse_args(["--device", "cuda"]).checkpointing == "full"
    tuned = [
        "--peers",
        "lctrain",
        "torchtitan",
        "--checkpointing",
        "selective",
        "--lctrain-set",
        "model.fused_kernels=liger",
    ]
    assert peer.parse_args(["--device", "cpu", *tuned]).lctrain_set == ["model.fused_kernels=liger"]
    for bad in (
        ["--lengths", "0"],
        ["--rounds", "0"],
        ["--warmup", "-1"],
        ["--peers", "lctrain", "lctrain"],
        ["--modes", "anchor"],
        ["--checkpointing", "selective"],  # transformers, among the default peers, has no selective policy
        ["--lctrain-set", "model.fused_kernels=fast"],  # not a value lctrain's config takes
        ["--lctrain-set", "model.nonsense=1"],
    ):
        with pytest.raises(SystemExit):
            peer.parse_args(["--device", "cpu", *bad])
    assert "error" in capsys.readouterr().err


@pytest.mark.slow
def test_lctrain_and_transformers_run_in_fresh_processes(tmp_path, capsys):
    out = tmp_path / "peer.json"
    peer.main(
        ["--model", "tiny", "--lengths", "128", "--modes", "document", "--peers", "lctrain", "transformers"]
        + ["--device", "cpu", "--steps", "1", "--warmup", "0", "--rounds", "1", "--out", str(out)]
    )
    data = json.loads(out.read_text())
    assert [r["peer"] for r in data["rows"]] == ["lctrain", "transformers"]
    assert all(r["tokens_per_s"] > 0 and "error" not in r for r in data["rows"])
    (ratio,) = data["ratios"]
    assert ratio["ratio"] == pytest.approx(data["rows"][0]["tokens_per_s"] / data["rows"][1]["tokens_per_s"])
    assert "lctrain / peer" in capsys.readouterr().out


@pytest.mark.slow  # a fresh process importing torch and lctrain: ~8 s on 2 cores
def test_a_failed_run_keeps_its_whole_stderr_in_the_log(tmp_path):
    """A row keeps the last line of a failed run's stderr (often torch.compile's 'Set TORCHDYNAMO_VERBOSE=1'); the
    traceback that says why is in the log beside the JSON."""
    log = tmp_path / "peer.log"
    spec = peer.RunSpec("lctrain", "tiny", 128, "full", 1, "float32", 1, 0, "none", device="no-such-device")
    row = peer.run_fresh(spec, timeout=120, log=log)
    assert row["error"].startswith("exit 1: ") and row["error"].endswith(f"(stderr in {log})")
    header, *stderr = log.read_text().splitlines()
    assert header == "=== lctrain L=128 full: exit 1"
    assert stderr[0] == "Traceback (most recent call last):" and len(stderr) > 3
