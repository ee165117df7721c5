"""The training loss: token losses summed in chunks from the final hidden states, normalised over the whole step.

At 128K tokens the fp32 logits alone are 128K x 32K x 4 B = 16 GB, so the loss never builds them: only one chunk's
logits exist at a time, forward and backward. `train.loss_gradients` says how the backward avoids keeping them:
- `forward`: each chunk's gradients (of the hidden states, lm_head's weight and bias) are computed in the loss's own
  forward, right after its logits, and the backward only scales them by the incoming gradient, as Liger's fused
  linear cross-entropy does. The LM head runs once per token; the hidden states' gradient and an fp32 lm_head
  gradient are held from the loss to its backward (`memory.loss_items` counts them).
- `recompute`: each chunk goes through `lm_head` and cross-entropy inside an activation checkpoint, which reruns the
  LM head's forward in the backward (`costmodel.lm_head_rerun_flops`: 1-1.5% of the 1B model's 64K step, about four
  times that with Llama-3's 128K vocabulary).

Normalisation: every rank returns the *sum* of its token losses; the trainer divides by the number of valid labels
in the whole optimizer step (all micro-batches, all ranks), so sequence- and data-parallel runs compute the same loss
and gradients as one process.

Kept over DeepSpeed's `TiledFusedLogitsLoss` (`python scripts/bench_loss.py --threads 1`: 16K/32K tokens, vocab 32000,
hidden 512, fp32 CPU): it also computes each chunk's backward in its forward, but it takes lm_head's incoming gradient
as 1, so the trainer's `(loss * scale).backward()` leaves lm_head's gradient 1/scale times too large; `forward` here
scales every gradient by the incoming one.
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
# `train.loss_gradients`: where the chunked loss computes its gradients (module docstring).
LOSS_GRADIENTS = ("forward", "recompute")

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
    lm_head: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    labels: torch.Tensor,
    transform: LogitTransform | None = None,
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
    micro_batch: int,
    seq_tokens: int,
    fused_kernels: str,
    loss_gradients: str,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> bool:
    """Whether a micro-batch's loss reruns the LM head's forward in its backward (`costmodel.lm_head_rerun_flops`):
    the `recompute` loss checkpoints every chunk of more than one; the `forward` one and Liger's fused loss never
    rerun it. `seq_tokens`: the rank's positions of a window (data.seq_len over the sequence-parallel degree)."""
    return (
        fused_kernels != "liger"
        and loss_gradients == "recompute"
        and positions_per_chunk(micro_batch, seq_tokens, chunk_tokens) < seq_tokens
    )


class _GradientsInForward(torch.autograd.Function):
    """The chunked loss sum whose forward also computes every chunk's gradients, with an incoming gradient of 1, and
    whose backward scales them by the real one: the cross-entropy sum is linear in its incoming gradient, so this is
    the backward of the same function, without logits kept or recomputed. lm_head's gradients accumulate over the
    chunks in fp32 (autograd would sum them in the weight's dtype)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, per_chunk, transform):
        wanted = ctx.needs_input_grad[:3]
        h_grad = torch.empty_like(hidden) if wanted[0] else None
        w_grad = torch.zeros_like(weight, dtype=torch.float32) if wanted[1] else None
        b_grad = torch.zeros_like(bias, dtype=torch.float32) if wanted[2] else None
        w = weight.detach().requires_grad_(wanted[1])
        b = bias.detach().requires_grad_(wanted[2]) if bias is not None else None
        total = hidden.new_zeros((), dtype=torch.float32)
        for start in range(0, hidden.shape[1], per_chunk):
            h = hidden[:, start : start + per_chunk].detach().requires_grad_(wanted[0])
            with torch.enable_grad():
                loss = _chunk_loss_sum(lambda x: F.linear(x, w, b), h, labels[:, start : start + per_chunk], transform)
            inputs = [t for t, want in zip((h, w, b), wanted) if want]
            grads = iter(torch.autograd.grad(loss, inputs) if inputs else ())
            if wanted[0]:
                h_grad[:, start : start + per_chunk] = next(grads)
            if wanted[1]:
                w_grad += next(grads)
            if wanted[2]:
                b_grad += next(grads)
            total += loss.detach()
        ctx.grads = (h_grad, w_grad, b_grad)
        ctx.dtypes = (weight.dtype, bias.dtype if bias is not None else None)
        return total

    @staticmethod
    def backward(ctx, grad_total):
        h_grad, w_grad, b_grad = ctx.grads
        ctx.grads = None  # held only until here
        w_dtype, b_dtype = ctx.dtypes
        scaled = [g.mul_(grad_total) if g is not None else None for g in (h_grad, w_grad, b_grad)]
        weight_grad = scaled[1].to(w_dtype) if scaled[1] is not None else None
        bias_grad = scaled[2].to(b_dtype) if scaled[2] is not None else None
        return scaled[0], weight_grad, bias_grad, None, None, None


def _through(module: torch.nn.Module, forward: Callable[..., torch.Tensor], *args) -> torch.Tensor:
    """`forward(*args)` run as `module`'s forward, so that the hooks on the module run around it: ZeRO-3 gathers
    lm_head's partitioned weight for its forward and again for its backward, and releases it after each."""
    own = module.__dict__.get("forward")
    module.forward = forward
    try:
        return module(*args)
    finally:
        if own is None:
            del module.forward
        else:
            module.forward = own


