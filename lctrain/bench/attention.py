"""Attention benchmark: forward and backward time of each engine and mode on SlimPajama-like packed windows.

q, k and v are laid out as the model passes them (token-major projections viewed head-major), in the head shape of a
trained model with --preset 1b or 7b. TFLOP/s are reported in two labelled conventions: strict (the causally visible
pairs the mode computes) and full-square (every L x L pair, torchtitan's and Megatron's MFU convention).

Prints a table and writes JSON. Next to each measured speedup of a document mode over `full` (same engine) it
prints the ideal one from attention FLOPs: visible (query, key) pairs of the causal window over the mode's visible
pairs, both counted by `lctrain.costmodel` (the cost model that MFU uses), and the achieved TFLOP/s. Times are the
best of --reps runs after a warm-up call (the median is in the JSON too): on a shared machine the minimum is the
stable estimate of the intrinsic cost. Segment layouts are the seeded SlimPajama-like windows that
scripts/bench_train.py uses too (`lctrain.data.layouts`), or windows of a prepared dataset (--data DIR).

    python scripts/bench_attention.py --device cpu --lengths 8192 32768 --engines sdpa --threads 1
    python scripts/bench_attention.py --device cpu --lengths 8192 --interleave
    python scripts/bench_attention.py --device cuda --lengths 32768 131072 --preset 1b --profile 5

--profile N adds, per row, the N kernels with the most self time in one more profiled forward + backward (name, calls,
total ms; on CPU the operators), to the JSON and a second table.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from rich.progress import track
from rich.table import Table

from lctrain.attention import ENGINES, MODES, Batch, make_batch
from lctrain.console import plain_console
from lctrain.costmodel import attention_flops, full_square_pairs, visible_pairs
from lctrain.data.layouts import slimpajama_like_layouts
from lctrain.data.packing import chunk_order, split_into_chunks
from lctrain.data.store import open_packed
from lctrain.profiling import profiled_kernels
from lctrain.shapes import SHAPES

CPU_ENGINES = ("sdpa", "reference")
GPU_ENGINES = ("varlen", "sdpa", "flex")
REFERENCE_MAX_LEN = 8192  # the dense mask and scores are O(L²)
# The attention shapes of the models trained (lctrain.shapes): 1B is 32 query / 8 KV heads of dim 64, 7B 32/32 of 128.
PRESETS = {"1b": SHAPES["llama-1b"], "7b": SHAPES["llama2-7b"]}


def dataset_windows(path: str, length: int, rows: int) -> list[list[int]]:
    data = open_packed(path)
    if data.manifest.seq_len != length:
        raise SystemExit(f"{path}: windows are {data.manifest.seq_len} tokens, not {length}")
    return [data[i]["seg_lens"].tolist() for i in range(min(rows, len(data)))]


def interleave(seg_lens: list[int], rng: np.random.Generator) -> tuple[list[int], list[int]]:
    """Paper Fig. 5 layout as `lctrain.data.packing` builds it: each document of a window split into 2-3 chunks (its
    anchor in the first), chunks shuffled with every document's chunk order kept; the window keeps its length."""
    chunks = [[len(c) for c in split_into_chunks(np.arange(n), rng)] for n in seg_lens]
    next_chunk = [0] * len(chunks)
    lens, docs = [], []
    for d in chunk_order([len(c) for c in chunks], rng, open_end=False):
        lens.append(chunks[d][next_chunk[d]])
        docs.append(d)
        next_chunk[d] += 1
    return lens, docs


