"""The training loss three ways: lctrain's `chunked_loss_sum` with each `train.loss_gradients` (forward: `lctrain`,
recompute: `lctrain_recompute`) against DeepSpeed's `TiledFusedLogitsLoss` (ulysses_sp), each summing cross-entropy
over the valid labels from [B, S, hidden] states without the full logits.

Correctness: loss and gradients (hidden states and lm_head weight) against full-logits cross-entropy in fp64, with
labels -100, chunks that do not divide the length and micro-batch 2, both for `loss.backward()` and for the trainer's
`(loss * scale).backward()` (the step's normalisation, train/loss.py).
Memory and time: each (method, tokens) runs in a fresh subprocess with glibc's mmap threshold at 64 KiB, so every
tensor above that is its own mapping, returned to the system when freed: the resident set follows the live tensor
bytes, whatever the CPU. After a warm-up forward + backward (libraries, thread pools, kernel scratch), the resident
set high-water mark (VmHWM) is reset through /proc/self/clear_refs; peak = VmHWM after one more forward + backward
minus the resident set before it: the bytes the loss needs beyond its inputs (hidden states, lm_head, labels).
Time = forward + backward, the best of the warm-up and --reps runs, as wall clock and as this process's CPU time
(one thread by default: on a shared machine the CPU seconds are the work done, the wall clock includes waiting).

    python scripts/bench_loss.py --tokens 16384 32768 --vocab 32000 --hidden 512 --chunk 8192 --threads 1
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from lctrain.attention import IGNORE_INDEX
from lctrain.measure import host_peak_bytes, reset_host_peak
from lctrain.train.loss import DEFAULT_CHUNK_TOKENS, chunked_loss_sum
from lctrain.units import to_gb

METHODS = ("lctrain", "lctrain_recompute", "deepspeed", "full_logits")
_GRADIENTS = {"lctrain": "forward", "lctrain_recompute": "recompute"}


def _ce_sum(lm_head, x, y):
    return F.cross_entropy(
        lm_head(x).float().reshape(-1, lm_head.out_features), y.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
    )


def loss_sum(method: str, lm_head, hidden, labels, chunk_tokens: int):
    """The token-loss sum by `method`: the one chunk size, given as tokens (DeepSpeed takes a shard count)."""
    if method in _GRADIENTS:
        return chunked_loss_sum(lm_head, hidden, labels, chunk_tokens, gradients=_GRADIENTS[method])
    if method == "deepspeed":
        # deepspeed on use: it takes seconds to import (start-up time); only --method deepspeed needs it
        from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss

        shards = math.ceil(hidden.shape[0] * hidden.shape[1] / chunk_tokens)
        return TiledFusedLogitsLoss.apply(_ce_sum, lm_head, hidden, labels, None, shards, [lm_head.weight], "sum")
    return _ce_sum(lm_head, hidden, labels)


def _problem(batch, seq, hidden_size, vocab, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    lm_head = torch.nn.Linear(hidden_size, vocab, bias=False).to(dtype)
    with torch.no_grad():
        lm_head.weight.copy_(torch.randn(vocab, hidden_size, generator=g, dtype=torch.float64) / hidden_size**0.5)
    hidden = torch.randn(batch, seq, hidden_size, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, (batch, seq), generator=g)
    labels[:, -1] = IGNORE_INDEX
    labels[torch.rand(batch, seq, generator=g) < 0.2] = IGNORE_INDEX
    return lm_head, hidden, labels


def _rel(a, b):
    return float((a.double() - b).abs().max() / b.abs().max())


def correctness() -> list[dict]:
    """Max relative error of loss and gradients of fp32 inputs against full logits in fp64: 2 x 37 tokens, chunks of
    10 tokens (not dividing 37), vocab 50, hidden 16; backward from the loss (scale 1) and from loss / 61 (the
    trainer's normalisation)."""
    rows = []
    for scale in (1.0, 1 / 61):
        ref_head, ref_hidden, labels = _problem(2, 37, 16, 50, torch.float64)
        ref = F.cross_entropy(
            ref_head(ref_hidden).reshape(-1, 50), labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
        )
        (ref * scale).backward()
        for method in METHODS[:3]:
            head, hidden, _ = _problem(2, 37, 16, 50, torch.float32)
            loss = loss_sum(method, head, hidden, labels, chunk_tokens=10)
            (loss * scale).backward()
            rows.append(
                {
                    "method": method,
                    "grad_scale": scale,
                    "loss": _rel(loss.detach(), ref.detach()),
                    "grad_hidden": _rel(hidden.grad, ref_hidden.grad),
                    "grad_lm_head": _rel(head.weight.grad, ref_head.weight.grad),
                }
            )
    return rows


def measure_one(method: str, tokens: int, vocab: int, hidden_size: int, chunk: int, reps: int, threads: int) -> dict:
    """Run in a fresh process: a warm-up forward + backward, then the peak bytes of the next, then `reps - 1` more
    for the time."""
    torch.set_num_threads(threads)
    lm_head, hidden, labels = _problem(1, tokens, hidden_size, vocab, torch.float32)
    times, cpu_times = [], []
    for _ in range(max(reps, 1) + 1):
        lm_head.weight.grad, hidden.grad = None, None
        if len(times) == 1:
            if not reset_host_peak():
                raise SystemExit("error: the loss benchmark measures the peak resident set of one step: Linux only")
            base = host_peak_bytes()  # just reset: the current resident set
        t0, c0 = time.perf_counter(), time.process_time()
        loss_sum(method, lm_head, hidden, labels, chunk).backward()
        times.append(time.perf_counter() - t0)
        cpu_times.append(time.process_time() - c0)
        if len(times) == 2:
            peak = host_peak_bytes() - base
    return {
        "method": method,
        "tokens": tokens,
        "peak_gb": to_gb(peak),
        "time_s": min(times),
        "cpu_s": min(cpu_times),
        "loss": float(loss_sum(method, lm_head, hidden.detach(), labels, chunk)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[16384, 32768])
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--chunk", type=int, default=DEFAULT_CHUNK_TOKENS)
    parser.add_argument("--reps", type=int, default=1, help="timed runs after the warm-up")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--full-logits-up-to",
        type=int,
        default=16384,
        help="also measure plain full-logits cross-entropy up to this many tokens",
    )
    parser.add_argument("--json", type=Path, default=Path("bench_loss.json"))
    parser.add_argument("--one", nargs=2, metavar=("METHOD", "TOKENS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(
            json.dumps(
                measure_one(args.one[0], int(args.one[1]), args.vocab, args.hidden, args.chunk, args.reps, args.threads)
            )
        )
        return

    checks = correctness()
    print("max relative error of fp32 against fp64 full logits (2 x 37 tokens, chunks of 10, 20% labels -100)")
    print(f"{'method':<17} {'grad_scale':>10} {'loss':>9} {'d hidden':>9} {'d lm_head':>9}")
    for r in checks:
        print(
            f"{r['method']:<17} {r['grad_scale']:>10.4g} {r['loss']:>9.1e} {r['grad_hidden']:>9.1e} "
            f"{r['grad_lm_head']:>9.1e}"
        )
    runs = []
    for tokens in args.tokens:
        for method in METHODS:
            if method == "full_logits" and tokens > args.full_logits_up_to:
                continue
            out = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--one",
                    method,
                    str(tokens),
                    "--vocab",
                    str(args.vocab),
                    "--hidden",
                    str(args.hidden),
                    "--chunk",
                    str(args.chunk),
                    "--reps",
                    str(args.reps),
                    "--threads",
                    str(args.threads),
                ],
                capture_output=True,
                text=True,
                check=True,
                env=os.environ | {"MALLOC_MMAP_THRESHOLD_": "65536"},
            ).stdout
            runs.append(json.loads(out.strip().splitlines()[-1]))
    print(
        f"\npeak and time of forward + backward, vocab {args.vocab}, hidden {args.hidden}, fp32, chunks of "
        f"{args.chunk} tokens, {args.threads} thread(s)"
    )
    print(f"{'tokens':>7} {'method':<17} {'peak GB':>8} {'wall s':>7} {'CPU s':>7} {'loss':>14}")
    for r in runs:
        print(
            f"{r['tokens']:>7} {r['method']:<17} {r['peak_gb']:>8.2f} {r['time_s']:>7.2f} {r['cpu_s']:>7.2f} "
            f"{r['loss']:>14.6g}"
        )
    args.json.write_text(
        json.dumps({"correctness": checks, "runs": runs, "args": vars(args) | {"json": str(args.json)}}, indent=1)
    )


if __name__ == "__main__":
    main()
