"""PNG figures for the evaluation, the RoPE diagnostic and the dataset inspection (matplotlib, no display)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

# the file-only backend must be chosen before pyplot is imported: evaluation runs on headless machines
matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.ticker import MaxNLocator, PercentFormatter

# metrics.jsonl fields that are fractions: drawn as the percentages the step lines print
FRACTIONS = ("mfu", "mfu_full_square", "hfu")


def length_label(n: int) -> str:
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def _save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_ruler(results: dict, path: Path) -> Path:
    """Left: mean score over tasks against length, per checkpoint and averaged. Right: task x length heatmap of the
    checkpoint average."""
    lengths = results["lengths"]
    x = range(len(lengths))
    fig, (ax, hm) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [1, 1.2]})
    for ckpt, per_len in results["task_mean"].items():
        ys = [per_len[str(L)] for L in lengths]
        if ckpt == "average":
            ax.plot(x, ys, "k-o", lw=2.5, label="average over checkpoints")
        else:
            ax.plot(x, ys, "-", marker=".", lw=1, alpha=0.7, label=ckpt)
    ax.set_xticks(list(x), [length_label(L) for L in lengths])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("RULER score (mean over tasks)")
    ax.set_ylim(-2, 102)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    tasks = results["tasks"]
    grid = [[results["average"][t].get(str(L), float("nan")) for L in lengths] for t in tasks]
    im = hm.imshow(grid, vmin=0, vmax=100, cmap="viridis", aspect="auto")
    hm.set_xticks(list(x), [length_label(L) for L in lengths])
    hm.set_yticks(range(len(tasks)), tasks)
    for i, row in enumerate(grid):
        for j, v in enumerate(row):
            if v == v:  # a task/length the data lacks is left blank
                hm.text(j, i, f"{v:.0f}", ha="center", va="center", color="w" if v < 60 else "k", fontsize=8)
    fig.colorbar(im, ax=hm, label="score")
    hm.set_title("average over checkpoints")
    fig.suptitle(f"{results['suite']}: {results['target']}", fontsize=10)
    return _save(fig, path)


def _positive(values) -> list[float]:
    """Values for a log axis: exact zeros (e.g. D at Δ1 = Δ2) are left out of the line rather than clipped."""
    return [v if v > 0 else float("nan") for v in values]


def _shift_axis(ax, shifts, label: str) -> None:
    ax.set_xticks(range(len(shifts)), [str(s) for s in shifts], rotation=60, fontsize=7)
    ax.set_xlabel(label)
    ax.set_yscale("log")
    ax.grid(alpha=0.3)


def plot_rope_figure1(results: dict, path: Path) -> Path:
    """The paper's Figure 1. Left: D (Eq. 4) against Δ1 at fixed Δ2, mean over the sequences, one line per case.
    Middle: the per-token difference d_j at Δ1 = 0. Right: D_logit (Eq. 5) against the sequence length."""
    fig, (left, mid, right) = plt.subplots(1, 3, figsize=(17, 4.8))
    cases, shifts = results["cases"], results["shifts"]
    for v in cases.values():
        left.plot(range(len(shifts)), _positive(v["D"]), "-o", ms=3, label=v["label"])
    _shift_axis(left, shifts, f"Δ1 (Δ2 = {results['delta2']})")
    left.set_ylabel("attention difference D (Eq. 4)")
    left.legend(fontsize=7)
    for v in cases.values():
        label = f"{v['label']}: first token {100 * v['first_token_share']:.0f}%"
        mid.plot(_positive(v["per_token"]), lw=0.8, label=label)
    mid.set_xlabel("key token index j")
    mid.set_ylabel(f"per-token difference d_j (Δ1 = 0, Δ2 = {results['delta2']})")
    mid.set_xscale("symlog", linthresh=1)
    mid.set_yscale("log")
    mid.legend(fontsize=7)
    mid.grid(alpha=0.3)
    for v in cases.values():
        right.plot(results["logit_lengths"], _positive(v["D_logit"]), "-o", ms=3, label=v["label"])
    right.set_xscale("log", base=2)
    right.set_yscale("log")
    right.set_xlabel("sequence length T")
    right.set_ylabel(f"first-token logit difference D_logit (Eq. 5, {results['logits'].split(' (')[0]})")
    right.legend(fontsize=7)
    right.grid(alpha=0.3)
    fig.suptitle(
        f"RoPE under a positional shift: {results['model']}, T = {results['seq_len']}, mean of "
        f"{results['samples']} sequences",
        fontsize=10,
    )
    return _save(fig, path)


def plot_rope_figure7(results: dict, path: Path, curves: int = 5) -> Path:
    """The paper's Figure 7 (Appendix B). Left: D against Δ1 for individual sequences (the first `curves`) of the
    bf16 case (else the first case). Right: D(X, Δ1 = 0, Δ2) against Δ2, per case, when the run swept Δ2."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8))
    cases, shifts = results["cases"], results["shifts"]
    name = "bf16" if "bf16" in cases else next(iter(cases))
    for i, curve in enumerate(cases[name]["D_per_sample"][:curves]):
        left.plot(range(len(shifts)), _positive(curve), "-o", ms=3, label=f"sample {i + 1}")
    _shift_axis(left, shifts, f"Δ1 (Δ2 = {results['delta2']})")
    left.set_ylabel("attention difference D (Eq. 4)")
    left.set_title(f"individual sequences, {cases[name]['label']}", fontsize=9)
    left.legend(fontsize=7)
    if results["vary_delta2"]:
        for v in cases.values():
            right.plot(range(len(shifts)), _positive(v["D_vary_delta2"]), "-o", ms=3, label=v["label"])
        _shift_axis(right, shifts, "Δ2 (Δ1 = 0)")
        right.set_ylabel("attention difference D (Eq. 4)")
        right.legend(fontsize=7)
    else:
        right.text(0.5, 0.5, "Δ2 not swept: run with --vary-delta2", ha="center", va="center")
        right.set_axis_off()
    fig.suptitle(f"RoPE drift per sequence and against Δ2: {results['model']}", fontsize=10)
    return _save(fig, path)


