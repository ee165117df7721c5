"""A prepared dataset's `manifest.json`: one typed record (`Manifest`), written by `write_manifest` and read only by
`load_manifest`, which refuses any damage in one line naming the file.

Reading checks, in this order: the file is JSON and says `complete`; its format version is this lctrain's (or an
older one whose encoder wrote the same windows, `_STILL_CURRENT`; a later one, or fields this lctrain does not know,
under a checksum that covers them, is a newer lctrain's dataset: `Newer`, not damage); every key is there with its
type and domain (pydantic, strict: `"5"` is not a number) and the record agrees with itself (shard rows add up to
`num_windows`, the anchor is the tokenizer's); and its content matches the checksum it was written with, so an
edited or bit-flipped value that still has the right type is caught too. The shards themselves are checked against
the records here by `lctrain.data.store`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from lctrain import __version__
from lctrain.checksums import XXH3, digest
from lctrain.files import replace_file

# 5: document text that spells a special token ("<|endoftext|>") is encoded as text (before, the "tokenizers" and
# "pickled" encoders gave the special token's id: the anchor or a chat marker inside a document).
# 4: every shard record carries content checksums and the manifest its own (before, only the shard sizes).
# 3: a SentencePiece model's ids are SentencePiece's own (before, those of transformers' converted tokenizer), and an
# interleaved document's later chunks in a window carry no anchor or tag (before, both were repeated on every chunk).
FORMAT_VERSION = 5
MANIFEST = "manifest.json"
DATA_SUBDIR = "data"
CHECKSUM_KEY = "checksum"
_FORMAT_CHANGES = {
    4: "in which document text spelling a special token, such as <|endoftext|>, became that token's id",
    3: "without shard checksums, so damage to its shards cannot be detected",
    2: "whose token ids (SentencePiece tokenizers) or interleaved-chunk layout this lctrain no longer trains on",
    1: "whose token ids (SentencePiece tokenizers) or interleaved-chunk layout this lctrain no longer trains on",
}
# Older formats whose datasets hold what this lctrain writes, by the `TokenizerRecord.encoder` that wrote them:
# SentencePiece always encoded control symbols in text as text, so rebuilding its format-4 datasets (hours for a 128K
# recipe's 2B tokens) would only write the same bytes again.
_STILL_CURRENT = {4: ("sentencepiece",)}
_HEX64 = r"^[0-9a-f]{64}$"


class Damaged(Exception):
    """Why a directory does not hold a usable prepared dataset: one line that starts with the file at fault."""


class Outdated(Damaged):
    """A whole dataset of a format this lctrain does not read."""


class Newer(Damaged):
    """A whole dataset written by a newer lctrain: of a later format, or with fields this one does not know, under a
    checksum that covers them (`_written_whole`; without one they are an edit: damage). Rebuilding it would throw
    away the newer build: the remedy is the newer lctrain."""


class _Record(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


class ShardRecord(_Record):
    file: str = Field(pattern=rf"^{DATA_SUBDIR}/shard-\d{{5}}\.arrow$")
    num_windows: int = Field(ge=1)
    bytes: int = Field(ge=0)
    checksum: str = Field(pattern=XXH3, description="of the whole file")
    edge_checksum: str = Field(pattern=XXH3, description="of its first and last EDGE_BYTES (checksums.file_checksums)")


class TokenizerRecord(_Record):
    spec: str
    name: str
    vocab_size: int = Field(ge=1)
    fingerprint: str = Field(min_length=1)  # lctrain.tokenizer.tokenizer_fingerprint: perplexity checks it
    encoder: str
    anchor_id: int = Field(ge=0)
    bos_id: int | None
    eos_id: int | None


class AnchorRecord(_Record):
    token: str
    id: int = Field(ge=0)


class Manifest(_Record):
    """Everything `prepare` records, in the order it writes it. The descriptive sections (statistics, source, build)
    are plain mappings: reports read them, training does not."""

    format_version: int
    complete: bool
    data_fingerprint: str = Field(pattern=_HEX64)
    config_fingerprint: str = Field(pattern=_HEX64)
    seq_len: int = Field(ge=1)
    num_windows: int = Field(ge=1)
    num_tokens: int = Field(ge=1)
    mixture: str
    token_budget: int = Field(ge=1)
    domain_tags: bool
    interleave_chunks: bool
    short_doc_tokens: int = Field(ge=1)
    down_sample_ratio: float = Field(ge=0.0, le=1.0)
    domains: list[str] = Field(min_length=1)
    tokenizer: TokenizerRecord
    anchor: AnchorRecord
    tags: dict[str, list[int]] | None
    seed: int
    shuffle: dict[str, Any]
    stats: dict[str, Any]
    skipped: dict[str, Any]
    mixture_dropped: dict[str, int]
    source: dict[str, Any]
    source_exhausted: bool
    dropped_tail_tokens: int = Field(ge=0)
    dropped_tail_by_domain: dict[str, int]
    shards: list[ShardRecord] = Field(min_length=1)
    build: dict[str, Any]
    # how input_ids are stored (`store.token_dtype`); datasets prepared before 2026-11-27 stored int32 and say nothing
    token_dtype: Literal["uint16", "int32"] = "int32"
    # what decided the ids (`TextEncoder.digest`): prepare refuses to call the dataset prepared once the tokenizer
    # encodes otherwise (edited in place). At the top level, not in `tokenizer`: an lctrain that does not know it then
    # reads a newer lctrain's dataset, not damage to rebuild. Datasets prepared before it was kept say nothing.
    tokenizer_digest: str | None = Field(default=None, pattern=_HEX64)

    @model_validator(mode="after")
    def _consistent(self):
        rows = sum(s.num_windows for s in self.shards)
        if rows != self.num_windows:
            raise ValueError(f"the shards hold {rows:,} windows, num_windows says {self.num_windows:,}")
        if self.num_tokens != self.num_windows * self.seq_len:
            raise ValueError(f"num_tokens {self.num_tokens:,} is not num_windows x seq_len")
        if self.anchor.id != self.tokenizer.anchor_id:
            raise ValueError(f"anchor id {self.anchor.id} is not the tokenizer's anchor_id {self.tokenizer.anchor_id}")
        for i, s in enumerate(self.shards):
            if s.file != shard_file(i):
                raise ValueError(f"shard {i} is {s.file}, not {shard_file(i)}")
        return self


def shard_file(index: int) -> str:
    """The `index`-th shard's path inside the dataset directory."""
    return f"{DATA_SUBDIR}/shard-{index:05d}.arrow"


