"""Tokenizer loading (hub name, local directory, SentencePiece file, or a built-in one), the anchor token, and the
one home of "text -> token ids" (`TextEncoder`).

Built-in tokenizers are the real SentencePiece models that the `mistral-common` package ships, so tests and the demo
use a real 32K-vocabulary tokenizer without touching a hub. The Hugging Face tokenizer object (special tokens, decode,
vocabulary size) is the converted fast tokenizer, cached on disk because converting SentencePiece to `tokenizers`
takes seconds. Its ids are not SentencePiece's: the conversion (Metaspace pre-tokenizer + BPE) splits runs of spaces
and a leading space differently ("x    y": SentencePiece '▁x' '▁▁▁' '▁y', converted '▁x' '▁▁▁▁' 'y'), which changes
the ids of most real documents (code, indented text). So text is turned into ids by `TextEncoder`, which runs
SentencePiece itself whenever the tokenizer comes with a SentencePiece model (docs/design.md §2: "for a SentencePiece
`.model`, SentencePiece's own `encode`"), and the `tokenizers` pipeline of the Hugging Face tokenizer otherwise.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import tempfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from lctrain.compat.transformers import legacy_tokenizer_config, load_errors
from lctrain.errors import UserError, WriteFailed, writing

if TYPE_CHECKING:
    from lctrain.config import Config

BUILTIN_PREFIX = "builtin:"
# name -> file in mistral_common/data. v1 is the Mistral-7B-v0.1 (Llama-2-style) 32000-token model, v3 the
# Mistral-7B-v0.3 32768-token one.
BUILTIN_TOKENIZERS = {
    "mistral-7b-v0.1": "tokenizer.model.v1",
    "mistral-7b-v0.3": "mistral_instruct_tokenizer_240323.model.v3",
}


def builtin_model_file(name: str) -> Path:
    if name not in BUILTIN_TOKENIZERS:
        allowed = ", ".join(BUILTIN_PREFIX + k for k in BUILTIN_TOKENIZERS)
        raise UserError(f"tokenizer '{BUILTIN_PREFIX}{name}' is unknown; built-in tokenizers: {allowed}")
    try:
        # optional at run time: only the built-in tokenizers need mistral-common
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


SPM_FILE = "tokenizer.model"  # the name transformers gives a tokenizer's SentencePiece model (its `vocab_file`)
TOKENIZER_CONFIG = "tokenizer_config.json"


def _from_sentencepiece(model_file: Path, cache_key: str):
    # transformers on use: this module loads without it (start-up time)
    from transformers import AutoTokenizer, LlamaTokenizerFast

    cached = _cache_dir() / cache_key
    # The entry keeps the model beside the converted files, so the loaded tokenizer's `vocab_file` names it; an entry
    # without it (written by an older lctrain) is rebuilt.
    if (cached / "tokenizer.json").is_file() and (cached / SPM_FILE).is_file():
        try:
            return AutoTokenizer.from_pretrained(str(cached))
        except Exception:  # a damaged entry (truncated by a full disk, edited by hand) is rebuilt, not fatal
            shutil.rmtree(cached, ignore_errors=True)
    # sentencepiece on use: each tokenizer kind needs only its own library (start-up time)
    import sentencepiece as spm

    # Inputs start with BOS, as the Llama and Mistral tokenizers on the hub do (the conversion alone adds none).
    has_bos = spm.SentencePieceProcessor(model_file=str(model_file)).bos_id() >= 0
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copy(model_file, Path(tmp) / SPM_FILE)
        tok = LlamaTokenizerFast.from_pretrained(tmp, add_bos_token=has_bos)
    # Staged beside the cache entry and renamed, so a concurrent or killed process never leaves a half-written one.
    staging = None
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=cached.parent, prefix=f".{cache_key}-"))
        with writing(staging, "the tokenizer cache"):
            tok.save_pretrained(str(staging))
            shutil.copy(model_file, staging / SPM_FILE)
            shutil.rmtree(cached, ignore_errors=True)  # a stale entry: os.replace cannot overwrite a non-empty one
            os.replace(staging, cached)
    except (OSError, WriteFailed):
        pass  # a full or read-only home, or another process that won the rename, only costs the conversion next time
    finally:
        if staging is not None and staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    if (cached / "tokenizer.json").is_file():
        # Loaded from the cache like every later call, so `name_or_path` names a directory that exists (the
        # conversion's temporary directory is gone, and reloading by that name would go to the hub).
        return AutoTokenizer.from_pretrained(str(cached))
    # No cache (a read-only home): the conversion's temporary model is gone, so `vocab_file` names the original
    tok.vocab_file = str(model_file)
    return tok


@lru_cache(maxsize=8)
def load_tokenizer(spec: str):
    """Load a tokenizer from `builtin:NAME`, a directory, a SentencePiece `.model` file, or a hub name."""
    if spec.startswith(BUILTIN_PREFIX):
        name = spec[len(BUILTIN_PREFIX) :]
        return _from_sentencepiece(builtin_model_file(name), f"builtin-{name}")
    path = Path(spec)
    if path.is_file():
        digest = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
        try:
            return _from_sentencepiece(path, f"spm-{digest}")
        except Exception as e:  # sentencepiece/protobuf/transformers each raise their own types for a foreign file
            raise UserError(
                f"tokenizer '{spec}' is a file but not a SentencePiece model ({type(e).__name__}); set "
                f"data.tokenizer to a .model file, a tokenizer directory or a hub name"
            ) from None
    # transformers on use (start-up time)
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


def tokenizer_fingerprint(tok) -> str:
    """What token ids mean under `tok`: a hash of its vocabulary (token -> id, added tokens included), the same for
    a tokenizer loaded from its source and from the copy an evaluation checkpoint saved."""
    vocab = sorted(tok.get_vocab().items())
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()[:16]


def foreign_ids(data_vocab: dict[str, int], model_vocab: dict[str, int]) -> list[tuple[int, str, str | None]]:
    """The ids of `data_vocab` that mean something else under `model_vocab`, in id order, each as (id, the data's
    token, the model's token at that id or None). Empty when the model's vocabulary extends the data's (a model whose
    tokenizer adds a padding token reads the data as written)."""
    model_tokens = {i: t for t, i in model_vocab.items()}
    return sorted((i, t, model_tokens.get(i)) for t, i in data_vocab.items() if model_vocab.get(t) != i)


def _model_tokenizer(source: str):
    """The tokenizer saved with a pretrained model (a local directory, or a hub name already cached), or None: nothing
    is downloaded."""
    # transformers on use (start-up time)
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(source, local_files_only=True)
    except (*load_errors(), ImportError):  # none beside the model, not cached, or its package missing: none to compare
        return None


def _embedding_rows(model_dir: str) -> int | None:
    """`vocab_size` of a local model directory's config, None when it has none to read (its load, later, says why)."""
    # transformers on use (start-up time)
    from transformers import AutoConfig

    try:
        return getattr(AutoConfig.from_pretrained(model_dir), "vocab_size", None)
    except load_errors():  # a damaged or foreign config: the model's own load refuses it in one line
        return None


