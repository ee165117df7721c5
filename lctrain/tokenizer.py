"""Tokenizer loading (hub name, local directory, SentencePiece file, or a built-in one) and the anchor token.

Built-in tokenizers are the real SentencePiece models that the `mistral-common` package ships, so tests and the demo
use a real 32K-vocabulary tokenizer without touching a hub. The converted fast tokenizer is cached on disk because
converting SentencePiece to `tokenizers` takes seconds.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from functools import lru_cache
from pathlib import Path

from lctrain.errors import UserError

BUILTIN_PREFIX = "builtin:"
# name -> file in mistral_common/data. v1 is the Mistral-7B-v0.1 (Llama-2-style) 32000-token model, v3 the
# Mistral-7B-v0.3 32768-token one.
BUILTIN_TOKENIZERS = {
    "mistral-7b-v0.1": "tokenizer.model.v1",
    "mistral-7b-v0.3": "mistral_instruct_tokenizer_240323.model.v3",
}


def _builtin_model_file(name: str) -> Path:
    if name not in BUILTIN_TOKENIZERS:
        allowed = ", ".join(BUILTIN_PREFIX + k for k in BUILTIN_TOKENIZERS)
        raise UserError(f"tokenizer '{BUILTIN_PREFIX}{name}' is unknown; built-in tokenizers: {allowed}")
    try:
        import mistral_common
    except ImportError:
        raise UserError("built-in tokenizers need the 'mistral-common' package: pip install mistral-common") from None
    path = Path(mistral_common.__file__).parent / "data" / BUILTIN_TOKENIZERS[name]
    if not path.is_file():
        raise UserError(f"{path}: built-in tokenizer file missing; reinstall mistral-common")
    return path


def _cache_dir() -> Path:
    root = os.environ.get("LCTRAIN_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "lctrain")
    return Path(root) / "tokenizers"


def _from_sentencepiece(model_file: Path, cache_key: str):
    from transformers import AutoTokenizer, LlamaTokenizerFast

    cached = _cache_dir() / cache_key
    if (cached / "tokenizer.json").is_file():
        try:
            return AutoTokenizer.from_pretrained(str(cached))
        except Exception:  # a damaged entry (truncated by a full disk, edited by hand) is rebuilt, not fatal
            shutil.rmtree(cached, ignore_errors=True)
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copy(model_file, Path(tmp) / "tokenizer.model")
        tok = LlamaTokenizerFast.from_pretrained(tmp)
    # Staged beside the cache entry and renamed, so a concurrent or killed process never leaves a half-written one.
    staging = None
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=cached.parent, prefix=f".{cache_key}-"))
        tok.save_pretrained(str(staging))
        os.replace(staging, cached)
    except OSError:
        pass  # a read-only home, or another process that won the rename, only costs the conversion next time
    finally:
        if staging is not None and staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    if (cached / "tokenizer.json").is_file():
        # Loaded from the cache like every later call, so `name_or_path` names a directory that exists (the
        # conversion's temporary directory is gone, and reloading by that name would go to the hub).
        return AutoTokenizer.from_pretrained(str(cached))
    return tok


@lru_cache(maxsize=8)
def load_tokenizer(spec: str):
    """Load a tokenizer from `builtin:NAME`, a directory, a SentencePiece `.model` file, or a hub name."""
    if spec.startswith(BUILTIN_PREFIX):
        name = spec[len(BUILTIN_PREFIX):]
        return _from_sentencepiece(_builtin_model_file(name), f"builtin-{name}")
    path = Path(spec)
    if path.is_file():
        digest = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
        try:
            return _from_sentencepiece(path, f"spm-{digest}")
        except Exception as e:  # sentencepiece/protobuf/transformers each raise their own types for a foreign file
            raise UserError(f"tokenizer '{spec}' is a file but not a SentencePiece model ({type(e).__name__}); set "
                            f"data.tokenizer to a .model file, a tokenizer directory or a hub name") from None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(spec)
    except Exception as e:  # transformers raises OSError/ValueError/HF hub errors depending on the cause
        where = "directory" if path.is_dir() else "hub name or path"
        raise UserError(
            f"tokenizer '{spec}' could not be loaded as a {where} ({type(e).__name__}); set data.tokenizer to a "
            f"local tokenizer directory, a SentencePiece .model file, or one of "
            f"{', '.join(BUILTIN_PREFIX + k for k in BUILTIN_TOKENIZERS)}"
        ) from None


def anchor_token_id(tokenizer) -> int:
    """The anchor that starts every segment: BOS, or EOS for tokenizers without BOS (Qwen)."""
    if tokenizer.bos_token_id is not None:
        return int(tokenizer.bos_token_id)
    if tokenizer.eos_token_id is not None:
        return int(tokenizer.eos_token_id)
    raise UserError(f"tokenizer '{tokenizer.name_or_path}' has neither a BOS nor an EOS token to use as the anchor")
