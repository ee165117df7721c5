"""lctrain.bench.generation (scripts/bench_generation.py) runs the planned generation path end to end on a tiny CPU
model: the plan it reports is the one eval uses, its answers equal transformers' own greedy generate, and it writes
its JSON."""

import json

import torch
from transformers import GenerationConfig

import lctrain.bench.generation as bench


def test_runs_and_its_path_is_greedy(tmp_path, capsys):
    out = tmp_path / "gen.json"
    bench.main(["--device", "cpu", "--lengths", "96", "--new-tokens", "5", "--out", str(out)])
    (row,) = json.loads(out.read_text())["results"]
    assert row["length"] == 96 and row["new_tokens"] == 5 and 0 < row["prefill_s"] and row["decode_s_per_token"] >= 0
    assert row["offload"] is False and "KV cache on the device" in row["plan"]
    assert row["measured_peak_gb"] is None and row["predicted_peak_gb"] > row["weights_gb"] > 0
    assert "prefill" in capsys.readouterr().out

    from lctrain.eval.generation import greedy_ids, plan_for

    lm = bench.build("tiny", torch.device("cpu"))
    ids = torch.randint(3, 32000, (96,), generator=torch.Generator().manual_seed(0)).tolist()
    gen = GenerationConfig(
        max_new_tokens=5, do_sample=False, num_beams=1, use_cache=True, eos_token_id=None, pad_token_id=0
    )
    x = torch.tensor([ids])
    with torch.no_grad():
        want = lm.generate(input_ids=x, attention_mask=torch.ones_like(x), generation_config=gen)[0, 96:].tolist()
    assert greedy_ids(lm, ids, 5, plan_for(lm, 101)) == want
