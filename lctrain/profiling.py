"""torch.profiler where lctrain uses it: the benchmarks' kernel tables and `logging.profile`'s trace of training steps.

A training run with `logging.profile.start: S` records steps S to S + steps - 1 on the chosen ranks, each into
`RUN_DIR/profile/steps_<first>-<last>/`:

- `rank<r>.pt.trace.json.gz`: the Chrome trace (ui.perfetto.dev opens it as it is; TensorBoard's profiler plugin
  reads the `.pt.trace.json` name), with the trainer's `lctrain.forward` / `lctrain.backward` /
  `lctrain.optimizer` ranges around each micro-batch's work;
- `rank<r>.top.txt`: the operators with the most self time (device kernels on a GPU, operators on the CPU);
- with `memory: true`, the trace's allocation events and, on CUDA, `rank<r>.memory.pickle`: the caching
  allocator's history with the stack of every live block (pytorch.org/memory_viz).

The step before the first recorded one, when the run has one, runs under the profiler unrecorded (torch.profiler's
warm-up: its start-up cost stays out of the trace). Steps under the profiler, the warm-up included, are slower than
the others; their metrics.jsonl records say `profiled: true`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, schedule

from lctrain.compat.torch import dump_memory_history, record_memory_history, stop_memory_history
from lctrain.errors import writing

TOP_ROWS = 40  # operators in rank<r>.top.txt


def activities(device: torch.device) -> list[ProfilerActivity]:
    device = torch.device(device)
    return [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])


def self_time_attr(device_type: str) -> str:
    """What `key_averages()` ranks by: on CUDA the device kernels' self time, on the CPU the operators' own."""
    return "self_device_time_total" if device_type == "cuda" else "self_cpu_time_total"


def top_kernels(averages, n: int, device_type: str) -> list[dict]:
    """The `n` entries of a profiler's `key_averages()` with the most self time, as {name, count, total_ms, share}
    (`share`: of all the self time recorded)."""
    attr = self_time_attr(device_type)
    timed_events = sorted((e for e in averages if getattr(e, attr) > 0), key=lambda e: getattr(e, attr), reverse=True)
    total = sum(getattr(e, attr) for e in timed_events)
    return [
        {"name": e.key, "count": e.count, "total_ms": getattr(e, attr) / 1000, "share": getattr(e, attr) / total}
        for e in timed_events[:n]
    ]


def profiled_kernels(step, device, n: int) -> list[dict]:
    """`top_kernels` of one more call of `step` under torch.profiler: the benchmarks run it after their timed calls,
    so the profiler's overhead is in no reported time."""
    device_type = torch.device(device).type
    with profile(activities=activities(device)) as prof:
        step()
        if device_type == "cuda":
            torch.cuda.synchronize()
    return top_kernels(prof.key_averages(), n, device_type)


@dataclass(frozen=True)
class ProfiledSteps:
    """Which 0-based step indices a run profiles: `first` to `last` recorded, `warmup` steps before them run under
    the profiler unrecorded."""

    first: int
    last: int
    warmup: int

    @classmethod
    def of(cls, start: int | None, steps: int, total: int, resumed_at: int) -> ProfiledSteps | None:
        """`start` (1-based, as metrics.jsonl's step) and `steps` of the config, for a run of `total` steps that
        (re)starts at index `resumed_at`; None when nothing is left to profile."""
        if start is None:
            return None
        first, last = start - 1, min(start - 1 + steps, total) - 1
        if last < resumed_at:
            return None
        first = max(first, resumed_at)
        return cls(first, last, warmup=1 if first > resumed_at else 0)

    @property
    def name(self) -> str:
        return f"steps_{self.first + 1}-{self.last + 1}"


class StepProfiler:
    """`before(i)` / `after(i)` around training step `i` (0-based); `close()` when training ends or fails (a
    profile cut short by a failure is not written)."""

    def __init__(self, steps: ProfiledSteps | None, out_dir: Path, *, writes: bool, rank: int, device, memory: bool):
        """`writes`: whether this rank records a trace; one that does not still knows which steps the others
        record (the whole run's step is slower then)."""
        self.steps, self.writes, self.rank, self.device, self.memory = steps, writes, rank, torch.device(device), memory
        self.out = out_dir / steps.name if steps is not None else None
        self.prof: profile | None = None
        self.written: Path | None = None  # the directory, once the trace is written
        self.top: list[dict] = []  # top_kernels of the written trace

    def slowed(self, step_index: int) -> bool:
        """Whether step `step_index` runs under a profiler: the recorded steps and their warm-up."""
        return self.steps is not None and self.steps.first - self.steps.warmup <= step_index <= self.steps.last

    def finished(self, step_index: int) -> bool:
        """Whether `step_index` is the last profiled step."""
        return self.steps is not None and step_index == self.steps.last

    def before(self, step_index: int) -> None:
        if not self.writes or self.steps is None or step_index != self.steps.first - self.steps.warmup:
            return
        if self.memory and self.device.type == "cuda":
            record_memory_history()
        recorded = self.steps.last - self.steps.first + 1
        self.prof = profile(
            activities=activities(self.device),
            # without a warm-up step, no schedule: the trace is written when the profiler stops
            schedule=schedule(wait=0, warmup=self.steps.warmup, active=recorded, repeat=1)
            if self.steps.warmup
            else None,
            on_trace_ready=self._write,
            profile_memory=self.memory,
            record_shapes=self.memory,
        )
        self.prof.start()

    def after(self, step_index: int) -> None:
        if self.prof is None:
            return
        self.prof.step()
        if self.finished(step_index):
            self._stop()

    def close(self) -> None:
        if self.prof is not None:
            self.prof.on_trace_ready = None  # a failed run's partial profile would read as a finished one
            self._stop()

    def _stop(self) -> None:
        prof, self.prof = self.prof, None
        prof.stop()
        if self.memory and self.device.type == "cuda":
            stop_memory_history()

    def _write(self, prof: profile) -> None:
        averages = prof.key_averages()
        with writing(self.out, "the profile"):
            self.out.mkdir(parents=True, exist_ok=True)
            prof.export_chrome_trace(str(self.out / f"rank{self.rank}.pt.trace.json.gz"))
            (self.out / f"rank{self.rank}.top.txt").write_text(
                averages.table(sort_by=self_time_attr(self.device.type), row_limit=TOP_ROWS) + "\n"
            )
            if self.memory and self.device.type == "cuda":
                dump_memory_history(self.out / f"rank{self.rank}.memory.pickle")
        self.written = self.out
        self.top = top_kernels(averages, 3, self.device.type)
