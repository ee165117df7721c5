"""Long-prompt generation benchmark: does `lctrain eval`'s memory plan hold, and how long do prefill and decode take?

    python scripts/bench_generation.py                                    # CPU: tiny Llama, 2K prompt
    python scripts/bench_generation.py --model llama2-7b --lengths 65536 131072   # one GPU: the paper's 128K

A Llama-shaped model with random bf16 weights (GPU) or fp32 (CPU) answers a prompt of random token ids through the
planned generation path (lctrain.eval.generation: chunked prefill, the KV cache offloaded to host memory when it does
not fit). Per length it reports the plan, prefill and decode time, and on a GPU the measured peak memory against the
plan's prediction (weights + what the plan needs beside them), and the host cache beside the process's peak RSS (which
includes the Python runtime). Writes JSON after every length.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from lctrain.eval.generation import greedy_ids, plan_for
from lctrain.measure import host_peak_bytes, peak_bytes, reset_peak, synchronize
from lctrain.shapes import SHAPES, hf_arch
from lctrain.units import to_gb

MODELS = ("tiny", "llama2-7b")  # lctrain.shapes names


def build(model: str, device: torch.device):
    shape = SHAPES[model]
    # untied output embeddings, as Llama-2's, at every size
    arch = {k: v for k, v in hf_arch(shape).items() if k not in ("model_type", "tie_word_embeddings")}
    cfg = AutoConfig.for_model("llama", max_position_embeddings=1 << 20, rope_theta=1e7, vocab_size=shape.vocab, **arch)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    with torch.device(device):
        lm = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")
    return lm.eval()


def measure(lm, length: int, new_tokens: int, seed: int) -> dict:
    device = lm.device
    plan = plan_for(lm, length + new_tokens)
    ids = torch.randint(3, lm.config.vocab_size, (length,), generator=torch.Generator().manual_seed(seed)).tolist()
    weights = sum(p.numel() * p.element_size() for p in lm.parameters())
    synchronize(device)
    if device.type == "cuda":
        reset_peak(device)
    marks = []

    def first_token(new: list[int]) -> bool:  # called after each token; the argmax read has synchronized the device
        if len(new) == 1:
            marks.append(time.perf_counter())
        return False

    t0 = time.perf_counter()
    out = greedy_ids(lm, ids, new_tokens, plan, stop=first_token)
    synchronize(device)
    total = time.perf_counter() - t0
    prefill = (marks[0] if marks else time.perf_counter()) - t0
    peak = peak_bytes(device) if device.type == "cuda" else None
    return {
        "length": length,
        "new_tokens": len(out),
        "plan": plan.describe(),
        "offload": plan.offload,
        "prefill_s": prefill,
        "decode_s_per_token": max(total - prefill, 0.0) / max(len(out) - 1, 1),
        "weights_gb": to_gb(weights),
        "predicted_peak_gb": to_gb(weights + plan.device_bytes),
        "measured_peak_gb": to_gb(peak) if peak is not None else None,
        "host_cache_gb": to_gb(plan.host_bytes),
        "host_peak_rss_gb": to_gb(host_peak_bytes()),
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="tiny")
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048])
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench_out/bench_generation.json")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    lm = build(args.model, device)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for length in args.lengths:
        rows.append(measure(lm, length, args.new_tokens, args.seed))
        r = rows[-1]
        peak = (
            f", peak {r['measured_peak_gb']:.1f} GB vs predicted {r['predicted_peak_gb']:.1f} GB"
            if r["measured_peak_gb"] is not None
            else ""
        )
        print(
            f"{length}: {r['plan']}; prefill {r['prefill_s']:.1f} s, decode {r['decode_s_per_token'] * 1e3:.0f} "
            f"ms/token{peak}",
            flush=True,
        )
        out.write_text(json.dumps({"args": vars(args), "device": str(device), "results": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
