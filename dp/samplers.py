"""Exact integer noise samplers driven by a cryptographic source.

* :func:`discrete_gaussian` -- Canonne, Kamath, Steinke, "The Discrete Gaussian for
  Differential Privacy", NeurIPS 2020, Algorithms 1-3 (rejection from a discrete Laplace).
* :func:`poisson` -- rejection from a discrete Laplace centred at ``floor(lam)``; the Poisson
  pmf is log-concave, so the acceptance ratio is bounded and its maximum is found exactly.
* :func:`skellam` -- Agarwal, Kairouz, Liu, "The Skellam Mechanism for Differentially
  Private Federated Learning", NeurIPS 2021: the difference of two independent Poissons.

Why these are exact although they run in float64 (the argument the tests rely on):
every random decision is either a uniform integer from :func:`dp.randomness.uniform_below`
(exact by rejection) or a coin ``Bernoulli(exp(-gamma))`` decided as ``U < exp(-gamma)`` for a
uniform real ``U`` whose first 53 bits come from the source. The float64 value of
``exp(-gamma)`` is trusted only outside a margin that bounds its rounding error (a few ulps of
the terms of ``gamma``, plus 2**-40); a draw whose 53-bit interval meets the margin is
decided by :func:`dp._exact.resolve`, which extends ``U`` bit by bit and compares with a
rigorously bracketed high-precision ``exp(-gamma)``. So every coin has exactly the
probability ``exp(-gamma)``, and the rejection samplers inherit exactness from their proofs.
The fallback runs with probability about 1e-11 per coin (1e-7 for large Poisson means).
Vectorization only changes the order in which independent coins are drawn.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from decimal import Decimal, localcontext
from fractions import Fraction
from typing import cast

import numpy as np
import numpy.typing as npt

from dp._exact import ExactGamma, ln_factorial, rational_gamma, resolve
from dp.randomness import RandomSource, SystemRandom, uniform_below, uniform_words

I64 = npt.NDArray[np.int64]
F64 = npt.NDArray[np.float64]
Bools = npt.NDArray[np.bool_]

_TWO53 = float(2**53)
_BASE_MARGIN = 2.0**-40


def bernoulli_exp(
    source: RandomSource,
    gamma: F64,
    gamma_err: F64 | float,
    exact: Callable[[int], ExactGamma],
) -> Bools:
    """Independent coins with ``P[True] = exp(-gamma[i])`` exactly (CKS 2020, the role of Alg. 1).

    ``gamma_err`` bounds the absolute float error of ``gamma``; ``exact(i)`` returns the
    high-precision evaluator of ``gamma[i]`` used when the float comparison is undecided.
    """
    n = gamma.size
    k = (uniform_words(source, n) >> np.uint64(11)).astype(np.float64)  # 53 uniform bits
    e = np.exp(-gamma)
    margin = np.asarray(gamma_err, dtype=np.float64) + _BASE_MARGIN
    u_lo = k / _TWO53
    u_hi = (k + 1.0) / _TWO53
    yes = u_hi <= e - margin
    no = u_lo >= e + margin
    out = yes.copy()
    for i in np.flatnonzero(~(yes | no)):
        out[i] = resolve(int(k[i]), 53, exact(int(i)), source)
    return out


def _geometric_exp1(source: RandomSource, n: int) -> I64:
    """Successes of Bernoulli(exp(-1)) before the first failure: P[V >= k] = exp(-k)."""
    v = np.zeros(n, dtype=np.int64)
    active = np.arange(n)
    one = rational_gamma(Fraction(1))
    while active.size:
        coin = bernoulli_exp(source, np.ones(active.size), 0.0, lambda _i: one)
        v[active[coin]] += 1
        active = active[coin]
    return v


def discrete_laplace(source: RandomSource, scale: int, n: int) -> I64:
    """Exact discrete Laplace, ``P[x] ∝ exp(-|x| / scale)`` (CKS 2020, Algorithm 2)."""
    if scale < 1:
        raise ValueError(f"scale must be a positive integer, got {scale}")
    out = np.empty(n, dtype=np.int64)
    pending = np.arange(n)
    while pending.size:
        m = pending.size
        u = uniform_below(source, scale, m).astype(np.int64)
        g = u / scale

        def exact_u(i: int, u: I64 = u) -> ExactGamma:
            return rational_gamma(Fraction(int(u[i]), scale))

        d = bernoulli_exp(source, g, 1e-15 * g, exact_u)
        x = u + scale * _geometric_exp1(source, m)
        b = (uniform_words(source, m) & np.uint64(1)).astype(bool)
        ok = d & ~(b & (x == 0))
        y = np.where(b, -x, x)
        out[pending[ok]] = y[ok]
        pending = pending[~ok]
    return out


def discrete_gaussian(sigma2: float, n: int, source: RandomSource | None = None) -> I64:
    """``n`` exact draws of the discrete Gaussian N_Z(0, sigma2) (CKS 2020, Algorithm 3).

    ``sigma2`` is the variance parameter (the true variance is within 1e-9 of it once
    sigma2 >= 1, CKS 2020 Prop. 5). It is used as the exact binary fraction it is stored as.
    """
    if not sigma2 > 0 or not math.isfinite(sigma2):
        raise ValueError(f"sigma2 must be a positive finite float, got {sigma2}")
    source = source or SystemRandom()
    s2 = Fraction(sigma2)
    t = math.isqrt(math.floor(s2)) + 1  # floor(sigma) + 1, computed exactly
    out = np.empty(n, dtype=np.int64)
    pending = np.arange(n)
    while pending.size:
        y = discrete_laplace(source, t, pending.size)
        g = (np.abs(y) - sigma2 / t) ** 2 / (2.0 * sigma2)
        err = 1e-14 * (g + 1.0)

        def exact(i: int, y: I64 = y) -> ExactGamma:
            return rational_gamma((abs(int(y[i])) - s2 / t) ** 2 / (2 * s2))

        c = bernoulli_exp(source, g, err, exact)
        out[pending[c]] = y[c]
        pending = pending[~c]
    return out


class _PoissonEnvelope:
    """Rejection of a discrete Laplace proposal ``floor(lam) + L(t)`` onto Poisson(lam).

    ``g(k) = k ln lam - lam - ln k! + |k - c| / t`` is the log ratio target/proposal up to a
    constant. It is concave on each side of ``c`` (``ln k!`` is convex), so its maximum is at
    the sign change of the discrete slope; ``g_max`` is that maximum, evaluated rigorously
    and rounded up, so ``exp(g(k) - g_max) <= 1`` for every ``k``.
    """

    def __init__(self, lam: float) -> None:
        self.lam = lam
        self.lam_q = Fraction(lam)
        self.c = math.floor(lam)
        self.t = max(1, round(math.sqrt(lam)))
        k_right = max(self.c, math.ceil(lam * math.exp(1.0 / self.t)) - 1)
        k_left = min(self.c, max(0, math.ceil(lam * math.exp(-1.0 / self.t)) - 1))
        candidates = {self.c, *range(k_left - 2, k_left + 3), *range(k_right - 2, k_right + 3)}
        upper = max(self._g_decimal(k, 40)[0] + self._g_decimal(k, 40)[1]
                    for k in candidates if k >= 0)
        self.g_max = float(upper) + 1e-9 * (1.0 + abs(float(upper)))
        self.log_lam = math.log(lam)

    def _g_decimal(self, k: int, prec: int) -> tuple[Decimal, Decimal]:
        lf, lf_err = ln_factorial(k, prec)
        with localcontext() as ctx:
            ctx.prec = prec + 10
            lam = Decimal(self.lam_q.numerator) / Decimal(self.lam_q.denominator)
            log_lam = lam.ln()
            dist = Decimal(abs(k - self.c)) / Decimal(self.t)
            g = k * log_lam - lam - lf + dist
            err = lf_err + (k * abs(log_lam) + abs(lam) + dist + 1) * Decimal(10) ** (2 - prec)
        return g, err

    def gamma_exact(self, k: int) -> ExactGamma:
        def exact(prec: int) -> tuple[Decimal, Decimal]:
            g, err = self._g_decimal(k, prec)
            with localcontext() as ctx:
                ctx.prec = prec + 10
                return Decimal(self.g_max) - g, err

        return exact


_lgamma = np.frompyfunc(math.lgamma, 1, 1)


def poisson(lam: float, n: int, source: RandomSource | None = None) -> I64:
    """``n`` exact Poisson(lam) draws (see the module docstring for the exactness argument)."""
    if not lam > 0 or not math.isfinite(lam) or lam > 2.0**40:
        raise ValueError(f"lam must be a positive float below 2**40, got {lam}")
    source = source or SystemRandom()
    env = _PoissonEnvelope(lam)
    out = np.empty(n, dtype=np.int64)
    pending = np.arange(n)
    while pending.size:
        k = env.c + discrete_laplace(source, env.t, pending.size)
        valid = k >= 0
        kk = np.where(valid, k, 0)
        lf = cast(npt.NDArray[np.object_], _lgamma(kk + 1.0)).astype(np.float64)
        term = kk * env.log_lam
        dist = np.abs(kk - env.c) / env.t
        g = env.g_max - (term - lam - lf + dist)
        err = 1e-13 * (np.abs(term) + lam + lf + dist + abs(env.g_max) + 1.0)

        def exact_k(i: int, kk: I64 = kk) -> ExactGamma:
            return env.gamma_exact(int(kk[i]))

        c = bernoulli_exp(source, np.maximum(g, 0.0), err, exact_k)
        ok = valid & c
        out[pending[ok]] = k[ok]
        pending = pending[~ok]
    return out


def skellam(variance: float, n: int, source: RandomSource | None = None) -> I64:
    """``n`` exact symmetric Skellam draws with the given variance: Pois(v/2) - Pois(v/2).

    The Skellam mechanism of Agarwal, Kairouz, Liu 2021 (Definition 2.1 with mu = v / 2).
    Sums of independent Skellams are Skellam, so per-site shares add up exactly.
    """
    source = source or SystemRandom()
    lam = variance / 2.0
    return poisson(lam, n, source) - poisson(lam, n, source)

