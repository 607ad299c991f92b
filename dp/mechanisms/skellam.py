"""The Skellam mechanism (Agarwal, Kairouz, Liu, NeurIPS 2021).

Each site adds Pois(v/2) - Pois(v/2) (:func:`dp.samplers.skellam`); sums of Skellams are
Skellam, so the shares of ``n`` sites are one Skellam of total variance ``V = n sigma**2``.
RDP of order ``a`` (Thm. 3.5): ``a Delta_2**2/(2V) + min(((2a-1) Delta_2**2 + 6 Delta_1)/(4
V**2), 3 Delta_1/(2V))``, hence the zCDP ``rho = Delta_2**2 / (2V)``, ``xi = 3 Delta_1 / (2V)``
of the audit export. The sum is sub-gamma (Bernstein), which bounds its tail.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from dp.mechanisms.base import I64, IntegerMechanism, register
from dp.randomness import RandomSource
from dp.samplers import skellam


def skellam_rdp_fn(
    l2_sensitivity: float, l1_sensitivity: float, variance: float
) -> Callable[[int], float]:
    """Per-step RDP of the (multi-dimensional) Skellam mechanism with total ``variance``."""
    d2, d1, v = l2_sensitivity, l1_sensitivity, variance

    def eps(a: int) -> float:
        return a * d2**2 / (2 * v) + min(((2 * a - 1) * d2**2 + 6 * d1) / (4 * v**2),
                                         3 * d1 / (2 * v))

    return eps


class Skellam(IntegerMechanism):
    name = "skellam"
    title = "distributed Skellam"

    def sample(self, variance: float, n: int, source: RandomSource | None = None) -> I64:
        return skellam(variance, n, source)

    def tail_bound(self, variance: float, log_term: float) -> float:
        # Bernstein: a^2 / (2 (V + a/3)) >= log_term
        return log_term / 3 + math.sqrt((log_term / 3) ** 2 + 2 * variance * log_term)

    def rdp_fn(self, l2: float, l1: float, sigma: float, threshold: int, dim: int
               ) -> Callable[[int], float]:
        return skellam_rdp_fn(l2, l1, threshold * sigma**2)

    def zcdp(self, l2: float, l1: float, sigma: float, threshold: int, dim: int
             ) -> tuple[float, float]:
        v = threshold * sigma**2
        return l2**2 / (2 * v), 3 * l1 / (2 * v)


SKELLAM = register(Skellam())
