"""Activation checkpointing of the decoder layers: `model.checkpointing` full, selective, selective_matmul or none.

`full` recomputes each layer's forward in its backward (transformers' checkpointing, non-reentrant). `selective`
does the same through `torch.utils.checkpoint.create_selective_checkpoint_contexts` with a policy that keeps the
outputs of the attention kernels: the recomputation returns them from the forward's cache instead of running the
kernel again, and their backward finds the output and log-sum-exp it needs. The lctrain engines are Python functions
around these kernels (the function itself reruns; only what it does around the kernel, the permutations and casts,
is recomputed). `selective_matmul` also keeps every matmul's output (torchtitan's op-level policy keeps every other
one; here all of them), so the recomputation is the elementwise work alone.

The kernels kept, by engine: `sdpa` and `full` mode run `aten._scaled_dot_product_flash_attention_for_cpu` on CPU,
and one of the fused SDPA ops on GPU; `varlen` PyTorch's `torch_attn::_varlen_attn` custom op or flash-attn's
varlen forward. The `reference` engine is eager matmuls and softmax: no attention kernel to keep (`selective_matmul`
keeps its two matmuls). Nor is `flex`'s: it trains on CUDA only, compiled (torch.compile), and the policy sees the
ops that pass PyTorch's dispatcher, which inductor's generated kernel does not; so its backward reruns attention
as under `full` (`keeps_attention`).
"""

from __future__ import annotations

import functools

from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from lctrain.compat.transformers import enable_activation_checkpointing

MODES = ("full", "selective", "selective_matmul", "none")


def op_name(op) -> str:
    """An op's name without its overload ("aten.mm", "torch_attn._varlen_attn"); a higher-order op's own name
    ("flex_attention"). By name, so that ops registered only when their library is imported (flash-attn's, PyTorch's
    varlen) are matched whenever they run."""
    return str(getattr(op, "overloadpacket", op))


ATTENTION_OPS = frozenset(
    {
        "aten._scaled_dot_product_flash_attention_for_cpu",
        "aten._scaled_dot_product_flash_attention",
        "aten._scaled_dot_product_efficient_attention",
        "aten._scaled_dot_product_cudnn_attention",
        "aten._scaled_dot_product_fused_attention_overrideable",
        "aten._flash_attention_forward",
        "aten._efficient_attention_forward",
        "torch_attn._varlen_attn",
        "flash_attn._flash_attn_varlen_forward",
        "flex_attention",
    }
)
MATMUL_OPS = frozenset({"aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm"})


def keeps_attention(engine: str) -> bool:
    """Whether selective checkpointing keeps the attention kernel's output under `engine` (a name; `auto` resolves
    to sdpa or varlen on a GPU with flash-attn or PyTorch's varlen, which it keeps). Measured on an H100
    (2026-11-27, tests/test_activation_checkpointing.py): beyond whole-layer checkpointing `selective` kept the
    planned 33 MiB a layer under sdpa and varlen, 0 bytes under flex."""
    return engine not in ("flex", "reference")


def saved_ops(mode: str) -> frozenset:
    """The names of the ops whose outputs the backward keeps under `mode` (none for full and none)."""
    if mode == "selective":
        return ATTENTION_OPS
    if mode == "selective_matmul":
        return ATTENTION_OPS | MATMUL_OPS
    return frozenset()


def _policy(ops: frozenset, ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op_name(op) in ops else CheckpointPolicy.PREFER_RECOMPUTE


def context_fn(mode: str):
    """The `context_fn` of `torch.utils.checkpoint.checkpoint` for a selective `mode`."""
    return functools.partial(create_selective_checkpoint_contexts, functools.partial(_policy, saved_ops(mode)))


def enable(model, mode: str) -> None:
    """Checkpoint every decoder layer of this model instance under `mode` (transformers' per-instance switch, with
    the selective policy as its checkpoint function's `context_fn`); `none` leaves the model as built."""
    if mode == "none":
        return
    kwargs = {"use_reentrant": False}
    if mode != "full":
        kwargs["context_fn"] = context_fn(mode)
    enable_activation_checkpointing(model, kwargs)