def token_major_qkv(L: int, heads: int, kv_heads: int, head_dim: int, dtype, device):
    """q, k, v as the model hands them to the engine: the projections' [1, L, H, D] outputs, viewed head-major by a
    transpose (no copy), so the benchmark pays no layout change the model does not pay."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    return tuple(
        torch.randn(1, L, h, head_dim, generator=gen).to(device, dtype).requires_grad_(True)
        for h in (heads, kv_heads, kv_heads)
    )


def time_engine(
    engine: str, batch: Batch, heads: int, kv_heads: int, head_dim: int, dtype, device, reps: int, profile: int = 0
):
    """(best forward, best backward, median forward + backward, first call) in seconds, and the `profile` kernels
    with the most time in one profiled forward + backward (`profiled_kernels`; [] for 0)."""
    L = batch.input_ids.shape[1]
    q, k, v = token_major_qkv(L, heads, kv_heads, head_dim, dtype, device)
    fn = ENGINES[engine].attention

    def forward():
        out, _ = fn(
            None,
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            None,
            scaling=head_dim**-0.5,
            **batch.attention_kwargs(),
        )
        return out

    def sync():
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize()

    def timed(fn):
        sync()
        t0 = time.perf_counter()
        result = fn()
        sync()
        return result, time.perf_counter() - t0

    def step():
        out = forward()
        out.backward(torch.ones_like(out))

    t0 = time.perf_counter()
    step()  # warm-up: builds the per-batch plan or block mask (and compiles on GPU)
    sync()
    first = time.perf_counter() - t0
    fwd, bwd = [], []
    for _ in range(reps):
        out, seconds = timed(forward)
        fwd.append(seconds)
        grad = torch.ones_like(out)
        bwd.append(timed(functools.partial(out.backward, grad))[1])
    kernels = profiled_kernels(step, device, profile) if profile else []
    return min(fwd), min(bwd), statistics.median(f + b for f, b in zip(fwd, bwd)), first, kernels


def attention_row(L: int, seg_lens, docs, mode: str, width: int, fwd: float, bwd: float) -> dict:
    """The FLOP columns of one timed row, from `lctrain.costmodel`: TFLOP/s forward, backward and together, counting
    the causally visible pairs (strict) and the whole L x L square (torchtitan's and Megatron's convention); the
    backward is two forwards' FLOPs."""
    pairs = visible_pairs(seg_lens, docs, mode, L)
    square = full_square_pairs(L)
    seconds = fwd + bwd
    row = {"pairs": pairs, "seconds": seconds, "forward_seconds": fwd, "backward_seconds": bwd}
    for label, n in (("strict", pairs), ("full_square", square)):
        row[f"tflops_{label}"] = attention_flops(n, width) / seconds / 1e12
        row[f"forward_tflops_{label}"] = attention_flops(n, width, passes=1) / fwd / 1e12
        row[f"backward_tflops_{label}"] = attention_flops(n, width, passes=2) / bwd / 1e12
    row["ideal_speedup"] = visible_pairs(seg_lens, docs, "full", L) / pairs
    return row


