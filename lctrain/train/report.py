"""What a training run prints, as text: the start banner, the plain step line (stdout not a terminal) and the end
summary. Pure: the trainer gathers the facts (`RunStart`, `RunEnd`) and prints on rank 0.

The step line is `key=value` pairs named as in metrics.jsonl (`step=12/60 loss=6.1234 lr=1.000e-03 ...`), so a log
under nohup or a batch scheduler can be followed with `tail -f` and parsed with a regular expression.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from shlex import quote

from lctrain.model import ConfigChange, changes_text
from lctrain.parallel.layout import ParallelLayout


def duration(seconds: float) -> str:
    """`1:02:03`, `2d 03:04:05` past a day; whole seconds."""
    s = max(int(round(seconds)), 0)
    days, s = divmod(s, 86400)
    hours, s = divmod(s, 3600)
    minutes, s = divmod(s, 60)
    if days:
        return f"{days}d {hours:02d}:{minutes:02d}:{s:02d}"
    return f"{hours}:{minutes:02d}:{s:02d}"


def eta_seconds(elapsed_s: float, steps_done: int, steps_left: int) -> float | None:
    """The time the remaining steps take at this session's mean pace so far (checkpoint writes included); None
    before the first step."""
    if steps_done <= 0:
        return None
    return elapsed_s / steps_done * steps_left


def _optional(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def loss_text(loss: float) -> str:
    """A loss as the run prints it: the step line, the progress bar and the summary alike, so the final loss reads
    as the last step's line does (metrics.jsonl keeps every digit)."""
    return f"{loss:.4f}"


def step_line(record: dict, total_steps: int, eta_s: float | None) -> str:
    """One metrics.jsonl record as the plain log line: step/total, loss (and the held-out loss where scored:
    `train.heldout_every`), lr, grad norm, tokens/s, MFU, the step's peak memory in GB (10^9 bytes) and the ETA."""
    heldout = [f"heldout_loss={loss_text(record['heldout_loss'])}"] if "heldout_loss" in record else []
    return " ".join(
        [
            f"step={record['step']}/{total_steps}",
            f"loss={loss_text(record['loss'])}",
            *heldout,
            f"lr={record['lr']:.3e}",
            f"grad_norm={_optional(record['grad_norm'], '#.5g').removesuffix('.')}",  # 5 digits: 1.0030, not 1.003
            f"tokens_per_s={record['tokens_per_s']:.0f}",
            f"mfu={_optional(record['mfu'] * 100 if record['mfu'] is not None else None, '.1f')}%",
            f"peak_mem_gb={record['peak_mem_gb']:.2f}",
            f"eta={duration(eta_s) if eta_s is not None else 'n/a'}",
        ]
    )


def profile_line(out_dir: Path, ranks: str | list[int], top: list[dict]) -> str:
    """Where `logging.profile` wrote its traces, and the operators with the most self time in this rank's (`top`:
    `lctrain.profiling.top_kernels` rows; empty where this rank wrote none)."""
    who = "every rank" if ranks == "all" else f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
    line = f"profile of {out_dir.name.removeprefix('steps_')}: {out_dir}/ ({who}; Chrome traces for ui.perfetto.dev)"
    if top:
        line += "; most self time: " + ", ".join(f"{k['name']} {k['share']:.0%}" for k in top)
    return line


@dataclass(frozen=True)
class PlannedMemory:
    """`lctrain.memory`'s plan of one rank: bytes on its device (None on the CPU, where everything is host memory)
    and on its host."""

    device_gb: float | None
    host_gb: float


@dataclass(frozen=True)
class RunStart:
    """The facts of the start banner."""

    name: str
    run_dir: Path
    model: str  # what the weights are: a path or hub name, or the `model.arch` random init
    params: int
    dense_params: int  # the parameters that multiply per token (costmodel.dense_params): what MFU counts
    rope: dict  # the rope_parameters trained with
    max_positions: int
    changes: list[ConfigChange]
    anchor_token: str
    anchor_id: int
    mode: str
    engine: str
    seq_len: int
    global_batch: int
    tokens_per_step: int
    micro_batch: int
    grad_accum: int
    layout: ParallelLayout
    zero_stage: int
    device: str
    steps: int
    start_step: int
    planned: PlannedMemory
    disk_peak_gb: float  # the run's checkpoints and exports at their peak (`lctrain.disk`)
    disk_free_gb: float  # free on the run directory's filesystem at the start