def check_matches_model(cfg: Config, data_tokenizer=None) -> None:
    """A pretrained model trained on the ids of another tokenizer reads other words than the text holds (a config
    whose `base:` pairs its model with another tokenizer, a `--set model.name_or_path` that left `data.tokenizer`
    behind): refused, by `prepare` and `train` before any work, when the model's own tokenizer gives any of the
    data's ids another meaning, or when the data's ids run past the model's embedding rows. `data_tokenizer`:
    `data.tokenizer` already loaded."""
    if cfg.model.arch is not None:
        return  # random init: its vocabulary is the data tokenizer's
    model_source, data_source = cfg.resolve_source(cfg.model.name_or_path), cfg.resolve_source(cfg.data.tokenizer)
    if model_source == data_source:
        return
    data_vocab = (data_tokenizer or load_tokenizer(data_source)).get_vocab()
    where = f"data.tokenizer = '{cfg.data.tokenizer}' is not the tokenizer of model.name_or_path = "
    where += f"'{cfg.model.name_or_path}'"
    fix = f"set data.tokenizer to the model's ({cfg.model.name_or_path}) and run 'lctrain prepare' again"
    own = _model_tokenizer(model_source)
    foreign = foreign_ids(data_vocab, own.get_vocab()) if own is not None else []
    if foreign:
        i, ours, theirs = foreign[0]
        meaning = "no token" if theirs is None else repr(theirs)
        raise UserError(
            f"{where}: {len(foreign):,} of its {len(data_vocab):,} ids mean other tokens to the model (id {i} is "
            f"{ours!r} in the data, {meaning} to the model); {fix}"
        )
    rows = _embedding_rows(model_source) if Path(model_source).is_dir() else None  # a hub config is not downloaded
    top = max(data_vocab.values())
    if rows is not None and top >= rows:
        raise UserError(f"{where}: its ids reach {top:,}, past the model's {rows:,} embedding rows; {fix}")


