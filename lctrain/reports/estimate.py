"""`lctrain estimate`: predicted training time for each attention mode: hours per 1B tokens (the paper's Figure 6),
the time of one optimizer step and of the config's whole run (`train.steps` steps of `train.global_batch` windows).

FLOPs per window come from the cost model (`lctrain.costmodel`, the convention MFU uses): the linear layers (q, k,
v, o, the gated MLP, the LM head) and attention over the causally visible (query, key) pairs, each 3 forward passes
for training, plus what activation checkpointing reruns (`costmodel.recomputed_flops`: the layers' forward under
`full`, all of it but attention under `selective`), with `model.tiled_mlp` the MLP forward that TiledMLP reruns in
the backward, and the LM head's forward that the loss reruns under `train.loss_gradients=recompute`: the FLOPs the
device runs (`costmodel.hardware_flops_parts`, which `train`'s hfu counts too), as wall time, not utilisation, is
predicted here. The rate is per GPU on those FLOPs: `--tflops`, bench_train's `hardware_tflops_per_gpu`
(`--from-bench`), or by default a device's peak for the time at 100% HFU: `--gpu NAME`'s dense bf16 peak from
lctrain's hardware table, else this machine's (`logging.peak_tflops`, its GPU's from the table, or its CPU's measured
matmul rate; lctrain.hardware).
The visible pairs per mode come from the actual segment layout of the prepared dataset; without one, from a
synthetic packing of SlimPajama-like document lengths (`lctrain.data.layouts`, the benchmarks' windows), flagged
as such. Time = FLOPs / (achieved TFLOP/s per GPU x GPUs); a step is `train.global_batch` windows.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from rich.table import Table

from lctrain.activation_checkpointing import keeps_attention
from lctrain.config import Config, data_dir
from lctrain.console import plain_console
from lctrain.costmodel import hardware_flops_parts, window_pairs
from lctrain.data.layouts import slimpajama_like_layouts
from lctrain.data.store import open_packed
from lctrain.errors import UserError, output_path
from lctrain.hardware import GPUS, device_peak_flops, known_gpu
from lctrain.model import model_shape
from lctrain.parallel.layout import ParallelLayout, kv_replication, layout_of
from lctrain.reports.inspect_data import MODES, dataset_stats
from lctrain.train.data import BatchPlan
from lctrain.train.loss import reruns_lm_head

MAX_TFLOPS = 1e6  # an exaflop per GPU: larger is a typo (1e300 made every time 0, then a division by it)
SYNTHETIC_WINDOWS = 64  # windows of the fallback layout when no prepared dataset has the config's length


def mean_pairs(cfg: Config) -> tuple[dict[str, float], str]:
    """Mean visible pairs per window for each mode, and where the segment layout came from."""
    path = data_dir(cfg)
    L = cfg.data.seq_len
    why = f"no prepared dataset at {path}"
    if (path / "manifest.json").is_file():
        packed = open_packed(path)  # refuses a dataset without windows
        if packed.manifest.seq_len == L:
            stats = dataset_stats(packed)
            return {m: v / stats["windows"] for m, v in stats["attention_pairs"].items()}, f"prepared dataset {path}"
        why = f"the prepared dataset at {path} has seq_len {packed.manifest.seq_len}, not {L}"
    wins = slimpajama_like_layouts(L, SYNTHETIC_WINDOWS, cfg.data.seed)
    totals = dict.fromkeys(MODES, 0)
    for w in wins:
        for k, v in window_pairs(L, w, list(range(len(w)))).items():
            totals[k] += v
    source = (
        f"SYNTHETIC: {why} (run `lctrain prepare` for the real layout); SlimPajama-like document lengths per "
        f"domain, packed as prepare packs (lctrain.data.layouts)"
    )
    return {m: v / len(wins) for m, v in totals.items()}, source


def read_bench(path: str | Path) -> dict[str, float]:
    """Achieved TFLOP/s per GPU from a benchmark JSON: either {"tflops_per_gpu": x} or per mode, as
    {"results": [{"mode": m, "tflops_per_gpu": x}, ...]} or {"tflops_per_gpu": {mode: x}}. Returns {mode or "*": x}.
    A result of scripts/bench_train.py gives its `hardware_tflops_per_gpu` (what checkpointing reruns counted, as the
    prediction counts it); its `tflops_per_gpu` is model FLOPs, which checkpointing's rerun takes time from."""
    p = Path(path)
    try:
        raw = json.loads(p.read_text())
    except OSError as e:
        raise UserError(f"--from-bench {p}: cannot read ({e.strerror})") from None
    except json.JSONDecodeError as e:
        raise UserError(f"--from-bench {p}:{e.lineno}: not valid JSON ({e.msg})") from None
    found: dict[str, float] = {}
    value = raw.get("tflops_per_gpu") if isinstance(raw, dict) else None
    if isinstance(value, (int, float)):
        found["*"] = float(value)
    elif isinstance(value, dict):
        found.update({str(k): float(v) for k, v in value.items() if isinstance(v, (int, float))})
    for r in raw.get("results", []) if isinstance(raw, dict) else []:
        rate = r.get("hardware_tflops_per_gpu", r.get("tflops_per_gpu")) if isinstance(r, dict) else None
        if isinstance(rate, (int, float)) and r.get("mode") in MODES:
            found[r["mode"]] = float(rate)
    if not found or any(not (math.isfinite(v) and v > 0) for v in found.values()):
        raise UserError(
            f"--from-bench {p}: no positive 'tflops_per_gpu' found (top level, per mode, or in "
            f"'results' entries with a 'mode'); pass --tflops instead"
        )
    return found