def _count(n: int) -> str:
    for unit, size in (("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)


def _number(x: float) -> str:
    return f"{x:,.0f}" if float(x).is_integer() else f"{x:,}"


def _rope(params: dict, max_positions: int) -> str:
    theta = params.get("rope_theta")
    extra = ", ".join(f"{k} {v}" for k, v in sorted(params.items()) if k not in ("rope_theta", "rope_type"))
    return (
        f"base {_number(theta)}, rope_type {params.get('rope_type', 'default')}"
        + (f" ({extra})" if extra else "")
        + f"; max positions {max_positions:,}"
    )


def banner(s: RunStart) -> str:
    """What rank 0 prints before the first step."""
    where = "from step 0" if s.start_step == 0 else f"resuming at step {s.start_step}"
    on_device = f"{s.planned.device_gb:.1f} GB per device, " if s.planned.device_gb is not None else ""
    memory = f"{on_device}{s.planned.host_gb:.1f} GB host (`lctrain plan` itemises it)"
    said = "`lctrain plan` says what"
    rows = [
        ("model", f"{s.model}: {_count(s.params)} parameters ({_count(s.dense_params)} counted for MFU)"),
        ("rope", _rope(s.rope, s.max_positions)),
        ("anchor", f"{s.anchor_token} (id {s.anchor_id})"),
        ("attention", f"{s.mode}, engine {s.engine}"),
        (
            "batch",
            f"{s.global_batch} x {s.seq_len:,} = {s.tokens_per_step:,} tokens per step (micro-batch {s.micro_batch}, "
            f"{s.grad_accum} accumulation step{'s' if s.grad_accum != 1 else ''})",
        ),
        (
            "parallel",
            f"world {s.layout.world} = dp {s.layout.dp} x sp {s.layout.sp}, ZeRO stage {s.zero_stage}, {s.device}",
        ),
        ("memory plan", memory),
        ("disk plan", f"{s.disk_peak_gb:,.1f} GB at the run's peak, {s.disk_free_gb:,.1f} GB free ({said})"),
        ("run dir", str(s.run_dir)),
    ]
    lines = [f"lctrain train {s.name}: {s.steps} step{'' if s.steps == 1 else 's'}, {where}"]
    lines += [f"  {k:<12} {v}" for k, v in rows]
    lines += ["  " + line for line in changes_text(s.changes).splitlines()]
    return "\n".join(lines)


@dataclass(frozen=True)
class RunEnd:
    """The facts of the end summary: the last metrics record, what this session trained and what the run dir
    holds."""

    run_dir: Path
    last: dict | None  # the last metrics.jsonl record; None when no step ran
    steps: int
    start_step: int
    tokens_per_step: int
    wall_s: float
    peak_mem_gb: float | None  # the largest per-step peak of this session
    checkpoint: Path | None  # the resume checkpoint `lctrain resume` would continue from
    exports: list[Path]
    metrics_file: Path
    start_over: str  # the command that starts this run over with a lower train.lr (advice after a divergence)
    diverged: dict | None = None  # the run's first metrics record that says "diverged", this session's or an earlier


def summary(e: RunEnd) -> str:
    """What rank 0 prints after the last step; its first line names a divergence (`trainer.divergence_warning`)."""
    if e.last is None:
        return f"no step trained: {e.run_dir} is at step {e.start_step} of {e.steps}"
    step = e.last["step"]
    head = f"done: {e.run_dir}"
    session_tokens = (step - e.start_step) * e.tokens_per_step
    rate = session_tokens / e.wall_s if e.wall_s > 0 else float("nan")
    rows = [("final loss", f"{loss_text(e.last['loss'])} at step {step} of {e.steps}")]
    if e.diverged is not None:
        at = e.diverged["step"]
        head += f" (diverged at step {at})"
        loss = loss_text(e.diverged["loss"])
        rows.append(("diverged", f'loss {loss} at step {at}; metrics.jsonl says "diverged": true from there'))
    rows += [
        ("tokens", f"{e.last['tokens']:,} seen ({session_tokens:,} in this session)"),
        ("time", f"{duration(e.wall_s)} wall, {rate:,.0f} tokens/s"),
    ]
    if e.peak_mem_gb is not None:
        rows.append(("peak memory", f"{e.peak_mem_gb:.2f} GB"))
    rows.append(("checkpoint", str(e.checkpoint) if e.checkpoint else "none"))
    if e.exports:
        shown = ", ".join(p.name for p in e.exports)
        rows.append(("hf exports", f"{e.exports[0].parent}/ ({shown})"))
    else:
        rows.append(("hf exports", "none"))
    rows.append(("metrics", str(e.metrics_file)))
    if e.diverged is not None:
        rows.append(("next", f"start over with a lower train.lr, e.g. {e.start_over}"))
    elif step < e.steps:
        rows.append(("next", f"lctrain resume {quote(str(e.run_dir))}"))
    elif e.exports:
        rows.append(("next", f"lctrain eval {quote(str(e.run_dir))}; lctrain plot {quote(str(e.run_dir))}"))
    else:
        rows.append(("next", f"lctrain plot {quote(str(e.run_dir))}"))
    return "\n".join([head] + [f"  {k:<12} {v}" for k, v in rows])