ANCHOR_AUTO = "auto"
# The document separator of GPT-2-style byte-level BPE vocabularies (GPT-2, Qwen, SmolLM2, StarCoder): the token
# their base models were pretrained with between documents.
END_OF_TEXT = "<|endoftext|>"


@dataclass(frozen=True)
class Anchor:
    """The token that starts every training segment and every prompt lctrain builds (`data.anchor` resolved)."""

    token: str
    id: int
    why: str

    def record(self) -> dict:
        """What the manifest, the run directory and the checkpoints keep."""
        return {"token": self.token, "id": self.id}


ANCHOR_FILE = "anchor.json"


def write_anchor(directory: Path, anchor: Anchor) -> Path:
    """`directory/anchor.json`: the anchor a run trained with, in its run directory and each evaluation checkpoint."""
    out = Path(directory) / ANCHOR_FILE
    with writing(out, "the anchor"):
        out.write_text(json.dumps(anchor.record()) + "\n")
    return out


def recorded_anchor(directory: Path) -> Anchor | None:
    """The anchor `write_anchor` recorded in `directory`, or None when there is none (a model not trained here)."""
    path = Path(directory) / ANCHOR_FILE
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
        return Anchor(str(record["token"]), int(record["id"]), f"recorded in {path}")
    except (ValueError, KeyError, TypeError):
        raise UserError(
            f'{path}: not an anchor record ({{"token": ..., "id": ...}}); delete it or restore it'
        ) from None


def _vocabulary_id(tokenizer, token: str) -> int | None:
    return tokenizer.get_vocab().get(token)


def resolve_anchor(tokenizer, spec: str = ANCHOR_AUTO, name: str | None = None) -> Anchor:
    """`data.anchor` for `tokenizer`: "auto" (the rule `config.DataConfig.anchor` describes), "bos", "eos", or one
    token of its vocabulary. `name`: the tokenizer as the user named it (`data.tokenizer`) for messages; a built-in
    one's own is the cache directory it was written to."""
    name = name or getattr(tokenizer, "name_or_path", "?")
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    if spec in ("bos", "eos"):
        token_id = bos if spec == "bos" else eos
        if token_id is None:
            raise UserError(
                f"data.anchor = {spec}: tokenizer '{name}' has no {spec.upper()} token; use auto or a token"
            )
        return Anchor(tokenizer.convert_ids_to_tokens(int(token_id)), int(token_id), f"data.anchor = {spec}")
    if spec != ANCHOR_AUTO:
        token_id = _vocabulary_id(tokenizer, spec)
        if token_id is None:
            # an example of this tokenizer's own: a fixed one (<|endoftext|>) was the very token refused for some
            own = next(
                (t for t in (tokenizer.eos_token, tokenizer.bos_token, *tokenizer.all_special_tokens) if t), None
            )
            example = f" (e.g. {own}, one of its special tokens)" if own else ""
            raise UserError(
                f"data.anchor = {spec!r} is not a token of tokenizer '{name}'; use auto, bos, eos or one token of "
                f"its vocabulary{example}"
            )
        special = int(token_id) in set(tokenizer.all_special_ids) | set(tokenizer.added_tokens_decoder)
        # an ordinary piece ("none", "hello") also occurs inside text, where it would read as a document start
        ordinary = "; warning: an ordinary vocabulary token, which text contains too"
        why = "data.anchor" + ("" if special else ordinary)
        return Anchor(spec, int(token_id), why)
    if bos is not None and int(bos) in special_affixes(tokenizer)[0]:
        return Anchor(tokenizer.bos_token, int(bos), "auto: the BOS the tokenizer puts before every text")
    separator = _vocabulary_id(tokenizer, END_OF_TEXT)
    declared = f"; its BOS {tokenizer.bos_token} is not put before text" if bos is not None else ""
    if separator is not None:
        return Anchor(END_OF_TEXT, int(separator), f"auto: the byte-level BPE document separator{declared}")
    if eos is not None:
        return Anchor(tokenizer.eos_token, int(eos), f"auto: the EOS{declared}")
    if bos is not None:
        return Anchor(tokenizer.bos_token, int(bos), "auto: the BOS (the tokenizer has no EOS)")
    raise UserError(
        f"tokenizer '{name}' has neither a BOS nor an EOS token to use as the anchor; set data.anchor to a token"
    )


