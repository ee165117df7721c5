"""Pure schedules: the learning rate per step and which steps write checkpoints.

Steps are counted from 1: step N is the N-th optimizer update, and a checkpoint "at step N" holds the state after it.
"""

from __future__ import annotations

import math

from lctrain.config import CheckpointConfig, TrainConfig


def lr_factor(step_index: int, train: TrainConfig) -> float:
    """Multiplier of `train.lr` for the update with 0-based index `step_index` (linear warmup, then the schedule)."""
    warm = train.warmup_steps
    if warm and step_index < warm:
        return (step_index + 1) / warm
    if train.lr_schedule == "constant":
        return 1.0
    decay_steps = max(1, train.steps - warm)
    progress = min(1.0, (step_index - warm) / decay_steps)
    if train.lr_schedule == "linear":
        return 1.0 - progress
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def learning_rate(step_index: int, train: TrainConfig) -> float:
    """The rate of the update with 0-based index `step_index`: what the optimizer steps with and the log shows."""
    return train.lr * lr_factor(step_index, train)


def warmup_warning(train: TrainConfig) -> str | None:
    """One line when the whole run is warmup (`warmup_steps` >= `steps`): it ends below `train.lr`, or reaches it
    only at its last step, and its schedule never decays. A warning, not a refusal: a short smoke test of a long
    config (`--set train.steps=20`), or a resume that shortens the run, is such a run on purpose."""
    if train.warmup_steps < train.steps:
        return None
    # the warmup only rises, so the run's highest rate is its last step's
    highest = learning_rate(train.steps - 1, train)
    decay = f", and the {train.lr_schedule} decay never starts" if train.lr_schedule != "constant" else ""
    return (
        f"warning: train.warmup_steps = {train.warmup_steps} >= train.steps = {train.steps}: the whole run is "
        f"warmup; its highest learning rate is {highest:.3e} at step {train.steps} (train.lr = {train.lr:g})"
        f"{decay}"
    )


# What `learning_rate` reads of TrainConfig: the keys that re-shape the schedule.
SCHEDULE_KEYS = ("lr", "lr_schedule", "steps", "warmup_steps")


def resumed_rate_note(step: int, saved: dict | None, now: TrainConfig) -> str | None:
    """One line when a resume after `step` updates continues on another schedule than the one its checkpoint was
    written under (`saved`: the checkpoint's `config.settings`), such that the next update's rate differs: the rate
    of the last update taken and of the next one, so a jump in the curve (a cosine stretched by more `train.steps`
    starts high again) is expected, not found. None where the next rate is the checkpoint schedule's, or the
    checkpoint holds no settings."""
    train = (saved or {}).get("train") or {}
    if not all(k in train for k in SCHEDULE_KEYS):
        return None
    before = now.model_copy(update={k: train[k] for k in SCHEDULE_KEYS})
    last, planned, next_rate = learning_rate(step - 1, before), learning_rate(step, before), learning_rate(step, now)
    if next_rate == planned:
        return None
    changed = ", ".join(
        f"train.{k} {getattr(before, k)!r} -> {getattr(now, k)!r}"
        for k in SCHEDULE_KEYS
        if getattr(before, k) != getattr(now, k)
    )
    return (
        f"note: the learning rate goes from {last:.3e} at step {step} (the last taken) to {next_rate:.3e} at step "
        f"{step + 1} ({changed}; {planned:.3e} under the checkpoint's schedule)"
    )


def resume_checkpoint_due(step: int, total_steps: int, ckpt: CheckpointConfig) -> bool:
    """Resume checkpoints every `every_steps` updates and after the last one (unless `save_final` is off)."""
    return (step == total_steps and ckpt.save_final) or step % ckpt.every_steps == 0


def resume_checkpoint_after(start_step: int, total_steps: int, ckpt: CheckpointConfig) -> bool:
    """Whether `resume_checkpoint_due` holds for a step after `start_step`, by arithmetic: asking it of every step
    took minutes for a run of a billion steps."""
    first_multiple = (start_step // ckpt.every_steps + 1) * ckpt.every_steps
    return start_step < total_steps and (ckpt.save_final or first_multiple <= total_steps)


def hf_checkpoint_steps(total_steps: int, ckpt: CheckpointConfig) -> range:
    """Evaluation checkpoints every `hf_every` steps within the last `hf_last`, ending at the last step:
    N-40, N-30, N-20, N-10, N for the paper's protocol (hf_every 10, hf_last 50). A range, not a list: `hf_last` may
    be as large as `train.steps`, and membership is arithmetic."""
    if ckpt.hf_last <= 0:
        return range(0)
    first = max(1, total_steps - ckpt.hf_last + 1)
    earliest = total_steps - (total_steps - first) // ckpt.hf_every * ckpt.hf_every
    return range(earliest, total_steps + 1, ckpt.hf_every)


def heldout_due(step: int, total_steps: int, every: int) -> bool:
    """Whether `train.heldout_every` scores the held-out loss after `step`: every `every` steps and at the last
    (never for 0)."""
    return every > 0 and (step % every == 0 or step == total_steps)
