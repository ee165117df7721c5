"""Memory benchmark: the planner's prediction (lctrain/memory.py) against the measured peak of the trainer's own step
(`Trainer.train_step` on SlimPajama-like windows), with tokens/s, per memory-saving setting.

    python scripts/bench_memory.py                                   # CPU: small Llama, 4K windows, 5 settings
    python scripts/bench_memory.py --device cuda --arch llama-1b --seq-len 65536 --vocab 32000 \
        --settings gradient_checkpointing,offload_activations,checkpointing+tiled_mlp   # the settings on one GPU
    python scripts/bench_memory.py --preset llama2-7b-128k           # one GPU: Llama-2-7B at 128K, ZeRO-3 + offload
    python scripts/bench_memory.py --preset llama2-7b-128k --ladder  # longer windows until out of memory
    python scripts/bench_memory.py --preset llama2-7b-128k --layers auto   # a host too small for all 32 layers
    python scripts/bench_memory.py --preset llama2-7b-1m --ladder    # 8 GPUs (the paper's layout): 1M tokens and up

A preset's rows are per rank. One rank on a GPU keeps one trainer for every length of its ladder; several ranks are
launched afresh for every length (parallel.launcher, `run_on_ranks`), the row holding the most any rank used.

CPU: the peak is the most bytes of tensor storage alive during one step (`cpu_peak_bytes`, the allocator totals the
profiler records), counted from before the model is built; the prediction is the plan's device plus host items.
GPU: torch.cuda.max_memory_allocated / max_memory_reserved against the plan's device items (without the runtime
overhead, which is outside PyTorch's allocator), and the process's peak RSS against its host items.
Prints a table and writes JSON after every row (default bench_out/bench_memory.json).
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import numpy as np
import psutil
import torch
from rich.table import Table
from transformers import AutoConfig

from lctrain.config import load_config
from lctrain.console import plain_console
from lctrain.costmodel import ModelShape
from lctrain.data.layouts import slimpajama_like_layouts, window_ids
from lctrain.errors import UserError
from lctrain.measure import (
    cpu_peak_bytes,
    host_peak_bytes,
    peak_bytes,
    peak_reserved_bytes,
    reset_peak,
    synchronize,
    timed,
)
from lctrain.memory import HOST_RUNTIME_BYTES, Budget, plan_memory
from lctrain.parallel.groups import init_topology, release_single_process
from lctrain.parallel.launch import OutOfMemory, RanksFailed, run_on_ranks
from lctrain.parallel.ulysses import kv_replication
from lctrain.shapes import SHAPES, hf_arch
from lctrain.train.trainer import Trainer
from lctrain.units import GB

ROW_ARCHS = {name: hf_arch(SHAPES[name]) for name in ("small", "llama-1b")}
LLAMA2_7B = hf_arch(SHAPES["llama2-7b"])
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
    # the single-GPU goal: ZeRO-3 with the optimizer states on the host
    "llama2-7b-128k": dict(
        arch=LLAMA2_7B,
        vocab=SHAPES["llama2-7b"].vocab,
        seq_len=131072,
        nproc=1,
        settings=[
            "model.dtype=bfloat16",
            "parallel.zero_stage=3",
            "parallel.offload_optimizer=true",
            "model.gradient_checkpointing=true",
            "model.tiled_mlp=auto",
            "attention.mode=anchor",
        ],
    ),
    # the paper's llama2_128k_anchor layout (8 GPUs, Ulysses over all 8, ZeRO-3, checkpointing) with the MLP tiled,
    # from the 8-GPU goal of 1M tokens up
    "llama2-7b-1m": dict(
        arch=LLAMA2_7B,
        vocab=SHAPES["llama2-7b"].vocab,
        seq_len=1 << 20,
        nproc=8,
        settings=[
            "model.dtype=bfloat16",
            "parallel.zero_stage=3",
            "model.gradient_checkpointing=true",
            "model.tiled_mlp=auto",
            "attention.mode=anchor",
        ],
    ),
}


def make_config(arch: dict, seq_len: int, settings: list[str]):
    return load_config(
        None,
        [
            f"data.seq_len={seq_len}",
            f"model.arch={json.dumps(arch)}",
            "attention.engine=auto",
            "train.global_batch=1",
            "train.micro_batch=1",
            "parallel.nproc_per_node=1",
            "parallel.sequence_parallel=1",
            "model.dtype=float32",
            "parallel.zero_stage=0",
            *settings,
        ],
    )


def make_windows(seq_len: int, vocab: int, seed: int) -> list[dict]:
    seg_lens = slimpajama_like_layouts(seq_len, 1, seed)
    return [
        {
            "input_ids": window_ids(seg_lens, vocab=vocab, anchor=1, seed=seed),
            "seg_lens": [np.array(s) for s in seg_lens],
            "seg_doc": [np.arange(len(s)) for s in seg_lens],
            "tag_lens": [np.zeros(len(s), dtype=np.int64) for s in seg_lens],
        }
    ]


def arch_shape(arch: dict, vocab: int) -> ModelShape:
    fields = {k: v for k, v in arch.items() if k != "model_type"}
    return ModelShape.from_hf_config(AutoConfig.for_model("llama", vocab_size=vocab, **fields))


def predicted(cfg, arch: dict, vocab: int, gpu: bool):
    return plan_memory(cfg, arch_shape(arch, vocab), gpu=gpu)


def timed_steps(trainer, windows, steps: int, gpu: bool) -> float:
    device = torch.device("cuda" if gpu else "cpu")
    return float(np.median([timed(lambda: trainer.train_step(windows), device)[1] for _ in range(steps)]))


def settings_row(name: str, settings: list[str], args) -> dict:
    """One memory setting through the trainer's step: on the CPU the profiler's peak of tensor storage (fp32, ZeRO
    off), on a GPU (`--device cuda`, bf16 under ZeRO-1) torch's peak allocation during one step after a warm-up,
    each against the plan (device plus host items on the CPU, where both are one memory; device items on a GPU)."""
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
            device = trainer.topo.device
            synchronize(device)
            baseline = torch.cuda.memory_allocated(device)
            reset_peak(device)
            trainer.train_step(windows)
            synchronize(device)
            peak = peak_bytes(device)
        else:
            peak, baseline = cpu_peak_bytes(setup, lambda trainer: trainer.train_step(windows))
        step = timed_steps(kept.pop("trainer"), windows, args.steps, gpu=gpu)  # outside the profiler
    finally:
        release_single_process()
        if gpu:
            torch.cuda.empty_cache()
    plan = predicted(cfg, arch, args.vocab, gpu)
    pred = plan.total("device") + (0 if gpu else plan.total("host"))
    return {
        "setting": name,
        "overrides": settings,
        "seq_len": args.seq_len,
        "step_s": step,
        "tokens_per_s": args.seq_len / step,
        "measured_peak_gb": peak / GB,
        "measured_states_gb": baseline / GB,
        "predicted_gb": pred / GB,
        "predicted_over_measured": pred / peak,
    }


def preset_spec(args) -> dict:
    """What every length of a preset's ladder runs: the model shape, the config overrides with the layout (Ulysses
    over all `nproc` ranks, as the paper's configs), and the step counts."""
    preset = PRESETS[args.preset]
    nproc = args.nproc or preset["nproc"]
    layout = [f"parallel.nproc_per_node={nproc}", f"parallel.sequence_parallel={nproc}"]
    arch = ROW_ARCHS[args.arch] if args.arch else preset["arch"]
    if isinstance(args.layers, int):
        arch = {**arch, "num_hidden_layers": args.layers}
    # DeepSpeed's CPU Adam (the trainer's choice for an offloaded optimizer on a GPU) builds a C++ op on first use
    adam = ["train.torch_adam=true"] if args.adam == "torch" else []
    return {
        "arch": arch,
        "vocab": args.vocab or preset["vocab"],
        "settings": preset["settings"] + layout + adam,
        "nproc": nproc,
        "warmup": args.warmup,
        "steps": args.steps,
        "seed": args.seed,
    }


