"""`lctrain estimate --measure`: the paper's Figure 6 measured, with the FLOP model's prediction beside it.

The paper's Figure 6 shows "the estimated number of days required to process 1 billion tokens at various context
lengths" for full attention and AnchorAttention, "when using the same sequence parallelism and DeepSpeed-Ulysses
configurations". Here each (length, mode) point is a real training run of the config: `prepare` then `train`, the
same launcher, parallel layout, engine and data source as the full run, with `warmup + steps` optimizer steps and no
checkpoints. The mean `step_time_s` of the last `steps` steps in the run's `metrics.jsonl` gives

    days per 1B tokens = 1e9 / (global_batch x seq_len / step time) / 86400

and the FLOP model (`lctrain.reports.estimate.predict`) gives the same quantity at `--tflops` per GPU (default: the
device's peak, so its prediction is the time at 100% HFU), over the segment layout of the data each run trained on.
The ratio measured / predicted is printed beside each point.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

from rich.table import Table

from lctrain.config import Config, tokens_to_prepare, with_overrides
from lctrain.console import plain_console
from lctrain.data.prepare import prepare
from lctrain.errors import UserError, output_dir
from lctrain.hardware import device_peak_flops
from lctrain.rundir import RunDir

SECONDS_PER_DAY = 86400.0


@dataclass(frozen=True)
class Point:
    mode: str
    seq_len: int
    step_time_s: float
    steps_timed: int
    tokens_per_step: int
    days_per_1b_tokens: float
    predicted_days_per_1b_tokens: float
    run_dir: str

    @property
    def ratio(self) -> float:
        return self.days_per_1b_tokens / self.predicted_days_per_1b_tokens


def days_per_billion(tokens_per_step: int, step_time_s: float) -> float:
    return 1e9 / (tokens_per_step / step_time_s) / SECONDS_PER_DAY


def point_config(cfg: Config, mode: str, seq_len: int, steps: int, warmup: int, work: Path) -> Config:
    """The config of one measured point: the user's, at `seq_len` and `mode`, just enough data for its steps, no
    checkpoints, its own data and run directories under `work`."""
    total = warmup + steps
    budget = tokens_to_prepare(total, cfg.train.global_batch, seq_len, held_out=0)  # nothing evaluates these runs
    return with_overrides(
        cfg,
        [
            f"data.seq_len={seq_len}",
            f"attention.mode={mode}",
            f"train.steps={total}",
            f"data.token_budget={budget}",
            f"data.output_dir={work / f'data_{seq_len}'}",
            f"train.run_dir={work / f'{mode}_{seq_len}'}",
            "checkpoint.save_final=false",
            "checkpoint.hf_last=0",
            f"checkpoint.every_steps={total + 1}",
            "logging.wandb=disabled",
            "train.warmup_steps=0",
        ],
        f"measured at {seq_len} tokens, {mode}",
    )


def timed_steps(run_dir: Path, warmup: int) -> list[float]:
    """`step_time_s` of the steps after the first `warmup` in the run's metrics.jsonl."""
    rd = RunDir(run_dir)
    if not rd.metrics_file.is_file():
        raise UserError(f"{rd.metrics_file}: missing; the measured run wrote no step metrics")
    return [r["step_time_s"] for r in rd.read_metrics() if r["step"] > warmup]


def measure(
    cfg: Config,
    *,
    lengths: list[int],
    modes: list[str],
    steps: int,
    warmup: int,
    work: Path,
    tflops: float | None = None,
) -> dict:
    """Train each (length, mode) point for `warmup + steps` steps and time the last `steps`; write figure6.json and
    figure6.png in `work`, print the table. Returns the results."""
    # these import torch: on use, so this module loads without it (start-up time)
    from lctrain.reports.estimate import predict
    from lctrain.train.command import train

    if steps < 1 or warmup < 0:
        raise UserError(f"--steps {steps} --warmup {warmup}: need at least 1 timed step and no negative warmup")
    output_dir(work)  # before any point trains: a --out that cannot be written is refused first
    n_gpus = cfg.parallel.world
    if tflops is None:
        peak = device_peak_flops(_local_device(), cfg.logging.peak_tflops, cfg.model.dtype)
        if peak is None:
            raise UserError(
                "this GPU's peak is not in lctrain's table; pass --tflops (the per-GPU rate for the "
                "prediction) or set logging.peak_tflops"
            )
        tflops = peak / 1e12
    points: list[Point] = []
    for seq_len in lengths:
        # the modes of one length train on one prepared dataset, and the FLOP model reads its layout once
        configs = {mode: point_config(cfg, mode, seq_len, steps, warmup, work) for mode in modes}
        prepare(configs[modes[0]])
        predicted = predict(configs[modes[0]], {"*": tflops}, n_gpus, modes=tuple(modes))[0]
        for mode, pcfg in configs.items():
            run = train(pcfg, force=True)
            times = timed_steps(run, warmup)
            if not times:
                raise UserError(f"{run}: no step after the {warmup} warm-up steps was logged")
            tokens = pcfg.tokens_per_step
            step_time = statistics.fmean(times)
            points.append(
                Point(
                    mode,
                    seq_len,
                    step_time,
                    len(times),
                    tokens,
                    days_per_billion(tokens, step_time),
                    predicted[mode]["hours_per_1b_tokens"] / 24,
                    str(run),
                )
            )
    results = {
        "config": cfg.name,
        "gpus": n_gpus,
        "tflops_for_prediction": tflops,
        "steps": steps,
        "warmup": warmup,
        "points": [asdict(p) | {"ratio": p.ratio} for p in points],
    }
    (work / "figure6.json").write_text(json.dumps(results, indent=2))
    # reports.plots imports matplotlib: on use (start-up time)
    from lctrain.reports.plots import plot_figure6

    plot_figure6(results, work / "figure6.png")
    _print(results, work)
    return results


def _local_device():
    # torch on use: this module loads without it (start-up time of the light commands)
    import torch

    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def _print(results: dict, work: Path) -> None:
    # matplotlib, via reports.plots, on use (start-up time)
    from lctrain.reports.plots import length_label

    t = Table(
        title=f"{results['config']}: days per 1B tokens on {results['gpus']} GPU(s), measured "
        f"({results['steps']} steps after {results['warmup']} warm-up) and predicted by the FLOP model at "
        f"{results['tflops_for_prediction']:.3g} TFLOP/s per GPU"
    )
    for c in ("length", "mode", "step s", "days / 1B tok", "predicted", "measured / predicted"):
        t.add_column(c, justify="right")
    for p in results["points"]:
        t.add_row(
            length_label(p["seq_len"]),
            p["mode"],
            f"{p['step_time_s']:.3f}",
            f"{p['days_per_1b_tokens']:.3g}",
            f"{p['predicted_days_per_1b_tokens']:.3g}",
            f"{p['ratio']:.2f}",
        )
    console = plain_console()
    console.print(t)
    console.print(f"wrote {work}/figure6.json, figure6.png")
