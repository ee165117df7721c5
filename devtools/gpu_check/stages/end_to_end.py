"""The cli stage: lctrain prepare, train (ZeRO-1 and ZeRO-3), kill -9 and resume to the same losses (as it was, and
as ZeRO-2 through the universal checkpoint), eval and diagnose rope, with a bundled config."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

from devtools.gpu_check.runner import Runner, lctrain_cli


def read_losses(run_dir: Path) -> dict[int, float]:
    from lctrain.rundir import RunDir  # the install stage runs before lctrain is installed: import it in the stages

    return {int(rec["step"]): float(rec["loss"]) for rec in RunDir(run_dir).read_metrics()}


def compare_losses(a: dict[int, float], b: dict[int, float]) -> dict:
    """Steps both runs logged, how many agree bit for bit, and the largest relative difference."""
    steps = sorted(set(a) & set(b))
    rel = [abs(a[s] - b[s]) / max(abs(a[s]), 1e-12) for s in steps]
    return {"steps": len(steps), "identical": sum(a[s] == b[s] for s in steps), "max_rel_diff": max(rel, default=0.0)}


def kill_after_step(run: Runner, cmd: list[str], run_dir: Path, step: int, cwd: Path) -> bool:
    """Start a training command, SIGKILL its whole process group once `step` is in metrics.jsonl. False if it ended
    before that."""
    proc = run.start(cmd, cwd)
    while proc.poll() is None:
        if max(read_losses(run_dir), default=0) >= step:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return True
        if run.remaining() < 0:
            os.killpg(proc.pid, signal.SIGKILL)
            raise TimeoutError(run.timeout_note())
        time.sleep(0.5)
    return False


# Losses of the same config on the same GPU: bf16 kernels with atomics (FlashAttention's backward) are not
# bit-reproducible, so a resumed run is held to run-to-run noise, and ZeRO-3 (other reduction order) likewise.
RESUME_MAX_REL = 1e-2
# Perplexity in bf16 by two paths (the training engine, eval's eager model): their logits differ by bf16 rounding, a
# ~1% change of the loss's exponent at most
HELDOUT_MAX_REL = 2e-2


def stage_cli(run: Runner, args) -> None:
    # the install stage runs before lctrain is installed: import it in the stages
    from lctrain.config import load_config
    from lctrain.rundir import RunDir

    r = run.result
    # absolute: the commands run in `work`, while this process reads their run directories from its own directory
    work = (Path(args.work) if args.work else run.log.parent / "cli_work").absolute()
    work.mkdir(parents=True, exist_ok=True)
    cfg = ["-c", args.cli_config, "--set", f"data.output_dir={work / 'prepared'}"]
    run.run(lctrain_cli() + ["prepare", *cfg], cwd=work)
    runs = {z: work / f"zero{z}" for z in ("1", "3")}
    # the held-out loss scored at the last step, the export's, to compare with eval's perplexity of that export
    steps = load_config(args.cli_config).train.steps
    for z, rd in runs.items():
        run.run(
            lctrain_cli()
            + ["train", *cfg, "--set", f"parallel.zero_stage={z}", "--set", f"train.run_dir={rd}", "--force"]
            + ["--set", f"train.heldout_every={steps}"],
            cwd=work,
        )
    # killed, then resumed as it was and resumed as ZeRO-2 (the checkpoint converted to DeepSpeed's universal form:
    # bf16's optimizer -> ZeRO-2's, CUDA tensors converted on the host)
    killed = {"resumed": work / "zero1_killed", "resharded": work / "zero1_killed_to_zero2"}
    for name, rd in killed.items():
        cmd = lctrain_cli() + [
            "train",
            *cfg,
            "--set",
            "parallel.zero_stage=1",
            "--set",
            f"train.run_dir={rd}",
            "--force",
        ]
        if not kill_after_step(run, cmd, rd, args.kill_step, work):
            r.fail(f"the run to kill finished before step {args.kill_step}")
        layout = ["--set", "parallel.zero_stage=2"] if name == "resharded" else []
        run.run(lctrain_cli() + ["resume", str(rd), *layout], cwd=work)
    losses = {name: read_losses(rd) for name, rd in [("zero1", runs["1"]), ("zero3", runs["3"]), *killed.items()]}
    r.columns = ["comparison", "steps", "bit-identical", "max rel diff", "limit"]
    for name, other in (
        (f"zero1 killed at step {args.kill_step} + resumed vs uninterrupted", "resumed"),
        (f"zero1 killed at step {args.kill_step} + resumed as ZeRO-2 vs uninterrupted", "resharded"),
        ("zero3 vs zero1", "zero3"),
    ):
        c = compare_losses(losses["zero1"], losses[other])
        r.rows.append([name, c["steps"], c["identical"], c["max_rel_diff"], RESUME_MAX_REL])
        if c["steps"] == 0 or c["max_rel_diff"] > RESUME_MAX_REL:
            r.fail(f"{name}: {c}")
    r.data["losses"] = losses
    last = max(losses["zero1"], default=None)
    r.notes.append(f"zero1 loss: step 1 {losses['zero1'].get(1)}, step {last} {losses['zero1'].get(last)}")
    metrics = RunDir(runs["1"]).read_metrics()
    r.notes.append(
        f"zero1 last step: {metrics[-1]['tokens_per_s']:,.0f} tokens/s, peak {metrics[-1]['peak_mem_gb']:.2f} GB"
    )
    run.run(lctrain_cli() + ["eval", str(runs["1"])], cwd=work)
    results = json.loads((RunDir(runs["1"]).eval_dir / "results.json").read_text())
    r.data["eval"] = {k: v for k, v in results.items() if k != "predictions"}
    scored = metrics[-1]
    evaluated = results["perplexity"]["per_checkpoint"].get(f"step_{scored['step']}")
    if evaluated is None or "heldout_ppl" not in scored:
        r.fail(f"no held-out score to compare at step {scored['step']} (eval's: {evaluated})")
    else:
        # the training engine's kernels against eval's eager Hugging Face model, both in the run's dtype
        rel = abs(scored["heldout_ppl"] - evaluated) / evaluated
        r.rows.append(["held-out perplexity during training vs lctrain eval's", 1, rel == 0, rel, HELDOUT_MAX_REL])
        if rel > HELDOUT_MAX_REL:
            r.fail(f"held-out perplexity {scored['heldout_ppl']} during training, {evaluated} by lctrain eval")
        r.notes.append(
            f"held-out score of {results['perplexity']['windows']} windows: {scored['heldout_time_s']:.2f} s, "
            f"against {scored['step_time_s']:.2f} s for the step"
        )
    hf = RunDir(runs["1"]).exports()
    # within the prepared windows: 16K on a GPU (gpu_small_16k), 1K for a CPU run of the stage (tiny_anchor)
    window = load_config(args.cli_config).data.seq_len
    max_len = min(4096, window // 2)
    run.run(
        lctrain_cli()
        + [
            "diagnose",
            "rope",
            str(hf[-1]),
            "--text",
            str(work / "prepared"),
            "--samples",
            "4",
            "--seq-len",
            str(min(1024, max_len)),
            "--max-len",
            str(max_len),
            "--out",
            str(work / "diagnose"),
        ],
        cwd=work,
    )
    r.notes.append(f"eval and diagnose rope ran; outputs in {work}")
