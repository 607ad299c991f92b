"""Private adaptive clipping: Andrew, Thakkar, McMahan, Ramaswamy, "Differentially Private
Learning with Adaptive Clipping", NeurIPS 2021 (Algorithm 1, geometric update).

Each round every sampled unit reports the bit ``b = [||g|| <= C]``, centred as in the paper:
it contributes ``b - 1/2`` (sensitivity 1/2), carried as the integer ``2b - 1`` with twice the
noise so it stays in the integer domain. The sites sum these, add a share of discrete Gaussian
noise (so the count is protected like the update itself), and the sum travels through secure
aggregation mod ``2**bits``; the server only sees the noisy total and updates
``C <- C * exp(-lr * (b~ - target_quantile))`` with ``b~ = noisy sum / expected_units + 1/2``.
No site reveals a percentile of its norms in the clear.

The count is answered on the *same* Poisson sample as the update, so its cost is not a
separately subsampled curve: the two unsubsampled mechanisms compose and are subsampled once
(:func:`dp.accounting.joint_rdp_fn`; :func:`dp.distributed.round_rdp` with ``clipper=``).
For the Gaussian (site mode) that is Andrew et al.'s Thm. 1,
:func:`dp.accounting.adaptive_clip_noise_multiplier`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from dp.errors import PrivacyConfigError, TooFewSurvivors
from dp.mechanisms.dgauss import DGAUSS
from dp.randomness import RandomSource, SystemRandom
from secagg.crypto import MAX_BITS, MIN_BITS

U64 = npt.NDArray[np.uint64]

COUNT_MECHANISM = DGAUSS
"""The noise of the clip count (the audit export describes the count by it)."""


@dataclass
class QuantileClipper:
    """Tracks the clip norm ``C`` toward the ``target_quantile`` of unit norms, privately.

    ``count_stddev`` is the central stddev of the noise on the centred count (Andrew et al.
    suggest about ``expected_units / 20``); on the integer ``2b - 1`` scale each of
    ``threshold`` sites adds stddev ``2 count_stddev / sqrt(t)``, which must be >= 1/2.
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
        if self.threshold < 1 or not MIN_BITS <= self.bits <= MAX_BITS:
            raise PrivacyConfigError(f"threshold must be >= 1 and bits in [{MIN_BITS}, "
                                     f"{MAX_BITS}]")
        if self.per_site_variance < 0.25:
            raise PrivacyConfigError(
                f"each site's count noise stddev {math.sqrt(self.per_site_variance):.3g} is "
                "below 1/2 (the discrete Gaussian bound's assumption): raise count_stddev")

    @property
    def per_site_variance(self) -> float:
        """Each site's noise variance on the integer ``2b - 1`` scale."""
        return (2 * self.count_stddev) ** 2 / self.threshold

    def site_share(self, unit_norms: npt.ArrayLike, source: RandomSource | None = None) -> U64:
        """This site's masked-ready count ``sum(2b - 1)`` plus its noise share, mod 2**bits."""
        norms = np.asarray(unit_norms, dtype=np.float64)
        count = 2 * int(np.count_nonzero(norms <= self.clip_norm)) - norms.size
        noise = int(COUNT_MECHANISM.sample(self.per_site_variance, 1, source or SystemRandom())[0])
        return np.array([(count + noise) % (1 << self.bits)], dtype=np.uint64)

    def update(self, modular_sum: U64, num_included: int, units: float | None = None) -> float:
        """Apply the geometric update from the securely summed noisy count; returns new C.
        ``units``: the round's number of counted units if a release of the same run gives
        it (a noised count: post-processing), else :attr:`expected_units`."""
        if num_included < self.threshold:
            raise TooFewSurvivors(
                f"count summed over {num_included} sites < threshold {self.threshold}; skip "
                "the clip update this round"
            )
        v = int(np.asarray(modular_sum, dtype=np.uint64)[0])
        if v >= 1 << (self.bits - 1):
            v -= 1 << self.bits
        fraction = v / 2 / max(units or self.expected_units, 1.0) + 0.5
        self.clip_norm *= math.exp(-self.learning_rate * (fraction - self.target_quantile))
        return self.clip_norm

    def count_rdp_fn(self) -> Callable[[int], float]:
        """Per-step unsubsampled RDP of the count (sensitivity 1 on the ``2b - 1`` scale);
        compose it with the update's before subsampling (:func:`dp.distributed.round_rdp`)."""
        return COUNT_MECHANISM.rdp_fn(1.0, 1.0, math.sqrt(self.per_site_variance),
                                      self.threshold, 1)
