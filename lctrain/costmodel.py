"""The one cost model: visible attention pairs, attention FLOPs and dense FLOPs, for the MFU of `train`, the attention
work of `inspect`, the predictions of `estimate` and the benchmarks.

Convention (model FLOPs, as MFU is defined): a matmul costs 2 FLOPs per multiply-add forward and twice its forward
backward (the gradients of both operands), so training is 3 forward passes. That gives 6 x N x tokens for the dense
layers, N the weights of the linear layers (`ModelShape.linear_params`, the one count of MFU, HFU and `estimate`;
norms and biases do element-wise work, no matmul), and, per causally visible (query, key) pair and layer, 4 x width
forward (QK^T and PV, `width` = heads x head dim) and 12 x width for training. FlashAttention's backward recomputes
the scores (2.5x forward instead of 2x); that recomputation is the kernel's implementation, like activation
checkpointing, so the model FLOPs count neither.
The FLOPs the device runs add what activation checkpointing reruns (`recomputed_flops`), the MLP forward that
`model.tiled_mlp` reruns (`tiled_mlp_flops`) and the LM head's forward that the recomputing loss reruns
(`lm_head_rerun_flops`): the hardware FLOPs utilisation (HFU) of a run, and `estimate`, which predicts wall time rather
than utilisation, count them through one function (`hardware_flops_parts`).

Visible pairs follow the masks the engines compute (docs/design.md §3): the causal window for `full`; for the document
modes, each token sees the earlier tokens of its own document, an interleaved document's earlier chunks included.
The paper (section 3.2): AnchorAttention "reduces the attention computation" because "the attention computation is
performed only within each document and with the anchor token"; the anchor adds no pair of its own, since every
segment's anchor copy starts its document.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from lctrain.attention.modes import MODES
from lctrain.errors import UserError

# FLOPs per visible pair and unit of width in one forward pass: 2 for QK^T, 2 for PV.
ATTENTION_FORWARD_FLOPS = 4
# FLOPs per parameter and token in one forward pass: one multiply-add.
DENSE_FORWARD_FLOPS = 2
# Forward + backward, the backward costing two forwards.
TRAINING_PASSES = 3


def visible_pairs(seg_lens, seg_doc, mode: str, seq_len: int) -> int:
    """(query, key) pairs the mode's causal mask keeps in one window."""
    if mode == "full":
        return seq_len * (seq_len + 1) // 2
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}")
    tokens: dict[int, int] = {}
    for n, d in zip(np.asarray(seg_lens).tolist(), np.asarray(seg_doc).tolist()):
        tokens[d] = tokens.get(d, 0) + n
    return sum(t * (t + 1) // 2 for t in tokens.values())


def full_square_pairs(seq_len: int) -> int:
    """(query, key) pairs of one window in torchtitan's and Megatron's MFU convention: the whole L x L square, as if
    the causal half were computed too (twice the causal pairs, nearly). The strict MFU counts `visible_pairs`."""
    return seq_len * seq_len


def window_pairs(seq_len: int, seg_lens, seg_doc) -> dict[str, int]:
    """Visible pairs of one window under each attention mode."""
    return {m: visible_pairs(seg_lens, seg_doc, m, seq_len) for m in MODES}


def attention_flops(pairs: float, width: int, passes: float = TRAINING_PASSES) -> float:
    """Attention FLOPs of one layer over `pairs` visible pairs with `width` = heads x head dim."""
    return ATTENTION_FORWARD_FLOPS * width * pairs * passes


def dense_flops(dense_params: int, tokens: float, passes: float = TRAINING_PASSES) -> float:
    """FLOPs of the matmuls of `dense_params` weights over `tokens` tokens."""
    return DENSE_FORWARD_FLOPS * dense_params * tokens * passes


def step_flops_parts(
    dense_params: int, layers: int, width: int, tokens: float, pairs: float, passes: float = TRAINING_PASSES
) -> tuple[float, float]:
    """(dense, attention) FLOPs of `tokens` tokens whose windows keep `pairs` visible pairs in each layer."""
    return dense_flops(dense_params, tokens, passes), layers * attention_flops(pairs, width, passes)


def step_flops(
    dense_params: int, layers: int, width: int, tokens: float, pairs: float, passes: float = TRAINING_PASSES
) -> float:
    """Dense plus attention FLOPs of `tokens` tokens whose windows keep `pairs` visible pairs in each layer."""
    return sum(step_flops_parts(dense_params, layers, width, tokens, pairs, passes))


# what `ModelShape.from_hf_config` reads without a default
_SHAPE_FIELDS = ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size")


@dataclass(frozen=True)
class ModelShape:
    """What the cost of a decoder depends on, read from a Hugging Face config (no weights needed)."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool = False  # the LM head shares the input embedding's weight

    @classmethod
    def from_hf_config(cls, hf) -> ModelShape:
        """Refuses, in one line, a config without the fields of a Llama-shaped decoder (the cost model's)."""
        missing = [k for k in _SHAPE_FIELDS if getattr(hf, k, None) is None]
        if missing:
            raise UserError(
                f"model type '{hf.model_type}' has no {' or '.join(missing)} in its config: lctrain plans and trains "
                f"Llama-shaped decoders (Llama, Mistral, Qwen, ...)"
            )
        heads = hf.num_attention_heads
        return cls(
            hf.num_hidden_layers,
            hf.hidden_size,
            heads,
            getattr(hf, "num_key_value_heads", None) or heads,
            getattr(hf, "head_dim", None) or hf.hidden_size // heads,
            hf.intermediate_size,
            hf.vocab_size,
            bool(getattr(hf, "tie_word_embeddings", False)),
        )

    @property
    def width(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        """KV heads x head dim: the width of the k and v projections."""
        return self.kv_heads * self.head_dim

    def layer_projection_params(self) -> int:
        """Weights of one decoder layer's projections: q, k, v, o and the gated MLP (gate, up, down)."""
        return 2 * self.hidden * (self.width + self.kv_width) + 3 * self.hidden * self.intermediate

    def layer_params(self) -> int:
        """Weights of one decoder layer: its projections and the two RMSNorm scales (no biases)."""
        return self.layer_projection_params() + 2 * self.hidden

    def param_count(self) -> int:
        """All weights: the layers, the final norm, the input embedding and the LM head unless tied to it."""
        return self.layers * self.layer_params() + self.hidden + self.vocab * self.hidden * (1 if self.tied else 2)

    def mlp_params(self) -> int:
        """Weights of the gated MLPs of all layers (gate, up, down)."""
        return self.layers * 3 * self.hidden * self.intermediate

    def decoder_linear_params(self) -> int:
        """Weights of every decoder layer's projections: those the decoder without its LM head multiplies per token."""
        return self.layers * self.layer_projection_params()

    def linear_params(self) -> int:
        """Weights of the projections (q, k, v, o, the gated MLP) and the LM head: those that multiply per token."""
        return self.decoder_linear_params() + self.hidden * self.vocab


def count_params(module) -> int:
    """Distinct parameters of a module, their full size also when ZeRO-3 has partitioned them (`ds_numel`)."""
    seen, total = set(), 0
    for p in module.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += int(getattr(p, "ds_numel", p.numel()))
    return total


def dense_params(lm) -> int:
    """The parameters the FLOPs of model `lm` count: `ModelShape.linear_params` of its config, read from the config
    rather than the module so that a run counts what `estimate` counts without the weights."""
    return ModelShape.from_hf_config(lm.config).linear_params()


# Forward passes that each activation checkpointing reruns in every decoder layer: (its projections, its attention).
# `selective` keeps the attention kernel's output; `selective_matmul` every matmul's too, so it reruns no FLOPs (but an
# engine's attention that they cannot keep: `recomputed_flops`).
RECOMPUTED_PASSES = {"full": (1, 1), "selective": (1, 0), "selective_matmul": (0, 0), "none": (0, 0)}


def recomputed_flops(
    shape: ModelShape, tokens: float, pairs: float, checkpointing: str, attention_kept: bool = True
) -> tuple[float, float]:
    """(projection, attention) FLOPs that activation checkpointing reruns over `tokens` tokens whose windows keep
    `pairs` visible pairs in each layer: the decoder layers' forward (not the LM head, outside them) under `full`, all
    of it but attention under `selective`. torch's checkpoint stops recomputing once it holds every tensor the
    backward needs (early stop): the MLP's down projection, the layer's last matmul, produces none of them and is not
    rerun. `attention_kept` false (`activation_checkpointing.keeps_attention`): the selective modes rerun the
    attention too."""
    dense_rerun, attention_rerun = RECOMPUTED_PASSES[checkpointing]
    if checkpointing != "none" and not attention_kept:
        attention_rerun = 1
    rerun_params = shape.layer_projection_params() - shape.hidden * shape.intermediate
    return (
        dense_flops(shape.layers * rerun_params, tokens, dense_rerun),
        shape.layers * attention_flops(pairs, shape.width, attention_rerun),
    )


def tiled_mlp_flops(shape: ModelShape, tokens: float) -> float:
    """FLOPs of the MLP forward that DeepSpeed's TiledMLP (`model.tiled_mlp`) reruns, slice by slice, in the backward
    of every layer over `tokens` tokens: it keeps only its input, not the MLP's intermediates."""
    return dense_flops(shape.mlp_params(), tokens, 1)


def lm_head_rerun_flops(shape: ModelShape, tokens: float) -> float:
    """FLOPs of the LM head's forward over `tokens` tokens, which the recomputing loss reruns in its backward: it keeps
    each chunk's hidden states, not its logits (`lctrain.train.loss.reruns_lm_head`)."""
    return dense_flops(shape.vocab * shape.hidden, tokens, 1)


def hardware_flops_parts(
    shape: ModelShape,
    dense_params: int,
    tokens: float,
    pairs: float,
    checkpointing: str,
    tiled_mlp: bool = False,
    attention_kept: bool = True,
    lm_head_rerun: bool = False,
) -> tuple[float, float]:
    """(dense, attention) FLOPs the device runs: `step_flops_parts`, plus what activation checkpointing reruns
    (`recomputed_flops`), with `tiled_mlp` what TiledMLP reruns (`tiled_mlp_flops`), and with `lm_head_rerun` the LM
    head's forward the recomputing loss reruns (`lm_head_rerun_flops`)."""
    dense, attention = step_flops_parts(dense_params, shape.layers, shape.width, tokens, pairs)
    dense_rerun, attention_rerun = recomputed_flops(shape, tokens, pairs, checkpointing, attention_kept)
    tiled = tiled_mlp_flops(shape, tokens) if tiled_mlp else 0.0
    head = lm_head_rerun_flops(shape, tokens) if lm_head_rerun else 0.0
    return dense + dense_rerun + tiled + head, attention + attention_rerun


def hardware_step_flops(
    shape: ModelShape,
    dense_params: int,
    tokens: float,
    pairs: float,
    checkpointing: str,
    tiled_mlp: bool = False,
    attention_kept: bool = True,
    lm_head_rerun: bool = False,
) -> float:
    """The FLOPs the device runs (`hardware_flops_parts`), for the hardware FLOPs utilisation (HFU) of Megatron's
    "Reducing Activation Recomputation" and PaLM, against MFU's model FLOPs, and for `estimate`'s wall time."""
    parts = hardware_flops_parts(
        shape, dense_params, tokens, pairs, checkpointing, tiled_mlp, attention_kept, lm_head_rerun
    )
    return sum(parts)