def layer_count(value: str):
    """--layers: 'auto' or a number of decoder layers (argparse prints a bad one as a usage error)."""
    if value == "auto":
        return value
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"expected 'auto' or a number of layers >= 1, not {value!r}")
    return int(value)


def host_need(spec: dict, seq_len: int, gpu: bool) -> int:
    """Host bytes of all the ranks on this host: their host items and runtime."""
    return spec_plan(spec, seq_len, gpu).host_bytes()


def fit_layers(spec: dict, seq_len: int, available: int, gpu: bool) -> dict:
    """`spec` with the most decoder layers, up to its model's, whose host items fit in the share of `available` bytes
    a plan is held to (`Budget.planned`): a host too small for the whole model's offloaded optimizer states still
    measures the model's own width and window length (each layer's activations and recomputation, the loss chunk)
    against the plan."""
    layers = spec["arch"]["num_hidden_layers"]
    planned = Budget(None, available, "this host's available memory").planned().host
    while (
        layers > 1
        and host_need({**spec, "arch": {**spec["arch"], "num_hidden_layers": layers}}, seq_len, gpu) > planned
    ):
        layers -= 1
    return {**spec, "arch": {**spec["arch"], "num_hidden_layers": layers}}


def spec_plan(spec: dict, seq_len: int, gpu: bool):
    """The plan of one length."""
    return predicted(make_config(spec["arch"], seq_len, spec["settings"]), spec["arch"], spec["vocab"], gpu)


