"""Training-step benchmark per attention mode: tokens/s, MFU and peak memory of the trainer's own step
(`Trainer.train_step`: make_batch -> HF model with the lctrain engine -> chunked loss -> DeepSpeed step) on
SlimPajama-like windows.

    python scripts/bench_train.py                                   # CPU: tiny Llama, 1K windows
    python scripts/bench_train.py --model llama-1b --seq-len 65536  # one GPU: Llama-shaped 1B at 64K, bf16

Windows are packed from document lengths drawn from SlimPajama's per-domain mix (`lctrain.data.layouts`, shared with
scripts/bench_attention.py: most documents short, a few book-length), so `anchor`/`intra_doc` skip the attention a
real batch would let them skip.
Prints a table and writes JSON (default bench_out/bench_train.json).
"""

from __future__ import annotations

import argparse
import json
from functools import partial
from pathlib import Path

import numpy as np
import torch
from rich.table import Table

from lctrain.config import load_config
from lctrain.console import plain_console
from lctrain.data.layouts import slimpajama_like_layouts, window_ids
from lctrain.fused import MODES as MODES_FUSED
from lctrain.hardware import device_peak_flops
from lctrain.measure import peak_bytes, reset_peak, timed
from lctrain.parallel.groups import init_topology, release_single_process
from lctrain.profiling import profiled_kernels
from lctrain.shapes import SHAPES, hf_arch
from lctrain.train.trainer import Trainer
from lctrain.units import to_gb

MODELS = ("tiny", "llama-1b")  # lctrain.shapes names


