"""Rigorous high-precision arithmetic for the rare undecided coin of the exact samplers.

The samplers in :mod:`dp.samplers` decide almost every Bernoulli(exp(-gamma)) coin in float64
with a safety margin; when a uniform draw falls inside the margin they call :func:`resolve`,
which keeps drawing bits of the same uniform and compares them with ``exp(-gamma)`` computed
in :mod:`decimal` at growing precision with a proven error bound, until the comparison is
decided. Decimal's ``exp`` and ``ln`` are correctly rounded, which is what the bounds use.
"""

from __future__ import annotations

from collections.abc import Callable
from decimal import Decimal, localcontext
from fractions import Fraction

from dp.randomness import RandomSource

#: ``exact(prec) -> (gamma, err)``: gamma to ``prec`` digits and a bound on its absolute error.
ExactGamma = Callable[[int], tuple[Decimal, Decimal]]

# B_2 .. B_22 (Bernoulli numbers) for the Stirling series of ln Gamma.
_BERNOULLI = [
    Fraction(1, 6), Fraction(-1, 30), Fraction(1, 42), Fraction(-1, 30), Fraction(5, 66),
    Fraction(-691, 2730), Fraction(7, 6), Fraction(-3617, 510), Fraction(43867, 798),
    Fraction(-174611, 330),
]
_B22 = Fraction(854513, 138)


def _pi(prec: int) -> Decimal:
    """pi to ``prec`` digits (the series recipe of the :mod:`decimal` documentation)."""
    with localcontext() as ctx:
        ctx.prec = prec + 5
        three = Decimal(3)
        lasts, t, s, n, na, d, da = Decimal(0), three, three, 1, 0, 0, 24
        while s != lasts:
            lasts = s
            n, na = n + na, na + 8
            d, da = d + da, da + 32
            t = (t * n) / d
            s += t
        return +s


def ln_factorial(k: int, prec: int) -> tuple[Decimal, Decimal]:
    """``ln k!`` and a bound on its absolute error, at ``prec`` significant digits.

    Small ``k``: a sum of correctly rounded logarithms. Large ``k``: the Stirling series of
    ``ln Gamma(z)`` with ten Bernoulli terms, whose remainder is bounded by the first omitted
    term ``|B_22| / (22 * 21 * z**21)``; ``z`` is shifted up until that is below 10**-prec.
    """
    with localcontext() as ctx:
        ctx.prec = prec + 10
        ulp = Decimal(10) ** (3 - prec)
        if k < 64:
            total = sum((Decimal(j).ln() for j in range(2, k + 1)), Decimal(0))
            return total, (abs(total) + k) * ulp
        z = Decimal(k + 1)
        zmin = int(Decimal(10) ** Decimal((prec + 2) / 21)) + 1
        shift = max(0, zmin - (k + 1))
        correction = sum((Decimal(k + 1 + i).ln() for i in range(shift)), Decimal(0))
        z = Decimal(k + 1 + shift)
        value = (z - Decimal("0.5")) * z.ln() - z + (2 * _pi(prec + 10)).ln() / 2
        for j, b in enumerate(_BERNOULLI, start=1):
            value += Decimal(b.numerator) / Decimal(b.denominator) / (
                2 * j * (2 * j - 1) * z ** (2 * j - 1)
            )
        remainder = Decimal(_B22.numerator) / Decimal(_B22.denominator) / (22 * 21 * z**21)
        total = value - correction
        err = remainder + (abs(value) + abs(correction) + shift + 30) * ulp
        return total, err


def rational_gamma(value: Fraction) -> ExactGamma:
    """An :data:`ExactGamma` for a rational gamma (a correctly rounded division)."""

    def exact(prec: int) -> tuple[Decimal, Decimal]:
        with localcontext() as ctx:
            ctx.prec = prec
            g = Decimal(value.numerator) / Decimal(value.denominator)
        return g, abs(g) * Decimal(10) ** (1 - prec) + Decimal(10) ** (-prec - 5)

    return exact


def resolve(prefix: int, nbits: int, exact: ExactGamma, source: RandomSource) -> bool:
    """Decide ``U < exp(-gamma)`` exactly, given the first ``nbits`` bits of ``U`` (``prefix``).

    ``U`` lies in ``[prefix, prefix + 1) / 2**nbits``. While that interval straddles the
    proven bracket of ``exp(-gamma)``, draw 64 more bits of ``U`` and 20 more digits of
    ``gamma``. Terminates with probability one; each loop shrinks the ambiguity 2**64-fold.
    """
    prec = 40
    while True:
        g, err = exact(prec)
        with localcontext() as ctx:
            ctx.prec = prec
            rel = Decimal(10) ** (1 - prec)
            e_lo = (-(g + err)).exp() * (1 - rel)
            e_hi = (-(g - err)).exp() * (1 + rel)
        lo, hi = Fraction(prefix, 2**nbits), Fraction(prefix + 1, 2**nbits)
        if hi <= Fraction(e_lo):
            return True
        if lo >= Fraction(e_hi):
            return False
        prefix = (prefix << 64) | int.from_bytes(source.random_bytes(8), "big")
        nbits += 64
        prec += 20