def require_linear_head(lm_head: torch.nn.Module) -> None:
    """Refuse in one line an LM head the `forward` loss cannot differentiate itself (it computes `F.linear`'s)."""
    if not isinstance(lm_head, torch.nn.Linear):
        raise UserError(
            f"train.loss_gradients=forward computes the gradients of a linear LM head, and this model's is a "
            f"{type(lm_head).__name__}; set train.loss_gradients=recompute"
        )


def _loss_with_gradients(lm_head: torch.nn.Linear, per_chunk: int, transform: LogitTransform | None):
    def forward(hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return _GradientsInForward.apply(hidden, lm_head.weight, lm_head.bias, labels, per_chunk, transform)

    return forward


def chunked_loss_sum(
    lm_head: torch.nn.Module,
    hidden: torch.Tensor,
    labels: torch.Tensor,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    transform: LogitTransform | None = None,
    gradients: str = "forward",
) -> torch.Tensor:
    """Sum of cross-entropy over `labels != IGNORE_INDEX`; `hidden` [B, S, d], `labels` [B, S] already shifted;
    `transform` (`logit_transform`) applied to the logits first; `gradients` (`train.loss_gradients`) forward or
    recompute."""
    if gradients not in LOSS_GRADIENTS:
        raise ValueError(f"loss gradients {gradients!r}: expected one of {', '.join(LOSS_GRADIENTS)}")
    per_chunk = positions_per_chunk(hidden.shape[0], hidden.shape[1], chunk_tokens)
    if per_chunk == hidden.shape[1]:
        # one chunk: its logits are the peak either way, so recomputing them would only cost time
        return _chunk_loss_sum(lm_head, hidden, labels, transform)
    training = torch.is_grad_enabled()
    if training and gradients == "forward":
        require_linear_head(lm_head)
        return _through(lm_head, _loss_with_gradients(lm_head, per_chunk, transform), hidden, labels)
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, hidden.shape[1], per_chunk):
        h = hidden[:, start : start + per_chunk]
        y = labels[:, start : start + per_chunk]
        if training:
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
        gradients: str = "forward",
    ):
        super().__init__()
        self.lm = lm
        self.chunk_tokens = chunk_tokens
        self.gradients = gradients  # train.loss_gradients
        if fused_loss_sum is None and gradients == "forward":
            require_linear_head(lm.get_output_embeddings())
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
        return chunked_loss_sum(head, hidden, batch.labels, self.chunk_tokens, self.logit_transform, self.gradients)

    @classmethod
    def lm_state_dict(cls, state: dict) -> dict:
        """The wrapped model's own state dict from one of this module (ZeRO-3 gathers the wrapper's)."""
        return {k.removeprefix(cls._LM_PREFIX): v for k, v in state.items()}
