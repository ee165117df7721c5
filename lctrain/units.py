"""Units of memory. lctrain prints and logs memory in GB (10^9 bytes), as GPU datasheets state it and as `lctrain
plan` budgets it; GiB (2^30 bytes) is the granularity of allocators and of the kernel's page accounting, so a size
meant as "about one allocation-sized block" is written in GiB."""

from __future__ import annotations

from lctrain.errors import UserError

GB = 1e9
GiB = 2**30
KiB = 2**10


def to_gb(n_bytes: float) -> float:
    return n_bytes / GB


def gb_to_bytes(gb: float) -> int:
    return int(gb * GB)


# A petabyte per GPU or node: larger is a typo (1e300 overflowed the byte count into a traceback)
MAX_OPTION_GB = 1e6


def option_gb_to_bytes(gb: float, option: str) -> int:
    """A memory size the user gave in GB (`option` names where, e.g. `--gpu-mem`), in bytes; refused in one line
    unless > 0 and at most `MAX_OPTION_GB`."""
    if not 0 < gb <= MAX_OPTION_GB:
        raise UserError(f"{option} = {gb}: expected a memory size in GB, > 0 and at most {MAX_OPTION_GB:,.0f}")
    return gb_to_bytes(gb)
