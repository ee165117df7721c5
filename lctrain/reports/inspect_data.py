"""`lctrain inspect DATA_DIR` (or a run directory: the dataset it trains on): a prepared dataset's composition (the
paper's Table 9: per-domain share of documents and of tokens), its length histogram (Figure 8), and what each attention
mode would compute on it.

Attention cost is counted in causally visible (query, key) pairs, which is what the FLOPs of QK^T and AV scale with,
under the masks the engines compute (docs/design.md §3), counted by the cost model (`lctrain.costmodel`) that `estimate`
and the MFU of `train` use too.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from rich.table import Table

from lctrain.attention.modes import MODES
from lctrain.config import data_dir
from lctrain.console import plain_console
from lctrain.costmodel import window_pairs
from lctrain.data.store import open_packed
from lctrain.errors import output_dir, writing
from lctrain.reports.plots import plot_dataset
from lctrain.rundir import RunDir


def _log2_edges(max_len: int) -> list[int]:
    edges = [0, 64]
    while edges[-1] < max_len:
        edges.append(edges[-1] * 2)
    return edges


def dataset_stats(packed) -> dict:
    """Per-domain counts and shares, segment-length histogram and attention pairs per mode over every window."""
    seq_len = packed.manifest.seq_len
    domains = list(packed.manifest.domains)
    seg_count = np.zeros(len(domains), dtype=np.int64)
    tok_count = np.zeros(len(domains), dtype=np.int64)
    pairs = dict.fromkeys(MODES, 0)
    lengths: list[np.ndarray] = []
    cols = packed.rows.select_columns(["seg_lens", "seg_doc", "seg_domain"])
    for batch in cols.iter(batch_size=1024):
        for sl, sd, dom in zip(batch["seg_lens"], batch["seg_doc"], batch["seg_domain"]):
            sl, dom = np.asarray(sl, dtype=np.int64), np.asarray(dom, dtype=np.int64)
            np.add.at(seg_count, dom, 1)
            np.add.at(tok_count, dom, sl)
            for k, v in window_pairs(seq_len, sl, sd).items():
                pairs[k] += v
            lengths.append(sl)
    per_window = [len(sl) for sl in lengths]
    all_lengths = np.concatenate(lengths) if lengths else np.zeros(0, dtype=np.int64)
    edges = _log2_edges(max(seq_len, 64))
    counts, _ = np.histogram(all_lengths, bins=edges)
    total_seg, total_tok = int(seg_count.sum()), int(tok_count.sum())
    domain_rows = {
        d: {
            "segments": int(seg_count[i]),
            "segment_share": seg_count[i] / total_seg if total_seg else 0.0,
            "tokens": int(tok_count[i]),
            "token_share": tok_count[i] / total_tok if total_tok else 0.0,
        }
        for i, d in enumerate(domains)
    }
    # Whole documents (also those spanning windows) are only known to prepare: take them from its manifest.
    manifest_stats = packed.manifest.stats
    doc_stats = manifest_stats.get("domains") or {}
    for d, row in domain_rows.items():
        row["documents"] = (doc_stats.get(d) or {}).get("documents")
        row["doc_share"] = (doc_stats.get(d) or {}).get("documents_share")
        row["target_token_share"] = (doc_stats.get(d) or {}).get("target_tokens_share")
    hist = manifest_stats.get("length_histogram")
    if not (hist and "counts" in hist and "edges" in hist):
        hist = {"edges": edges, "counts": counts.tolist(), "unit": "tokens per segment (document piece in a window)"}
    return {
        "path": str(packed.path),
        "seq_len": seq_len,
        "windows": len(packed),
        "tokens": total_tok,
        "segments": total_seg,
        "documents": manifest_stats.get("documents"),
        "segments_per_window": {
            "mean": float(np.mean(per_window)) if per_window else 0.0,
            "max": int(max(per_window, default=0)),
        },
        "domains": domain_rows,
        "length_histogram": hist,
        "segment_length_histogram": {"edges": edges, "counts": counts.tolist()},
        "attention_pairs": pairs,
        "attention_saving": {k: 1.0 - v / pairs["full"] if pairs["full"] else 0.0 for k, v in pairs.items()},
    }


def inspect(path: str | Path, out: str | Path | None = None) -> Path:
    """Print the tables and write dataset_stats.json and dataset.png (default DATA_DIR/inspect/) for the prepared
    dataset at `path`, or the one the run directory `path` trains on (what a user has at hand after training)."""
    console = plain_console()
    run = RunDir(path)
    dataset = Path(path)
    if run.is_run():
        dataset = data_dir(run.read_config())
        console.print(f"{path} is a run directory; its dataset: {dataset}")
    packed = open_packed(dataset, verify=True)  # it reads every window anyway: check every byte
    out_dir = output_dir(Path(out) if out else dataset / "inspect")  # before every window is read
    stats = dataset_stats(packed)
    with writing(out_dir, "the inspection"):
        (out_dir / "dataset_stats.json").write_text(json.dumps(stats, indent=2))
        plot_dataset(stats, out_dir / "dataset.png")
    t = Table(
        title=f"{dataset}: {stats['windows']} windows of {stats['seq_len']} tokens, {stats['segments']} segments "
        f"({stats['segments_per_window']['mean']:.1f} per window, max {stats['segments_per_window']['max']})"
    )
    t.add_column("domain")
    for c in ("documents", "share of documents", "segments", "tokens", "share of tokens"):
        t.add_column(c, justify="right")
    targeted = any(v["target_token_share"] is not None for v in stats["domains"].values())
    if targeted:  # data.domain_shares: the share prepare aimed at
        t.add_column("target share", justify="right")
    for d, v in stats["domains"].items():
        # a domain asked for and not written is shown, with its 0
        if v["segments"] or v["documents"] or v["target_token_share"]:
            docs = "?" if v["documents"] is None else str(v["documents"])
            share = "?" if v["doc_share"] is None else f"{100 * v['doc_share']:.1f}%"
            row = [d, docs, share, str(v["segments"]), str(v["tokens"]), f"{100 * v['token_share']:.1f}%"]
            if targeted:
                row.append("" if v["target_token_share"] is None else f"{100 * v['target_token_share']:.1f}%")
            t.add_row(*row)
    console.print(t)
    a = Table(title="attention work per mode (causally visible query-key pairs)")
    a.add_column("mode")
    a.add_column("pairs", justify="right")
    a.add_column("saving vs full", justify="right")
    for m in MODES:
        a.add_row(m, f"{stats['attention_pairs'][m]:.3e}", f"{100 * stats['attention_saving'][m]:.1f}%")
    console.print(a)
    console.print(f"wrote {out_dir}/dataset_stats.json, dataset.png")
    return out_dir
