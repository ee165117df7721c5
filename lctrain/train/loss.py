"""The training loss: token losses summed in chunks from the final hidden states, normalised over the whole step.

At 128K tokens the fp32 logits alone are 128K x 32K x 4 B = 16 GB, so the loss never builds them: each chunk of
hidden states goes through `lm_head` and cross-entropy inside an activation checkpoint, which keeps only that chunk's
logits alive at a time (forward and backward).

Normalisation: every rank returns the *sum* of its token losses; the trainer divides by the number of valid labels
in the whole optimizer step (all micro-batches, all ranks), so sequence- and data-parallel runs compute the same loss
and gradients as one process.

Kept over DeepSpeed's `TiledFusedLogitsLoss` (`python scripts/bench_loss.py --threads 1`: 16K/32K tokens, vocab 32000,
hidden 512, fp32 CPU): same peak, 3.0 GiB (full logits: 5.9 GiB at 16K), at 1.37x its time (28.4/57.5 vs 20.8/42.2 CPU
s; it runs each chunk's backward in the forward instead of recomputing logits), but it takes lm_head's incoming
gradient as 1, so the trainer's `(loss * scale).backward()` leaves lm_head's gradient 1/scale times too large.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from lctrain.attention import IGNORE_INDEX, Batch
from lctrain.errors import UserError

# Tokens per logits chunk: 8K x 32K vocab x 4 B = 1 GB of fp32 logits at most.
DEFAULT_CHUNK_TOKENS = 8192

# The loss runs lm_head itself, so what a model class's forward does to lm_head's output must be redone here: by model
# type, the config key of the factor its forward multiplies ("mul") or divides ("div") the logits by (transformers
# 5.17-5.23, each `*ForCausalLM.forward`).
_LOGIT_SCALES = {
    "cohere": ("logit_scale", "mul"),
    "cohere2": ("logit_scale", "mul"),
    "cohere2_moe": ("logit_scale", "mul"),
    "granite": ("logits_scaling", "div"),
    "granitemoe": ("logits_scaling", "div"),
    "granitemoeshared": ("logits_scaling", "div"),
    "granitemoehybrid": ("logits_scaling", "div"),
    "hyperclovax": ("logits_scaling", "mul"),
}
# Every model class with this key caps its logits as `cap * tanh(logits / cap)` after any scale (Gemma-2/3).
_SOFTCAP_KEY = "final_logit_softcapping"
# Keys that scale the logits in some model classes: on a model type not in `_LOGIT_SCALES` their meaning is unknown
# here, so such a model is refused rather than trained on other logits than it computes.
_SCALE_KEYS = ("logit_scale", "logits_scaling", "output_multiplier")


class LogitTransform(NamedTuple):
    """What a model's forward applies to lm_head's output: `(op, config key, value)` steps, op mul, div or softcap."""

    steps: tuple[tuple[str, str, float], ...]

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        for op, _, value in self.steps:
            if op == "mul":
                logits = logits * value
            elif op == "div":
                logits = logits / value
            else:
                logits = torch.tanh(logits / value) * value
        return logits

    def __str__(self) -> str:
        return ", ".join(f"{key} = {value}" for _, key, value in self.steps)


def logit_transform(hf_config) -> LogitTransform | None:
    """The transform `hf_config`'s model class applies to its logits (None: none, or only by 1), the one home of it
    for the training loss and the evaluation perplexity. A scale key on a model type whose use of it is not known here
    is refused in one line."""
    model_type = hf_config.model_type
    steps = []
    if model_type in _LOGIT_SCALES:
        key, op = _LOGIT_SCALES[model_type]
        value = getattr(hf_config, key, None)
        if value is not None and value != 1:
            steps.append((op, key, value))
    else:
        for key in _SCALE_KEYS:
            value = getattr(hf_config, key, None)
            if value is not None and value != 1:
                raise UserError(
                    f"model {key} = {value}: lctrain does not know how model type '{model_type}' applies it to the "
                    f"logits, so its loss would not be the model's; it applies the logit scales of "
                    f"{', '.join(sorted(_LOGIT_SCALES))}"
                )
    cap = getattr(hf_config, _SOFTCAP_KEY, None)
    if cap is not None:
        steps.append(("softcap", _SOFTCAP_KEY, cap))
    return LogitTransform(tuple(steps)) if steps else None


def _chunk_loss_sum(
    lm_head: torch.nn.Module, hidden: torch.Tensor, labels: torch.Tensor, transform: LogitTransform | None = None
) -> torch.Tensor:
    # the transform on fp32 logits: the model's function, with the loss's rounding
    logits = lm_head(hidden).float()
    if transform is not None:
        logits = transform(logits)
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
    )


def positions_per_chunk(rows: int, length: int, chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> int:
    """Positions of each row whose logits exist at once: `chunk_tokens` shared by the rows, or the whole row."""
    return min(length, max(1, chunk_tokens // rows))


def reruns_lm_head(
    micro_batch: int, seq_tokens: int, fused_kernels: str, chunk_tokens: int = DEFAULT_CHUNK_TOKENS
) -> bool:
    """Whether a micro-batch's loss reruns the LM head's forward in its backward (`costmodel.lm_head_rerun_flops`):
    the chunked loss checkpoints every chunk of more than one, and Liger's fused loss replaces it. `seq_tokens`: the
    rank's positions of a window (data.seq_len over the sequence-parallel degree)."""
    return fused_kernels != "liger" and positions_per_chunk(micro_batch, seq_tokens, chunk_tokens) < seq_tokens