def table_peak(name: str, where: str) -> float:
    """The dense bf16 TFLOP/s of the GPU model `name` from lctrain's hardware table; `where` names it in the refusal
    of a GPU the table does not hold or gives no peak for."""
    found = known_gpu(name)
    if found is None or found.bf16_tflops is None:
        why = "is not in lctrain's hardware table" if found is None else "has no dense bf16 peak in lctrain's table"
        known = ", ".join(f"'{g.name}'" for g in GPUS if g.bf16_tflops)
        raise UserError(f"{where} {why} (peaks known: {known}); pass --tflops or --from-bench FILE")
    return found.bf16_tflops


def default_rate(cfg: Config, gpu: str | None) -> tuple[float, str]:
    """(TFLOP/s per GPU, what it is) without --tflops or --from-bench: a device's peak, so the prediction is the
    time at 100% HFU. `gpu` names a GPU model of lctrain's hardware table (planning for another machine); without
    it, this machine's device as MFU and `--measure` take it: `logging.peak_tflops`, its GPU's peak from the table,
    else its CPU's matmul rate measured in the model's dtype."""
    if gpu is not None:
        return table_peak(gpu, f"--gpu {gpu}"), f"{gpu}'s dense bf16 peak (--gpu): the time at 100% HFU"
    if cfg.logging.peak_tflops:
        return cfg.logging.peak_tflops, "logging.peak_tflops: the time at 100% HFU"
    # torch on use: a rate given on the command line does not pay for its import
    import torch

    if torch.cuda.is_available():
        name = torch.cuda.get_device_name(0)
        return table_peak(name, f"this machine's GPU '{name}'"), f"{name}'s dense bf16 peak: the time at 100% HFU"
    cpu = device_peak_flops(torch.device("cpu"), dtype=cfg.model.dtype) / 1e12
    return cpu, (
        f"this CPU's measured {cfg.model.dtype} matmul rate, which varies with its load: the time at 100% HFU (no GPU "
        f"here; --gpu NAME for a GPU's peak)"
    )


def checked_layout(cfg: Config, gpus: int | None) -> ParallelLayout:
    """The layout the estimate spreads the work over: the config's, or `gpus` GPUs in its sequence-parallel groups,
    refused in one line where `train` would refuse it (the sequence-parallel groups, the batch split)."""
    if gpus is None:
        layout = layout_of(cfg)
        BatchPlan.of(cfg, layout)
        return layout
    if gpus < 1:
        raise UserError(f"--gpus {gpus}: must be at least 1")
    sp = cfg.parallel.sequence_parallel
    if gpus % sp:
        raise UserError(
            f"--gpus {gpus}: not a multiple of parallel.sequence_parallel = {sp} "
            f"({cfg.origin('parallel.sequence_parallel')}): train forms sequence-parallel groups of {sp} GPUs"
        )
    layout = layout_of(cfg, gpus)
    try:
        BatchPlan.of(cfg, layout)
    except UserError as e:  # its message names the config's world, which --gpus replaces
        raise UserError(f"--gpus {gpus}: {e}") from None
    return layout