def ladder(args, first: int) -> list[int]:
    lengths = [first]
    while args.ladder and lengths[-1] + args.ladder_step <= args.ladder_max:
        lengths.append(lengths[-1] + args.ladder_step)
    return lengths


def preflight(spec: dict, seq_len: int) -> None:
    """Refuse in one line, before building or launching anything, a layout the model's heads cannot be split over,
    and ranks whose host items (offloaded optimizer states) exceed this host's memory."""
    shape = arch_shape(spec["arch"], spec["vocab"])
    kv_replication(shape.heads, shape.kv_heads, spec["nproc"], "--nproc")
    gpu = torch.cuda.is_available()
    need = host_need(spec, seq_len, gpu)
    available = psutil.virtual_memory().available
    print(
        f"plan per rank: {spec_plan(spec, seq_len, gpu).total('device') / GB:.1f} GB on the device (tensors); host "
        f"memory for {spec['nproc']} rank(s): {need / GB:.1f} GB of {available / GB:.1f} GB available",
        flush=True,
    )
    if need > available:
        raise SystemExit(
            f"error: the plan needs {need / GB:.1f} GB of host memory (offloaded optimizer states) "
            f"and {available / GB:.1f} GB are available; use a host with more memory, or measure "
            f"fewer of the model's layers (--layers auto)"
        )


def gpu_step_peak(trainer, windows, warmup: int, steps: int) -> tuple[float, int, int]:
    """(median step seconds, peak allocated bytes, peak reserved bytes) of `steps` steps after `warmup` ones."""
    for _ in range(warmup):
        trainer.train_step(windows)
    device = trainer.topo.device
    reset_peak(device)
    step = timed_steps(trainer, windows, steps, gpu=True)
    return step, peak_bytes(device), peak_reserved_bytes(device)


def length_row(spec: dict, seq_len: int, step: float, peak: int, reserved: int, rss: int, gpu: bool) -> dict:
    """One trained length against the plan, per rank. On a GPU the device items against PyTorch's peak allocation;
    on the CPU (one memory) device plus host items against the profiler's peak of tensor storage."""
    plan = spec_plan(spec, seq_len, gpu)
    device_pred = plan.total("device") + (0 if gpu else plan.total("host"))
    host_pred = plan.total("host") + HOST_RUNTIME_BYTES
    return {
        "seq_len": seq_len,
        "oom": False,
        "step_s": step,
        "tokens_per_s": seq_len / step,
        "max_allocated_gb": peak / GB,
        "max_reserved_gb": reserved / GB,
        "host_peak_rss_gb": rss / GB,
        "predicted_device_gb": device_pred / GB,
        "predicted_host_gb": host_pred / GB,
        "device_predicted_over_allocated": device_pred / peak,
        "host_predicted_over_rss": host_pred / rss,
    }


