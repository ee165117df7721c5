"""Units of memory. lctrain prints and logs memory in GB (10^9 bytes), as GPU datasheets state it and as `lctrain
plan` budgets it; GiB (2^30 bytes) is the granularity of allocators and of the kernel's page accounting, so a size
meant as "about one allocation-sized block" is written in GiB."""

from __future__ import annotations

GB = 1e9
GiB = 2**30
KiB = 2**10


def to_gb(n_bytes: float) -> float:
    return n_bytes / GB


def to_gib(n_bytes: float) -> float:
    return n_bytes / GiB


def gb_to_bytes(gb: float) -> int:
    return int(gb * GB)
