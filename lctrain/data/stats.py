"""Dataset statistics: per-domain document and token shares (the paper's Table 9) and the document-length
histogram (its Figure 8), collected from the windows as they are written, plus their rich tables."""

from __future__ import annotations

import numpy as np
from rich.table import Table

from lctrain.config import DOMAINS
from lctrain.data.packing import PackedWindow

# document-length bins in tokens: <1K, 1-2K, ..., 64-128K, >=128K
LENGTH_EDGES = [0, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072]


def _bin_label(i: int) -> str:
    def k(n):
        return f"{n // 1024}K"

    lo = LENGTH_EDGES[i]
    if i + 1 < len(LENGTH_EDGES):
        return f"<{k(LENGTH_EDGES[1])}" if lo == 0 else f"{k(lo)}-{k(LENGTH_EDGES[i + 1])}"
    return f">={k(lo)}"


class DatasetStats:
    def __init__(self, n: int = len(DOMAINS)):
        """`n`: how many domain ids there may be."""
        self.documents = np.zeros(n, dtype=np.int64)
        self.tokens = np.zeros(n, dtype=np.int64)
        self.hist = np.zeros((n, len(LENGTH_EDGES)), dtype=np.int64)

    def add(self, pw: PackedWindow) -> None:
        w = pw.window
        np.add.at(self.tokens, w.seg_domain.astype(np.int64), w.seg_lens.astype(np.int64))
        for domain, length in pw.doc_starts:
            self.documents[domain] += 1
            self.hist[domain, np.searchsorted(LENGTH_EDGES, length, side="right") - 1] += 1

    def to_dict(self, target_shares: dict[str, float] | None, names: tuple[str, ...] = DOMAINS) -> dict:
        """`names`: the domain name of each id."""
        docs, toks = int(self.documents.sum()), int(self.tokens.sum())
        domains = {}
        for i, name in enumerate(names):
            entry = {
                "documents": int(self.documents[i]),
                "documents_share": float(self.documents[i] / docs) if docs else 0.0,
                "tokens": int(self.tokens[i]),
                "tokens_share": float(self.tokens[i] / toks) if toks else 0.0,
            }
            if target_shares is not None:
                entry["target_tokens_share"] = target_shares.get(name, 0.0)
            domains[name] = entry
        return {
            "documents": docs,
            "tokens": toks,
            "domains": domains,
            "length_histogram": {
                "unit": "tokens per document (the whole document, also when it spans windows); edges are the "
                "lower bounds of the bins, the last bin is open-ended",
                "edges": LENGTH_EDGES,
                "labels": [_bin_label(i) for i in range(len(LENGTH_EDGES))],
                "counts": [int(c) for c in self.hist.sum(axis=0)],
                "per_domain": {name: [int(c) for c in self.hist[i]] for i, name in enumerate(names)},
            },
        }


def render(console, stats: dict, skipped: dict) -> None:
    """Print the Table 9 and Figure 8 equivalents and the skipped-record counts."""
    t = Table(title="Domains (cf. paper Table 9)")
    for col in ("domain", "documents", "docs %", "tokens", "tokens %"):
        t.add_column(col, justify="left" if col == "domain" else "right")
    has_target = any("target_tokens_share" in e for e in stats["domains"].values())
    if has_target:
        t.add_column("target %", justify="right")
    for name, e in stats["domains"].items():
        # a domain asked for and not written is shown, with its 0
        if not (e["documents"] or e["tokens"] or e.get("target_tokens_share")):
            continue
        row = [
            name,
            f"{e['documents']:,}",
            f"{100 * e['documents_share']:.1f}",
            f"{e['tokens']:,}",
            f"{100 * e['tokens_share']:.1f}",
        ]
        if has_target:
            row.append(f"{100 * e['target_tokens_share']:.1f}")
        t.add_row(*row)
    t.add_row(
        "total",
        f"{stats['documents']:,}",
        "100.0",
        f"{stats['tokens']:,}",
        "100.0",
        *(["100.0"] if has_target else []),
        style="bold",
    )
    console.print(t)

    h = stats["length_histogram"]
    total = max(1, sum(h["counts"]))
    ht = Table(title="Document lengths in tokens (cf. paper Figure 8)")
    ht.add_column("length")
    ht.add_column("documents", justify="right")
    ht.add_column("%", justify="right")
    ht.add_column("")
    for label, c in zip(h["labels"], h["counts"]):
        ht.add_row(label, f"{c:,}", f"{100 * c / total:.1f}", "#" * int(round(40 * c / total)))
    console.print(ht)

    if skipped["counts"]:
        st = Table(title="Skipped input records")
        st.add_column("reason")
        st.add_column("count", justify="right")
        for reason, c in skipped["counts"].items():
            st.add_row(reason, f"{c:,}")
        console.print(st)
        for ex in skipped["examples"]:
            console.print(f"  skipped {ex['reason']}: {ex['source']}:{ex['line']}", highlight=False)
