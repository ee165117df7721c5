"""lctrain.bench.train (scripts/bench_train.py) on the CPU: the trainer's step per mode, and the profiled kernels."""

import json


def test_a_profiled_cpu_run_ranks_each_modes_operators(tmp_path, capsys, one_thread):
    from lctrain.bench.train import main

    out = tmp_path / "bench_train.json"
    main(
        [
            "--seq-len",
            "256",
            "--modes",
            "full,anchor",
            "--steps",
            "1",
            "--warmup",
            "0",
            "--profile",
            "3",
            "--out",
            str(out),
        ]
    )
    rows = json.loads(out.read_text())["results"]
    assert [r["mode"] for r in rows] == ["full", "anchor"]
    for r in rows:
        kernels = r["kernels"]
        assert len(kernels) == 3
        assert [k["total_ms"] for k in kernels] == sorted((k["total_ms"] for k in kernels), reverse=True)
        assert 0 < sum(k["share"] for k in kernels) <= 1
    assert "aten::mm" in {k["name"] for r in rows for k in r["kernels"]}
    assert "top kernels by self time (one profiled step per mode)" in capsys.readouterr().out
