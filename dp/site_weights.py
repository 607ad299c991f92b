"""Heterogeneity-aware site weights computed from DP releases only (the private form of
DP-FedAvg+'s weights; docs/privacy.md, "DP-FedAvg+ privately").

The paper's weights ``w_k = exp(-lambda W1(P_k, P_bar))`` use each site's raw distribution
``P_k`` of a scalar of its data: the weight is a function of raw data, and a site that scales
its update by it changes *all* its patients' contributions when one patient changes (the
sensitivity of the weighted sum is then no longer one patient's clipped row). Here:

1. **Release.** Each site releases once, before training, a histogram of a public-range
   scalar of its patients on a public grid (``bins`` cells, one patient in exactly one
   cell), plus its patient count, each cell with discrete Gaussian noise of stddev
   ``noise_stddev`` (CKS 2020). One patient changes one cell and the count by 1 (add/remove),
   or two cells by 1 (replace-one): the L2 sensitivity is ``sqrt(2)`` either way, and the
   release is the Gaussian mechanism of noise multiplier ``noise_stddev / sqrt(2)``
   (:meth:`HistogramRelease.event`; a patient is in one site only, so one event covers every
   site's release). It is charged to the run's budget before anything is released and the
   training rounds are calibrated to compose with it (``prior=``).
2. **Weights, by post-processing.** ``P_k`` is site k's noised histogram clamped at 0 and
   normalised, ``P_bar`` the normalised sum of all the noised histograms; ``W1`` is the
   1-Wasserstein distance on the grid's public cell centres; ``w_k = exp(-lambda (W1_k -
   min_j W1_j))`` clipped to ``[w_min, w_max]`` (:func:`site_weights`). Nothing but the
   releases enters, so the weights are public and cost nothing more.
3. **Use.** Each site scales its own clipped unit rows by ``w_k`` before masking; the round's
   encoding clip (its sensitivity) and noise are those of ``w_max`` times the clip
   (:class:`fl.codec.DistributedCodec`, ``max_weight``), so a site with a small weight is
   never under-noised, and a weight above ``w_max`` is refused by the site.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from dp.accounting import _bisect_noise, integer_rdp, rdp_to_epsilon
from dp.budget import RdpRound
from dp.errors import PrivacyConfigError
from dp.mechanisms.dgauss import DGAUSS
from dp.randomness import RandomSource, SystemRandom

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]

#: One patient moves one cell and the count (add/remove) or two cells (replace-one) by 1.
HISTOGRAM_L2 = math.sqrt(2.0)
HISTOGRAM_L1 = 2.0


@dataclass(frozen=True)
class HistogramRelease:
    """One noised histogram plus count per site, on a public grid of ``bins`` cells."""

    bins: int
    noise_stddev: float
    epsilon_target: float | None = None

    def __post_init__(self) -> None:
        if self.bins < 1:
            raise PrivacyConfigError(f"the histogram needs at least 1 cell, got {self.bins}")
        if not (self.noise_stddev >= 0.5 and math.isfinite(self.noise_stddev)):
            raise PrivacyConfigError(
                f"the histogram's noise stddev {self.noise_stddev:g} is below 1/2 (the "
                "discrete Gaussian bound's assumption): raise it or lower the epsilon share")

    @property
    def noise_multiplier(self) -> float:
        """Noise stddev over the L2 sensitivity ``sqrt(2)``."""
        return self.noise_stddev / HISTOGRAM_L2

    def event(self) -> RdpRound:
        """The release's budget event: one unsubsampled (discrete) Gaussian of sensitivity
        ``sqrt(2)``, described for the audit export as a zCDP release (:mod:`dp.audit`)."""
        fn = DGAUSS.rdp_fn(HISTOGRAM_L2, HISTOGRAM_L1, self.noise_stddev, 1, self.bins + 1)
        spec = {"sample_rate": 1.0, "steps": 1.0, "l2": HISTOGRAM_L2, "l1": HISTOGRAM_L1,
                "sigma": self.noise_stddev, "threshold": 1.0, "dim": float(self.bins + 1)}
        return RdpRound.from_array(integer_rdp(fn, 1.0, 1), DGAUSS.name, spec)

    def release(self, cells: npt.ArrayLike, source: RandomSource | None = None) -> I64:
        """A site's release: ``[noised count per cell..., noised patient count]`` from its
        patients' cell indices (one per patient, each in ``[0, bins)``)."""
        index = np.asarray(cells, dtype=np.int64).reshape(-1)
        if index.size and (index.min() < 0 or index.max() >= self.bins):
            raise PrivacyConfigError(f"a patient's cell is outside the public grid of "
                                     f"{self.bins} cells: clip the scalar to the grid first")
        counts = np.append(np.bincount(index, minlength=self.bins), index.size)
        noise = DGAUSS.sample(self.noise_stddev**2, self.bins + 1,
                                  source or SystemRandom())
        return (counts + noise).astype(np.int64)


