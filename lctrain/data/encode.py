"""Worker side of `prepare`: raw record batch -> (domain, token ids) or a skip reason per record.

Runs in spawned worker processes, so it imports only what it needs (no transformers): the tokenizer travels as a
`lctrain.tokenizer.TextEncoder` (a SentencePiece model's bytes, or a fast tokenizer's JSON).
"""

from __future__ import annotations

import json
import os

import numpy as np

from lctrain.config import DOMAINS
from lctrain.data.sources import RawBatch, field_at, parse_line
from lctrain.data.synthetic import generate
from lctrain.tokenizer import TextEncoder

OTHER = DOMAINS.index("other")
# SlimPajama's `meta.redpajama_set_name` values; bare domain names are accepted too
REDPAJAMA_SET_NAMES = {
    "RedPajamaCommonCrawl": "CommonCrawl",
    "RedPajamaC4": "C4",
    "RedPajamaGithub": "GitHub",
    "RedPajamaArXiv": "ArXiv",
    "RedPajamaBook": "Book",
    "RedPajamaWikipedia": "Wikipedia",
    "RedPajamaStackExchange": "StackExchange",
}
_DOMAIN_IDS = {name: i for i, name in enumerate(DOMAINS)}
_DOMAIN_IDS.update({set_name: DOMAINS.index(d) for set_name, d in REDPAJAMA_SET_NAMES.items()})

# skip reasons that mean malformed input (strict mode stops on them); `too_short` is a filter, not an error
MALFORMED = ("malformed_json", "no_text", "empty_text", "undecodable")

_encoder: TextEncoder | None = None


def init_worker(encoder: TextEncoder, single_thread: bool = True) -> None:
    """Keep the encoder for this process. One tokenizer thread per worker process: the workers are the parallelism
    (in-process use lets one batch use every core)."""
    global _encoder
    if single_thread:  # a worker process of `prepare`
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        encoder = encoder.with_threads(1)
    _encoder = encoder


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


def _source_record(item, name: str, text_field: str, domain_field: str | None) -> tuple[str | None, str, str | None]:
    """A record of `data.sources`: its text is the value at `text_field` and its domain the value at `domain_field`
    (dotted keys; the domain as text, SlimPajama's set names read as the domains a single source gets,
    `RedPajamaArXiv` -> `ArXiv`), else the source's name."""
    if not isinstance(item, dict):
        return None, name, "malformed_json"
    text, reason = _check_text(field_at(item, text_field))
    domain = field_at(item, domain_field) if domain_field else None
    if domain is None or isinstance(domain, (dict, list)):
        return text, name, reason
    return text, REDPAJAMA_SET_NAMES.get(str(domain), str(domain)), reason


def _parse_line(line: bytes) -> tuple[str | None, int, str | None]:
    obj, reason = parse_line(line)
    return (None, OTHER, reason) if reason else _record(obj)


def _mixed(batch: RawBatch) -> list[tuple[str, int, str | None, tuple[int, str], str | None]]:
    """(file, line, text, (source index, domain name), skip reason) of each record of a `data.sources` batch."""
    out = []
    for source, kind, file, line, item in batch.items:
        name, text_field, domain_field = batch.params["sources"][source]
        if kind == "jsonl":
            item, reason = parse_line(item)
            if reason:
                out.append((file, line, None, (source, name), reason))
                continue
        text, domain, reason = _source_record(item, name, text_field, domain_field)
        out.append((file, line, text, (source, domain), reason))
    return out


def encode_batch(batch: RawBatch) -> list[tuple[str, int, int | tuple[int, str], np.ndarray | None, str | None]]:
    """Per record: (source file or name, line or row number, domain id (for `data.sources` the source's index and
    the domain's name), token ids or None, skip reason or None)."""
    if batch.kind == "mixed":
        recs = _mixed(batch)
        ids = iter(_encoder.encode_batch([t for _, _, t, _, r in recs if r is None]))
        return [(f, n, d, next(ids) if r is None else None, r) for f, n, _, d, r in recs]
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
    ids = iter(_encoder.encode_batch([t for t, _, r in recs if r is None]))
    return [(batch.source, batch.first + j, d, next(ids) if r is None else None, r) for j, (_, d, r) in enumerate(recs)]
