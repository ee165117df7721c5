"""An evaluation export's `export.json`: the step it holds and the size and content checksums of every file
`checkpoint.write_export` wrote beside it (weight shards and their index, config, tokenizer, anchor, model card; for
training's `save_hf` and `lctrain export` alike), so that `lctrain eval` scores each export under its own step.
Without it, two exports' weights swapped (or one copied over another) load, score and are reported under each
other's names: the files are valid, only their place is wrong.

Written last, inside the export's staging directory (the export appears whole or not at all); verified on open by
`verify_export`, which refuses any difference in one line naming the file. Files added beside them later are not
its concern.
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from lctrain import checksums
from lctrain.checksums import XXH3, file_checksums
from lctrain.errors import UserError, writing

EXPORT_RECORD = "export.json"


class FileRecord(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    bytes: int = Field(ge=0)
    checksum: str = Field(pattern=XXH3, description="of every byte")
    edge_checksum: str = Field(pattern=XXH3, description="of its first and last EDGE_BYTES")


class ExportRecord(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    step: int = Field(ge=0, description="the optimizer step whose weights the export holds")
    files: dict[str, FileRecord] = Field(min_length=1, description="by name, every file of the export but this one")


def write_export_record(directory: Path, step: int) -> Path:
    """Record `step` and the checksums of every file in `directory` (call after all of them are written)."""
    files = {}
    for f in sorted(p for p in Path(directory).iterdir() if p.is_file() and p.name != EXPORT_RECORD):
        whole, edges = file_checksums(f)
        files[f.name] = FileRecord(bytes=f.stat().st_size, checksum=whole, edge_checksum=edges)
    out = Path(directory) / EXPORT_RECORD
    with writing(out, "the export record"):
        out.write_text(ExportRecord(step=step, files=files).model_dump_json(indent=1) + "\n")
    return out


def read_export_record(directory: Path) -> ExportRecord | None:
    """The record in `directory`, None when there is none; a damaged one is refused in one line."""
    path = Path(directory) / EXPORT_RECORD
    if not path.is_file():
        return None
    try:
        return ExportRecord.model_validate(json.loads(path.read_text()))
    except ValueError as e:  # JSON, decoding and pydantic's ValidationError alike
        if isinstance(e, ValidationError):
            first = e.errors()[0]
            why = ": ".join(filter(None, (".".join(map(str, first["loc"])), first["msg"])))
        else:
            why = type(e).__name__
        raise UserError(
            f"{path}: not an export record ({why}); restore it, or delete it to evaluate the files as they are"
        ) from None


def verify_export(directory: Path, step: int | None) -> bool:
    """Refuse an export whose files are not the ones its record lists, or which holds another step than `step`
    (None: the directory is not named by a step). False when it has no record (a model not exported by lctrain, or
    exported before exports were recorded): there is nothing to check it against."""
    directory = Path(directory)
    record = read_export_record(directory)
    if record is None:
        return False
    if step is not None and record.step != step:
        raise UserError(
            f"{directory}/{EXPORT_RECORD}: records step {record.step}, not {step} (exports renamed or swapped); "
            f"restore the export, or delete {directory} to evaluate the others"
        )
    full = sum(f.bytes for f in record.files.values()) <= checksums.FULL_VERIFY_BYTES
    for name, expected in record.files.items():
        f = directory / name
        if not f.is_file():
            raise UserError(f"{f}: missing (the export wrote it); restore it, or delete {directory}")
        size = f.stat().st_size
        if size != expected.bytes:
            raise UserError(f"{f}: {size:,} bytes, not the {expected.bytes:,} the export wrote; restore the export")
        whole, edges = file_checksums(f, full)
        if edges != expected.edge_checksum or (whole is not None and whole != expected.checksum):
            raise UserError(
                f"{f}: not the file this export wrote (checksum differs: from another export, edited or damaged); "
                f"restore it, or, to evaluate the export as it now is, delete its {EXPORT_RECORD}"
            )
    return True
