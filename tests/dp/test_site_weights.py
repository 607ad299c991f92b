"""DP-FedAvg+'s site weights from DP releases (dp/site_weights.py): the histogram release's
sensitivity and accounting against dp-accounting, W1 against scipy, and weights that are a
function of the releases alone."""

from __future__ import annotations

import math

import numpy as np
import pytest

from dp.accounting import ORDERS, rdp_to_epsilon
from dp.errors import PrivacyConfigError
from dp.randomness import SeededRandom
from dp.site_weights import (
    HISTOGRAM_L2,
    HistogramRelease,
    release_for_budget,
    site_weights,
    wasserstein1,
)

CENTRES = tuple(k + 0.5 for k in range(11))


def test_one_patient_moves_the_release_by_the_accounted_sensitivity() -> None:
    """Add/remove and replace-one neighbours differ by L2 sqrt(2) before the noise (the same
    noise draws on both sides), the sensitivity the event is charged at."""
    plan = HistogramRelease(bins=11, noise_stddev=3.0)
    cells = np.array([0, 1, 1, 4, 10, 3])
    base = plan.release(cells, SeededRandom(7))
    for neighbour in (cells[:-1], np.append(cells, 5), np.r_[cells[:-1], 9]):
        moved = plan.release(neighbour, SeededRandom(7))
        assert np.linalg.norm(moved - base) <= HISTOGRAM_L2 + 1e-12
    with pytest.raises(PrivacyConfigError, match="outside the public grid"):
        plan.release(np.array([11]))


def test_release_epsilon_equals_dp_accounting_gaussian() -> None:
    """The release is charged as a Gaussian of noise multiplier sigma / sqrt(2): dp-accounting
    computes the same epsilon, alone and composed with 30 Gaussian rounds."""
    dp_accounting = pytest.importorskip("dp_accounting")
    plan = release_for_budget(1.0, 1e-5, 11)
    assert rdp_to_epsilon(plan.event().rdp(), 1e-5) == pytest.approx(1.0, rel=2e-3)
    gaussian = dp_accounting.GaussianDpEvent(plan.noise_stddev / math.sqrt(2))
    alone = dp_accounting.rdp.RdpAccountant(list(ORDERS)).compose(gaussian)
    assert alone.get_epsilon(1e-5) == pytest.approx(1.0, rel=1e-2)
    rounds = dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(4.0), 30)
    both = dp_accounting.rdp.RdpAccountant(list(ORDERS)).compose(
        dp_accounting.ComposedDpEvent([gaussian, rounds]))
    ours = plan.event().rdp() + 30 * np.array([a / (2 * 16.0) for a in
                                               (max(2, math.ceil(o)) for o in ORDERS)])
    # ours rounds fractional orders up (an upper bound): never below, within 1 %
    assert both.get_epsilon(1e-5) <= rdp_to_epsilon(ours, 1e-5) <= both.get_epsilon(1e-5) * 1.01


def test_wasserstein_matches_scipy() -> None:
    stats = pytest.importorskip("scipy.stats")
    rng = np.random.default_rng(3)
    for _ in range(5):
        p, q = rng.random(11), rng.random(11)
        p, q = p / p.sum(), q / q.sum()
        expected = stats.wasserstein_distance(CENTRES, CENTRES, p, q)
        assert wasserstein1(p, q, np.array(CENTRES)) == pytest.approx(expected, rel=1e-9)


def test_weights_read_other_sites_only_through_their_releases() -> None:
    """Changing site 1's raw data (same noise draws) changes site 1's release and nothing
    else the weights read: the other sites' releases are the same integers; the paper's
    weights of the raw histograms move with the raw data itself."""
    plan = HistogramRelease(bins=11, noise_stddev=2.0)
    sites = {1: np.array([0, 1, 1, 2, 3] * 8), 2: np.array([4, 5, 6, 9, 10] * 8),
             3: np.array([1, 2, 2, 3] * 10)}
    other = {**sites, 1: np.array([0, 0, 2, 2, 3] * 8)}
    before = {k: plan.release(v, SeededRandom(k)) for k, v in sites.items()}
    after = {k: plan.release(v, SeededRandom(k)) for k, v in other.items()}
    assert not np.array_equal(before[1], after[1])
    assert all(np.array_equal(before[k], after[k]) for k in (2, 3))
    options = {"strength": 1.0, "min_weight": 0.3, "max_weight": 1.0}
    weights = site_weights(before, CENTRES, **options)
    assert all(0.3 <= w <= 1.0 for w in weights.values()) and max(weights.values()) == 1.0
    raw_before = site_weights({k: np.bincount(v, minlength=11) for k, v in sites.items()},
                              CENTRES, **options)
    raw_after = site_weights({k: np.bincount(v, minlength=11) for k, v in other.items()},
                             CENTRES, **options)
    assert raw_before != raw_after
    with pytest.raises(PrivacyConfigError, match="w_min <= w_max"):
        site_weights(before, CENTRES, strength=1.0, min_weight=1.0, max_weight=0.5)
