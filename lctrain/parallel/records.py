"""The JSON files the ranks of a run leave in its ranks' directory (how each ended, failed or hung), read back."""

from __future__ import annotations

import json
from pathlib import Path


def read_records(directory: Path, prefix: str) -> list[dict]:
    """Every `PREFIX*.json` record in `directory` that can be read; one torn by its writer's end names nothing."""
    out = []
    for path in Path(directory).glob(f"{prefix}*.json"):
        try:
            out.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return out
