"""The longest length that fits, against a brute-force loop over every candidate."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lctrain.search import longest_fitting


def brute_force(fits, lo: int, hi: int, step: int) -> int | None:
    found = None
    for n in range(lo, hi + 1, step):
        if not fits(n):
            break
        found = n
    return found


@given(
    lo=st.integers(-100, 100),
    span=st.integers(0, 400),
    step=st.integers(1, 9),
    threshold=st.integers(-150, 600),
)
def test_longest_fitting_is_the_brute_force_answer(lo, span, step, threshold):
    calls = []

    def fits(n: int) -> bool:
        calls.append(n)
        return n <= threshold

    hi = lo + span
    got = longest_fitting(fits, lo, hi, step)
    assert got == brute_force(lambda n: n <= threshold, lo, hi, step)
    assert all(lo <= n <= hi and (n - lo) % step == 0 for n in calls)  # only the grid is probed
    assert len(calls) <= 2 * math.log2(span // step + 1) + 3  # doubling then bisection, not a scan


def test_every_length_fits_up_to_the_bound():
    # the bound is inclusive and off the doubling sequence: 1 + 7 steps of 3 -> 22
    assert longest_fitting(lambda n: True, 1, 23, 3) == 22
    assert longest_fitting(lambda n: True, 5, 5) == 5
    assert longest_fitting(lambda n: False, 0, 10) is None


@pytest.mark.parametrize("lo,hi,step", [(0, 10, 0), (0, 10, -1), (5, 4, 1)])
def test_a_bad_range_is_refused(lo, hi, step):
    with pytest.raises(ValueError, match="need step >= 1 and hi >= lo"):
        longest_fitting(lambda n: True, lo, hi, step)
