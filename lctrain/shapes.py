"""Named model shapes: the one table of every model shape lctrain names, the paper's base models (so that `plan` and
`estimate` need neither the hub nor a login: Llama-2 and Llama-3 are gated) and the Llama-shaped models the benchmarks
and the GPU check build with random weights; beside them, the base models' own RoPE base and context length."""

from __future__ import annotations

from dataclasses import dataclass

from lctrain.costmodel import ModelShape

# (layers, hidden, heads, kv heads, head dim, intermediate, vocab, tied); the base models as their config.json says
SHAPES: dict[str, ModelShape] = {
    "llama2-7b": ModelShape(32, 4096, 32, 32, 128, 11008, 32000),
    "llama3-8b": ModelShape(32, 4096, 32, 8, 128, 14336, 128256),
    "mistral-7b-v0.3": ModelShape(32, 4096, 32, 8, 128, 14336, 32768),
    "qwen1.5-1.8b": ModelShape(24, 2048, 16, 16, 128, 5504, 151936),
    # bases people extend today
    "llama3.1-8b": ModelShape(32, 4096, 32, 8, 128, 14336, 128256),
    "llama3.2-1b": ModelShape(16, 2048, 32, 8, 64, 8192, 128256, tied=True),
    "llama3.2-3b": ModelShape(28, 3072, 24, 8, 128, 8192, 128256, tied=True),
    "qwen2.5-7b": ModelShape(28, 3584, 28, 4, 128, 18944, 152064),
    "mistral-7b-v0.1": ModelShape(32, 4096, 32, 8, 128, 14336, 32000),
    # Llama-3.2-1B's shape with the 32K vocabulary of the built-in tokenizer
    "llama-1b": ModelShape(16, 2048, 32, 8, 64, 8192, 32000, tied=True),
    # CPU-sized Llamas: the memory benchmark's rows (a small vocabulary, so the layers dominate) and the tiny one of
    # the training and generation benchmarks
    "small": ModelShape(4, 256, 4, 2, 64, 688, 1024),
    "tiny": ModelShape(4, 128, 4, 2, 32, 352, 32000, tied=True),
}
# The base models' names on the Hugging Face hub (model.name_or_path).
HUB_NAMES = {
    "meta-llama/Llama-2-7b-hf": "llama2-7b",
    "meta-llama/Meta-Llama-3-8B": "llama3-8b",
    "mistralai/Mistral-7B-v0.3": "mistral-7b-v0.3",
    "Qwen/Qwen1.5-1.8B": "qwen1.5-1.8b",
    "meta-llama/Llama-3.1-8B": "llama3.1-8b",
    "meta-llama/Llama-3.2-1B": "llama3.2-1b",
    "meta-llama/Llama-3.2-3B": "llama3.2-3b",
    "Qwen/Qwen2.5-7B": "qwen2.5-7b",
    "mistralai/Mistral-7B-v0.1": "mistral-7b-v0.1",
}


@dataclass(frozen=True)
class Positions:
    """A base model's own RoPE base, context length and RoPE variant (config.json's rope_theta,
    max_position_embeddings and rope_scaling's rope_type), beside its shape: `lctrain init` adapts them without a
    download."""

    rope_theta: float
    max_positions: int
    rope_type: str = "default"


# Gemma-2 is left out on purpose: its attention soft-caps the logits and alternates sliding-window layers, which
# lctrain's attention engines do not reproduce.
POSITIONS: dict[str, Positions] = {
    "llama2-7b": Positions(10_000.0, 4096),
    "llama3-8b": Positions(500_000.0, 8192),
    "mistral-7b-v0.3": Positions(1_000_000.0, 32768),
    "qwen1.5-1.8b": Positions(1_000_000.0, 32768),
    # Llama-3.1/3.2: rope_scaling {rope_type: llama3, factor 8 (3.2: 32), original_max_position_embeddings 8192}
    "llama3.1-8b": Positions(500_000.0, 131072, "llama3"),
    "llama3.2-1b": Positions(500_000.0, 131072, "llama3"),
    "llama3.2-3b": Positions(500_000.0, 131072, "llama3"),
    "qwen2.5-7b": Positions(1_000_000.0, 131072),
    "mistral-7b-v0.1": Positions(10_000.0, 32768),
}


def hf_arch(shape: ModelShape) -> dict:
    """A Llama of `shape` as a Hugging Face config's fields (`model.arch`), without the vocabulary: training takes
    that from its tokenizer, the benchmarks pass their own."""
    arch = {
        "model_type": "llama",
        "hidden_size": shape.hidden,
        "intermediate_size": shape.intermediate,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "tie_word_embeddings": shape.tied,
    }
    if shape.head_dim != shape.hidden // shape.heads:
        arch["head_dim"] = shape.head_dim
    return arch