def anchor_token_id(tokenizer, spec: str = ANCHOR_AUTO) -> int:
    """The id of `resolve_anchor(tokenizer, spec)`."""
    return resolve_anchor(tokenizer, spec).id


def _sentencepiece_model(tok) -> bytes | None:
    """The bytes of the tokenizer's SentencePiece model, or None when it has none (Llama-3, Qwen: byte-level BPE)."""
    # sentencepiece on use (start-up time)
    import sentencepiece as spm

    vocab_file = getattr(tok, "vocab_file", None)
    if not vocab_file or not Path(vocab_file).is_file():
        return None
    blob = Path(vocab_file).read_bytes()
    try:
        spm.SentencePieceProcessor(model_proto=blob)
    except Exception:  # a vocab.json (Qwen) or anything else that is not a SentencePiece model proto
        return None
    return blob


def special_affixes(tok) -> tuple[list[int], list[int]]:
    """The ids the Hugging Face tokenizer puts before and after a text with `add_special_tokens=True` (Llama and
    Mistral: BOS before; Qwen: nothing)."""
    probe = "a"
    body = tok(probe, add_special_tokens=False)["input_ids"]
    full = tok(probe, add_special_tokens=True)["input_ids"]
    for i in range(len(full) - len(body) + 1):
        if full[i : i + len(body)] == body:
            return list(full[:i]), list(full[i + len(body) :])
    raise UserError(
        f"tokenizer '{tok.name_or_path}': its special tokens are not a prefix and suffix of the text's "
        f"ids; it cannot be used for packed pretraining data"
    )


def _canonical(value):
    """A tokenizers pipeline (its JSON) as every tokenizers release writes it: fields a release added are written as
    their default (null, false, an empty list) by the releases after it and absent in files before, and merges went
    from "a b" strings to ["a", "b"] pairs (0.20), so both are dropped or written one way; without this a library
    upgrade would read as a tokenizer edited in place."""
    if isinstance(value, dict):
        kept = {k: _canonical(v) for k, v in value.items() if not (v is None or v is False or v == [] or v == {})}
        if isinstance(kept.get("merges"), list):
            kept["merges"] = [" ".join(m) if isinstance(m, list) else m for m in kept["merges"]]
        return kept
    if isinstance(value, list):
        return [_canonical(v) for v in value]
    return value