def peak_rss() -> int:
    return host_peak_bytes()


def print_length(r: dict) -> None:
    if r["oom"]:
        print(f"{r['seq_len']}: out of memory", flush=True)
        return
    print(
        f"{r['seq_len']}: {r['step_s']:.1f} s/step, {r['tokens_per_s']:,.0f} tokens/s, allocated "
        f"{r['max_allocated_gb']:.1f} GB (predicted {r['predicted_device_gb']:.1f}), reserved "
        f"{r['max_reserved_gb']:.1f} GB, host RSS {r['host_peak_rss_gb']:.1f} GB (predicted "
        f"{r['predicted_host_gb']:.1f}) per rank",
        flush=True,
    )


def out_of_time(args, started: float, rows: list, length: int, warmup: int, steps: int, build: bool) -> bool:
    """Whether `length` would end after --time-limit: a longer window takes at least proportionally longer than the
    last one that trained (and, `build`, its construction again)."""
    last = next((r for r in reversed(rows) if not r["oom"]), None)
    if args.time_limit is None or last is None:
        return False
    expected = (last["build_s"] if build else 0.0) + (warmup + steps) * last["step_s"] * length / last["seq_len"]
    if time.perf_counter() + expected <= started + args.time_limit:
        return False
    print(f"stopping before {length}: it would end after --time-limit {args.time_limit:g} s", flush=True)
    return True


def in_process_rows(args, spec: dict, first: int, out: Path, rows: list, meta: dict) -> None:
    """One GPU: one trainer, every length of the ladder in this process (an out-of-memory step ends the ladder)."""
    started = time.perf_counter()
    cfg = make_config(spec["arch"], first, spec["settings"])
    t0 = time.perf_counter()
    trainer = Trainer(cfg, init_topology(cfg), vocab_size=spec["vocab"])
    build_s = time.perf_counter() - t0
    print(f"built in {build_s:.0f} s", flush=True)
    for i, length in enumerate(ladder(args, first)):
        # the first length's warm-up steps create the optimizer states and warm the allocator for the longer ones
        warmup = spec["warmup"] if i == 0 else 0
        if out_of_time(args, started, rows, length, warmup, spec["steps"], build=False):
            break
        windows = make_windows(length, spec["vocab"], spec["seed"])
        try:
            step, peak, reserved = gpu_step_peak(trainer, windows, warmup, spec["steps"])
        except torch.OutOfMemoryError:
            torch.cuda.empty_cache()  # the longest that trained is known: no longer length is tried
            rows.append({"seq_len": length, "oom": True})
        else:
            rows.append({**length_row(spec, length, step, peak, reserved, peak_rss(), gpu=True), "build_s": build_s})
        print_length(rows[-1])
        # written after every length, so a run stopped at a time limit keeps what it measured
        out.write_text(json.dumps({"args": vars(args), **meta, "results": rows}, indent=1))
        if rows[-1]["oom"]:
            break


def in_this_process(spec: dict) -> bool:
    """One rank on a GPU runs its whole ladder in this process; several ranks, or the CPU, are launched."""
    return spec["nproc"] == 1 and torch.cuda.is_available()


