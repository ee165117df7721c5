"""Memory benchmark: the planner's prediction (lctrain/memory.py) against the measured peak of the trainer's own step
(`Trainer.train_step` on SlimPajama-like windows), with tokens/s, per memory-saving setting.

    python scripts/bench_memory.py                                   # CPU: small Llama, 4K windows, 5 settings
    python scripts/bench_memory.py --device cuda --arch llama-1b --seq-len 65536 --vocab 32000 \
        --settings gradient_checkpointing,offload_activations,checkpointing+tiled_mlp   # the settings on one GPU
    python scripts/bench_memory.py --preset llama2-7b-128k           # one GPU: Llama-2-7B at 128K, ZeRO-3 + offload
    python scripts/bench_memory.py --preset llama2-7b-128k --ladder  # longer windows until out of memory

CPU: the peak is the most bytes of tensor storage alive during one step (`cpu_peak_bytes`, the allocator totals the
profiler records), counted from before the model is built; the prediction is the plan's device plus host items.
GPU: torch.cuda.max_memory_allocated / max_memory_reserved against the plan's device items (without the runtime
overhead, which is outside PyTorch's allocator), and the process's peak RSS against its host items.
Prints a table and writes JSON after every row (default bench_out/bench_memory.json).
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path

import numpy as np
import torch

from lctrain.config import load_config
from lctrain.costmodel import ModelShape
from lctrain.data.layouts import slimpajama_like_layouts, window_ids
from lctrain.memory import GB, HOST_RUNTIME_BYTES, plan_memory

CPU_ARCH = dict(model_type="llama", hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
# Llama-3.2-1B's shape with the 32K vocabulary of the built-in tokenizer (scripts/bench_train.py's llama-1b)
LLAMA_1B = dict(model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True)
ROW_ARCHS = {"small": CPU_ARCH, "llama-1b": LLAMA_1B}
LLAMA2_7B = dict(model_type="llama", hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=32, tie_word_embeddings=False)
# CPU rows: the memory settings, one alone or combined
CPU_SETTINGS = {
    "baseline": [],
    "gradient_checkpointing": ["model.gradient_checkpointing=true"],
    "tiled_mlp": ["model.tiled_mlp=auto"],
    "offload_activations": ["model.gradient_checkpointing=true", "model.offload_activations=true"],
    "checkpointing+tiled_mlp": ["model.gradient_checkpointing=true", "model.tiled_mlp=auto"],
    "all_three": ["model.gradient_checkpointing=true", "model.tiled_mlp=auto", "model.offload_activations=true"],
}
PRESETS = {
    "llama2-7b-128k": dict(arch=LLAMA2_7B, vocab=32000, seq_len=131072, settings=[
        "model.dtype=bfloat16", "parallel.zero_stage=3", "parallel.offload_optimizer=true",
        "model.gradient_checkpointing=true", "model.tiled_mlp=auto", "attention.mode=anchor"]),
}


def make_config(arch: dict, seq_len: int, settings: list[str]):
    return load_config(None, [f"data.seq_len={seq_len}", f"model.arch={json.dumps(arch)}", "attention.engine=auto",
                              "train.global_batch=1", "train.micro_batch=1", "parallel.nproc_per_node=1",
                              "parallel.sequence_parallel=1", "model.dtype=float32", "parallel.zero_stage=0",
                              *settings])


def make_windows(seq_len: int, vocab: int, seed: int) -> list[dict]:
    seg_lens = slimpajama_like_layouts(seq_len, 1, seed)
    return [{"input_ids": window_ids(seg_lens, vocab=vocab, anchor=1, seed=seed),
             "seg_lens": [np.array(s) for s in seg_lens], "seg_doc": [np.arange(len(s)) for s in seg_lens],
             "tag_lens": [np.zeros(len(s), dtype=np.int64) for s in seg_lens]}]


def predicted(cfg, arch: dict, vocab: int):
    from transformers import AutoConfig

    fields = {k: v for k, v in arch.items() if k != "model_type"}
    return plan_memory(cfg, ModelShape.from_hf_config(AutoConfig.for_model("llama", vocab_size=vocab, **fields)))


def timed_steps(trainer, windows, steps: int, gpu: bool) -> float:
    times = []
    for _ in range(steps):
        if gpu:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        trainer.train_step(windows)
        if gpu:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def settings_row(name: str, settings: list[str], args) -> dict:
    """One memory setting through the trainer's step: on the CPU the profiler's peak of tensor storage (fp32, ZeRO
    off), on a GPU (`--device cuda`, bf16 under ZeRO-1) torch's peak allocation during one step after a warm-up,
    each against the plan (device plus host items on the CPU, where both are one memory; device items on a GPU)."""
    from lctrain.parallel.groups import init_topology, release_single_process
    from lctrain.train.metrics import cpu_peak_bytes
    from lctrain.train.trainer import Trainer

    gpu = args.device == "cuda"
    arch = ROW_ARCHS[args.arch]
    base = ["model.dtype=bfloat16", "parallel.zero_stage=1"] if gpu else []
    cfg = make_config(arch, args.seq_len, base + settings)
    windows = make_windows(args.seq_len, args.vocab, args.seed)
    kept = {}

    def setup():
        kept["trainer"] = Trainer(cfg, init_topology(cfg), vocab_size=args.vocab)
        kept["trainer"].train_step(windows)  # the Adam moments exist from the first step on
        return kept["trainer"]

    try:
        if gpu:
            trainer = setup()
            torch.cuda.synchronize()
            baseline = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            trainer.train_step(windows)
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated()
        else:
            peak, baseline = cpu_peak_bytes(setup, lambda trainer: trainer.train_step(windows))
        step = timed_steps(kept.pop("trainer"), windows, args.steps, gpu=gpu)  # outside the profiler
    finally:
        release_single_process()
        if gpu:
            torch.cuda.empty_cache()
    plan = predicted(cfg, arch, args.vocab)
    pred = plan.total("device") + (0 if gpu else plan.total("host"))
    return {"setting": name, "overrides": settings, "seq_len": args.seq_len, "step_s": step,
            "tokens_per_s": args.seq_len / step, "measured_peak_gb": peak / GB, "measured_states_gb": baseline / GB,
            "predicted_gb": pred / GB, "predicted_over_measured": pred / peak}


def force_torch_adam() -> None:
    """DeepSpeed's CPU Adam (what the trainer picks for an offloaded optimizer on a GPU) compiles a C++ op on first
    use; torch's AdamW on the host's fp32 partitions needs no build (slower step, same memory)."""
    from lctrain.parallel.layout import ParallelLayout

    original = ParallelLayout.deepspeed_config

    def deepspeed_config(self, cfg, use_torch_adam):
        return original(self, cfg, use_torch_adam=True)

    ParallelLayout.deepspeed_config = deepspeed_config


def gpu_rows(args, out: Path, rows: list, meta: dict) -> None:
    import psutil

    from lctrain.parallel.groups import init_topology
    from lctrain.train.trainer import Trainer

    started = time.perf_counter()
    preset = PRESETS[args.preset]
    seq_len = args.seq_len or preset["seq_len"]
    cfg = make_config(preset["arch"], seq_len, preset["settings"])
    plan = predicted(cfg, preset["arch"], preset["vocab"])
    host_need = plan.total("host") + HOST_RUNTIME_BYTES
    available = psutil.virtual_memory().available
    print(f"plan: {plan.total('device') / GB:.1f} GB on the GPU (tensors), {host_need / GB:.1f} GB of host memory; "
          f"{available / GB:.1f} GB available", flush=True)
    if host_need > available:
        raise SystemExit(f"error: the plan needs {host_need / GB:.1f} GB of host memory (offloaded optimizer states) "
                         f"and {available / GB:.1f} GB are available; use a host with more memory")
    if args.adam == "torch":
        force_torch_adam()
    t0 = time.perf_counter()
    trainer = Trainer(cfg, init_topology(cfg), vocab_size=preset["vocab"])
    meta["build_s"] = time.perf_counter() - t0
    lengths = [seq_len]
    while args.ladder and lengths[-1] + args.ladder_step <= args.ladder_max:
        lengths.append(lengths[-1] + args.ladder_step)
    deadline = started + args.time_limit
    for length in lengths:
        last = next((r for r in reversed(rows) if not r["oom"]), None)
        # a longer window takes at least proportionally longer: do not start one that would overrun the limit
        expected = (args.warmup + args.steps) * last["step_s"] * length / last["seq_len"] if last else 0
        if time.perf_counter() + expected > deadline:
            print(f"stopping before {length}: it would end after --time-limit {args.time_limit:g} s", flush=True)
            break
        windows = make_windows(length, preset["vocab"], args.seed)
        at = make_config(preset["arch"], length, preset["settings"])
        length_plan = predicted(at, preset["arch"], preset["vocab"])
        try:
            for _ in range(args.warmup):
                trainer.train_step(windows)
            torch.cuda.reset_peak_memory_stats()
            step = timed_steps(trainer, windows, args.steps, gpu=True)
        except torch.OutOfMemoryError:
            torch.cuda.empty_cache()  # the longest that trained is known: no longer length is tried
            rows.append({"seq_len": length, "oom": True})
            print(f"{length}: out of memory", flush=True)
            out.write_text(json.dumps({"args": vars(args), **meta, "results": rows}, indent=1))
            break
        allocated = torch.cuda.max_memory_allocated()
        device_pred = length_plan.total("device")
        host_pred = length_plan.total("host") + HOST_RUNTIME_BYTES
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        rows.append({"seq_len": length, "oom": False, "step_s": step, "tokens_per_s": length / step,
                     "max_allocated_gb": allocated / GB, "max_reserved_gb": torch.cuda.max_memory_reserved() / GB,
                     "host_peak_rss_gb": rss / GB, "predicted_device_gb": device_pred / GB,
                     "predicted_host_gb": host_pred / GB, "device_predicted_over_allocated": device_pred / allocated,
                     "host_predicted_over_rss": host_pred / rss})
        r = rows[-1]
        print(f"{length}: {step:.1f} s/step, {r['tokens_per_s']:,.0f} tokens/s, allocated {r['max_allocated_gb']:.1f} "
              f"GB (predicted {r['predicted_device_gb']:.1f}), reserved {r['max_reserved_gb']:.1f} GB, host RSS "
              f"{r['host_peak_rss_gb']:.1f} GB (predicted {r['predicted_host_gb']:.1f})", flush=True)
        # written after every length, so a run stopped at a time limit keeps what it measured
        out.write_text(json.dumps({"args": vars(args), **meta, "results": rows}, indent=1))
    trained = [r["seq_len"] for r in rows if not r["oom"]]
    meta["longest_trained"] = max(trained, default=None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None, help="GPU preset (default: CPU rows)")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per window (CPU default 4096; GPU: the "
                        "preset's)")
    parser.add_argument("--vocab", type=int, default=1024, help="rows: vocabulary (small, so the layers dominate)")
    parser.add_argument("--settings", default=",".join(CPU_SETTINGS), help="rows to run")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the settings rows run")
    parser.add_argument("--arch", choices=sorted(ROW_ARCHS), default="small", help="the rows' model shape")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=1, help="GPU: untimed steps per length")
    parser.add_argument("--adam", choices=("torch", "deepspeed"), default="torch",
                        help="GPU: optimizer on the host (deepspeed compiles its CPU Adam on first use)")
    parser.add_argument("--ladder", action="store_true", help="GPU: then longer windows until out of memory")
    parser.add_argument("--ladder-step", type=int, default=32768)
    parser.add_argument("--ladder-max", type=int, default=1 << 20)
    parser.add_argument("--time-limit", type=float, default=420, help="GPU: start no length that would end after "
                        "this many seconds (model construction included)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="bench_out/bench_memory.json")
    args = parser.parse_args()

    from rich.console import Console
    from rich.table import Table

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    if args.preset:
        meta = {"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"}
        gpu_rows(args, out, rows, meta)
        out.write_text(json.dumps({"args": vars(args), **meta, "results": rows}, indent=1))
        table = Table(title=f"{args.preset} on {meta['device']}; longest trained: {meta['longest_trained']}")
        for col in ("seq_len", "s/step", "tokens/s", "alloc GB", "reserved GB", "pred dev GB", "pred/alloc",
                    "host RSS GB", "pred host GB"):
            table.add_column(col, justify="right")
        for r in rows:
            if r["oom"]:
                table.add_row(f"{r['seq_len']:,}", "OOM", *[""] * 7)
            else:
                table.add_row(f"{r['seq_len']:,}", f"{r['step_s']:.1f}", f"{r['tokens_per_s']:,.0f}",
                              f"{r['max_allocated_gb']:.1f}", f"{r['max_reserved_gb']:.1f}",
                              f"{r['predicted_device_gb']:.1f}", f"{r['device_predicted_over_allocated']:.2f}",
                              f"{r['host_peak_rss_gb']:.1f}", f"{r['predicted_host_gb']:.1f}")
    else:
        args.seq_len = args.seq_len or 4096
        for name in args.settings.split(","):
            rows.append(settings_row(name, CPU_SETTINGS[name], args))
            r = rows[-1]
            print(f"{name}: {r['tokens_per_s']:,.0f} tokens/s, measured {r['measured_peak_gb']:.3f} GB, predicted "
                  f"{r['predicted_gb']:.3f} GB", flush=True)
            out.write_text(json.dumps({"args": vars(args), "device": args.device, "results": rows}, indent=1))
        table = Table(title=f"train step memory, {args.device}, {args.seq_len} tokens, {args.arch} model, "
                            f"vocab {args.vocab}")
        for col in ("setting", "s/step", "tok/s", "meas GB", "pred GB", "pred/meas"):
            table.add_column(col, justify="right", no_wrap=True)
        for r in rows:
            table.add_row(r["setting"], f"{r['step_s']:.2f}", f"{r['tokens_per_s']:,.0f}",
                          f"{r['measured_peak_gb']:.3f}", f"{r['predicted_gb']:.3f}", f"{r['predicted_over_measured']:.2f}")
    Console().print(table)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
