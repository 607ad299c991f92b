"""The patient-idp planner's one root finder (dp/idp_search.py): ``largest`` (in x) and
``largest_log_in`` (in log x, from a warm bracket) both run ``illinois``, and each returns
the largest x whose ``fits(x) <= 0``, to its tolerance, in few evaluations.

The evaluation counts are logical bounds (no clock): regula falsi without the Illinois
halving does not converge in 10^4 steps on a one-sided curve, and without the stall
bisection takes twice the steps on a curve with a flat inflection; both are bounded here so
the planner's cost (every plan runs thousands of these searches over accountant calls)
cannot silently grow. A search past ``CAP`` evaluations fails at once instead of spinning.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dp.idp_search import largest, largest_log, largest_log_in, log_ratio

CAP = 1000


def _counted(fits: Callable[[float], float]) -> tuple[Callable[[float], float], list[float]]:
    calls: list[float] = []

    def f(x: float) -> float:
        calls.append(x)
        assert len(calls) <= CAP, "the search does not converge"
        return fits(x)

    return f, calls


@settings(max_examples=60, deadline=None)
@given(root=st.floats(0.01, 0.99), power=st.sampled_from([0.5, 1.0, 3.0, 9.0]))
def test_largest_finds_the_last_x_that_fits(root: float, power: float) -> None:
    fits, calls = _counted(lambda x: x ** power - root ** power)
    x = largest(fits, 0.0, 1.0, rel=1e-6)
    assert x ** power - root ** power <= 0 and x == pytest.approx(root, rel=2e-6)
    assert len(calls) <= 100


@settings(max_examples=60, deadline=None)
@given(log_root=st.floats(-9.0, 9.0), lo_guess=st.floats(-12.0, 12.0),
       width=st.floats(0.0, 3.0))
def test_largest_log_in_finds_it_from_any_warm_bracket(log_root: float, lo_guess: float,
                                                       width: float) -> None:
    """A guess that misses the root on either side grows (by 4x) until it holds it."""
    root = math.exp(log_root)
    fits, calls = _counted(lambda x: log_ratio(x, root))
    x = largest_log_in(fits, math.exp(lo_guess), math.exp(lo_guess + width), 1e-6, 1e6,
                       rel=1e-6)
    assert log_ratio(x, root) <= 0 and x == pytest.approx(root, rel=2e-6)
    assert len(calls) <= 60


def test_the_bracket_ends_when_all_or_nothing_fits() -> None:
    assert largest(lambda x: -1.0, 0.5, 2.0) == 2.0
    assert largest(lambda x: 1.0, 0.5, 2.0) == 0.0
    assert largest_log(lambda x: -1.0, 1e-3, 10.0) == 10.0
    assert largest_log(lambda x: 1.0, 1e-3, 10.0) == 0.0
    assert largest_log_in(lambda x: x - 5.0, 1e-3, 1e-2, 1e-4, 1.0) == 1.0  # past the limit


def test_the_illinois_step_keeps_a_one_sided_curve_fast() -> None:
    """exp(40 x) is so convex that plain regula falsi moves one end only (no convergence in
    10^4 steps here); halving the stuck end's value converges in 48."""
    fits, calls = _counted(lambda x: math.expm1(40 * (x - 0.3)))
    assert largest(fits, 0.0, 1.0, rel=1e-6) == pytest.approx(0.3, rel=1e-6)
    assert len(calls) <= 60


def test_a_flat_inflection_in_log_x_is_bisected_when_a_step_stalls() -> None:
    """(log x/root)^3 is flat at its root, so secant steps stall there; the search bisects
    whenever a step did not halve the bracket (37 evaluations; 74 without)."""
    root = 3.7
    fits, calls = _counted(lambda x: math.log(x / root) ** 3)
    assert largest_log(fits, 1e-6, 1e6, rel=1e-6) == pytest.approx(root, rel=2e-6)
    assert len(calls) <= 50
