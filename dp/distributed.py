"""Distributed-mode planning: per-site noise from the threshold, bit width, round cost.

Dropouts (Bonawitz et al. 2017) mean the server sums any surviving set of at least
``threshold`` sites. Each site therefore adds ``1 / threshold`` of the target variance, so the
fewest possible summands still carry the full noise; more survivors only add noise, which is
post-processing for privacy and a utility cost reported as :attr:`NoiseCalibration.cost`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from dp.accounting import F64, ORDERS, integer_rdp, joint_rdp_fn, rdp_to_epsilon
from dp.adaptive_clip import QuantileClipper
from dp.encoding import EncodingParams
from dp.errors import PrivacyConfigError
from dp.mechanisms import mechanism as find_mechanism
from dp.rotation import padded_dim


@dataclass(frozen=True)
class NoiseCalibration:
    """Per-site noise so that any ``threshold`` survivors give ``central_stddev``."""

    central_stddev: float
    per_site_stddev: float
    threshold: int
    num_sites: int

    @property
    def stddev_if_all_survive(self) -> float:
        return self.per_site_stddev * math.sqrt(self.num_sites)

    @property
    def cost(self) -> float:
        """Noise stddev with every site present over the target: ``sqrt(n / t)``."""
        return math.sqrt(self.num_sites / self.threshold)


def calibrate(
    noise_multiplier: float, clip_norm: float, num_sites: int, threshold: int
) -> NoiseCalibration:
    """Target central stddev ``noise_multiplier * clip_norm``, shared by ``threshold`` sites."""
    if not 1 <= threshold <= num_sites:
        raise PrivacyConfigError(
            f"threshold must be in [1, num_sites={num_sites}], got {threshold}"
        )
    if not noise_multiplier >= 0 or not clip_norm > 0:
        raise PrivacyConfigError("noise_multiplier must be >= 0 and clip_norm > 0")
    central = noise_multiplier * clip_norm
    return NoiseCalibration(central, central / math.sqrt(threshold), threshold, num_sites)


@dataclass(frozen=True)
class BitsChoice:
    """The chosen bit width and the tail bound that justifies it."""

    bits: int
    wrap_probability: float
    max_abs_bound: float
    signal_bound: float
    rounding_bound: float
    noise_bound: float


def choose_bits(
    *,
    dim: int,
    clip_norm: float,
    scale: float,
    noise_stddev: float,
    num_sites: int,
    units_per_site: int = 1,
    mechanism: str = "dgauss",
    wrap_probability: float = 2.0**-40,
) -> BitsChoice:
    """Smallest bits such that the modular sum wraps with probability <= ``wrap_probability``.

    Per coordinate of the rotated integer sum, with ``m = num_sites * units_per_site`` units,
    ``D`` the padded dim and ``p' = wrap_probability / (3 D)`` (union bound):
    the rotated signal (norm <= ``m * scale * clip``) is sub-Gaussian with proxy
    ``||x||^2 / D`` (Hoeffding over the random signs; KLS 2021 Lemma 29), the rounding errors
    are ``m`` independent terms of range < 2 (Hoeffding), and the noise of ``num_sites``
    shares is bounded by the mechanism's own tail
    (:meth:`dp.mechanisms.base.IntegerMechanism.tail_bound`). The centred range
    ``[-2**(b-1), 2**(b-1))`` must hold the sum of the three.
    """
    if num_sites < 1 or units_per_site < 1:
        raise PrivacyConfigError("num_sites and units_per_site must be >= 1")
    if not 0 < wrap_probability < 1:
        raise PrivacyConfigError(f"wrap_probability must be in (0, 1), got {wrap_probability}")
    d = padded_dim(dim)
    log_term = math.log(2 * 3 * d / wrap_probability)
    m = num_sites * units_per_site
    signal_norm = m * scale * clip_norm
    a_signal = signal_norm * math.sqrt(2 * log_term / d)
    a_round = math.sqrt(2 * m * log_term)
    var = num_sites * (scale * noise_stddev) ** 2
    a_noise = find_mechanism(mechanism).tail_bound(var, log_term)
    total = a_signal + a_round + a_noise
    bits = max(2, math.ceil(math.log2(total + 1)) + 1)
    if bits > 64:
        raise PrivacyConfigError(
            f"the sum needs {bits} bits (> 64): lower scale (now {scale}), clip_norm or units"
        )
    return BitsChoice(bits, wrap_probability, total, a_signal, a_round, a_noise)


def round_rdp_fn(params: EncodingParams) -> Callable[[int], float] | None:
    """Per-step, unsubsampled RDP of the integer mechanism ``params`` describes (None when no
    bound is known: no noise, or a share below the mechanism's ``min_stddev``, e.g. a
    discrete Gaussian share below 1/2)."""
    mech = find_mechanism(params.mechanism)
    sigma = params.scale * params.noise_stddev
    if sigma <= 0 or sigma < mech.min_stddev:
        return None
    return mech.rdp_fn(params.rounded_l2_bound, params.rounded_l1_bound, sigma,
                       params.threshold, params.encoded_dim)


def round_rdp(
    params: EncodingParams, sample_rate: float, steps: int = 1, orders: Sequence[float] = ORDERS,
    *, clipper: QuantileClipper | None = None,
) -> F64:
    """RDP of ``steps`` rounds of the integer mechanism ``params`` describes.

    Sensitivity is one unit's rounded vector (:attr:`EncodingParams.rounded_l2_bound`), the
    noise is the sum over the ``threshold`` fewest survivors. Without a known bound (no
    noise, or a discrete Gaussian share below the 1/2 its bound assumes) the RDP is infinite:
    such a round never fits a budget. With ``clipper`` the round also releases the adaptive
    clipping count on the same sample: the two are composed, then subsampled once.
    """
    fn = round_rdp_fn(params)
    if fn is None:
        return np.full(len(orders), math.inf)
    if clipper is not None:
        fn = joint_rdp_fn(fn, clipper.count_rdp_fn())
    return integer_rdp(fn, sample_rate, steps, orders)


def round_epsilon(params: EncodingParams, sample_rate: float, steps: int, delta: float) -> float:
    """Epsilon after ``steps`` rounds (see :func:`round_rdp`)."""
    return rdp_to_epsilon(round_rdp(params, sample_rate, steps), delta)


def effective_noise_multiplier(params: EncodingParams) -> float:
    """Central stddev over the rounded sensitivity: the Gaussian-equivalent multiplier."""
    return math.sqrt(params.threshold) * params.scale * params.noise_stddev / (
        params.rounded_l2_bound)


def noise_for_budget(
    template: EncodingParams, epsilon: float, delta: float, sample_rate: float, rounds: int,
    prior_rdp: F64 | None = None, clipper: QuantileClipper | None = None,
) -> EncodingParams:
    """``template`` with the smallest per-site ``noise_stddev`` whose ``rounds`` rounds fit in
    ``epsilon`` under the distributed accounting (bisection to 0.5 %), together with
    ``prior_rdp`` (releases already made, RDP at :data:`dp.accounting.ORDERS`) if given;
    with ``clipper`` every round also releases its adaptive-clipping count, accounted
    jointly (:func:`round_rdp`)."""
    from dataclasses import replace

    prior = 0.0 if prior_rdp is None else np.asarray(prior_rdp, dtype=np.float64)

    def eps(sd: float) -> float:
        rdp = round_rdp(replace(template, noise_stddev=sd), sample_rate, rounds,
                        clipper=clipper)
        return rdp_to_epsilon(prior + rdp, delta)

    hi = template.clip_norm
    while eps(hi) > epsilon:
        hi *= 2
        if hi > 1e6 * template.clip_norm:
            raise PrivacyConfigError("no noise level reaches this epsilon; raise epsilon/delta")
    lo = hi / 2
    while eps(lo) <= epsilon and lo > 1e-9:
        lo /= 2
    while hi / lo > 1.005:
        mid = math.sqrt(lo * hi)
        lo, hi = (lo, mid) if eps(mid) <= epsilon else (mid, hi)
    return replace(template, noise_stddev=hi)
