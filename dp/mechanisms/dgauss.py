"""The distributed discrete Gaussian (Kairouz, Liu, Steinke, ICML 2021).

Each site adds N_Z(0, sigma**2) (:func:`dp.samplers.discrete_gaussian`, CKS 2020). The sum of
``n`` shares satisfies RDP of order ``a`` with (KLS 2021, Prop. 14 / Eq. (17))
``min(a/2 r2**2 + tau d, a/2 (r2**2 + 2 r1 tau + tau**2 d), a/2 (r2 + sqrt(d) tau)**2)``,
``r_p = Delta_p / (sqrt(n) sigma)``, ``tau = 10 sum_{k<n} exp(-2 pi**2 sigma**2 k/(k+1))``;
its first form is the zCDP ``rho = r2**2 / 2``, ``xi = tau d`` of the audit export. The sum is
sub-Gaussian (CKS 2020, Cor. 9), which bounds its tail.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from dp.errors import PrivacyConfigError
from dp.mechanisms.base import I64, IntegerMechanism, register
from dp.randomness import RandomSource
from dp.samplers import discrete_gaussian


def ddg_tau(sigma: float, num_clients: int) -> float:
    """KLS 2021 Thm. 1: ``tau = 10 sum_{k=1}^{n-1} exp(-2 pi^2 sigma^2 k / (k+1))``."""
    return 10.0 * sum(
        math.exp(-2.0 * math.pi**2 * sigma**2 * k / (k + 1)) for k in range(1, num_clients)
    )


def ddg_rdp_fn(
    l2_sensitivity: float, l1_sensitivity: float, sigma: float, num_clients: int, dim: int
) -> Callable[[int], float]:
    """Per-step RDP (as a function of the integer order) of the distributed discrete Gaussian.

    ``sigma`` is each client's integer-domain standard deviation; sensitivities are in the
    integer domain. ``num_clients`` should be the calibration threshold (fewest summands).
    KLS 2021 Thm. 1 (hence this bound) assumes ``sigma >= 1/2``: smaller is refused.
    """
    if not sigma >= 0.5:
        raise PrivacyConfigError(
            f"the distributed discrete Gaussian bound (KLS 2021, Thm. 1) needs each site's "
            f"integer-domain stddev >= 1/2, got {sigma:.4g}: raise the noise or the scale")
    tau = ddg_tau(sigma, num_clients)
    r2 = l2_sensitivity / (math.sqrt(num_clients) * sigma)
    r1 = l1_sensitivity / (math.sqrt(num_clients) * sigma)

    def eps(a: int) -> float:
        return min(
            a / 2 * r2**2 + tau * dim,
            a / 2 * (r2**2 + 2 * r1 * tau + tau**2 * dim),
            a / 2 * (r2 + math.sqrt(dim) * tau) ** 2,
        )

    return eps


class DiscreteGaussian(IntegerMechanism):
    name = "dgauss"
    title = "distributed discrete Gaussian"
    min_stddev = 0.5

    def sample(self, variance: float, n: int, source: RandomSource | None = None) -> I64:
        return discrete_gaussian(variance, n, source)

    def tail_bound(self, variance: float, log_term: float) -> float:
        return math.sqrt(2 * variance * log_term)

    def rdp_fn(self, l2: float, l1: float, sigma: float, threshold: int, dim: int
               ) -> Callable[[int], float]:
        return ddg_rdp_fn(l2, l1, sigma, threshold, dim)

    def zcdp(self, l2: float, l1: float, sigma: float, threshold: int, dim: int
             ) -> tuple[float, float]:
        r2 = l2 / (math.sqrt(threshold) * sigma)
        return r2**2 / 2, ddg_tau(sigma, threshold) * dim


DGAUSS = register(DiscreteGaussian())
