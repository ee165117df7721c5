"""Every GPU-side check and benchmark of lctrain on one CUDA GPU, in stages of at most ~10 minutes, into one report.

    python scripts/gpu_check.py                          # every stage, in order (about 45 minutes on an H100)
    python scripts/gpu_check.py install tests attention  # some stages; the report keeps the other stages' results
    python scripts/gpu_check.py --wheels .whl install    # on an offline machine: install what it lacks from wheels
    python scripts/gpu_check.py wheels --have freeze.txt --dest .whl   # on a connected machine: build that wheelhouse

Stages:
  install    lctrain and the dependencies the machine lacks, from --wheels (never replacing its torch, numpy, ...)
  tests      the `-m gpu` tests: every engine against the dense reference, every mode, fwd+bwd, bf16/fp32, GQA
  attention  scripts/bench_attention.py at 8K/32K/128K, Llama-2-7B head layout: time and fraction of FLOP ideal
  train      scripts/bench_train.py, a 1B Llama-shaped model at 64K, every mode, bf16, activation checkpointing
  cli        lctrain prepare + train (ZeRO-1 and ZeRO-3, nccl) + kill -9 + resume to the same losses + eval +
             diagnose rope, with the bundled config gpu_small_16k
  rope       the paper's Figure 1 on a Llama-2-7B-shaped model: lctrain diagnose rope at 4096 tokens, fp32 / bf16 /
             random init, real text (Python's standard library)
  generation scripts/bench_generation.py, Llama-2-7B shape at 32K/64K/128K prompts: the eval memory plan against the
             measured peak, prefill and decode time
  figure6    lctrain estimate --measure with gpu_small_16k at 4K/8K/16K, full and anchor (Figure 6 measured)
  memory     scripts/bench_memory.py --preset llama2-7b-128k --layers auto --ladder: Llama-2-7B, anchor, bf16 at 128K
             on one GPU (ZeRO-3, optimizer offloaded, checkpointing, tiled MLP), with as many of its layers as the
             host holds the optimizer states of, then longer windows until out of memory; the planner's prediction
             against the measured peak

The report is `--out`/gpu_check.json (merged across invocations, newest result per stage) and gpu_check.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

STAGES = ("install", "tests", "attention", "train", "cli", "rope", "generation", "figure6", "memory")
STAGE_LIMIT_S = 570  # one stage fits a 10-minute slot with room for the interpreter start and the report
TARGETS = {
    "doc_mode_fraction_of_ideal": 0.80,  # document-mode attention fwd+bwd at 32K and 128K
    "anchor_step_vs_full": 0.50,  # anchor training step time over the full-attention one at 64K
    "full_mfu": 0.40,  # full-attention training MFU, 1B model at 64K
    "memory_plan_error": 0.10,  # the memory planner's device prediction against the measured peak
}


def select_stages(names: list[str]) -> list[str]:
    """Stage names (or 'all', or none) -> the stages to run, in their canonical order."""
    if not names or names == ["all"]:
        return list(STAGES)
    unknown = [n for n in names if n not in STAGES]
    if unknown:
        raise SystemExit(
            f"gpu_check: unknown stage {', '.join(unknown)}; expected 'all' or some of {', '.join(STAGES)}"
        )
    return [s for s in STAGES if s in names]


@dataclass
class StageResult:
    stage: str
    status: str = "passed"  # passed | failed | error (could not run)
    seconds: float = 0.0
    commands: list[str] = field(default_factory=list)
    columns: list[str] = field(default_factory=list)
    rows: list[list] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    targets: list[dict] = field(default_factory=list)  # {"name", "value", "goal", "met"}
    data: dict = field(default_factory=dict)

    def fail(self, note: str) -> None:
        self.status = "failed"
        self.notes.append(note)


def merge_report(path: Path, results: list[StageResult], meta: dict) -> dict:
    """Read the report at `path` (if any), replace the stages just run, and write it back."""
    report = json.loads(path.read_text()) if path.is_file() else {"stages": {}}
    report["meta"] = {**report.get("meta", {}), **meta}
    for r in results:
        report["stages"][r.stage] = vars(r)
    report["stages"] = {s: report["stages"][s] for s in STAGES if s in report["stages"]}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1, default=str))
    return report


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    return "" if value is None else str(value).replace("|", "\\|")


def render_markdown(report: dict) -> str:
    meta = report.get("meta", {})
    lines = ["# lctrain GPU check", ""]
    lines += [f"- {k}: {v}" for k, v in meta.items()]
    lines += ["", "| stage | status | seconds |", "|---|---|---|"]
    lines += [f"| {s} | {r['status']} | {r['seconds']:.0f} |" for s, r in report["stages"].items()]
    targets = [t for r in report["stages"].values() for t in r["targets"]]
    if targets:
        lines += ["", "## Targets", "", "| target | measured | goal | met |", "|---|---|---|---|"]
        lines += [
            f"| {t['name']} | {_cell(t['value'])} | {t['goal']} | {'yes' if t['met'] else 'NO'} |" for t in targets
        ]
    for stage, r in report["stages"].items():
        lines += ["", f"## {stage}: {r['status']} ({r['seconds']:.0f} s)", ""]
        lines += [f"    {c}" for c in r["commands"]]
        if r["columns"]:
            lines += ["", "| " + " | ".join(r["columns"]) + " |", "|" + "---|" * len(r["columns"])]
            lines += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in r["rows"]]
        if r["notes"]:
            lines += [""] + [f"- {n}" for n in r["notes"]]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------------------------
# Running commands


class Runner:
    """Runs a stage's commands with its log, its remaining time and the environment every stage shares."""

    def __init__(self, result: StageResult, out: Path, limit: float):
        self.result = result
        self.limit = limit
        self.deadline = time.monotonic() + limit
        self.log = out / f"{result.stage}.log"
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", "WANDB_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false"}

    def timeout_note(self) -> str:
        return f"stopped at the stage's time limit ({self.limit:.0f} s)"

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def start(self, cmd: list[str], cwd: Path | None = None) -> subprocess.Popen:
        self.result.commands.append(shlex.join(cmd))
        with open(self.log, "a") as log:
            log.write(f"\n$ {shlex.join(cmd)}\n")
            log.flush()
            return subprocess.Popen(
                cmd, cwd=cwd or ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    def wait(self, proc: subprocess.Popen) -> int:
        try:
            return proc.wait(timeout=max(1.0, self.remaining()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise TimeoutError(self.timeout_note()) from None

    def run(self, cmd: list[str], cwd: Path | None = None, check: bool = True) -> int:
        rc = self.wait(self.start(cmd, cwd))
        if check and rc:
            raise RuntimeError(f"exit code {rc}: {shlex.join(cmd)} (see {self.log.name})")
        return rc


def python() -> list[str]:
    return [sys.executable]


def lctrain_cli() -> list[str]:
    return [sys.executable, "-m", "lctrain.cli"]


# ---------------------------------------------------------------------------------------------------------------
# Stages


def stage_install(run: Runner, args) -> None:
    from devtools.wheelhouse import installed_distributions, plan_install, project_requirements, wheel_finder

    r = run.result
    reqs = project_requirements(ROOT / "pyproject.toml", extras=["test"])
    have = installed_distributions()
    if args.wheels:
        plan = plan_install(reqs, have, wheel_finder(args.wheels))
    else:
        plan = plan_install(reqs, have, lambda req: None)
    r.data["plan"] = plan.summary()
    r.columns = ["distribution", "action"]
    r.rows = [[w.path.name, "install from wheelhouse"] for w in plan.install]
    r.rows += [[k, "kept (machine's own version)"] for k in plan.kept]
    r.rows += [[u, "UNAVAILABLE"] for u in plan.unavailable]
    if not plan.ok:
        r.fail(
            f"missing and not in the wheelhouse ({args.wheels or 'no --wheels given'}): "
            f"{'; '.join(plan.unavailable)}; build one with `scripts/gpu_check.py wheels --have FREEZE`"
        )
        return
    pip = python() + ["-m", "pip", "install", "--no-index", "--no-deps", "--no-cache-dir", "--quiet"]
    if plan.install:
        run.run(pip + [str(w.path) for w in plan.install])
    run.run(pip + ["--no-build-isolation", "--editable", str(ROOT)])
    r.notes.append(
        f"{len(plan.install)} installed from the wheelhouse, {len(plan.present)} already present, "
        f"{len(plan.kept)} kept at the machine's version"
    )


def junit_summary(xml_path: Path) -> dict:
    """Counts, failures and skips (with reasons) from a pytest JUnit XML file."""
    root = ET.parse(xml_path).getroot()
    cases = root.iter("testcase")
    out = {"passed": 0, "failed": [], "skipped": []}
    for case in cases:
        name = f"{case.get('classname', '')}::{case.get('name')}"
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        skip = case.find("skipped")
        if bad is not None:
            out["failed"].append({"test": name, "message": (bad.get("message") or "")[:300]})
        elif skip is not None:
            out["skipped"].append({"test": name, "reason": skip.get("message") or ""})
        else:
            out["passed"] += 1
    return out


OPTIONAL_SKIP = "optional package"  # the one skip reason a GPU run accepts (e.g. flash-attn not installed)


def stage_tests(run: Runner, args) -> None:
    r = run.result
    xml = run.log.with_suffix(".xml")
    xml.unlink(missing_ok=True)
    run.run(
        python() + ["-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}", "tests"],
        check=False,
    )
    if not xml.is_file():
        r.fail("pytest wrote no report (see tests.log)")
        return
    judge_tests(r, junit_summary(xml))


def judge_tests(r: StageResult, s: dict) -> None:
    """On a GPU nothing may fail, and nothing may skip except for a missing optional package."""
    r.data = s
    r.columns = ["result", "count"]
    r.rows = [["passed", s["passed"]], ["failed", len(s["failed"])], ["skipped", len(s["skipped"])]]
    for f in s["failed"]:
        r.fail(f"FAILED {f['test']}: {f['message']}")
    for sk in s["skipped"]:
        if OPTIONAL_SKIP in sk["reason"]:
            r.notes.append(f"skipped {sk['test']}: {sk['reason']}")
        else:
            r.fail(f"skipped on a GPU {sk['test']}: {sk['reason']}")
    if s["passed"] == 0 and not s["failed"]:
        r.fail("no GPU test ran")


def run_bench(run: Runner, cmd: list[str], out: Path) -> dict | None:
    """A benchmark that writes its JSON after every row: on a timeout, what it measured so far is still reported."""
    out.unlink(missing_ok=True)
    try:
        run.run(cmd)
    except TimeoutError as e:
        run.result.fail(f"{e}; the rows below were measured before it")
    if not out.is_file():
        run.result.fail(f"{out.name} was not written (see {run.log.name})")
        return None
    return json.loads(out.read_text())


def stage_attention(run: Runner, args) -> None:
    r = run.result
    out = run.log.with_name("bench_attention.json")
    data = run_bench(
        run,
        python()
        + [
            str(ROOT / "scripts" / "bench_attention.py"),
            "--device",
            "cuda",
            "--lengths",
            *map(str, args.attention_lengths),
            "--engines",
            *args.attention_engines,
            "--heads",
            "32",
            "--kv-heads",
            "32",
            "--head-dim",
            "128",
            "--reps",
            "3",
            "--out",
            str(out),
        ],
        out,
    )
    if data is None:
        return
    r.data = data["meta"]
    r.columns = ["L", "engine", "mode", "ms", "TFLOP/s", "speedup vs full", "ideal", "of ideal"]
    for x in data["results"]:
        r.rows.append(
            [
                x["length"],
                x["engine"],
                x["mode"],
                1000 * x["seconds"],
                x["tflops"],
                x["speedup"],
                x["ideal_speedup"],
                x["fraction_of_ideal"],
            ]
        )
    for L in (32768, 131072):
        doc = [x for x in data["results"] if x["length"] == L and x["mode"] != "full" and x["fraction_of_ideal"]]
        for mode in sorted({x["mode"] for x in doc}):
            best = max(x["fraction_of_ideal"] for x in doc if x["mode"] == mode)
            r.targets.append(
                dict(
                    name=f"{mode} fwd+bwd fraction of FLOP ideal at {L // 1024}K (best engine)",
                    value=best,
                    goal=f">= {TARGETS['doc_mode_fraction_of_ideal']:.0%}",
                    met=best >= TARGETS["doc_mode_fraction_of_ideal"],
                )
            )


def stage_train(run: Runner, args) -> None:
    r = run.result
    out = run.log.with_name("bench_train.json")
    data = run_bench(
        run,
        python()
        + [
            str(ROOT / "scripts" / "bench_train.py"),
            "--model",
            "llama-1b",
            "--seq-len",
            str(args.train_seq_len),
            "--steps",
            "3",
            "--warmup",
            "1",
            "--out",
            str(out),
        ],
        out,
    )
    if data is None:
        return
    rows = {x["mode"]: x for x in data["results"]}
    r.data = data
    r.columns = ["mode", "engine", "step s", "vs full", "tokens/s", "MFU", "peak mem GB"]
    full = rows.get("full")
    for x in data["results"]:
        r.rows.append(
            [
                x["mode"],
                x["engine"],
                x["step_s"],
                x["step_s"] / full["step_s"] if full else None,
                x["tokens_per_s"],
                x["mfu"],
                x["peak_mem_gb"],
            ]
        )
    if full and "anchor" in rows:
        ratio = rows["anchor"]["step_s"] / full["step_s"]
        r.targets.append(
            dict(
                name=f"anchor step / full step at {args.train_seq_len // 1024}K",
                value=ratio,
                goal=f"<= {TARGETS['anchor_step_vs_full']}",
                met=ratio <= TARGETS["anchor_step_vs_full"],
            )
        )
    if full and full["mfu"] is not None:
        r.targets.append(
            dict(
                name=f"full-attention MFU, 1B at {args.train_seq_len // 1024}K",
                value=full["mfu"],
                goal=f">= {TARGETS['full_mfu']:.0%}",
                met=full["mfu"] >= TARGETS["full_mfu"],
            )
        )


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


def stage_cli(run: Runner, args) -> None:
    from lctrain.rundir import RunDir  # the install stage runs before lctrain is installed: import it in the stages

    r = run.result
    work = Path(args.work) if args.work else run.log.parent / "cli_work"
    work.mkdir(parents=True, exist_ok=True)
    cfg = ["-c", args.cli_config, "--set", f"data.output_dir={work / 'prepared'}"]
    run.run(lctrain_cli() + ["prepare", *cfg], cwd=work)
    runs = {z: work / f"zero{z}" for z in ("1", "3")}
    for z, rd in runs.items():
        run.run(
            lctrain_cli()
            + ["train", *cfg, "--set", f"parallel.zero_stage={z}", "--set", f"train.run_dir={rd}", "--force"],
            cwd=work,
        )
    killed = work / "zero1_killed"
    cmd = lctrain_cli() + [
        "train",
        *cfg,
        "--set",
        "parallel.zero_stage=1",
        "--set",
        f"train.run_dir={killed}",
        "--force",
    ]
    if not kill_after_step(run, cmd, killed, args.kill_step, work):
        r.fail(f"the run to kill finished before step {args.kill_step}")
    run.run(lctrain_cli() + ["resume", str(killed)], cwd=work)
    losses = {name: read_losses(rd) for name, rd in [("zero1", runs["1"]), ("zero3", runs["3"]), ("resumed", killed)]}
    r.columns = ["comparison", "steps", "bit-identical", "max rel diff", "limit"]
    for name, other in (
        (f"zero1 killed at step {args.kill_step} + resumed vs uninterrupted", "resumed"),
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
    hf = RunDir(runs["1"]).exports()
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
            "1024",
            "--max-len",
            "4096",
            "--out",
            str(work / "diagnose"),
        ],
        cwd=work,
    )
    r.notes.append(f"eval and diagnose rope ran; outputs in {work}")


LLAMA2_7B_ARCH = (
    "{model_type: llama, hidden_size: 4096, intermediate_size: 11008, num_hidden_layers: 32, "
    "num_attention_heads: 32, num_key_value_heads: 32}"
)


def stage_rope(run: Runner, args) -> None:
    import sysconfig

    r = run.result
    out = run.log.parent / "rope"
    # fp32 has no tensor-core speed: fewer sequences keep the three cases inside one stage
    run.run(
        lctrain_cli()
        + [
            "diagnose",
            "rope",
            "tiny_anchor",
            "--device",
            "cuda",
            "--cases",
            "bf16,random,fp32",
            "--samples",
            str(args.rope_samples),
            "--seq-len",
            "4096",
            "--max-len",
            "8192",
            "--text",
            sysconfig.get_path("stdlib"),
            "--out",
            str(out),
            "--set",
            "model.rope_theta=10000",
            "--set",
            f"model.arch={LLAMA2_7B_ARCH}",
        ]
    )
    res = json.loads((out / "rope_drift.json").read_text())
    shifts = res["shifts"]
    r.columns = [
        "case",
        "D(Δ1=0)",
        f"D(Δ1={shifts[-1]})",
        "first-token share",
        f"D_logit at T={res['logit_lengths'][-1]}",
        "seconds",
    ]
    for case, v in res["cases"].items():
        r.rows.append(
            [case, v["D"][0], v["D"][-1], v["first_token_share"], v["D_logit"][-1], res["timing"][case]["seconds"]]
        )
    r.data = {k: res[k] for k in ("shifts", "delta2", "samples", "seq_len", "timing")}
    r.notes.append(f"{res['samples']} sequences of {res['seq_len']} tokens; figures in {out}")


def stage_generation(run: Runner, args) -> None:
    r = run.result
    out = run.log.with_name("bench_generation.json")
    data = run_bench(
        run,
        python()
        + [
            str(ROOT / "scripts" / "bench_generation.py"),
            "--model",
            "llama2-7b",
            "--lengths",
            *map(str, args.generation_lengths),
            "--out",
            str(out),
        ],
        out,
    )
    if data is None:
        return
    r.data = data
    r.columns = [
        "prompt tokens",
        "plan",
        "prefill s",
        "decode ms/token",
        "predicted peak GB",
        "measured peak GB",
        "host cache GB",
        "host peak RSS GB",
    ]
    for x in data["results"]:
        r.rows.append(
            [
                x["length"],
                x["plan"],
                x["prefill_s"],
                x["decode_s_per_token"] * 1e3,
                x["predicted_peak_gb"],
                x["measured_peak_gb"],
                x["host_cache_gb"],
                x["host_peak_rss_gb"],
            ]
        )
        if x["measured_peak_gb"] > x["predicted_peak_gb"] * 1.10:
            r.fail(
                f"{x['length']} tokens: measured peak {x['measured_peak_gb']:.1f} GB is over the plan's "
                f"{x['predicted_peak_gb']:.1f} GB by more than 10%"
            )


def stage_figure6(run: Runner, args) -> None:
    r = run.result
    work = run.log.parent / "figure6"
    run.run(
        lctrain_cli()
        + [
            "estimate",
            "-c",
            args.cli_config,
            "--measure",
            "--lengths",
            "4k,8k,16k",
            "--modes",
            "full,anchor",
            "--steps",
            "3",
            "--warmup",
            "2",
            "--out",
            str(work),
        ]
    )
    res = json.loads((work / "figure6.json").read_text())
    r.data = res
    r.columns = ["length", "mode", "step s", "days / 1B tokens", "FLOP model at peak", "measured / predicted"]
    for p in res["points"]:
        r.rows.append(
            [
                p["seq_len"],
                p["mode"],
                p["step_time_s"],
                p["days_per_1b_tokens"],
                p["predicted_days_per_1b_tokens"],
                p["ratio"],
            ]
        )


def stage_memory(run: Runner, args) -> None:
    r = run.result
    out = run.log.with_name("bench_memory.json")
    # The bench stops itself before a length that would overrun the stage (room is left for its exit). A host too
    # small for all 32 layers' offloaded optimizer states (178 GB; these machines have 128 GiB) measures as many of
    # Llama-2-7B's layers as it holds, at its width and window length.
    data = run_bench(
        run,
        python()
        + [
            str(ROOT / "scripts" / "bench_memory.py"),
            "--preset",
            "llama2-7b-128k",
            "--layers",
            "auto",
            "--ladder",
            "--steps",
            str(args.memory_steps),
            "--time-limit",
            str(max(60.0, run.remaining() - 45)),
            "--out",
            str(out),
        ],
        out,
    )
    if data is None:
        return
    r.data = data
    r.columns = [
        "seq_len",
        "s/step",
        "tokens/s",
        "max allocated GB",
        "predicted GB",
        "predicted / allocated",
        "host RSS GB",
        "predicted host GB",
    ]
    for x in data["results"]:
        if x["oom"]:
            r.rows.append([x["seq_len"], "out of memory", None, None, None, None, None, None])
            continue
        r.rows.append(
            [
                x["seq_len"],
                x["step_s"],
                x["tokens_per_s"],
                x["max_allocated_gb"],
                x["predicted_device_gb"],
                x["device_predicted_over_allocated"],
                x["host_peak_rss_gb"],
                x["predicted_host_gb"],
            ]
        )
        error = abs(x["device_predicted_over_allocated"] - 1)
        r.targets.append(
            dict(
                name=f"memory plan vs measured peak, Llama-2-7B ({data['layers']} layers) at {x['seq_len'] // 1024}K",
                value=error,
                goal=f"<= {TARGETS['memory_plan_error']:.0%} off",
                met=error <= TARGETS["memory_plan_error"],
            )
        )
    trained = [x["seq_len"] for x in data["results"] if not x["oom"]]
    if data["layers"] < 32:
        r.notes.append(
            f"{data['layers']} of Llama-2-7B's 32 layers: this host cannot hold the whole model's offloaded "
            f"optimizer states; the single-GPU goal needs a host with more memory (`lctrain plan`)"
        )
        return
    r.targets.append(
        dict(
            name="Llama-2-7B trains at 128K on one GPU",
            value=max(trained, default=0),
            goal=">= 131072 tokens",
            met=max(trained, default=0) >= 131072,
        )
    )


STAGE_FNS: dict[str, Callable] = {
    "install": stage_install,
    "tests": stage_tests,
    "attention": stage_attention,
    "train": stage_train,
    "cli": stage_cli,
    "rope": stage_rope,
    "generation": stage_generation,
    "figure6": stage_figure6,
    "memory": stage_memory,
}


def run_stage(stage: str, args, out: Path) -> StageResult:
    result = StageResult(stage)
    runner = Runner(result, out, args.stage_limit)
    runner.log.write_text("")
    t0 = time.monotonic()
    try:
        STAGE_FNS[stage](runner, args)
    except Exception as e:  # a stage that breaks is reported, and the next stage still runs
        result.status = "error"
        result.notes.append(f"{type(e).__name__}: {e}")
    result.seconds = time.monotonic() - t0
    return result


def gpu_meta() -> dict:
    meta = {"python": sys.version.split()[0], "date": time.strftime("%Y-%m-%d %H:%M")}
    try:
        import torch

        meta["torch"] = torch.__version__
        if torch.cuda.is_available():
            meta["gpu"] = torch.cuda.get_device_name()
        import transformers

        meta["transformers"] = transformers.__version__
    except ImportError as e:
        meta["import_error"] = str(e)
    return meta


# ---------------------------------------------------------------------------------------------------------------
# Building a wheelhouse on a connected machine


def pip_download_finder(dest: Path, python_version: str, platforms: list[str], pins: dict[str, str | None]):
    """`find` for plan_install that downloads a wheel for the target with pip: the version `pins` (the tested lock,
    constraints.txt) names where it fits, else the newest. A package published only as a source distribution
    (DeepSpeed) is built into a wheel here, which works for pure-Python packages."""
    from packaging.utils import canonicalize_name

    from devtools.wheelhouse import read_wheel

    def newest(name: str) -> set[Path]:
        return {p for p in dest.glob("*.whl") if canonicalize_name(p.name.split("-")[0]) == name}

    def find(req):
        name = canonicalize_name(req.name)
        before = newest(name)
        pin = pins.get(name)
        spec = (
            f"{req.name}=={pin}"
            if pin and req.specifier.contains(pin, prereleases=True)
            else f"{req.name}{req.specifier}"
        )
        plat = [a for p in platforms for a in ("--platform", p)]
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--quiet",
            "--no-deps",
            "--only-binary=:all:",
            "--python-version",
            python_version,
            "--implementation",
            "cp",
            *plat,
            "--dest",
            str(dest),
            spec,
        ]
        if subprocess.call(cmd, stderr=subprocess.DEVNULL):
            cmd = [
                sys.executable,
                "-m",
                "pip",
                "wheel",
                "--quiet",
                "--no-deps",
                "--no-build-isolation",
                "--wheel-dir",
                str(dest),
                spec,
            ]
            if subprocess.call(cmd, stderr=subprocess.DEVNULL):
                return None
        got = newest(name) - before or newest(name)
        return read_wheel(max(got, key=lambda p: p.stat().st_mtime)) if got else None

    return find


def build_wheelhouse(args) -> None:
    from devtools.wheelhouse import plan_install, project_requirements, read_freeze

    dest = Path(args.dest)
    dest.mkdir(parents=True, exist_ok=True)
    have = read_freeze(Path(args.have).read_text().splitlines())
    reqs = project_requirements(ROOT / "pyproject.toml", extras=["test"])
    env = {
        "python_version": args.python_version,
        "python_full_version": f"{args.python_version}.0",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "platform_machine": "x86_64",
    }
    pins = read_freeze((ROOT / "constraints.txt").read_text().splitlines())
    finder = pip_download_finder(dest, args.python_version, args.platform, pins)
    plan = plan_install(reqs, have, finder, environment=env)
    for w in plan.install:
        print(f"wheel  {w.path.name}")
    for k in plan.kept:
        print(f"kept   {k}")
    for u in plan.unavailable:
        print(f"MISSING {u}")
    size = sum(w.path.stat().st_size for w in plan.install)
    print(f"{len(plan.install)} wheels, {size / 2**20:.1f} MiB in {dest}")
    if not plan.ok:
        raise SystemExit(1)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["wheels"]:
        ap = argparse.ArgumentParser(
            prog="gpu_check.py wheels",
            description="build the wheelhouse for an offline machine from its `pip freeze` (run here, with internet)",
        )
        ap.add_argument("--have", required=True, help="the target machine's `python -m pip freeze` output")
        ap.add_argument("--dest", default=".whl")
        ap.add_argument("--python-version", default="3.12")
        ap.add_argument(
            "--platform",
            nargs="+",
            default=["manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "linux_x86_64"],
        )
        build_wheelhouse(ap.parse_args(argv[1:]))
        return 0
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 2)[2],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("stages", nargs="*", help=f"'all' (default) or some of: {', '.join(STAGES)}")
    ap.add_argument("--out", default="gpu_report", help="report directory (logs, JSON, markdown)")
    ap.add_argument("--wheels", default=None, help="wheelhouse for the install stage on an offline machine")
    ap.add_argument("--stage-limit", type=float, default=STAGE_LIMIT_S, help="seconds per stage")
    ap.add_argument("--attention-lengths", type=int, nargs="+", default=[8192, 32768, 131072])
    ap.add_argument("--attention-engines", nargs="+", default=["varlen", "sdpa", "flex"])
    ap.add_argument("--train-seq-len", type=int, default=65536)
    ap.add_argument("--cli-config", default="gpu_small_16k")
    ap.add_argument("--kill-step", type=int, default=12)
    ap.add_argument("--rope-samples", type=int, default=4, help="rope stage: text sequences per case")
    ap.add_argument("--generation-lengths", type=int, nargs="+", default=[32768, 65536, 131072])
    ap.add_argument("--memory-steps", type=int, default=2, help="memory stage: timed steps per length")
    ap.add_argument(
        "--work",
        default=None,
        help="where the cli stage prepares and trains (default OUT/cli_work; a few GB of checkpoints)",
    )
    args = ap.parse_args(argv)
    stages = select_stages(args.stages)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for stage in stages:
        print(f"[gpu_check] {stage} ...", flush=True)
        results.append(run_stage(stage, args, out))
        print(f"[gpu_check] {stage}: {results[-1].status} in {results[-1].seconds:.0f} s", flush=True)
        report = merge_report(out / "gpu_check.json", results, gpu_meta())
        (out / "gpu_check.md").write_text(render_markdown(report))
    print((out / "gpu_check.md").read_text())
    return 0 if all(r.status == "passed" for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
