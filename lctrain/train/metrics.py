"""Step metrics: `metrics.jsonl`, the progress bar (or, outside a terminal, one plain line per
`logging.log_every` steps) and Weights & Biases; how loud the libraries are during a run. The step lines are the
run's data, on stdout; the bar and the notes go to stderr (`lctrain.console`).

The model FLOPs of a step come from `lctrain.costmodel`: 6 x (the linear layers' weights, LM head included) x
tokens plus 12 x layers x width per visible query-key pair, so MFU measures useful work and `anchor` is not credited
with FLOPs it skips (`mfu`, strict). `mfu_full_square` counts the whole L x L square of pairs per window,
torchtitan's and Megatron's convention, for comparison with their numbers. `hfu` (hardware FLOPs utilisation) adds
to the strict count the forward that activation checkpointing reruns in the decoder layers (the whole layer under
`full`; all but attention under `selective`) and the MLP forward that `model.tiled_mlp` reruns: the work the device
does, where MFU is the work the model needs.
`peak_mem_gb` is in GB (10^9 bytes, the unit of `lctrain plan`) and is the step's own peak (`lctrain.measure`) of the
rank that peaked highest: PyTorch's allocations on a GPU, the resident set on the CPU; `peak_mem_scope` is
"lifetime" where the platform cannot reset the host's peak, and the value is then the process's peak so far.
"""

from __future__ import annotations

import logging
import statistics
import sys
import time
import warnings
from collections import deque
from collections.abc import Sequence

from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn
from transformers.utils import logging as hf_logging

from lctrain.config import settings
from lctrain.console import no_library_bars, say
from lctrain.errors import UserError
from lctrain.progress_bar import ProgressBar
from lctrain.rundir import RunDir
from lctrain.train.report import eta_seconds, loss_text, step_line

# Library loggers that repeat on every rank what rank 0 already says.
_RANK_LOGGERS = ("DeepSpeed", "torch.distributed")


def import_wandb(cfg):
    """Weights & Biases is an optional extra: an offline cluster trains without it."""
    try:
        # optional dependency: wandb (the `wandb` extra)
        import wandb
    except ImportError:
        raise UserError(
            f"{cfg.origin('logging.wandb')}: logging.wandb = {cfg.logging.wandb} needs Weights & Biases "
            f"(pip install 'lctrain[wandb]'); or set logging.wandb: disabled"
        ) from None
    return wandb


def tensorboard_writer_class(cfg):
    """torch's TensorBoard writer, which needs the optional `tensorboard` package."""
    try:
        # optional dependency: tensorboard (the `tensorboard` extra)
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise UserError(
            f"{cfg.origin('logging.tensorboard')}: logging.tensorboard = true needs TensorBoard "
            f"(pip install 'lctrain[tensorboard]'); or set logging.tensorboard: false"
        ) from None
    return SummaryWriter


def quiet_libraries(is_main: bool) -> None:
    """Set once per process before the model is built: no Hugging Face progress bars (a loading or saving bar tears
    through the training bar, and fills a log file with carriage returns), and on the ranks other than 0 only
    errors from the libraries, whose warnings rank 0 prints once. On every rank, torch's deprecation of the collectives
    DeepSpeed 0.19.8's ZeRO-3 calls (`all_gather_into_tensor`, `reduce_scatter_tensor`; torch 2.13) is not shown:
    nine FutureWarnings at the start of every ZeRO-3 run's log, about code the user does not own."""
    no_library_bars()
    warnings.filterwarnings(
        "ignore",
        message=r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated",
        category=FutureWarning,
    )
    if not is_main:
        hf_logging.set_verbosity_error()
        for name in _RANK_LOGGERS:
            logging.getLogger(name).setLevel(logging.ERROR)
        warnings.simplefilter("ignore")


# A step under this share of the median throughput of the run's recent usual steps is slow: far below the noise of
# a healthy run (on a shared CPU a step varies by a third), the sign of something outside the step (another job on
# the node, a slow filesystem, throttling, a straggling rank).
SLOW_SHARE = 0.5
SLOW_WINDOW = 20  # the recent steps whose median is the usual
SLOW_HISTORY = 5  # no verdict before this many usual steps: the first steps warm up (allocator, kernels, caches)
SLOW_NOTE_EVERY = 50  # steps from one note to the next at most: a run slowed for good is said once, not every step


def slow_step(tokens_per_s: float, recent: Sequence[float]) -> float | None:
    """The median of `recent` (the tokens/s of the usual steps before this one) when `tokens_per_s` is under
    SLOW_SHARE of it; None otherwise, and with fewer than SLOW_HISTORY steps to compare with."""
    if len(recent) < SLOW_HISTORY:
        return None
    usual = statistics.median(recent)
    return usual if tokens_per_s < SLOW_SHARE * usual else None