def chunked_loss_sum(
    lm_head: torch.nn.Module,
    hidden: torch.Tensor,
    labels: torch.Tensor,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    transform: LogitTransform | None = None,
) -> torch.Tensor:
    """Sum of cross-entropy over `labels != IGNORE_INDEX`; `hidden` [B, S, d], `labels` [B, S] already shifted;
    `transform` (`logit_transform`) applied to the logits first."""
    per_chunk = positions_per_chunk(hidden.shape[0], hidden.shape[1], chunk_tokens)
    if per_chunk == hidden.shape[1]:
        # one chunk: its logits are the peak either way, so recomputing them would only cost time
        return _chunk_loss_sum(lm_head, hidden, labels, transform)
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, hidden.shape[1], per_chunk):
        h = hidden[:, start : start + per_chunk]
        y = labels[:, start : start + per_chunk]
        if torch.is_grad_enabled():
            total = total + checkpoint(_chunk_loss_sum, lm_head, h, y, transform, use_reentrant=False)
        else:
            total = total + _chunk_loss_sum(lm_head, h, y, transform)
    return total


class CausalLMLossSum(torch.nn.Module):
    """Wraps a Hugging Face causal LM so DeepSpeed sees one module whose forward takes a `Batch` and returns the
    token-loss sum over its labels."""

    # The wrapped model's state-dict entries start with its attribute name: `lm_state_dict` strips it.
    _LM_PREFIX = "lm."

    def __init__(
        self,
        lm: torch.nn.Module,
        chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
        fused_loss_sum: Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    ):
        super().__init__()
        self.lm = lm
        self.chunk_tokens = chunk_tokens
        # a fused kernel's loss sum (`lctrain.fused.loss_sum`) over the same arguments, in place of the chunked one
        self.fused_loss_sum = fused_loss_sum
        self.logit_transform = logit_transform(lm.config)
        if fused_loss_sum is not None and self.logit_transform is not None:
            raise UserError(
                f"model.fused_kernels: the fused cross-entropy takes lm_head's logits as they are, but this model "
                f"transforms them ({self.logit_transform}); set model.fused_kernels=compile or none"
            )

    def forward(self, batch: Batch) -> torch.Tensor:
        hidden = self.lm.get_decoder()(**batch.model_kwargs(), use_cache=False).last_hidden_state
        head = self.lm.get_output_embeddings()
        if self.fused_loss_sum is not None:
            return self.fused_loss_sum(head, hidden, batch.labels)
        return chunked_loss_sum(head, hidden, batch.labels, self.chunk_tokens, self.logit_transform)

    @classmethod
    def lm_state_dict(cls, state: dict) -> dict:
        """The wrapped model's own state dict from one of this module (ZeRO-3 gathers the wrapper's)."""
        return {k.removeprefix(cls._LM_PREFIX): v for k, v in state.items()}
