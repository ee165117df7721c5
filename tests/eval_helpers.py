"""Shared by the evaluation tests: the tiny Llama they configure and run directories of its random checkpoints."""

from pathlib import Path

from train_helpers import export_by_hand

from lctrain.config import Config, write_resolved
from lctrain.tokenizer import load_tokenizer


def tiny_arch(layers: int = 2) -> list[str]:
    """The model.arch settings of a Llama small enough to evaluate or train in seconds on one core: 64 wide, 4 query
    heads sharing 2 KV heads, `layers` layers."""
    return [
        "model.arch.hidden_size=64",
        "model.arch.intermediate_size=128",
        f"model.arch.num_hidden_layers={layers}",
        "model.arch.num_attention_heads=4",
        "model.arch.num_key_value_heads=2",
    ]


def random_checkpoints(cfg: Config, run: Path, steps, tokenizer=None) -> dict:
    """`run` as a run directory of `cfg` (its config.yaml) holding an evaluation export per step of `steps`, each
    model randomly initialised from a seed of its own step so that their answers differ; `tokenizer` defaults to
    cfg.data.tokenizer. Returns the models by checkpoint name (step_N)."""
    # torch and transformers: on use, so that collecting the tests that never build a model stays quick
    from lctrain.model import build_model

    write_resolved(cfg, run)
    tok = tokenizer or load_tokenizer(cfg.data.tokenizer)
    models = {}
    for step in steps:
        model = build_model(cfg.model_copy(update={"seed": step}), vocab_size=len(tok)).model
        export_by_hand(model, tok, run, step)
        models[f"step_{step}"] = model
    return models