def release_for_budget(epsilon: float, delta: float, bins: int) -> HistogramRelease:
    """The release whose own epsilon at ``delta`` is ``epsilon`` (smallest noise, to
    1e-4): the share of the run's budget the planner gives the weights."""
    if not (epsilon > 0 and math.isfinite(epsilon)):
        raise PrivacyConfigError(f"the weights' epsilon share must be > 0, got {epsilon}")

    def fits(z: float) -> bool:
        sigma = max(z * HISTOGRAM_L2, 0.5)
        event = HistogramRelease(bins, sigma).event()
        return rdp_to_epsilon(event.rdp(), delta) <= epsilon

    z = _bisect_noise(fits, epsilon)
    return HistogramRelease(bins, max(z * HISTOGRAM_L2, 0.5), epsilon)


def wasserstein1(p: F64, q: F64, centres: F64) -> float:
    """W1 between two distributions on the same sorted support ``centres``."""
    cdf = np.cumsum(np.asarray(p, dtype=np.float64) - np.asarray(q, dtype=np.float64))
    return float(np.sum(np.abs(cdf[:-1]) * np.diff(np.asarray(centres, dtype=np.float64))))


def _distribution(noised_cells: F64) -> F64:
    clamped = np.maximum(np.asarray(noised_cells, dtype=np.float64), 0.0)
    total = clamped.sum()
    return clamped / total if total > 0 else np.full(clamped.size, 1.0 / clamped.size)


def site_weights(releases: Mapping[int, npt.ArrayLike], centres: npt.ArrayLike, *,
                 strength: float, min_weight: float, max_weight: float) -> dict[int, float]:
    """Each site's weight from the releases alone (module docstring, step 2): ``strength``
    is lambda, per unit of the scalar's W1."""
    if not (strength >= 0 and math.isfinite(strength)):
        raise PrivacyConfigError(f"the weights' lambda must be >= 0, got {strength}")
    if not 0 < min_weight <= max_weight or not math.isfinite(max_weight):
        raise PrivacyConfigError(f"site weights need 0 < w_min <= w_max, got "
                                 f"[{min_weight}, {max_weight}]")
    grid = np.asarray(centres, dtype=np.float64)
    cells = {k: np.asarray(v, dtype=np.float64)[:grid.size] for k, v in releases.items()}
    if not cells or any(c.size != grid.size for c in cells.values()):
        raise PrivacyConfigError(f"every release needs {grid.size} cells (the public grid)")
    pooled = _distribution(np.sum([np.maximum(c, 0.0) for c in cells.values()], axis=0))
    distance = {k: wasserstein1(_distribution(c), pooled, grid) for k, c in cells.items()}
    nearest = min(distance.values())
    return {k: float(np.clip(math.exp(-strength * (d - nearest)), min_weight, max_weight))
            for k, d in distance.items()}


def released_units(releases: Mapping[int, npt.ArrayLike]) -> float:
    """The noised patient count over all sites (the releases' last entries; at least 1)."""
    return max(1.0, float(sum(float(np.asarray(v)[-1]) for v in releases.values())))


__all__ = ["HISTOGRAM_L1", "HISTOGRAM_L2", "HistogramRelease", "release_for_budget",
           "released_units", "site_weights", "wasserstein1"]
