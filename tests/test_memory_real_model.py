"""`lctrain plan` against a real pretrained model's training on CPU (SmolLM2-135M: 30 layers, vocabulary 49,152,
tied embeddings, fp32, ZeRO-0): the predicted tensors against the exact peak of CPU tensor storage, and the predicted
host memory (runtime and allocator included) against the peak resident set of the training process
(`real_model_memory.py`, one process per setting, one at a time). docs/memory.md has the numbers."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from real_model_memory import config
from train_helpers import clean_env

from lctrain.memory import need, plan_memory
from lctrain.model import model_shape

pytestmark = pytest.mark.real_model

TENSOR_TOLERANCE = 0.05
RSS_TOLERANCE = 0.15


@pytest.mark.parametrize(
    "seq_len,checkpointing", [(2048, "full"), (1024, "full"), (1024, "none")], ids=["2K-ckpt", "1K-ckpt", "1K"]
)
def test_plan_within_tolerance_of_the_measured_peak(model_dir, seq_len, checkpointing):
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("real_model_memory.py")), str(model_dir), str(seq_len)]
        + [checkpointing],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    measured = json.loads(proc.stdout.strip().splitlines()[-1])
    cfg = config(str(model_dir), seq_len, checkpointing)
    plan = plan_memory(cfg, model_shape(cfg), gpu=False)
    tensors = plan.total("device") + plan.total("host")
    host = need(plan, gpu=False)[1]
    print(
        f"{seq_len} {checkpointing}: tensors {tensors / 1e9:.3f} predicted, {measured['peak_tensor_bytes'] / 1e9:.3f}"
        f" measured; host {host / 1e9:.3f} predicted, {measured['peak_rss_bytes'] / 1e9:.3f} measured (RSS)"
    )
    assert tensors / measured["peak_tensor_bytes"] == pytest.approx(1, abs=TENSOR_TOLERANCE)
    assert host / measured["peak_rss_bytes"] == pytest.approx(1, abs=RSS_TOLERANCE)
