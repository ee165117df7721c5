"""Every GPU-side check and benchmark of lctrain on one CUDA GPU, in stages of at most ~10 minutes, into one report.

    python scripts/gpu_check.py                          # every stage, in order (about 65 minutes on an H100)
    python scripts/gpu_check.py install tests attention  # some stages, in that order (the report keeps the rest)
    python scripts/gpu_check.py --wheels .whl install    # on an offline machine: install what it lacks from wheels
    python scripts/gpu_check.py wheels --dest .whl       # on a connected machine: build that wheelhouse (--have FREEZE)
    python scripts/gpu_check.py gguf-parts --dest .gguf    # here: the example model's GGUF in parts (carry limit)
    python scripts/gpu_check.py --gguf-parts .gguf1 .gguf2 rope_real experiment   # there, each part carried before

Stages:
  install    lctrain and the dependencies the machine lacks, from --wheels (never replacing its torch, numpy, ...)
  tests      the `-m "gpu and not slow"` tests (--tests-marker): every engine against the dense reference, every
             mode, fwd+bwd, bf16/fp32, GQA
  attention  scripts/bench_attention.py at 8K/32K/128K, Llama-2-7B head layout: time and fraction of FLOP ideal
  train      scripts/bench_train.py, a 1B Llama-shaped model at 64K, every mode, bf16, activation checkpointing
  fused      scripts/bench_train.py as train, selective checkpointing, with model.fused_kernels none / liger / compile
             (+ fused AdamW): step time of each against none
  peer       scripts/bench_peer.py at 64K: lctrain, torchtitan and transformers + SDPA, full and document, A/B/B/A
             in fresh processes; lctrain / torchtitan against issue 20's goals (needs torchtitan: the `peer` extra)
  peer_32k   the same at 32K
  peer_tuned the same at 64K with each side's own speed-ups: lctrain's selective checkpointing and Liger kernels,
             torchtitan's op-level selective checkpointing and compiled layers
  cli        lctrain prepare + train (ZeRO-1 and ZeRO-3, nccl) + kill -9 + resume to the same losses + eval +
             diagnose rope, with the bundled config gpu_small_16k
  rope       the paper's Figure 1 on a Llama-2-7B-shaped model: lctrain diagnose rope at 4096 tokens, fp32 / bf16 /
             random init, real text (Python's standard library)
  rope_real  Figures 1 and 7 on real weights: the example model (SmolLM2-135M; its GGUF carried in parts, --gguf-parts),
             sequences of the paper's 4096 tokens of the standard library's code (20; the paper's 50 with
             --rope-real-samples 50 and a longer --stage-limit), fp32 / bf16 / random init, the paper's findings
             reported as targets
  generation scripts/bench_generation.py, Llama-2-7B shape at 32K/64K/128K prompts: the eval memory plan against the
             measured peak, prefill and decode time
  figure6    lctrain estimate --measure with gpu_small_16k at 4K/8K/16K, full and anchor (Figure 6 measured)
  memory     scripts/bench_memory.py --preset llama2-7b-128k --layers auto --ladder: Llama-2-7B, anchor, bf16 at 128K
             on one GPU (ZeRO-3, optimizer offloaded, checkpointing, tiled MLP), with as many of its layers as the
             host holds the optimizer states of, then longer windows until out of memory; the planner's prediction
             against the measured peak
  experiment lctrain experiment extend: SmolLM2-135M extended 8K -> 32K in full, intra_doc and anchor modes, steps
             per run sized from measured throughput, the needle tasks and perplexity at 8K/16K/32K, the report's table

The report is `--out`/gpu_check.json (merged across invocations, newest result per stage) and gpu_check.md.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from devtools.gpu_check.gguf_parts import split_example_model, use_joined
from devtools.gpu_check.report import gpu_meta, merge_report, render_markdown
from devtools.gpu_check.stages import MIN_STAGE_S, STAGE_LIMIT_S, STAGES, run_stage, select_stages, skipped
from devtools.gpu_check.wheels import DEVICE_FREEZE, build_wheelhouse
from devtools.wheelhouse import CARRIED_EXTRAS


def add_extras_argument(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--extras",
        type=lambda text: tuple(e for e in text.split(",") if e),
        default=CARRIED_EXTRAS,
        help="lctrain's extras the wheelhouse holds and the install stage installs (default: "
        f"{','.join(CARRIED_EXTRAS)}; 'example' alone keeps the wheels small enough to share a call with a GGUF part)",
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["wheels"]:
        ap = argparse.ArgumentParser(
            prog="gpu_check.py wheels",
            description="build the wheelhouse for an offline machine from its `pip freeze` (run here, with internet)",
        )
        ap.add_argument(
            "--have",
            default=str(DEVICE_FREEZE),
            help="the target machine's `python -m pip freeze` output (default: the lent GPU machine's, as read there "
            "on 2026-11-26)",
        )
        ap.add_argument("--dest", default=".whl")
        add_extras_argument(ap)
        ap.add_argument("--python-version", default="3.12")
        ap.add_argument(
            "--platform",
            nargs="+",
            default=["manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "linux_x86_64"],
        )
        build_wheelhouse(ap.parse_args(argv[1:]))
        return 0
    if argv[:1] == ["gguf-parts"]:
        ap = argparse.ArgumentParser(
            prog="gpu_check.py gguf-parts",
            description="cut the example model's GGUF into folders DEST1, DEST2, ... each under the carry limit",
        )
        ap.add_argument("--dest", default=".gguf")
        ap.add_argument("--max-mib", type=float, default=48, help="part size (the carry limit is 64 MiB a call)")
        args = ap.parse_args(argv[1:])
        for folder in split_example_model(Path(args.dest), args.max_mib):
            print(folder)
        return 0
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 2)[2],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("stages", nargs="*", help=f"'all' (default) or some of: {', '.join(STAGES)}")
    ap.add_argument("--out", default="gpu_report", help="report directory (logs, JSON, markdown)")
    ap.add_argument("--wheels", default=None, help="wheelhouse for the install stage on an offline machine")
    add_extras_argument(ap)
    ap.add_argument(
        "--gguf-parts",
        nargs="+",
        default=None,
        help="folders written by `gpu_check.py gguf-parts` (each carried in an earlier call): the example model's GGUF",
    )
    ap.add_argument("--stage-limit", type=float, default=STAGE_LIMIT_S, help="seconds per stage")
    ap.add_argument(
        "--total-limit",
        type=float,
        default=None,
        help="seconds for this whole invocation (one device call's limit, less the interpreter's start): each stage "
        f"gets at most what is left, and one with under {MIN_STAGE_S:.0f} s left is skipped, so the report comes back "
        "before the call is killed",
    )
    ap.add_argument("--attention-lengths", type=int, nargs="+", default=[8192, 32768, 131072])
    ap.add_argument("--attention-engines", nargs="+", default=["varlen", "sdpa", "flex"])
    ap.add_argument("--train-seq-len", type=int, default=65536)
    ap.add_argument("--peer-rounds", type=int, default=2, help="peer stages: runs of every peer per mode")
    ap.add_argument(
        "--tests-marker",
        default="gpu and not slow",
        help="tests stage: the pytest -m expression ('gpu' adds the slow GPU tests, e.g. flex's memory test, which "
        "spends ~200 s compiling)",
    )
    ap.add_argument("--cli-config", default="gpu_small_16k")
    ap.add_argument("--kill-step", type=int, default=12)
    ap.add_argument("--rope-samples", type=int, default=4, help="rope stage: text sequences per case")
    ap.add_argument(
        "--rope-real-samples",
        type=int,
        default=20,
        help="rope_real stage: text sequences per case (the paper's 50 need about 2.5x the stage's 10 minutes: raise "
        "--stage-limit with it)",
    )
    ap.add_argument("--generation-lengths", type=int, nargs="+", default=[32768, 65536, 131072])
    ap.add_argument("--memory-steps", type=int, default=2, help="memory stage: timed steps per length")
    ap.add_argument(
        "--experiment-train-seconds", type=float, default=45, help="experiment stage: training time per run"
    )
    ap.add_argument("--experiment-seeds", type=int, default=1, help="experiment stage: seeds per mode")
    ap.add_argument("--experiment-checkpoints", type=int, default=3, help="experiment stage: checkpoints averaged")
    ap.add_argument(
        "--experiment-tasks", default="niah_single_1,niah_multikey_1", help="experiment stage: needle tasks scored"
    )
    ap.add_argument("--experiment-samples", type=int, default=3, help="experiment stage: samples per task and length")
    ap.add_argument(
        "--work",
        default=None,
        help="where the cli (OUT/cli_work) and experiment (OUT/experiment) stages work; a few GB of checkpoints",
    )
    args = ap.parse_args(argv)
    stages = select_stages(args.stages)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.gguf_parts:
        print(f"[gpu_check] example model GGUF: {use_joined([Path(p) for p in args.gguf_parts], out / 'gguf')}")
    results = []
    end = None if args.total_limit is None else time.monotonic() + args.total_limit
    for stage in stages:
        left = args.stage_limit if end is None else min(args.stage_limit, end - time.monotonic())
        if left < MIN_STAGE_S:
            why = f"skipped: {max(left, 0):.0f} s left of --total-limit {args.total_limit:.0f}"
            results.append(skipped(stage, why))
        else:
            print(f"[gpu_check] {stage} ...", flush=True)
            results.append(run_stage(stage, args, out, limit=left))
        print(f"[gpu_check] {stage}: {results[-1].status} in {results[-1].seconds:.0f} s", flush=True)
        report = merge_report(out / "gpu_check.json", results, gpu_meta())
        (out / "gpu_check.md").write_text(render_markdown(report))
    print((out / "gpu_check.md").read_text())
    return 0 if all(r.status == "passed" for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
