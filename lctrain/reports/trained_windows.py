"""Which prepared windows runs trained on, and whether their attention modes could differ there.

The four modes differ only in a window that holds more than one document (`lctrain.attention.modes`): in a window of
one document every mode's mask is the causal one, its positions are 0..L-1 (its one anchor, if any, at 0, where
`anchor` puts it), and the labels are the mode-free rule, so runs of different modes that read only such windows
train identically. A window in which some document is cut into interleaved chunks is the one place where
`intra_doc` and `intra_doc_reset` positions differ by more than one offset per document.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from lctrain.config import Config, data_dir, data_fingerprint
from lctrain.data.store import MANIFEST, open_packed
from lctrain.errors import UserError


@dataclass(frozen=True)
class Windows:
    """Windows of one prepared dataset, by row."""

    dataset: Path
    rows: frozenset[int]
    multi_document: frozenset[int]  # rows holding more than one document
    chunked: frozenset[int]  # rows where a document is in several pieces (interleaved chunks)


def trained_windows(cfg: Config, steps: int, run: Path | None = None) -> Windows | str:
    """The windows the first `steps` steps of a run of `cfg` read from its prepared dataset, or why they cannot be
    told. The order is the trainer's (`lctrain.train.data.stream_rows`, seeded by `seed`), never recomputed here. A
    relative dataset path not found from the current directory is looked for under the run directory `run` too (as
    `lctrain eval` does)."""
    # the trainer's data module with its tokenizer imports, on use (start-up time of `lctrain report`)
    from lctrain.train.data import stream_rows

    path = data_dir(cfg)
    if run is not None and not path.is_absolute() and not path.exists() and (run / path).exists():
        path = run / path
    if not (path / MANIFEST).is_file():
        return f"its prepared dataset {path} is not here"
    try:
        packed = open_packed(path)
    except UserError as e:
        return str(e)
    if packed.manifest.data_fingerprint != data_fingerprint(cfg.data):
        return f"{path} was prepared with other data settings than the run's"
    rows = sorted(set(stream_rows(cfg.seed, len(packed), 0, cfg.windows_read(steps))))
    docs = packed.rows.select_columns(["seg_doc"])[rows]["seg_doc"] if rows else []
    return Windows(
        path,
        frozenset(rows),
        frozenset(r for r, d in zip(rows, docs) if len(set(d)) > 1),
        frozenset(r for r, d in zip(rows, docs) if len(set(d)) < len(d)),
    )
