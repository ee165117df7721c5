"""Units of memory. lctrain prints and logs memory in GB (10^9 bytes), as GPU datasheets state it and as `lctrain
plan` budgets it; GiB (2^30 bytes) is the granularity of allocators and of the kernel's page accounting, so a size
meant as "about one allocation-sized block" is written in GiB."""

from __future__ import annotations

import math

from lctrain.errors import UserError

GB = 1e9
GiB = 2**30
KiB = 2**10


def to_gb(n_bytes: float) -> float:
    return n_bytes / GB


def gb_to_bytes(gb: float) -> int:
    return int(gb * GB)


def option_gb_to_bytes(gb: float, option: str) -> int:
    """A memory size the user gave in GB (`option` names where, e.g. `--gpu-mem`), in bytes; refused in one line
    unless finite and > 0."""
    if not 0 < gb < math.inf:
        raise UserError(f"{option} = {gb}: expected a memory size in GB, finite and > 0")
    return gb_to_bytes(gb)
