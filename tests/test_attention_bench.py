"""lctrain.bench.attention (scripts/bench_attention.py) runs end to end on a tiny size and reports the FLOP-ideal
speedups correctly."""

import json

import pytest
import torch


@pytest.fixture(scope="module")
def bench():
    import lctrain.bench.attention as module

    return module


def test_layouts_fill_windows():
    from lctrain.data.layouts import slimpajama_like_layouts, window_ids

    windows = slimpajama_like_layouts(4096, 3, seed=0)
    assert all(sum(w) == 4096 and min(w) >= 1 for w in windows)
    assert slimpajama_like_layouts(4096, 3, seed=0) == windows  # seeded
    ids = window_ids(windows, vocab=32000, anchor=1, seed=0)
    for row, lens in zip(ids, windows):
        starts = {sum(lens[:i]) for i in range(len(lens))}
        assert all((row[t] == 1) == (t in starts) for t in range(4096))  # the anchor exactly at segment starts


def test_interleaved_layout_keeps_chunk_order_and_window_length(bench):
    import numpy as np

    lens, docs = bench.interleave([20, 1, 30, 13], np.random.default_rng(0))
    assert sum(lens) == 64 and min(lens) >= 1 and len(docs) > 4  # chunks add no tokens: the window keeps its length
    assert all(1 <= docs.count(d) <= 3 for d in set(docs))
    assert docs.count(1) <= 1  # a one-token document is never split


def test_interleaved_run(bench, tmp_path):
    out = tmp_path / "bench.json"
    bench.main(
        [
            "--device",
            "cpu",
            "--lengths",
            "256",
            "--reps",
            "1",
            "--engines",
            "sdpa",
            "--modes",
            "full",
            "anchor",
            "--interleave",
            "--out",
            str(out),
        ]
    )
    rows = json.loads(out.read_text())["results"]
    assert [r["mode"] for r in rows] == ["full", "anchor"]
    assert rows[1]["segments"] > 1 and rows[1]["ideal_speedup"] >= 1


def test_runs_and_writes_json(bench, tmp_path, capsys):
    out = tmp_path / "bench.json"
    bench.main(["--device", "cpu", "--lengths", "256", "--reps", "1", "--dtype", "float32", "--out", str(out)])
    data = json.loads(out.read_text())
    rows = {(r["engine"], r["mode"]): r for r in data["results"]}
    assert set(rows) == {
        (e, m) for e in ("sdpa", "reference") for m in ("full", "intra_doc", "intra_doc_reset", "anchor")
    }
    assert rows[("sdpa", "full")]["speedup"] == 1.0
    for r in data["results"]:  # the cost model's pairs and FLOPs, not a second formula
        assert r["ideal_speedup"] == pytest.approx(256 * 257 / 2 / r["pairs"])
        assert r["seconds"] == r["forward_seconds"] + r["backward_seconds"]
        assert r["tflops_strict"] == pytest.approx(12 * 2 * 64 * r["pairs"] / r["seconds"] / 1e12)
        assert r["tflops_full_square"] == pytest.approx(12 * 2 * 64 * 256 * 256 / r["seconds"] / 1e12)
        assert r["forward_tflops_strict"] == pytest.approx(4 * 2 * 64 * r["pairs"] / r["forward_seconds"] / 1e12)
        assert r["backward_tflops_strict"] == pytest.approx(8 * 2 * 64 * r["pairs"] / r["backward_seconds"] / 1e12)
    assert all(r["seconds"] > 0 and r["ideal_speedup"] >= 1 for r in data["results"])
    assert "speedup vs full" in capsys.readouterr().out


def test_row_math_on_a_tiny_window(bench):
    # 4 tokens, documents of 3 and 1: 6 + 1 causal pairs, 16 in the full square; width 2, 1 s forward, 2 s backward
    row = bench.attention_row(4, [3, 1], [0, 1], "intra_doc", 2, 1.0, 2.0)
    assert row["pairs"] == 7 and row["ideal_speedup"] == 10 / 7
    assert row["tflops_strict"] == pytest.approx(3 * 4 * 2 * 7 / 3 / 1e12)
    assert row["tflops_full_square"] == pytest.approx(3 * 4 * 2 * 16 / 3 / 1e12)
    assert row["forward_tflops_full_square"] == pytest.approx(4 * 2 * 16 / 1e12)
    assert row["backward_tflops_full_square"] == pytest.approx(2 * 4 * 2 * 16 / 2 / 1e12)


def test_preset_and_token_major_layout(bench, tmp_path):
    q, k, v = bench.token_major_qkv(8, 4, 2, 16, torch.float32, "cpu")
    assert q.shape == (1, 8, 4, 16) and k.shape == v.shape == (1, 8, 2, 16)
    assert not q.transpose(1, 2).is_contiguous()  # what the engine gets: a view, as from the model's projections
    out = tmp_path / "bench.json"
    args = ["--device", "cpu", "--lengths", "128", "--reps", "1", "--engines", "sdpa", "--modes", "anchor"]
    bench.main([*args, "--preset", "1b", "--dtype", "float32", "--out", str(out)])
    meta = json.loads(out.read_text())["meta"]
    assert (meta["heads"], meta["kv_heads"], meta["head_dim"]) == (32, 8, 64)
    with pytest.raises(SystemExit):
        bench.main([*args, "--preset", "1b", "--heads", "4"])
    with pytest.raises(SystemExit):
        bench.main([*args, "--preset", "13b"])
    with pytest.raises(SystemExit):
        bench.main([*args, "--heads", "6", "--kv-heads", "4"])


def test_profile_logs_the_operators_by_self_time(bench, tmp_path, capsys):
    out = tmp_path / "bench.json"
    args = ["--device", "cpu", "--lengths", "256", "--reps", "1", "--engines", "sdpa", "--modes", "full", "anchor"]
    bench.main([*args, "--dtype", "float32", "--profile", "4", "--out", str(out)])
    rows = json.loads(out.read_text())["results"]
    for r in rows:
        kernels = r["kernels"]
        assert 1 <= len(kernels) <= 4
        assert [k["total_ms"] for k in kernels] == sorted((k["total_ms"] for k in kernels), reverse=True)
        assert all(k["count"] >= 1 and k["total_ms"] > 0 for k in kernels)
    # the CPU flash-attention kernel the sdpa engine calls, forward and backward, is among the top operators
    names = {k["name"] for k in rows[0]["kernels"]}
    assert {
        "aten::_scaled_dot_product_flash_attention_for_cpu",
        "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
    } & names
    assert "top kernels by self time" in capsys.readouterr().out
