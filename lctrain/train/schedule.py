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


def resume_checkpoint_due(step: int, total_steps: int, ckpt: CheckpointConfig) -> bool:
    """Resume checkpoints every `every_steps` updates and after the last one (unless `save_final` is off)."""
    return (step == total_steps and ckpt.save_final) or step % ckpt.every_steps == 0


def hf_checkpoint_steps(total_steps: int, ckpt: CheckpointConfig) -> list[int]:
    """Evaluation checkpoints every `hf_every` steps within the last `hf_last`, ending at the last step:
    N-40, N-30, N-20, N-10, N for the paper's protocol (hf_every 10, hf_last 50)."""
    if ckpt.hf_last <= 0:
        return []
    first = max(1, total_steps - ckpt.hf_last + 1)
    return [s for s in range(total_steps, first - 1, -ckpt.hf_every)][::-1]
