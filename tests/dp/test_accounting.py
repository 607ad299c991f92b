"""Accounting cross-checks: Opacus vs dp-accounting vs independent numerics vs papers."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
from scipy import integrate, stats

pytest.importorskip("opacus")

from dp.accounting import (
    ORDERS,
    gaussian_epsilon,
    gaussian_rdp,
    noise_multiplier_for,
    rdp_to_epsilon,
    rounds_for,
    subsampled_rdp,
)
from dp.distributed import round_epsilon
from dp.encoding import EncodingParams
from dp.mechanisms.dgauss import ddg_rdp_fn
from dp.mechanisms.skellam import skellam_rdp_fn

TABLE = [  # (q, z, steps, delta)
    (0.01, 4.0, 10_000, 1e-5),
    (256 / 60_000, 1.1, 14_062, 1e-5),
    (0.05, 2.0, 500, 1e-6),
    (0.2, 1.5, 50, 1e-5),
    (1.0, 5.0, 20, 1e-5),
]


@pytest.mark.parametrize(("q", "z", "steps", "delta"), TABLE)
def test_rdp_matches_dp_accounting(q: float, z: float, steps: int, delta: float) -> None:
    dpa = pytest.importorskip("dp_accounting")
    event = dpa.SelfComposedDpEvent(
        dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(z)), steps)
    theirs = dpa.rdp.RdpAccountant().compose(event).get_epsilon(delta)
    ours = gaussian_epsilon(z, q, steps, delta, "rdp")
    assert ours == pytest.approx(theirs, rel=0.01)


@pytest.mark.parametrize(("q", "z", "steps", "delta"), TABLE[:3])
def test_prv_matches_dp_accounting_pld(q: float, z: float, steps: int, delta: float) -> None:
    dpa = pytest.importorskip("dp_accounting")
    event = dpa.SelfComposedDpEvent(
        dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(z)), steps)
    theirs = dpa.pld.PLDAccountant().compose(event).get_epsilon(delta)
    ours = gaussian_epsilon(z, q, steps, delta, "prv")
    assert ours == pytest.approx(theirs, rel=0.03)
    assert ours <= gaussian_epsilon(z, q, steps, delta, "rdp")  # PRV is tighter than RDP


def test_abadi_et_al_2016_published_figure() -> None:
    """Abadi et al. 2016, Sec. 3.1: q=0.01, sigma=4, 10^4 steps, delta=1e-5: eps ~ 1.26 with
    the moments accountant; RDP with the improved conversion must be at most that."""
    eps = gaussian_epsilon(4.0, 0.01, 10_000, 1e-5)
    assert 0.9 < eps <= 1.26


def _sampled_gaussian_rdp_numeric(q: float, z: float, alpha: float) -> float:
    """Independent: integrate E_{mu0}[(mu/mu0)^alpha] for the sampled Gaussian (Mironov 2019)."""
    def integrand(x: float) -> float:
        ratio = (1 - q) + q * math.exp((2 * x - 1) / (2 * z * z))
        return stats.norm.pdf(x, scale=z) * ratio**alpha
    value, _ = integrate.quad(integrand, -40 * z, 40 * z, limit=400)
    return math.log(value) / (alpha - 1)


@pytest.mark.parametrize(("q", "z", "alpha"), [(0.01, 1.0, 2), (0.1, 2.0, 8), (0.5, 3.0, 5.5)])
def test_opacus_rdp_matches_numerical_integration(q: float, z: float, alpha: float) -> None:
    ours = float(gaussian_rdp(z, q, 1, orders=[alpha])[0])
    assert ours == pytest.approx(_sampled_gaussian_rdp_numeric(q, z, alpha), rel=1e-4)


def test_rdp_conversion_matches_opacus() -> None:
    from opacus.accountants.analysis.rdp import get_privacy_spent
    rdp = gaussian_rdp(1.3, 0.02, 700)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs, _ = get_privacy_spent(orders=list(ORDERS), rdp=rdp, delta=1e-5)
    assert rdp_to_epsilon(rdp, 1e-5) == pytest.approx(float(theirs), rel=1e-9)


def test_planner_directions_are_consistent() -> None:
    z = noise_multiplier_for(2.0, 1e-5, 0.02, 300)
    assert gaussian_epsilon(z, 0.02, 300, 1e-5) <= 2.0
    assert gaussian_epsilon(z * 0.98, 0.02, 300, 1e-5) > 2.0  # smallest, to 2 %
    r = rounds_for(2.0, 1e-5, 0.02, z)
    assert r >= 300
    assert gaussian_epsilon(z, 0.02, r, 1e-5) <= 2.0 < gaussian_epsilon(z, 0.02, r + 1, 1e-5)


# --- integer mechanisms ----------------------------------------------------------------
def _renyi(p: np.ndarray, q: np.ndarray, alpha: int) -> float:
    mask = (p > 1e-150) & (q > 1e-150)  # the dropped tails carry < 1e-100 mass
    logs = alpha * np.log(p[mask]) + (1 - alpha) * np.log(q[mask])
    top = logs.max()
    return float(top + np.log(np.exp(logs - top).sum())) / (alpha - 1)


def _dgauss_pmf(sigma2: float, support: np.ndarray) -> np.ndarray:
    w = np.exp(-(support.astype(float) ** 2) / (2 * sigma2))
    return w / w.sum()


@pytest.mark.parametrize(("sigma", "n", "shift"), [(0.6, 3, 1), (1.0, 4, 2), (2.0, 5, 3)])
def test_ddg_bound_dominates_exact_divergence_of_the_summed_noise(
        sigma: float, n: int, shift: int) -> None:
    """Independent check of KLS 2021 Prop. 14 in one dimension: convolve n discrete
    Gaussians exactly and compute the Renyi divergence to its shift by Delta."""
    support = np.arange(-60, 61)
    one = _dgauss_pmf(sigma**2, support)
    total = one
    for _ in range(n - 1):
        total = np.convolve(total, one)
    shifted = np.concatenate([np.zeros(shift), total[:-shift]])
    bound = ddg_rdp_fn(shift, shift, sigma, n, 1)
    gaussian = lambda a: a * shift**2 / (2 * n * sigma**2)  # noqa: E731
    for alpha in (2, 4, 8):
        exact = max(_renyi(shifted, total, alpha), _renyi(total, shifted, alpha))
        assert exact <= bound(alpha) + 1e-9
        if sigma >= 1.0:  # tau is negligible: the bound is the Gaussian one
            assert bound(alpha) == pytest.approx(gaussian(alpha), rel=0.02)


@pytest.mark.parametrize(("variance", "shift"), [(4.0, 1), (50.0, 3), (400.0, 5)])
def test_skellam_bound_dominates_exact_divergence(variance: float, shift: int) -> None:
    support = np.arange(-400, 401)
    pmf = stats.skellam.pmf(support, variance / 2, variance / 2)
    shifted = stats.skellam.pmf(support - shift, variance / 2, variance / 2)
    bound = skellam_rdp_fn(shift, shift, variance)
    for alpha in (2, 5, 16):
        exact = max(_renyi(shifted, pmf, alpha), _renyi(pmf, shifted, alpha))
        assert exact <= bound(alpha) + 1e-9
        assert bound(alpha) < 2.5 * exact + 0.05  # and it is not vacuous


def test_general_subsampling_bound_is_above_the_tight_gaussian_one() -> None:
    """Zhu-Wang's general bound applied to the Gaussian RDP must upper-bound Opacus' exact
    sampled-Gaussian RDP, and be within a small factor of it."""
    z, q = 1.5, 0.05
    fn = lambda a: a / (2 * z * z)  # noqa: E731
    for alpha in (2, 4, 10, 32):
        tight = float(gaussian_rdp(z, q, 1, orders=[alpha])[0])
        general = subsampled_rdp(fn, q, alpha)
        assert tight <= general + 1e-12
        assert general < 3 * tight + 1e-3


def test_distributed_epsilon_approaches_central_gaussian() -> None:
    """With fine granularity the distributed discrete Gaussian costs about what the central
    Gaussian of the same noise multiplier costs (KLS 2021, Fig. 1's message)."""
    z, q, steps, delta, t = 1.0, 1.0, 10, 1e-5, 10
    p = EncodingParams(dim=1000, clip_norm=1.0, scale=1000.0, bits=40,
                       noise_stddev=z / math.sqrt(t), rotation_seed=0, threshold=t)
    central = gaussian_epsilon(z, q, steps, delta)
    distributed = round_epsilon(p, q, steps, delta)
    assert central <= distributed < 1.1 * central
    coarse = EncodingParams(dim=1000, clip_norm=1.0, scale=10.0, bits=40,
                            noise_stddev=z / math.sqrt(t), rotation_seed=0, threshold=t)
    assert round_epsilon(coarse, q, steps, delta) > 1.5 * central  # rounding costs privacy
    sk = EncodingParams(dim=1000, clip_norm=1.0, scale=1000.0, bits=40, mechanism="skellam",
                        noise_stddev=z / math.sqrt(t), rotation_seed=0, threshold=t)
    assert central <= round_epsilon(sk, q, steps, delta) < 1.15 * central


def test_noise_for_budget_is_the_smallest_that_fits() -> None:
    from dataclasses import replace

    from dp.distributed import noise_for_budget
    template = EncodingParams(dim=50, clip_norm=1.0, scale=500.0, bits=40, noise_stddev=0.0,
                              rotation_seed=0, threshold=3)
    p = noise_for_budget(template, 2.0, 1e-5, 0.1, 30)
    assert round_epsilon(p, 0.1, 30, 1e-5) <= 2.0
    assert round_epsilon(replace(p, noise_stddev=0.98 * p.noise_stddev), 0.1, 30, 1e-5) > 2.0