def launched_rows(args, spec: dict, first: int, out: Path, rows: list, meta: dict) -> None:
    """Several ranks: every length is its own `run_on_ranks` of `measure_length`, because one rank out of memory
    leaves the others waiting in a collective; out of memory on any rank ends the ladder, any other failure ends the
    benchmark with the ranks' output above."""
    started = time.perf_counter()
    for length in ladder(args, first):
        if out_of_time(args, started, rows, length, spec["warmup"], spec["steps"], build=True):
            break
        cfg = make_config(spec["arch"], length, spec["settings"])
        # beside the output, not in a temporary folder: a failure's message names the launcher's log in it
        work = out.with_name(f"{out.stem}.ranks-{length}")
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        try:
            outcome = run_on_ranks(cfg, f"{__name__}:measure_length", {**spec, "seq_len": length}, work)
        except RanksFailed as e:
            raise SystemExit(
                f"error: the {spec['nproc']} workers at {length} tokens exited with code {e.exit_code} "
                f"(their output is above; the launcher's log is in {work})"
            ) from None
        except UserError as e:
            raise SystemExit(f"error: {e}") from None
        shutil.rmtree(work)
        row = {"seq_len": length, "oom": True} if isinstance(outcome, OutOfMemory) else outcome.result
        meta["device"] = row.pop("device", meta.get("device"))
        rows.append(row)
        print_length(row)
        out.write_text(json.dumps({"args": vars(args), **meta, "results": rows}, indent=1))
        if row["oom"]:
            break