def predict(
    cfg: Config, rate: dict[str, float], n_gpus: int, from_bench: str | None = None, modes=MODES
) -> tuple[dict[str, dict], str]:
    """The FLOP model's hours per 1B tokens, seconds per optimizer step and hours for the config's `train.steps`,
    for each of `modes` at `rate` TFLOP/s per GPU ({mode or "*": rate}), and where the segment layout came from."""
    shape = model_shape(cfg)
    # refused as train, plan and init refuse it: a sequence-parallel size that does not divide the heads
    kv_replication(
        shape.heads, shape.kv_heads, cfg.parallel.sequence_parallel, cfg.origin("parallel.sequence_parallel", "model")
    )
    L = cfg.data.seq_len
    pairs, source = mean_pairs(cfg)
    windows_per_b = 1e9 / L
    rows = {}
    for mode in modes:
        r = rate.get(mode, rate.get("*"))
        if r is None:
            raise UserError(f"--from-bench {from_bench}: no throughput for mode '{mode}' and no overall one")
        # the count `train`'s hfu divides by the step time (Trainer.hardware_flops), for one window
        dense, attention = hardware_flops_parts(
            shape,
            shape.linear_params(),
            L,
            pairs[mode],
            cfg.model.checkpointing_mode,
            bool(cfg.model.tiled_mlp),
            keeps_attention(cfg.attention.engine),
            reruns_lm_head(
                cfg.train.micro_batch,
                L // cfg.parallel.sequence_parallel,
                cfg.model.fused_kernels,
                cfg.train.loss_gradients,
            ),
        )
        flops = dense + attention
        window_s = flops / (r * 1e12 * n_gpus)
        step_s = cfg.train.global_batch * window_s
        rows[mode] = {
            "flops_per_window": flops,
            "attention_share": attention / flops,
            "tflops_per_gpu": r,
            "hours_per_1b_tokens": windows_per_b * window_s / 3600,
            "step_s": step_s,
            "run_hours": cfg.train.steps * step_s / 3600,
        }
    if "full" in rows:
        full = rows["full"]["hours_per_1b_tokens"]
        for v in rows.values():
            v["speedup_vs_full"] = full / v["hours_per_1b_tokens"]
    return rows, source


def estimate(
    cfg: Config,
    *,
    tflops: float | None = None,
    from_bench: str | None = None,
    gpu: str | None = None,
    gpus: int | None = None,
    out: str | None = None,
) -> dict:
    """Hours per 1B training tokens, per optimizer step and for the config's run, per attention mode; prints a
    table, writes JSON when `out` is given."""
    given = [o for o, v in (("--tflops", tflops), ("--from-bench", from_bench), ("--gpu", gpu)) if v is not None]
    if len(given) > 1:
        raise UserError(f"{' and '.join(given)}: give at most one (the rate per GPU); default: the device's peak")
    if tflops is not None and not 0 < tflops <= MAX_TFLOPS:
        raise UserError(f"--tflops {tflops}: expected the achieved TFLOP/s per GPU, > 0 and at most {MAX_TFLOPS:,.0f}")
    n_gpus = checked_layout(cfg, gpus).world
    if tflops is not None:
        rate, rate_source = {"*": float(tflops)}, "--tflops"
    elif from_bench is not None:
        rate, rate_source = read_bench(from_bench), f"--from-bench {from_bench}"
    else:
        peak, rate_source = default_rate(cfg, gpu)
        rate = {"*": peak}
    if out:  # the inputs checked, before the table is printed: an --out that cannot be written is refused first
        output_path(Path(out), "--out")
    rows, source = predict(cfg, rate, n_gpus, from_bench)
    result = {
        "config": cfg.name,
        "seq_len": cfg.data.seq_len,
        "gpus": n_gpus,
        "global_batch": cfg.train.global_batch,
        "steps": cfg.train.steps,
        "rate_source": rate_source,
        "segment_source": source,
        "synthetic": source.startswith("SYNTHETIC"),
        "model": model_shape(cfg).__dict__,
        "modes": rows,
    }
    _print(result)
    if out:
        Path(out).write_text(json.dumps(result, indent=2))
    return result


def _print(result: dict) -> None:
    console = plain_console()
    t = Table(
        title=f"{result['config']}: predicted time at {result['seq_len']} tokens on {result['gpus']} GPU(s), "
        f"{result['global_batch']} windows per step"
    )
    t.add_column("mode")
    for c in ("TFLOP/s/GPU", "attention FLOPs", "hours / 1B tok", "s / step", f"hours / {result['steps']} steps"):
        t.add_column(c, justify="right")
    t.add_column("vs full", justify="right")
    for mode, v in result["modes"].items():
        t.add_row(
            mode,
            f"{v['tflops_per_gpu']:.3g}",
            f"{100 * v['attention_share']:.1f}%",
            f"{v['hours_per_1b_tokens']:.3g}",
            f"{v['step_s']:.3g}",
            f"{v['run_hours']:.3g}",
            f"{v['speedup_vs_full']:.2f}x",
        )
    console.print(t)
    console.print(f"rate per GPU: {result['rate_source']}")
    style = "bold yellow" if result["synthetic"] else ""
    console.print(f"segment layout: {result['segment_source']}", style=style)
