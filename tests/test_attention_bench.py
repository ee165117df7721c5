"""lctrain.bench.attention (scripts/bench_attention.py) runs end to end on a tiny size and reports the FLOP-ideal
speedups correctly."""

import json

import pytest


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
        assert r["tflops"] == pytest.approx(12 * 2 * 64 * r["pairs"] / r["seconds"] / 1e12)
    assert all(r["seconds"] > 0 and r["ideal_speedup"] >= 1 for r in data["results"])
    assert "speedup vs full" in capsys.readouterr().out
