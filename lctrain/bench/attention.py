"""Attention benchmark: forward+backward time of each engine and mode on SlimPajama-like packed windows.

Prints a table and writes JSON. Next to each measured speedup of a document mode over `full` (same engine) it
prints the ideal one from attention FLOPs: visible (query, key) pairs of the causal window over the mode's visible
pairs, both counted by `lctrain.costmodel` (the cost model that MFU uses), and the achieved TFLOP/s. Times are the
best of --reps runs after a warm-up call (the median is in the JSON too): on a shared machine the minimum is the
stable estimate of the intrinsic cost. Segment layouts are the seeded SlimPajama-like windows that
scripts/bench_train.py uses too (`lctrain.data.layouts`), or windows of a prepared dataset (--data DIR).

    python scripts/bench_attention.py --device cpu --lengths 8192 32768 --engines sdpa --threads 1
    python scripts/bench_attention.py --device cpu --lengths 8192 --interleave
    python scripts/bench_attention.py --device cuda --lengths 8192 32768 131072 --heads 32 --kv-heads 8 --head-dim 128
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from rich.progress import track
from rich.table import Table

from lctrain.attention import ENGINES, MODES, Batch, make_batch
from lctrain.costmodel import attention_flops, visible_pairs
from lctrain.data.layouts import slimpajama_like_layouts
from lctrain.data.packing import chunk_order, split_into_chunks

CPU_ENGINES = ("sdpa", "reference")
GPU_ENGINES = ("varlen", "sdpa", "flex")
REFERENCE_MAX_LEN = 8192  # the dense mask and scores are O(L²)


def dataset_windows(path: str, length: int, rows: int) -> list[list[int]]:
    from lctrain.data.store import open_packed

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


def time_engine(engine: str, batch: Batch, heads: int, kv_heads: int, head_dim: int, dtype, device, reps: int):
    L = batch.input_ids.shape[1]
    gen = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (
        torch.randn(1, h, L, head_dim, generator=gen).to(device, dtype).requires_grad_(True)
        for h in (heads, kv_heads, kv_heads)
    )
    fn = ENGINES[engine].attention

    def step():
        out, _ = fn(None, q, k, v, None, scaling=head_dim**-0.5, **batch.attention_kwargs())
        out.backward(torch.ones_like(out))

    def sync():
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize()

    t0 = time.perf_counter()
    step()  # warm-up: builds the per-batch plan or block mask (and compiles on GPU)
    sync()
    first = time.perf_counter() - t0
    times = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
    return min(times), statistics.median(times), first


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
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench_attention.json")
    args = ap.parse_args(argv)

    gpu = torch.device(args.device).type == "cuda"
    engines = args.engines or list(GPU_ENGINES if gpu else CPU_ENGINES)
    heads = args.heads or (32 if gpu else 2)
    kv_heads = args.kv_heads or (8 if gpu else 1)
    head_dim = args.head_dim or (128 if gpu else 64)
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
        "reps": args.reps,
        "torch": torch.__version__,
        "data": args.data,
        "seed": args.seed,
        "device_name": torch.cuda.get_device_name() if gpu else "cpu",
        "threads": torch.get_num_threads(),
    }
    console = Console(width=140)
    results = []
    for L, w, seg_lens, seg_doc, engine, mode in track(jobs, description="benchmarking", console=console):
        ids = torch.randint(3, 32000, (1, L))
        batch = make_batch(ids, [seg_lens], mode, seg_doc=[seg_doc] if seg_doc else None)
        seconds, median, first = time_engine(engine, batch, heads, kv_heads, head_dim, dtype, args.device, args.reps)
        docs = seg_doc if seg_doc else list(range(len(seg_lens)))
        pairs = visible_pairs(seg_lens, docs, mode, L)
        results.append(
            {
                "length": L,
                "window": w,
                "engine": engine,
                "mode": mode,
                "seconds": seconds,
                "median_seconds": median,
                "first_call_seconds": first,
                "segments": len(seg_lens),
                "pairs": pairs,
                "tflops": attention_flops(pairs, heads * head_dim) / seconds / 1e12,
                "ideal_speedup": visible_pairs(seg_lens, docs, "full", L) / pairs,
            }
        )
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
        "best ms",
        "first ms",
        "TFLOP/s",
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
            f"{1000 * r['seconds']:.1f}",
            f"{1000 * r['first_call_seconds']:.1f}",
            f"{r['tflops']:.1f}",
            sp,
            f"{r['ideal_speedup']:.2f}x",
            frac,
        )
    console.print(table)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
