"""Empirical checks of the exact samplers: mean, variance, integrality, pmf, dropouts."""

from __future__ import annotations

import math

import numpy as np
import pytest

import dp.samplers as samplers
from dp.distributed import calibrate
from dp.mechanisms import sample_noise
from dp.randomness import SeededRandom, SystemRandom, uniform_below
from dp.samplers import discrete_gaussian, poisson, skellam

N = 40_000


def _dg_pmf(sigma2: float, support: np.ndarray) -> np.ndarray:
    grid = np.arange(-2000, 2001)
    norm = np.exp(-(grid**2) / (2 * sigma2)).sum()
    return np.exp(-(support**2) / (2 * sigma2)) / norm


def _moment_tol(var: float, n: int) -> tuple[float, float]:
    """6-sigma tolerances for the sample mean and variance (kurtosis ~3)."""
    return 6 * math.sqrt(var / n), 6 * var * math.sqrt(2 / n)


@pytest.mark.parametrize("sigma2", [0.8, 4.0, 250.0, 1e6])
def test_discrete_gaussian_mean_variance_integral(sigma2: float) -> None:
    x = discrete_gaussian(sigma2, N, SystemRandom())
    assert x.dtype == np.int64
    support = np.arange(-int(40 * math.sqrt(sigma2)) - 5, int(40 * math.sqrt(sigma2)) + 6)
    true_var = float((support**2 * _dg_pmf(sigma2, support)).sum()) if sigma2 < 1e3 else sigma2
    mean_tol, var_tol = _moment_tol(true_var, N)
    assert abs(x.mean()) < mean_tol
    assert abs(x.var() - true_var) < var_tol


def test_discrete_gaussian_pmf_matches_chi_square() -> None:
    sigma2 = 2.0
    x = discrete_gaussian(sigma2, N, SeededRandom(1))
    support = np.arange(-4, 5)
    expected = _dg_pmf(sigma2, support) * N
    observed = np.array([(x == k).sum() for k in support])
    chi2 = float((((observed - expected) ** 2) / expected).sum())
    assert chi2 < 35.0  # 8 dof: p < 1e-4 under the null
    assert (np.abs(x) > 4).sum() == pytest.approx(N - observed.sum())


@pytest.mark.parametrize("variance", [0.6, 3.0, 400.0, 1e5])
def test_skellam_mean_variance_integral(variance: float) -> None:
    x = skellam(variance, N, SystemRandom())
    assert x.dtype == np.int64
    mean_tol, var_tol = _moment_tol(variance, N)
    assert abs(x.mean()) < mean_tol
    assert abs(x.var() - variance) < 2 * var_tol  # heavier tails for tiny variance


@pytest.mark.parametrize("lam", [0.3, 7.0, 5000.0])
def test_poisson_mean_variance_pmf(lam: float) -> None:
    x = poisson(lam, N, SeededRandom(3))
    mean_tol, var_tol = _moment_tol(lam, N)
    assert x.min() >= 0
    assert abs(x.mean() - lam) < mean_tol
    assert abs(x.var() - lam) < 2 * var_tol
    if lam < 10:
        k = np.arange(0, 6)
        pmf = np.exp(-lam + k * math.log(lam) - np.array([math.lgamma(i + 1) for i in k]))
        observed = np.array([(x == i).sum() for i in k]) / N
        assert np.all(np.abs(observed - pmf) < 6 * np.sqrt(pmf * (1 - pmf) / N) + 1e-4)


def test_exact_fallback_path_alone_gives_the_same_distribution(monkeypatch) -> None:
    """Force every coin through the high-precision resolver: the law must not change."""
    monkeypatch.setattr(samplers, "_BASE_MARGIN", 2.0)
    x = discrete_gaussian(2.0, 3000, SeededRandom(5))
    support = np.arange(-2000, 2001)
    true_var = float((support**2 * _dg_pmf(2.0, support)).sum())
    assert abs(x.var() - true_var) < 6 * true_var * math.sqrt(2 / 3000)
    y = poisson(2000.0, 400, SeededRandom(6))
    assert abs(y.mean() - 2000.0) < 6 * math.sqrt(2000 / 400)


def test_uniform_below_is_uniform_and_in_range() -> None:
    x = uniform_below(SeededRandom(7), 7, 70_000)
    counts = np.bincount(x.astype(np.int64), minlength=7)
    assert x.max() < 7 and counts.size == 7
    assert np.all(np.abs(counts - 10_000) < 600)


def test_seeded_source_is_reproducible_and_system_is_not() -> None:
    assert np.array_equal(discrete_gaussian(9.0, 100, SeededRandom(11)),
                          discrete_gaussian(9.0, 100, SeededRandom(11)))
    assert not np.array_equal(discrete_gaussian(9.0, 100), discrete_gaussian(9.0, 100))


@pytest.mark.parametrize("mechanism", ["dgauss", "skellam"])
def test_sum_of_site_noise_meets_target_for_any_survivor_set(mechanism: str) -> None:
    """Per-site noise from the threshold: every surviving set >= t carries >= the target."""
    num_sites, threshold, target_std, d = 7, 4, 30.0, 20_000
    cal = calibrate(noise_multiplier=target_std, clip_norm=1.0, num_sites=num_sites,
                    threshold=threshold)
    shares = np.stack([sample_noise(mechanism, cal.per_site_stddev**2, d)
                       for _ in range(num_sites)])
    rng = np.random.default_rng(0)  # only picks which sites survive, not noise
    for m in range(threshold, num_sites + 1):
        survivors = rng.choice(num_sites, size=m, replace=False)
        total = shares[survivors].sum(axis=0)
        expected = m / threshold * target_std**2
        assert abs(total.var() - expected) < 6 * expected * math.sqrt(2 / d)
        assert total.var() > 0.95 * target_std**2
    # fewer than the threshold would fall short: the reason decode() refuses them
    short = shares[: threshold - 1].sum(axis=0)
    assert short.var() < 0.9 * target_std**2
    assert cal.cost == pytest.approx(math.sqrt(num_sites / threshold))


def test_bad_parameters_raise() -> None:
    with pytest.raises(ValueError, match="sigma2"):
        discrete_gaussian(-1.0, 3)
    with pytest.raises(ValueError, match="mechanism"):
        sample_noise("laplace", 1.0, 3)