def add_speedups(results: list[dict]) -> None:
    """Speedup of each row over `full` with the same engine, length and window, and its fraction of the ideal."""
    full = {(r["length"], r["window"], r["engine"]): r["seconds"] for r in results if r["mode"] == "full"}
    for r in results:
        base = full.get((r["length"], r["window"], r["engine"]))
        r["speedup"] = base / r["seconds"] if base else None
        r["fraction_of_ideal"] = r["speedup"] / r["ideal_speedup"] if base else None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--engines", nargs="+", default=None)
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument(
        "--preset", choices=sorted(PRESETS), default=None, help="heads, KV heads and head dim of a trained model"
    )
    ap.add_argument("--heads", type=int, default=None, help="query heads (default: 2 on CPU, 32 on GPU)")
    ap.add_argument("--kv-heads", type=int, default=None, help="KV heads (default: 1 on CPU, 8 on GPU)")
    ap.add_argument("--head-dim", type=int, default=None, help="default: 64 on CPU, 128 on GPU")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--windows", type=int, default=1, help="windows per length; each is timed separately")
    ap.add_argument("--data", default=None, help="a prepared dataset directory to take segment layouts from")
    ap.add_argument("--interleave", action="store_true", help="split documents into interleaved chunks (Fig. 5)")
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads (default: PyTorch's); 1 gives stable timings on a shared machine",
    )
    ap.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="log the N kernels (CPU: operators) with the most self time in one more profiled forward + backward "
        "per row (torch.profiler, after the timed runs)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench_attention.json")
    args = ap.parse_args(argv)

    gpu = torch.device(args.device).type == "cuda"
    engines = args.engines or list(GPU_ENGINES if gpu else CPU_ENGINES)
    if args.preset and (args.heads or args.kv_heads or args.head_dim):
        ap.error("--preset sets the heads, KV heads and head dim: give either it or them")
    if args.preset:
        shape = PRESETS[args.preset]
        heads, kv_heads, head_dim = shape.heads, shape.kv_heads, shape.head_dim
    else:
        heads = args.heads or (32 if gpu else 2)
        kv_heads = args.kv_heads or (8 if gpu else 1)
        head_dim = args.head_dim or (128 if gpu else 64)
    if heads % kv_heads:
        ap.error(f"--heads {heads} is not a multiple of --kv-heads {kv_heads}")
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(args.seed)
    if args.threads:
        torch.set_num_threads(args.threads)

    jobs = []
    for L in args.lengths:
        layouts = (
            dataset_windows(args.data, L, args.windows)
            if args.data
            else slimpajama_like_layouts(L, args.windows, args.seed)
        )
        rng = np.random.default_rng(args.seed)
        for w, seg_lens in enumerate(layouts):
            seg_lens, seg_doc = interleave(seg_lens, rng) if args.interleave else (seg_lens, None)
            for engine in engines:
                if engine == "reference" and L > REFERENCE_MAX_LEN:
                    continue
                for mode in args.modes:
                    jobs.append((L, w, seg_lens, seg_doc, engine, mode))
    # One engine at a time, in the order given: a run stopped at a time limit has the first engines complete (and
    # FlexAttention, which compiles a kernel per mode and length, is listed last by default).
    jobs.sort(key=lambda job: engines.index(job[4]))

    meta = {
        "device": args.device,
        "dtype": args.dtype,
        "interleave": args.interleave,
        "heads": heads,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "preset": args.preset,
        "layout": "token-major [B, S, H, D] viewed head-major, as the model passes q, k, v",
        "reps": args.reps,
        "torch": torch.__version__,
        "data": args.data,
        "seed": args.seed,
        "device_name": torch.cuda.get_device_name() if gpu else "cpu",
        "threads": torch.get_num_threads(),
    }
    console = plain_console(width=180)
    results = []
    for L, w, seg_lens, seg_doc, engine, mode in track(jobs, description="benchmarking", console=console):
        ids = torch.randint(3, 32000, (1, L))
        batch = make_batch(ids, [seg_lens], mode, seg_doc=[seg_doc] if seg_doc else None)
        fwd, bwd, median, first, kernels = time_engine(
            engine, batch, heads, kv_heads, head_dim, dtype, args.device, args.reps, args.profile
        )
        docs = seg_doc if seg_doc else list(range(len(seg_lens)))
        results.append(
            {
                "length": L,
                "window": w,
                "engine": engine,
                "mode": mode,
                "median_seconds": median,
                "first_call_seconds": first,
                "segments": len(seg_lens),
                **attention_row(L, seg_lens, docs, mode, heads * head_dim, fwd, bwd),
                **({"kernels": kernels} if args.profile else {}),
            }
        )
        seconds = fwd + bwd
        console.print(f"L={L} {engine} {mode}: {1000 * seconds:.1f} ms (first call {1000 * first:.0f} ms)")
        add_speedups(results)
        # written after every job, so a run stopped at a time limit keeps what it measured
        Path(args.out).write_text(json.dumps({"meta": meta, "results": results}, indent=2))
        if gpu:
            torch.cuda.empty_cache()

    table = Table(title=f"attention fwd+bwd, {args.device}, {args.dtype}, heads {heads}/{kv_heads}, dim {head_dim}")
    for col in (
        "L",
        "win",
        "segs",
        "engine",
        "mode",
        "fwd ms",
        "bwd ms",
        "first ms",
        "TFLOP/s strict",
        "TFLOP/s full-square",
        "speedup vs full",
        "ideal",
        "of ideal",
    ):
        table.add_column(col, justify="right")
    for r in results:
        sp = f"{r['speedup']:.2f}x" if r["speedup"] else "-"
        frac = f"{100 * r['fraction_of_ideal']:.0f}%" if r["fraction_of_ideal"] else "-"
        table.add_row(
            str(r["length"]),
            str(r["window"]),
            str(r["segments"]),
            r["engine"],
            r["mode"],
            f"{1000 * r['forward_seconds']:.1f}",
            f"{1000 * r['backward_seconds']:.1f}",
            f"{1000 * r['first_call_seconds']:.1f}",
            f"{r['tflops_strict']:.1f}",
            f"{r['tflops_full_square']:.1f}",
            sp,
            f"{r['ideal_speedup']:.2f}x",
            frac,
        )
    console.print(table)
    if args.profile:
        console.print(kernel_table(results))
    print(f"wrote {args.out}")


def kernel_table(results: list[dict]) -> Table:
    """Each row's profiled kernels: name, calls and total ms in the one profiled forward + backward."""
    table = Table(title="top kernels by self time (one profiled forward + backward per row)")
    for col in ("L", "win", "engine", "mode", "kernel", "calls", "total ms"):
        table.add_column(col, justify="left" if col == "kernel" else "right")
    for r in results:
        for k in r["kernels"]:
            table.add_row(
                str(r["length"]),
                str(r["window"]),
                r["engine"],
                r["mode"],
                k["name"],
                str(k["count"]),
                f"{k['total_ms']:.2f}",
            )
    return table


if __name__ == "__main__":
    main()
