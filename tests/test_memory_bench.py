"""scripts/bench_memory.py runs end to end on a micro size and its predictions stay within 15% of its measurements."""

import importlib.util
import json
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_memory.py"


def test_cpu_rows_are_written_and_predicted(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("bench_memory", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "bench.json"
    monkeypatch.setattr(sys, "argv", ["bench_memory.py", "--seq-len", "1024", "--steps", "1", "--settings",
                                      "baseline,checkpointing+tiled_mlp", "--out", str(out)])
    bench.main()
    rows = json.loads(out.read_text())["results"]
    assert [r["setting"] for r in rows] == ["baseline", "checkpointing+tiled_mlp"]
    assert rows[1]["measured_peak_gb"] < rows[0]["measured_peak_gb"]  # the settings save memory
    for r in rows:
        assert abs(r["predicted_over_measured"] - 1) <= 0.15, r
