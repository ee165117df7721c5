"""The longest length that fits: the planners' search over a quantity whose memory grows with it."""

from __future__ import annotations

from collections.abc import Callable


def longest_fitting(fits: Callable[[int], bool], lo: int, hi: int, step: int = 1) -> int | None:
    """The largest n of lo, lo + step, ... up to `hi` with `fits(n)`, or None when `fits(lo)` is false. `fits` must
    hold up to some n and fail beyond it (memory grows with the length): the search doubles the distance from `lo`
    until a length fails, then bisects, so it calls `fits` about 2 log2((hi - lo) / step) times."""
    if step < 1 or hi < lo:
        raise ValueError(f"longest_fitting: need step >= 1 and hi >= lo, got lo={lo}, hi={hi}, step={step}")
    if not fits(lo):
        return None
    last = (hi - lo) // step  # the largest k with lo + k * step <= hi
    good, bad = 0, 1  # in steps from lo: fits at `good`; `bad` fails or lies past `last`
    while bad <= last and fits(lo + bad * step):
        good, bad = bad, bad * 2
    bad = min(bad, last + 1)
    while bad - good > 1:
        mid = (good + bad) // 2
        good, bad = (mid, bad) if fits(lo + mid * step) else (good, mid)
    return lo + good * step