def measure_length(spec: dict) -> dict | None:
    """One rank of one ladder length (`run_on_ranks`): build the trainer, step, and (rank 0) return the group's peak,
    the most of any rank (all-reduced), as the row."""
    # deepspeed on use: it takes seconds to import (start-up time); only the ranks need it
    import deepspeed.comm as dist

    length = spec["seq_len"]
    cfg = make_config(spec["arch"], length, spec["settings"])
    topo = init_topology(cfg)
    gpu = topo.device.type == "cuda"
    windows = make_windows(length, spec["vocab"], spec["seed"])
    kept = {}

    def setup():
        t0 = time.perf_counter()
        kept["trainer"] = Trainer(cfg, topo, vocab_size=spec["vocab"])
        kept["build_s"] = time.perf_counter() - t0
        for _ in range(0 if gpu else spec["warmup"]):
            kept["trainer"].train_step(windows)
        return kept["trainer"]

    if gpu:
        step, peak, reserved = gpu_step_peak(setup(), windows, spec["warmup"], spec["steps"])
    else:
        peak, _ = cpu_peak_bytes(setup, lambda trainer: trainer.train_step(windows))
        reserved, step = peak, timed_steps(kept["trainer"], windows, spec["steps"], gpu=False)
    group = torch.tensor([peak, reserved, peak_rss(), step, kept["build_s"]], dtype=torch.float64, device=topo.device)
    dist.all_reduce(group, op=dist.ReduceOp.MAX)
    peak, reserved, rss, step, build_s = group.tolist()
    if topo.rank != 0:
        return None
    row = length_row(spec, length, step, int(peak), int(reserved), int(rss), gpu)
    return {**row, "build_s": build_s, "device": torch.cuda.get_device_name(topo.device) if gpu else "cpu"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None, help="GPU preset (default: CPU rows)")
    parser.add_argument(
        "--seq-len", type=int, default=None, help="tokens per window (rows: 4096; a preset: its first length)"
    )
    parser.add_argument(
        "--vocab", type=int, default=None, help="vocabulary (rows: 1024, so the layers dominate; a preset: its model's)"
    )
    parser.add_argument("--settings", default=",".join(CPU_SETTINGS), help="rows to run")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the settings rows run")
    parser.add_argument(
        "--arch", choices=sorted(ROW_ARCHS), default=None, help="model shape (rows: small; a preset: its model's)"
    )
    parser.add_argument("--nproc", type=int, default=None, help="preset: ranks (default the preset's: 1 or 8)")
    parser.add_argument(
        "--layers",
        type=layer_count,
        default=None,
        help="preset: decoder layers (default the model's), or 'auto': as "
        "many as this host's memory holds the offloaded optimizer states of",
    )
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument(
        "--warmup",
        type=int,
        default=1,
        help="preset: untimed steps before the first length (with several ranks: before every length)",
    )
    parser.add_argument(
        "--adam",
        choices=("torch", "deepspeed"),
        default="torch",
        help="preset: optimizer on the host (deepspeed compiles its CPU Adam on first use)",
    )
    parser.add_argument("--ladder", action="store_true", help="preset: then longer windows until out of memory")
    parser.add_argument("--ladder-step", type=int, default=None, help="(default: a quarter of the first length)")
    parser.add_argument("--ladder-max", type=int, default=None, help="(default: 8 times the first length)")
    parser.add_argument(
        "--time-limit",
        type=float,
        default=None,
        help="preset: start no length that would end after this many seconds (model construction included)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="bench_out/bench_memory.json")
    args = parser.parse_args()

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    if args.preset:
        spec = preset_spec(args)
        first = args.seq_len or PRESETS[args.preset]["seq_len"]
        if args.layers == "auto":
            whole = spec["arch"]["num_hidden_layers"]
            spec = fit_layers(spec, first, psutil.virtual_memory().available, torch.cuda.is_available())
            print(
                f"--layers auto: this host holds the states of {spec['arch']['num_hidden_layers']} of the model's "
                f"{whole} layers",
                flush=True,
            )
        args.ladder_step = args.ladder_step or first // 4
        args.ladder_max = args.ladder_max or 8 * first
        try:
            preflight(spec, first)
        except UserError as e:
            raise SystemExit(f"error: {e}") from None
        meta = {"device": "cpu", "nproc": spec["nproc"], "layers": spec["arch"]["num_hidden_layers"]}
        if in_this_process(spec):
            meta["device"] = torch.cuda.get_device_name(0)
            in_process_rows(args, spec, first, out, rows, meta)
        else:
            launched_rows(args, spec, first, out, rows, meta)
        meta["longest_trained"] = max((r["seq_len"] for r in rows if not r["oom"]), default=None)
        out.write_text(json.dumps({"args": vars(args), **meta, "results": rows}, indent=1))
        table = Table(
            title=f"{args.preset}, {spec['nproc']} x {meta['device']}; longest trained: "
            f"{meta['longest_trained']}; per rank"
        )
        for col in (
            "seq_len",
            "s/step",
            "tokens/s",
            "alloc GB",
            "reserved GB",
            "pred dev GB",
            "pred/alloc",
            "host RSS GB",
            "pred host GB",
        ):
            table.add_column(col, justify="right")
        for r in rows:
            if r["oom"]:
                table.add_row(f"{r['seq_len']:,}", "OOM", *[""] * 7)
            else:
                table.add_row(
                    f"{r['seq_len']:,}",
                    f"{r['step_s']:.1f}",
                    f"{r['tokens_per_s']:,.0f}",
                    f"{r['max_allocated_gb']:.1f}",
                    f"{r['max_reserved_gb']:.1f}",
                    f"{r['predicted_device_gb']:.1f}",
                    f"{r['device_predicted_over_allocated']:.2f}",
                    f"{r['host_peak_rss_gb']:.1f}",
                    f"{r['predicted_host_gb']:.1f}",
                )
    else:
        args.seq_len = args.seq_len or 4096
        args.arch = args.arch or "small"
        args.vocab = args.vocab or 1024
        for name in args.settings.split(","):
            rows.append(settings_row(name, CPU_SETTINGS[name], args))
            r = rows[-1]
            print(
                f"{name}: {r['tokens_per_s']:,.0f} tokens/s, measured {r['measured_peak_gb']:.3f} GB, predicted "
                f"{r['predicted_gb']:.3f} GB",
                flush=True,
            )
            out.write_text(json.dumps({"args": vars(args), "device": args.device, "results": rows}, indent=1))
        table = Table(
            title=f"train step memory, {args.device}, {args.seq_len} tokens, {args.arch} model, vocab {args.vocab}"
        )
        for col in ("setting", "s/step", "tok/s", "meas GB", "pred GB", "pred/meas"):
            table.add_column(col, justify="right", no_wrap=True)
        for r in rows:
            table.add_row(
                r["setting"],
                f"{r['step_s']:.2f}",
                f"{r['tokens_per_s']:,.0f}",
                f"{r['measured_peak_gb']:.3f}",
                f"{r['predicted_gb']:.3f}",
                f"{r['predicted_over_measured']:.2f}",
            )
    plain_console().print(table)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
