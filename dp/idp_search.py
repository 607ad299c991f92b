"""The one root finder of the patient-idp planner (:mod:`dp.idp`): the largest ``x`` with
``fits(x) <= 0`` for an increasing ``fits``, by regula falsi with the Illinois modification,
in ``x`` (:func:`largest`) or in ``log x`` from a warm bracket (:func:`largest_log_in`)."""

from __future__ import annotations

import math
from collections.abc import Callable


def largest(fits: Callable[[float], float], lo: float, hi: float, rel: float = 1e-4) -> float:
    """Largest x in [lo, hi] with ``fits(x) <= 0`` (``fits`` increasing in x); 0 if none."""
    f_hi = fits(hi)
    if f_hi <= 0:
        return hi
    f_lo = fits(lo)
    if f_lo > 0:
        return 0.0
    return illinois(fits, lo, f_lo, hi, f_hi, tol=rel, relative=True)


def illinois(fits: Callable[[float], float], lo: float, f_lo: float, hi: float, f_hi: float,
              *, tol: float, relative: bool = False, margin: float = 0.0,
              halve_stalls: bool = False) -> float:
    """The one root finder of the planner: the largest ``x`` in the bracket with ``fits(x)
    <= 0``, given ``f_lo <= 0 < f_hi`` (``fits`` increasing), to ``hi - lo <= tol`` (times
    ``hi`` when ``relative``). Regula falsi with the Illinois modification (the bracket
    shrinks from both sides); a step within ``margin`` of an end, or (``halve_stalls``) one
    after a step that did not halve the bracket, bisects instead (a kinked curve)."""
    side, width = 0, hi - lo
    while hi - lo > (tol * hi if relative else tol):
        x = hi - f_hi * (hi - lo) / (f_hi - f_lo)
        if not lo + margin < x < hi - margin or (halve_stalls and hi - lo > width / 2):
            x = (lo + hi) / 2
        width = hi - lo
        f_x = fits(x)
        if f_x <= 0:
            lo, f_lo = x, f_x
            if side == -1:
                f_hi /= 2
            side = -1
        else:
            hi, f_hi = x, f_x
            if side == 1:
                f_lo /= 2
            side = 1
    return lo


def largest_log(fits: Callable[[float], float], lo: float, hi: float,
                 rel: float = 1e-3) -> float:
    """Largest x in [lo, hi] (0 < lo <= hi) with ``fits(x) <= 0`` (``fits`` increasing), to
    a relative ``rel``; 0 if none."""
    return largest_log_in(fits, lo, hi, lo, hi, rel)


def largest_log_in(fits: Callable[[float], float], lo_guess: float, hi_guess: float,
                    lo_limit: float, hi_limit: float, rel: float = 1e-3, grow: float = 4.0
                    ) -> float:
    """:func:`largest_log` in [``lo_limit``, ``hi_limit``] from a warm bracket
    ``[lo_guess, hi_guess]`` (a guess: it grows by ``grow`` until it holds the answer).
    :func:`illinois` in log x."""
    lo, hi = max(lo_limit, min(lo_guess, hi_limit)), min(hi_limit, max(hi_guess, lo_limit))
    f_hi = fits(hi)
    while f_hi <= 0:
        if hi >= hi_limit:
            return hi
        lo, hi = hi, min(hi_limit, hi * grow)
        f_hi = fits(hi)
    f_lo = fits(lo) if lo < hi else f_hi
    while f_lo > 0:
        if lo <= lo_limit:
            return 0.0
        hi, f_hi = lo, f_lo
        lo = max(lo_limit, lo / grow)
        f_lo = fits(lo)
    tol = math.log1p(rel)
    return math.exp(illinois(lambda u: fits(math.exp(u)), math.log(lo), f_lo, math.log(hi),
                              f_hi, tol=tol, margin=tol / 4, halve_stalls=True))


def log_ratio(value: float, target: float) -> float:
    """``log(value / target)``, finite (an increasing score for the searches)."""
    if value <= 0:
        return -50.0
    if not math.isfinite(value):
        return 50.0
    return max(-50.0, min(50.0, math.log(value / target)))