def manifest_checksum(raw: dict) -> str:
    """The checksum of a manifest's fields (`raw`, without the checksum itself), as stored under CHECKSUM_KEY."""
    return digest(json.dumps(raw, sort_keys=True, separators=(",", ":")).encode())


def write_manifest(directory: Path, manifest: Manifest) -> None:
    """Write `manifest` (validated again, so a hand-built one is held to the reader's rules) with its checksum."""
    raw = Manifest.model_validate(manifest.model_dump()).model_dump(mode="json")
    raw[CHECKSUM_KEY] = manifest_checksum(raw)
    replace_file(directory / MANIFEST, json.dumps(raw, indent=2, sort_keys=False) + "\n", "the dataset manifest")


def _first_error(e: ValidationError) -> str:
    err = e.errors()[0]
    where = ".".join(str(p) for p in err["loc"])
    msg = err["msg"].removeprefix("Value error, ")
    more = f" (and {e.error_count() - 1} more)" if e.error_count() > 1 else ""
    return f"{where}: {msg}{more}" if where else f"{msg}{more}"


def _written_whole(raw: dict) -> bool:
    """Whether `raw` (a manifest's object, its checksum included) holds what its checksum covers: what a newer
    lctrain wrote, where a hand edit would not be."""
    return raw.get(CHECKSUM_KEY) == manifest_checksum({k: v for k, v in raw.items() if k != CHECKSUM_KEY})


def load_manifest(directory: Path) -> Manifest:
    """The manifest of the dataset at `directory`, or `Damaged` saying in one line what is wrong with it."""
    path = Path(directory) / MANIFEST
    try:
        raw = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise Damaged(f"{MANIFEST} is missing") from None
    except OSError as e:
        raise Damaged(f"{MANIFEST} cannot be read ({e.strerror or e})") from None
    except ValueError as e:  # UnicodeDecodeError is one too
        raise Damaged(f"{MANIFEST} is not valid JSON ({e})") from None
    if not isinstance(raw, dict) or raw.get("complete") is not True:
        raise Damaged(f"{MANIFEST} is incomplete (prepare did not finish) or not a prepared dataset's")
    version = raw.get("format_version")
    if isinstance(version, int) and not isinstance(version, bool) and version > FORMAT_VERSION and _written_whole(raw):
        raise Newer(
            f"{MANIFEST}: written by a newer lctrain (dataset format {version}; lctrain {__version__} reads format "
            f"{FORMAT_VERSION} and older)"
        )
    encoder = raw["tokenizer"].get("encoder") if isinstance(raw.get("tokenizer"), dict) else None
    still_current = isinstance(version, int) and encoder in _STILL_CURRENT.get(version, ())
    if version != FORMAT_VERSION and not still_current:
        why = _FORMAT_CHANGES.get(version) if isinstance(version, int) else None
        raise Outdated(
            f"{MANIFEST}: it is of dataset format {version}, {why}"
            if why
            else f"{MANIFEST}: dataset format version {version!r} is not {FORMAT_VERSION}"
        )
    claimed = raw.pop(CHECKSUM_KEY, None)
    unknown = sorted(set(raw) - set(Manifest.model_fields))
    if unknown and _written_whole(raw | {CHECKSUM_KEY: claimed}):
        raise Newer(
            f"{MANIFEST}: written by a newer lctrain (fields {', '.join(unknown)}, which lctrain {__version__} does "
            f"not know)"
        )
    try:
        manifest = Manifest.model_validate(raw)
    except ValidationError as e:
        raise Damaged(f"{MANIFEST}: {_first_error(e)}") from None
    if claimed != manifest_checksum(raw):
        raise Damaged(
            f"{MANIFEST}: its content does not match its {CHECKSUM_KEY} (edited or damaged after prepare wrote it)"
        )
    return manifest
