"""Worker side of `prepare`: raw record batch -> (domain, token ids) or a skip reason per record.

Runs in spawned worker processes, so it imports only what it needs (no transformers): a fast tokenizer travels as
its `tokenizers` JSON, any other one pickled.
"""

from __future__ import annotations

import json
import os
import pickle
import signal

import numpy as np

from lctrain.config import DOMAINS
from lctrain.data.sources import RawBatch
from lctrain.data.synthetic import generate
from lctrain.lifetime import exit_with_parent

OTHER = DOMAINS.index("other")
# SlimPajama's `meta.redpajama_set_name` values; bare domain names are accepted too
REDPAJAMA_SET_NAMES = {
    "RedPajamaCommonCrawl": "CommonCrawl", "RedPajamaC4": "C4", "RedPajamaGithub": "GitHub",
    "RedPajamaArXiv": "ArXiv", "RedPajamaBook": "Book", "RedPajamaWikipedia": "Wikipedia",
    "RedPajamaStackExchange": "StackExchange",
}
_DOMAIN_IDS = {name: i for i, name in enumerate(DOMAINS)}
_DOMAIN_IDS.update({set_name: DOMAINS.index(d) for set_name, d in REDPAJAMA_SET_NAMES.items()})

# skip reasons that mean malformed input (strict mode stops on them); `too_short` is a filter, not an error
MALFORMED = ("malformed_json", "no_text", "empty_text", "undecodable")

_tokenizer = None


def tokenizer_payload(tok) -> tuple[str, object]:
    backend = getattr(tok, "backend_tokenizer", None) if getattr(tok, "is_fast", False) else None
    if backend is not None:
        return ("fast", backend.to_str())
    return ("pickled", pickle.dumps(tok))


def init_worker(payload: tuple[str, object], single_thread: bool = True) -> None:
    """Build the tokenizer once per process. One tokenizer thread per worker process: the workers are the
    parallelism (in-process use leaves the tokenizer's own threading as the caller configured it)."""
    global _tokenizer
    if single_thread:  # a worker process of `prepare`
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle (it shuts the pool down)
        exit_with_parent()  # and if the parent is killed, nobody is left to read our results
    kind, blob = payload
    if kind == "fast":
        from tokenizers import Tokenizer

        _tokenizer = Tokenizer.from_str(blob)
    else:
        _tokenizer = pickle.loads(blob)


def _encode(texts: list[str]) -> list[np.ndarray]:
    if not texts:
        return []
    if hasattr(_tokenizer, "encode_batch"):
        # encode_batch_fast (tokenizers >= 0.21) skips the character offsets we do not use
        encode_fn = getattr(_tokenizer, "encode_batch_fast", _tokenizer.encode_batch)
        return [np.array(e.ids, dtype=np.int32) for e in encode_fn(texts, add_special_tokens=False)]
    ids = _tokenizer(texts, add_special_tokens=False)["input_ids"]
    return [np.array(x, dtype=np.int32) for x in ids]


def domain_of(meta) -> int:
    """`meta.redpajama_set_name` (or a bare domain name) -> domain id; anything else is `other`."""
    if isinstance(meta, str):
        try:
            meta = json.loads(meta)
        except (ValueError, RecursionError):
            return _DOMAIN_IDS.get(meta, OTHER)
    if isinstance(meta, dict):
        name = meta.get("redpajama_set_name")
        if isinstance(name, str):
            return _DOMAIN_IDS.get(name, OTHER)
    return OTHER


def _check_text(text) -> tuple[str | None, str | None]:
    if not isinstance(text, str):
        return None, "no_text"
    if not text.strip():
        return None, "empty_text"
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates from JSON escapes
        return None, "undecodable"
    return text, None


def _record(item) -> tuple[str | None, int, str | None]:
    if not isinstance(item, dict):
        return None, OTHER, "malformed_json"
    text, reason = _check_text(item.get("text"))
    return text, domain_of(item.get("meta")), reason


def _parse_line(line: bytes) -> tuple[str | None, int, str | None]:
    try:
        s = line.decode("utf-8").removeprefix("\ufeff")  # a byte-order mark opens files saved by some editors
    except UnicodeDecodeError:
        return None, OTHER, "undecodable"
    if not s.strip():
        return None, OTHER, "blank_line"
    try:
        obj = json.loads(s)
    except (ValueError, RecursionError):  # RecursionError: nesting deeper than the parser's stack ('[' * 200000)
        return None, OTHER, "malformed_json"
    return _record(obj)


def encode_batch(batch: RawBatch) -> tuple[str, list[tuple[int, int, np.ndarray | None, str | None]]]:
    """The batch's source name and, per record, (line or row number, domain id, token ids or None, skip reason or
    None)."""
    if batch.kind == "synthetic":
        p = batch.params
        recs = []
        for i in batch.items:
            text, domain = generate(p["seed"], i, p["median_words"], p["max_words"], p["long_doc_fraction"])
            recs.append((text, _DOMAIN_IDS[domain], None))
    elif batch.kind == "jsonl":
        recs = [_parse_line(line) for line in batch.items]
    else:
        recs = [_record(item) for item in batch.items]
    ids = iter(_encode([t for t, _, r in recs if r is None]))
    return batch.source, [(batch.first + j, d, next(ids) if r is None else None, r) for j, (_, d, r) in enumerate(recs)]