def plot_dataset(stats: dict, path: Path) -> Path:
    """Left: per-domain share of documents and of tokens (Table 9). Right: document-length histogram (Figure 8)."""
    fig, (bars, hist) = plt.subplots(1, 2, figsize=(13, 4.5))
    domains = [d for d, v in stats["domains"].items() if v["segments"] or v["documents"]]
    x = range(len(domains))
    w = 0.4
    docs = [stats["domains"][d]["doc_share"] for d in domains]
    if all(v is not None for v in docs):
        bars.bar([i - w / 2 for i in x], [100 * v for v in docs], w, label="documents")
    else:
        bars.bar(
            [i - w / 2 for i in x], [100 * stats["domains"][d]["segment_share"] for d in domains], w, label="segments"
        )
    bars.bar([i + w / 2 for i in x], [100 * stats["domains"][d]["token_share"] for d in domains], w, label="tokens")
    bars.set_xticks(list(x), domains, rotation=30)
    bars.set_ylabel("share (%)")
    bars.legend()
    h = stats["length_histogram"]
    labels = h.get("labels") or [f"<{length_label(e)}" for e in h["edges"][1:]]
    hist.bar(range(len(h["counts"])), h["counts"])
    hist.set_xticks(range(len(h["counts"])), labels, rotation=45, fontsize=7)
    hist.set_xlabel(h.get("unit", "tokens"))
    hist.set_ylabel("count")
    if any(h["counts"]):
        hist.set_yscale("log")
    fig.suptitle(f"prepared dataset: {stats['path']}", fontsize=10)
    return _save(fig, path)


def plot_figure6(results: dict, path: Path) -> Path:
    """The paper's Figure 6: days per 1B training tokens against context length, per mode; measured (solid) and the
    FLOP model's prediction (dashed)."""
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    lengths = sorted({p["seq_len"] for p in results["points"]})
    x = {L: i for i, L in enumerate(lengths)}
    for i, mode in enumerate(dict.fromkeys(p["mode"] for p in results["points"])):
        pts = sorted((p for p in results["points"] if p["mode"] == mode), key=lambda p: p["seq_len"])
        xs = [x[p["seq_len"]] for p in pts]
        color = f"C{i}"
        ax.plot(xs, [p["days_per_1b_tokens"] for p in pts], "-o", color=color, label=f"{mode} (measured)")
        ax.plot(
            xs,
            [p["predicted_days_per_1b_tokens"] for p in pts],
            "--",
            color=color,
            alpha=0.6,
            label=f"{mode} (FLOP model)",
        )
    ax.set_xticks(range(len(lengths)), [length_label(L) for L in lengths])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("days per 1B tokens")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(f"{results['config']} on {results['gpus']} GPU(s)", fontsize=10)
    return _save(fig, path)


def plot_curves(curves: dict, path: Path) -> Path:
    """`lctrain plot`: one panel per metric (`curves`: metric -> curves with `label`, `steps`, `values`), one line
    per run, against the optimizer step."""
    fig, axes = plt.subplots(1, len(curves), figsize=(6.4 * len(curves), 4.4), squeeze=False)
    for ax, (metric, lines) in zip(axes[0], curves.items()):
        for c in lines:
            ax.plot(c.steps, c.values, "-", marker="." if len(c.steps) < 50 else None, lw=1.2, label=c.label)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # a short run's axis had ticks at steps 1.5, 2.5, ...
        ax.set_ylabel(metric)
        if metric in FRACTIONS:
            ax.yaxis.set_major_formatter(PercentFormatter(1.0))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return _save(fig, path)


def plot_report(report: dict, path: Path) -> Path:
    """`lctrain report`: one panel per metric (RULER, perplexity), one line per row over the lengths; error bars are
    the standard deviation over seeds (none for a single seed)."""
    panels = [m for m in report["metrics"] if report["lengths"][m]]
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.8), squeeze=False)
    for ax, metric in zip(axes[0], panels):
        lengths = report["lengths"][metric]
        for row in report["rows"]:
            xs = [i for i, L in enumerate(lengths) if str(L) in row[metric]]
            cells = [row[metric][str(lengths[i])] for i in xs]
            label = f"{row['label']} (n={row['seeds']})"
            errors = [c["std"] or 0.0 for c in cells]
            ax.errorbar(xs, [c["mean"] for c in cells], yerr=errors, marker="o", capsize=4, label=label)
        ax.set_xticks(range(len(lengths)), [length_label(L) for L in lengths])
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel(report["metrics"][metric])
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{report['suite']}; error bars: std over seeds", fontsize=10)
    return _save(fig, path)
