"""Content checksums of the files lctrain writes and verifies on open (a prepared dataset's shards, an evaluation
export's files): xxh3-128, which hashes ~8 GiB/s from memory, so checking a file costs what reading it costs.

A file has two: of every byte, and of its first and last `EDGE_BYTES`. The second is what an open checks when
reading everything would cost more than it should (a large dataset on every rank's start); a missing, truncated,
zeroed or swapped file still differs there (an Arrow file's tail is its last record batch and footer; a safetensors
file's head is its header and first tensors, which training changes).
"""

from __future__ import annotations

from pathlib import Path

import xxhash

from lctrain.units import GiB

XXH3 = r"^xxh3_128:[0-9a-f]{32}$"
EDGE_BYTES = 1 << 20
# Up to this many bytes an open checks every byte; above, the edges (a large dataset's start on every rank).
FULL_VERIFY_BYTES = GiB
_READ_BLOCK = 8 << 20


def digest(data: bytes) -> str:
    """The checksum format (`XXH3`) of `data`."""
    return f"xxh3_128:{xxhash.xxh3_128_hexdigest(data)}"


def file_checksums(path: Path, full: bool = True) -> tuple[str | None, str]:
    """(checksum of every byte or None, checksum of the first and last EDGE_BYTES) of a file, in one pass."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        if full:
            h = xxhash.xxh3_128()
            head = b""
            while block := f.read(_READ_BLOCK):
                h.update(block)
                if len(head) < EDGE_BYTES:
                    head += block[: EDGE_BYTES - len(head)]
            whole = f"xxh3_128:{h.hexdigest()}"
        else:
            whole, head = None, f.read(EDGE_BYTES)
        f.seek(max(size - EDGE_BYTES, 0))
        return whole, digest(head + f.read(EDGE_BYTES))
