"""Benchmark `lctrain prepare` against the tokenizer's own limit, show that its memory does not grow with the
token budget, and count how many real documents get exactly SentencePiece's ids.

For each token budget: run `lctrain prepare` on a fixed synthetic SlimPajama-like corpus with the real 32K
SentencePiece tokenizer in a child process, sampling the RSS of its whole process tree (workers included); then
tokenize the very documents prepare read with the same encoder prepare uses (`lctrain.tokenizer.TextEncoder`:
SentencePiece's C++ batch encode) on all cores (its own threads, no Python in the loop, text generated beforehand):
that rate is the limit prepare is compared with. Other work on the machine skews wall-clock rates, so tokens per
CPU-second (whole process tree) are compared too, with the load average.

Agreement: every text file of a corpus that ships with Python and the installed packages (standard-library `.py`
modules, the packages' license files and READMEs, including the long descriptions in their METADATA), encoded by
each built-in tokenizer three ways: SentencePiece itself (the reference), lctrain's encoder, and the Hugging Face
converted fast tokenizer (what prepare used before); the table counts the documents whose ids equal the reference.

    python scripts/bench_prepare.py                      # budgets 10M and 50M tokens, 64K windows, and agreement
    python scripts/bench_prepare.py --tokens 2000000     # a quick run
    python scripts/bench_prepare.py --tokens ""          # agreement only
    python scripts/bench_prepare.py --interleave 20000,20000,20000 --weights 3,1,1   # the draw vs datasets'

`--interleave`: lctrain's weighted draw of `data.sources` (its jsonl reader and `mixed_batches`) against
`datasets`' streaming `load_dataset("json")` and `interleave_datasets` with the same probabilities and seed, on
local jsonl files: documents per second of the draw alone and whether the orders agree.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil
import sentencepiece as spm
from rich.table import Table

from lctrain.console import plain_console
from lctrain.data.prepare import SOURCES_DRAW_SEED
from lctrain.data.sources import SourceStream, local_batches, mixed_batches
from lctrain.data.synthetic import generate
from lctrain.hardware import usable_cpus
from lctrain.tokenizer import BUILTIN_PREFIX, BUILTIN_TOKENIZERS, builtin_model_file, load_encoder, load_tokenizer

TOKENIZER = "builtin:mistral-7b-v0.1"


def sample_tree(proc: psutil.Process, cpu: dict[int, float]) -> int:
    """RSS of the process tree now; records each process's latest CPU seconds in `cpu` (by pid)."""
    total = 0
    for p in [proc] + proc.children(recursive=True):
        try:
            with p.oneshot():
                total += p.memory_info().rss
                t = p.cpu_times()
                cpu[p.pid] = t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def run_prepare(out: Path, budget: int, seq_len: int, workers: int) -> tuple[dict, float, int, float]:
    overrides = {
        "data.source": "synthetic",
        "data.tokenizer": TOKENIZER,
        "data.seq_len": seq_len,
        "data.token_budget": budget,
        "data.num_workers": workers,
        "data.output_dir": str(out),
        "data.synthetic.num_docs": max(10_000, budget // 300),
        "data.synthetic.max_words": 200_000,
    }
    cmd = [sys.executable, "-m", "lctrain.cli", "prepare", "--force"]
    for k, v in overrides.items():
        cmd += ["--set", f"{k}={v}"]
    t0 = time.perf_counter()
    child = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    proc = psutil.Process(child.pid)
    peak, cpu = 0, {}
    while child.poll() is None:
        try:
            peak = max(peak, sample_tree(proc, cpu))
        except psutil.NoSuchProcess:
            break
        time.sleep(0.1)
    wall = time.perf_counter() - t0
    if child.returncode != 0:
        raise SystemExit(f"lctrain prepare failed with exit code {child.returncode}")
    # CPU seconds of the whole tree (sampled every 0.1 s, so the last instants are missed)
    return json.loads((out / "manifest.json").read_text()), wall, peak, sum(cpu.values())


def tokenizer_limit(manifest: dict) -> dict:
    """Tokens/s of the encoder prepare uses, batch encode on all cores, over the documents prepare read."""
    encoder = load_encoder(TOKENIZER)
    src = manifest["source"]
    tokens, seconds, cpu_seconds, i, n = 0, 0.0, 0.0, 0, src["records_read"]
    while i < n:
        texts = [
            generate(manifest["seed"], j, src["median_words"], src["max_words"], src["long_doc_fraction"])[0]
            for j in range(i, min(n, i + 2000))
        ]
        t0, c0 = time.perf_counter(), time.process_time()
        enc = encoder.encode_batch(texts)
        seconds += time.perf_counter() - t0
        cpu_seconds += time.process_time() - c0
        tokens += sum(len(e) for e in enc)
        i += len(texts)
    return {
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "tokens_per_cpu_s": tokens / cpu_seconds,
    }


def real_corpus() -> tuple[list[str], dict[str, int]]:
    """The UTF-8 text files of Python's standard library and the installed packages, in a fixed order, with the
    number of documents of each kind."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    site = Path(sysconfig.get_paths()["purelib"])
    kinds = {
        "stdlib .py": sorted(stdlib.glob("*.py")),
        "license files": sorted(
            {
                *site.glob("*.dist-info/LICENSE*"),
                *site.glob("*.dist-info/COPYING*"),
                *site.glob("*.dist-info/licenses/**/*"),
            }
        ),
        "READMEs": sorted({*site.glob("*.dist-info/METADATA"), *site.glob("**/README*")}),
    }
    docs, counts = [], {}
    for kind, paths in kinds.items():
        counts[kind] = 0
        for path in paths:
            try:
                text = path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):  # binary files, directories
                continue
            if text.strip():
                docs.append(text)
                counts[kind] += 1
    return docs, counts


def agreement() -> dict:
    """Per built-in tokenizer: documents whose ids equal SentencePiece's, with lctrain's encoder and with the
    converted fast tokenizer."""
    docs, counts = real_corpus()
    out = {"documents": len(docs), "characters": sum(map(len, docs)), "kinds": counts, "tokenizers": {}}
    for name in BUILTIN_TOKENIZERS:
        reference = spm.SentencePieceProcessor(model_file=str(builtin_model_file(name)))
        t0 = time.perf_counter()
        ref = reference.encode(docs)
        ref_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        ours = load_encoder(BUILTIN_PREFIX + name).encode_batch(docs)
        ours_s = time.perf_counter() - t0
        backend = load_tokenizer(BUILTIN_PREFIX + name).backend_tokenizer
        converted = backend.encode_batch(docs, add_special_tokens=False)
        tokens = sum(map(len, ref))
        out["tokenizers"][name] = {
            "tokens": tokens,
            "equal_lctrain": sum(a.tolist() == b for a, b in zip(ours, ref)),
            "equal_converted_fast": sum(a.ids == b for a, b in zip(converted, ref)),
            "sentencepiece_tokens_per_s": round(tokens / ref_s),
            "lctrain_tokens_per_s": round(tokens / ours_s),
        }
    return out


def write_sources(root: Path, docs_per_source: list[int], seed: int = 0) -> list[Path]:
    """One jsonl file of synthetic documents per source, each document's text prefixed with its source and index."""
    paths = []
    for i, n in enumerate(docs_per_source):
        path = root / f"source{i}.jsonl"
        with path.open("w") as f:
            for j in range(n):
                text, _ = generate(seed + i, j, 250, 4000, 0.0)
                f.write(json.dumps({"text": f"s{i}d{j} {text}"}) + "\n")
        paths.append(path)
    return paths


def lctrain_draw(paths: list[Path], weights: list[float], seed: int) -> tuple[list[str], float, float]:
    """(the documents' source-and-index tags in the order lctrain's weighted draw takes them, seconds, CPU seconds
    of this process): prepare's own `mixed_batches` over its own jsonl reader, records parsed only for the
    comparison, outside the timing."""
    streams = [
        SourceStream(f"s{i}", "text", None, w, local_batches([p]), f"data.sources[{i}]")
        for i, (p, w) in enumerate(zip(paths, weights))
    ]
    t0, c0 = time.perf_counter(), time.process_time()
    items = [
        item
        for b in mixed_batches(streams, np.random.SeedSequence(seed, spawn_key=(SOURCES_DRAW_SEED,)))
        for item in b.items
    ]
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    return [json.loads(item[-1])["text"].split(" ", 1)[0] for item in items], seconds, cpu


def datasets_draw(paths: list[Path], weights: list[float], seed: int) -> tuple[list[str], float, float]:
    """The same with `datasets`: streaming `load_dataset("json")` per source and `interleave_datasets` with the
    weights as probabilities, an exhausted source leaving the draw (`all_exhausted_without_replacement`), seeded
    with the very SeedSequence lctrain draws from."""
    # datasets on use (start-up time); only this comparison needs it
    from datasets import interleave_datasets, load_dataset

    t0, c0 = time.perf_counter(), time.process_time()
    sources = [load_dataset("json", data_files=str(p), split="train", streaming=True) for p in paths]
    total = sum(weights)
    mixed = interleave_datasets(
        sources,
        probabilities=[w / total for w in weights],
        seed=np.random.SeedSequence(seed, spawn_key=(SOURCES_DRAW_SEED,)),
        stopping_strategy="all_exhausted_without_replacement",
    )
    texts = [r["text"] for r in mixed]
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    return [t.split(" ", 1)[0] for t in texts], seconds, cpu


def interleave_comparison(docs_per_source: list[int], weights: list[float], seed: int = 0) -> dict:
    """lctrain's weighted draw against `datasets.interleave_datasets` on a local jsonl corpus: documents per
    second of each draw alone (no tokenization) and how long their orders agree."""
    with tempfile.TemporaryDirectory(prefix="bench_interleave_") as tmp:
        paths = write_sources(Path(tmp), docs_per_source, seed)
        size = sum(p.stat().st_size for p in paths)
        ours, ours_s, ours_cpu = lctrain_draw(paths, weights, seed)
        theirs, theirs_s, theirs_cpu = datasets_draw(paths, weights, seed)
    same = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
    # the draw at which a source gave its last document: after it, the remaining sources share the draw
    first_exhausted = min(ours.index(f"s{k}d{n - 1}") + 1 for k, n in enumerate(docs_per_source))
    return {
        "documents": len(ours),
        "datasets_documents": len(theirs),
        "bytes": size,
        "weights": weights,
        "lctrain_seconds": round(ours_s, 3),
        "datasets_seconds": round(theirs_s, 3),
        "lctrain_cpu_seconds": round(ours_cpu, 3),
        "datasets_cpu_seconds": round(theirs_cpu, 3),
        "lctrain_docs_per_s": round(len(ours) / ours_s),
        "datasets_docs_per_s": round(len(theirs) / theirs_s),
        "load_average": os.getloadavg()[0],
        "same_order_for_first": same,
        "identical": ours == theirs,
        "first_source_exhausted_at": first_exhausted,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="10000000,50000000", help="comma-separated token budgets")
    ap.add_argument("--seq-len", type=int, default=65536)
    ap.add_argument("--workers", type=int, default=0, help="data.num_workers (0 = all cores)")
    ap.add_argument("--json", default="bench_out/bench_prepare.json")
    ap.add_argument(
        "--interleave",
        default="",
        help="documents per source, comma-separated (e.g. 20000,20000,20000): only compare lctrain's weighted draw "
        "with datasets' interleave_datasets on a local jsonl corpus of that many synthetic documents",
    )
    ap.add_argument("--weights", default="3,1,1", help="--interleave: the sources' weights")
    args = ap.parse_args()
    if args.interleave:
        docs = [int(x) for x in args.interleave.split(",")]
        r = interleave_comparison(docs, [float(x) for x in args.weights.split(",")])
        plain_console().print_json(json.dumps(r))
        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"benchmark": "prepare --interleave", "result": r}, indent=2) + "\n")
        return

    console = plain_console()
    cores = usable_cpus()
    results = []
    scratch = Path(tempfile.mkdtemp(prefix="bench_prepare_"))
    try:
        for budget in [int(x) for x in args.tokens.split(",") if x.strip()]:
            console.print(f"prepare: budget {budget:,} tokens, {args.seq_len:,}-token windows ...")
            load_before = os.getloadavg()[0]
            manifest, wall, peak, cpu = run_prepare(scratch / f"b{budget}", budget, args.seq_len, args.workers)
            console.print("tokenizer limit on the same documents ...")
            limit = tokenizer_limit(manifest)
            b = manifest["build"]
            read = manifest["source"]["tokens_read"]
            results.append(
                {
                    "token_budget": budget,
                    "seq_len": args.seq_len,
                    "num_windows": manifest["num_windows"],
                    "tokens_read": read,
                    "documents_read": manifest["source"]["documents_read"],
                    "prepare_seconds": b["seconds"],
                    "prepare_wall_seconds_with_startup": round(wall, 2),
                    "prepare_tokenized_tokens_per_s": b["tokenized_tokens_per_s"],
                    "prepare_packed_tokens_per_s": b["packed_tokens_per_s"],
                    "tokenizer_limit_tokens_per_s": round(limit["tokens_per_s"]),
                    "fraction_of_limit": b["tokenized_tokens_per_s"] / limit["tokens_per_s"],
                    "prepare_tokens_per_cpu_s": round(read / cpu),
                    "tokenizer_limit_tokens_per_cpu_s": round(limit["tokens_per_cpu_s"]),
                    "cpu_efficiency": read / cpu / limit["tokens_per_cpu_s"],
                    "limit_tokens_checked": limit["tokens"],
                    "peak_rss_bytes": peak,
                    "num_workers": b["num_workers"],
                    "cores": cores,
                    "load_average_before": load_before,
                    "load_average_after": os.getloadavg()[0],
                }
            )
            shutil.rmtree(scratch / f"b{budget}", ignore_errors=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    if results:
        t = Table(title=f"lctrain prepare, synthetic corpus, {TOKENIZER}, {cores} cores")
        t.add_column("token budget")
        for r in results:
            t.add_column(f"{r['token_budget']:,}", justify="right")
        rows = [
            ("windows", lambda r: f"{r['num_windows']:,} x {r['seq_len']:,}"),
            ("tokens read (tokenized)", lambda r: f"{r['tokens_read']:,}"),
            ("prepare tokens/s", lambda r: f"{r['prepare_tokenized_tokens_per_s']:,}"),
            ("prepare packed tokens/s", lambda r: f"{r['prepare_packed_tokens_per_s']:,}"),
            ("tokenizer limit tokens/s", lambda r: f"{r['tokenizer_limit_tokens_per_s']:,}"),
            ("prepare / limit (wall)", lambda r: f"{100 * r['fraction_of_limit']:.0f}%"),
            ("prepare tokens/CPU-s (tree)", lambda r: f"{r['prepare_tokens_per_cpu_s']:,}"),
            ("limit tokens/CPU-s", lambda r: f"{r['tokenizer_limit_tokens_per_cpu_s']:,}"),
            ("prepare / limit (CPU)", lambda r: f"{100 * r['cpu_efficiency']:.0f}%"),
            ("peak RSS, process tree", lambda r: f"{r['peak_rss_bytes'] / 2**20:,.0f} MiB"),
            ("wall s (with startup)", lambda r: f"{r['prepare_wall_seconds_with_startup']:.1f}"),
            ("workers", lambda r: str(r["num_workers"])),
            ("load average before", lambda r: f"{r['load_average_before']:.1f}"),
        ]
        for label, fmt in rows:
            t.add_row(label, *[fmt(r) for r in results])
        console.print(t)

    console.print("agreement with SentencePiece on the installed packages' text ...")
    agree = agreement()
    kinds = ", ".join(f"{n:,} {k}" for k, n in agree["kinds"].items())
    t = Table(
        title=f"documents with exactly SentencePiece's ids: {agree['documents']:,} documents ({kinds}), "
        f"{agree['characters'] / 1e6:.1f}M characters"
    )
    for col in ("built-in", "tokens", "lctrain", "converted fast", "SentencePiece tokens/s", "lctrain tokens/s"):
        t.add_column(col, justify="left" if col == "built-in" else "right")
    for name, r in agree["tokenizers"].items():
        t.add_row(
            name,
            f"{r['tokens']:,}",
            f"{r['equal_lctrain']:,} / {agree['documents']:,}",
            f"{r['equal_converted_fast']:,} / {agree['documents']:,}",
            f"{r['sentencepiece_tokens_per_s']:,}",
            f"{r['lctrain_tokens_per_s']:,}",
        )
    console.print(t)

    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"benchmark": "prepare", "results": results, "agreement": agree}, indent=2) + "\n")
    console.print(f"wrote {out}")


if __name__ == "__main__":
    main()