class SlowSteps:
    """Rank 0's watch on throughput: a one-line note for a slow step (`slow_step`), at most one every
    SLOW_NOTE_EVERY steps; the slow steps within that many are counted and said with the next note, or by the first
    step after them (a slowdown for good becomes the usual within SLOW_WINDOW steps, and would otherwise never be
    said). Profiled steps (slower by design, `usual=False`) are neither judged nor part of the usual."""

    def __init__(self):
        self.recent: deque[float] = deque(maxlen=SLOW_WINDOW)
        self.last_note: int | None = None
        self.unsaid = 0

    def note(self, step: int, tokens_per_s: float, usual: bool) -> str | None:
        if not usual:
            return None
        median, compared = slow_step(tokens_per_s, self.recent), len(self.recent)
        self.recent.append(tokens_per_s)
        quiet = self.last_note is not None and step - self.last_note < SLOW_NOTE_EVERY
        if quiet or median is None:
            self.unsaid += median is not None
            if quiet or not self.unsaid:
                return None
        more = (
            f"{self.unsaid} more slow step{'s' if self.unsaid != 1 else ''} since step {self.last_note}"
            if self.unsaid
            else ""
        )
        self.last_note, self.unsaid = step, 0
        if median is None:
            return f"note: {more}, under {SLOW_SHARE:.0%} of the median tokens/s of the usual steps before each"
        return (
            f"note: step {step} ran at {tokens_per_s:,.0f} tokens/s, under {SLOW_SHARE:.0%} of the median of the "
            f"last {compared} usual steps ({median:,.0f} tokens/s)" + (f"; {more}" if more else "")
        )


class StepLogger:
    """Rank 0 only: appends one JSON line per step, shows progress and logs to Weights & Biases and TensorBoard (each
    numeric metric as scalar `train/NAME`, every `logging.log_every` steps and the last). Progress is the rich
    bar when stdout and stderr are both a terminal (the bar on stderr); otherwise (nohup, a redirect, a pipe, a batch
    scheduler, where the bar would print nothing until the end or tear through the lines) one plain line
    (`report.step_line`) on stdout per `logging.log_every` steps, and one for the last step."""

    def __init__(self, run: RunDir, cfg, start_step: int, total_steps: int, wandb_id: str):
        self.run = run
        self.every = cfg.logging.log_every
        self.start_step, self.total = start_step, total_steps
        self.slow = SlowSteps()
        self.heldout: float | None = None  # the last held-out loss, for the progress bar
        self.started = time.monotonic()
        self.progress = ProgressBar(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeRemainingColumn(),
            TextColumn("{task.fields[info]}"),
            disable=not sys.stdout.isatty(),
            log_lines=False,
            transient=False,
        )
        self.task = self.progress.add_task("train", total=total_steps, completed=start_step, info="")
        self.progress.start()
        self.wandb = None
        if cfg.logging.wandb != "disabled":
            wandb = import_wandb(cfg)

            self.wandb = wandb.init(
                project=cfg.logging.wandb_project,
                name=cfg.name,
                id=wandb_id,
                resume="allow",
                mode=cfg.logging.wandb,
                dir=str(run.path),
                config=settings(cfg),
            )
        self.tensorboard = None
        if cfg.logging.tensorboard:
            # purge_step: a resumed run drops the events a killed run wrote after its last checkpoint
            purge = start_step + 1 if start_step else None
            self.tensorboard = tensorboard_writer_class(cfg)(str(run.tensorboard_dir), purge_step=purge)

    def log(self, record: dict) -> None:
        self.run.append_metrics(record)
        step = record["step"]
        # the last step is always shown: the curve's end is the number a run is read for; so is a held-out score
        due = step % self.every == 0 or step == self.total or "heldout_loss" in record
        if self.progress.shown:
            mfu = f"{record['mfu']:.1%}" if record.get("mfu") is not None else "n/a"
            square = f"{record['mfu_full_square']:.1%}" if record.get("mfu_full_square") is not None else "n/a"
            # the last held-out loss stays shown until the next is scored (train.heldout_every)
            self.heldout = record.get("heldout_loss", self.heldout)
            held = f"held-out {loss_text(self.heldout)}  " if self.heldout is not None else ""
            info = (
                f"loss {loss_text(record['loss'])}  {held}{record['tokens_per_s']:,.0f} tok/s  MFU {mfu} strict, "
                f"{square} full-square  "
                f"mem {record['peak_mem_gb']:.1f} GB"
            )
            self.progress.update(self.task, completed=step, info=info)
        elif due:
            eta = eta_seconds(time.monotonic() - self.started, step - self.start_step, self.total - step)
            print(step_line(record, self.total, eta), flush=True)
        # a step's time is its forward, backward and update only (checkpoint writes are outside it): a profiled step
        # is the one slower by design
        slow = self.slow.note(step, record["tokens_per_s"], usual=not record.get("profiled"))
        if slow is not None:  # whether or not the step has a line: a slow step between two lines is said too
            say(slow)
        if self.wandb is not None and due:
            self.wandb.log({k: v for k, v in record.items() if v is not None}, step=step)
        if self.tensorboard is not None and due:
            for k, v in record.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step":
                    self.tensorboard.add_scalar(f"train/{k}", v, step)
            self.tensorboard.flush()

    def close(self) -> None:
        self.progress.stop()
        if self.wandb is not None:
            self.wandb.finish()
        if self.tensorboard is not None:
            self.tensorboard.close()
