"""Private adaptive clipping: Andrew, Thakkar, McMahan, Ramaswamy, "Differentially Private
Learning with Adaptive Clipping", NeurIPS 2021 (Algorithm 1, geometric update).

Each round every sampled unit reports the bit ``b = [||g|| <= C]``. The sites sum their bits,
add a share of discrete Gaussian noise (so the count is protected like the update itself),
and the count travels through secure aggregation mod ``2**bits``; the server only sees the
noisy total ``b~`` and updates ``C <- C * exp(-lr * (b~ / expected_units - target_quantile))``.
No site reveals a percentile of its norms in the clear.

The count is a one-dimensional query of L2 and L1 sensitivity 1 per unit; its RDP (distributed
discrete Gaussian, KLS 2021) is returned by :meth:`QuantileClipper.round_rdp` and must be
spent on the budget alongside the update's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from dp.accounting import F64, ORDERS, ddg_rdp_fn, integer_rdp
from dp.errors import PrivacyConfigError, TooFewSurvivors
from dp.randomness import RandomSource, SystemRandom
from dp.samplers import discrete_gaussian

U64 = npt.NDArray[np.uint64]


@dataclass
class QuantileClipper:
    """Tracks the clip norm ``C`` toward the ``target_quantile`` of unit norms, privately.

    ``count_stddev`` is the central stddev of the count noise (Andrew et al. suggest about
    ``expected_units / 20``); each of ``threshold`` sites adds ``count_stddev / sqrt(t)``.
    """

    clip_norm: float
    target_quantile: float = 0.5
    learning_rate: float = 0.2
    count_stddev: float = 1.0
    expected_units: float = 1.0
    threshold: int = 1
    bits: int = 32

    def __post_init__(self) -> None:
        if not self.clip_norm > 0:
            raise PrivacyConfigError(f"clip_norm must be > 0, got {self.clip_norm}")
        if not 0 < self.target_quantile < 1:
            raise PrivacyConfigError(f"target_quantile must be in (0, 1), got "
                                     f"{self.target_quantile}")
        if not self.count_stddev > 0 or not self.expected_units > 0:
            raise PrivacyConfigError("count_stddev and expected_units must be > 0")
        if self.threshold < 1 or not 8 <= self.bits <= 64:
            raise PrivacyConfigError("threshold must be >= 1 and bits in [8, 64]")

    @property
    def per_site_variance(self) -> float:
        return self.count_stddev**2 / self.threshold

    def site_share(self, unit_norms: npt.ArrayLike, source: RandomSource | None = None) -> U64:
        """This site's masked-ready count: ``#{||g|| <= C}`` plus its noise share, mod 2**bits."""
        norms = np.asarray(unit_norms, dtype=np.float64)
        count = int(np.count_nonzero(norms <= self.clip_norm))
        noise = int(discrete_gaussian(self.per_site_variance, 1, source or SystemRandom())[0])
        return np.array([(count + noise) % (1 << self.bits)], dtype=np.uint64)

    def update(self, modular_sum: U64, num_included: int) -> float:
        """Apply the geometric update from the securely summed noisy count; returns new C."""
        if num_included < self.threshold:
            raise TooFewSurvivors(
                f"count summed over {num_included} sites < threshold {self.threshold}; skip "
                "the clip update this round"
            )
        v = int(np.asarray(modular_sum, dtype=np.uint64)[0])
        if v >= 1 << (self.bits - 1):
            v -= 1 << self.bits
        fraction = v / self.expected_units
        self.clip_norm *= math.exp(-self.learning_rate * (fraction - self.target_quantile))
        return self.clip_norm

    def round_rdp(self, sample_rate: float, steps: int = 1) -> F64:
        """RDP of the count query (sensitivity 1) with ``threshold`` noise shares."""
        sigma = math.sqrt(self.per_site_variance)
        fn = ddg_rdp_fn(1.0, 1.0, sigma, self.threshold, 1)
        return integer_rdp(fn, sample_rate, steps, ORDERS)