def bench_mode(mode: str, args, device: torch.device) -> dict:
    gpu = device.type == "cuda"
    zero_stage = 1 if gpu else 0  # bf16 needs ZeRO's fp32 master weights
    shape = SHAPES[args.model]
    cfg = load_config(
        None,
        [
            f"data.seq_len={args.seq_len}",
            f"attention.mode={mode}",
            "attention.engine=auto",
            f"model.dtype={'bfloat16' if gpu else 'float32'}",
            f"model.checkpointing={args.checkpointing or ('full' if gpu else 'none')}",
            f"model.arch={json.dumps(hf_arch(shape))}",
            f"train.global_batch={args.batch}",
            f"train.micro_batch={args.batch}",
            f"parallel.zero_stage={zero_stage}",
            f"model.fused_kernels={args.fused_kernels}",
            f"train.fused_optimizer={args.fused_optimizer}",
        ],
    )
    trainer = Trainer(cfg, init_topology(cfg), vocab_size=shape.vocab)
    seg_lens = slimpajama_like_layouts(args.seq_len, args.batch, args.seed)
    windows = [
        {
            "input_ids": window_ids(seg_lens, vocab=shape.vocab, anchor=1, seed=args.seed),
            "seg_lens": [np.array(s) for s in seg_lens],
            "seg_doc": [np.arange(len(s)) for s in seg_lens],
            "tag_lens": [np.zeros(len(s), dtype=np.int64) for s in seg_lens],
        }
    ]
    times, mem_scope = [], None
    for i in range(args.warmup + args.steps):
        if i == args.warmup:
            mem_scope = reset_peak(device)
        result, seconds = timed(partial(trainer.train_step, windows), device)
        times.append(seconds)
    kernels = profiled_kernels(partial(trainer.train_step, windows), device, args.profile) if args.profile else []
    step = float(np.median(times[args.warmup :]))
    tokens = cfg.tokens_per_step
    flops = trainer.step_flops(tokens, result.pairs)
    square = trainer.full_square_flops()
    hardware = trainer.hardware_flops(tokens, result.pairs)
    peak = device_peak_flops(device, args.peak_tflops, trainer.cfg.model.dtype)
    out = {
        "mode": mode,
        "engine": trainer.attention.name,
        "step_s": step,
        "tokens_per_s": tokens / step,
        "tflops_per_gpu": flops / step / 1e12,
        "hardware_tflops_per_gpu": hardware / step / 1e12,
        "checkpointing": trainer.cfg.model.checkpointing_mode,
        "fused_kernels": args.fused_kernels,
        "fused_optimizer": args.fused_optimizer,
        "mfu": flops / step / peak if peak else None,
        "mfu_full_square": square / step / peak if peak else None,
        "hfu": hardware / step / peak if peak else None,
        "peak_mem_gb": to_gb(peak_bytes(device)),
        "peak_mem_scope": mem_scope,
        "docs_per_window": float(np.mean([len(s) for s in seg_lens])),
        **({"kernels": kernels} if args.profile else {}),
    }
    del trainer
    if gpu:
        torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=1, help="windows per step")
    parser.add_argument("--modes", default="full,intra_doc,intra_doc_reset,anchor")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help="device peak for MFU (default: known GPU table, or a measured fp32 matmul rate on CPU)",
    )
    parser.add_argument(
        "--checkpointing",
        choices=["full", "selective", "selective_matmul", "none"],
        default=None,
        help="model.checkpointing (default: full on a GPU, none on the CPU)",
    )
    parser.add_argument(
        "--fused-kernels", choices=MODES_FUSED, default="none", help="model.fused_kernels (lctrain.fused)"
    )
    parser.add_argument("--fused-optimizer", action="store_true", help="train.fused_optimizer: torch's fused AdamW")
    parser.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="log the N kernels (CPU: operators) with the most self time in one more profiled step per mode, after "
        "the timed ones",
    )
    parser.add_argument("--out", default="bench_out/bench_train.json")
    args = parser.parse_args(argv)

    device = init_topology(load_config(None, [])).device
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for mode in args.modes.split(","):
        rows.append(bench_mode(mode, args, device))
        r = rows[-1]
        print(
            f"{mode}: {r['step_s']:.3f} s/step, {r['tokens_per_s']:,.0f} tokens/s, peak {r['peak_mem_gb']:.2f} GB",
            flush=True,
        )
        # written after every mode, so a run stopped at a time limit keeps what it measured
        out.write_text(json.dumps({"args": vars(args), "device": str(device), "results": rows}, indent=1))
    full = next((r for r in rows if r["mode"] == "full"), None)
    table = Table(title=f"train step, {args.model}, {args.batch} x {args.seq_len} tokens, {device.type}")
    for col in (
        "mode",
        "engine",
        "step s",
        "vs full",
        "tokens/s",
        "MFU strict",
        "MFU full-square",
        "HFU",
        "peak mem GB",
    ):
        table.add_column(col, justify="right")
    for r in rows:
        rel = f"{r['step_s'] / full['step_s']:.0%}" if full else "-"
        share = [f"{r[k]:.1%}" if r[k] is not None else "n/a" for k in ("mfu", "mfu_full_square", "hfu")]
        table.add_row(
            r["mode"],
            r["engine"],
            f"{r['step_s']:.3f}",
            rel,
            f"{r['tokens_per_s']:,.0f}",
            *share,
            f"{r['peak_mem_gb']:.2f}",
        )
    plain_console(width=140).print(table)
    if args.profile:
        plain_console(width=140).print(kernel_table(rows))
    print(f"wrote {out}")
    release_single_process()  # else NCCL warns at exit that the process group was never destroyed


def kernel_table(rows: list[dict]) -> Table:
    """Each mode's profiled kernels: name, calls, milliseconds and share of the step's self time."""
    table = Table(title="top kernels by self time (one profiled step per mode)")
    for col in ("mode", "kernel", "calls", "total ms", "share"):
        table.add_column(col, justify="left" if col == "kernel" else "right")
    for r in rows:
        for k in r["kernels"]:
            table.add_row(r["mode"], k["name"], str(k["count"]), f"{k['total_ms']:.1f}", f"{k['share']:.1%}")
    return table


if __name__ == "__main__":
    main()