class TextEncoder:
    """Text -> token ids, exactly as the model's reference tokenizer gives them with its special tokens split: text
    that spells a special token ("<|endoftext|>", "<|im_start|>", "<s>") is encoded as the text it is, never as that
    token (transformers' `split_special_tokens=True`, tiktoken's `encode_ordinary`; SentencePiece's `encode` always
    did so for its control symbols). Otherwise a document quoting one would hold the anchor, the document separator,
    in its middle. The only special ids are `prefix` and `suffix`, which `encode(specials=True)` adds.

    `kind` is "sentencepiece" (`blob`: the model proto; ids of `SentencePieceProcessor.encode`), "tokenizers" (`blob`:
    the Hugging Face fast tokenizer's JSON) or "pickled" (`blob`: a pickled Hugging Face tokenizer of another kind).
    The blob makes the encoder picklable, so `prepare` ships it to its worker processes, which build the backend once
    (and never import transformers). `threads` is the number of threads one batch uses for SentencePiece (-1: all
    cores); the `tokenizers` pipeline follows TOKENIZERS_PARALLELISM.
    """

    def __init__(self, kind: str, blob: bytes | str, prefix: list[int], suffix: list[int], threads: int = -1):
        self.kind, self.blob, self.prefix, self.suffix, self.threads = kind, blob, prefix, suffix, threads
        self._backend = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_backend": None}

    def with_threads(self, threads: int) -> TextEncoder:
        return TextEncoder(self.kind, self.blob, self.prefix, self.suffix, threads)

    def prompted(self, anchor: Anchor) -> TextEncoder:
        """This encoder with `specials=True` putting `anchor` before a text and nothing after it: a prompt starts
        as every training segment did (for Llama and Mistral the same ids as the tokenizer's own BOS)."""
        return TextEncoder(self.kind, self.blob, [anchor.id], [], self.threads)

    @property
    def backend(self):
        if self._backend is None:
            if self.kind == "sentencepiece":
                # sentencepiece and tokenizers on use (start-up time)
                import sentencepiece as spm

                self._backend = spm.SentencePieceProcessor(model_proto=self.blob)
            elif self.kind == "tokenizers":
                from tokenizers import Tokenizer

                self._backend = Tokenizer.from_str(self.blob)
                self._backend.encode_special_tokens = True  # not serialized with the pipeline: set on every build
            else:
                self._backend = pickle.loads(self.blob)
        return self._backend

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """The ids of each text (int32), without special tokens: what a document contributes to a window."""
        if not texts:
            return []
        if self.kind == "sentencepiece":
            return self.backend.encode(texts, out_type="numpy", num_threads=self.threads)
        if self.kind == "tokenizers":
            # encode_batch_fast (tokenizers >= 0.21) skips the character offsets we do not use
            encode_fn = getattr(self.backend, "encode_batch_fast", self.backend.encode_batch)
            return [np.array(e.ids, dtype=np.int32) for e in encode_fn(texts, add_special_tokens=False)]
        ids = self.backend(texts, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        return [np.array(x, dtype=np.int32) for x in ids]

    def digest(self) -> str:
        """What decides the ids `encode_batch` gives a text (sha256): the SentencePiece model's bytes; the fast
        tokenizer's whole pipeline (normalizer, pre-tokenizer, model, added tokens, post-processor, truncation) but its
        decoder, which only turns ids back into text; for another tokenizer its class and vocabulary, its other rules
        being its class's code (its pickle differs from process to process). A prepared dataset records it: the
        vocabulary fingerprint stays the same when tokenizer.json gains a normalizer, and most documents' ids do not."""
        if self.kind == "sentencepiece":
            rules = self.blob
        elif self.kind == "tokenizers":
            pipeline = json.loads(self.blob)
            for unused in ("decoder", "truncation", "padding"):  # `encode_batch` neither decodes, truncates nor pads
                pipeline.pop(unused, None)
            rules = json.dumps(_canonical(pipeline), sort_keys=True, ensure_ascii=False).encode()
        else:
            cls = type(self.backend)
            vocab = sorted(self.backend.get_vocab().items())
            rules = json.dumps([f"{cls.__module__}.{cls.__qualname__}", vocab], ensure_ascii=False).encode()
        return hashlib.sha256(self.kind.encode() + b"\0" + rules).hexdigest()

    def encode(self, text: str, specials: bool = False) -> list[int]:
        """The ids of one text; `specials`: with the special tokens the model's tokenizer adds to an input (a
        prompt's BOS)."""
        body = self.encode_batch([text])[0].tolist()
        return self.prefix + body + self.suffix if specials else body


def text_encoder(tok) -> TextEncoder:
    """The exact encoder of a loaded Hugging Face tokenizer: SentencePiece when it comes with a SentencePiece model,
    else its own `tokenizers` pipeline (or the tokenizer itself, pickled, when it is not a fast one)."""
    prefix, suffix = special_affixes(tok)
    model = _sentencepiece_model(tok)
    if model is not None:
        return TextEncoder("sentencepiece", model, prefix, suffix)
    backend = getattr(tok, "backend_tokenizer", None) if getattr(tok, "is_fast", False) else None
    if backend is not None:
        return TextEncoder("tokenizers", backend.to_str(), prefix, suffix)
    return TextEncoder("pickled", pickle.dumps(tok), prefix, suffix)


@lru_cache(maxsize=8)
def load_encoder(spec: str) -> TextEncoder:
    """The exact encoder of the tokenizer `spec` names (as `load_tokenizer` takes it)."""
    return text_encoder(load_tokenizer(spec))


def save_tokenizer(tok, directory: Path) -> None:
    """`save_pretrained`, plus the SentencePiece model that transformers does not write back, so the saved directory
    encodes text exactly as `tok` does (an evaluation checkpoint, `hf/step_N/`); its tokenizer_config.json in the
    form transformers 4.x loads too (`compat.transformers.legacy_tokenizer_config`), as vLLM, lm-eval and TGI
    installs often run it."""
    with writing(directory, "the tokenizer"):
        tok.save_pretrained(str(directory))
        config_file = Path(directory) / TOKENIZER_CONFIG
        config = json.loads(config_file.read_text())
        config_file.write_text(
            json.dumps(legacy_tokenizer_config(config), indent=2, sort_keys=True, ensure_ascii=False) + "\n"
        )
        model = _sentencepiece_model(tok)
        if model is not None:
            (Path(directory) / SPM_FILE).write_bytes(model)
