"""Numerical edges of the accounting, joint adaptive-clipping accounting, and the audit export
recomputed with Google's dp-accounting (an independent library)."""

from __future__ import annotations

import math

import numpy as np
import pytest

pytest.importorskip("opacus")
dpa = pytest.importorskip("dp_accounting")

from dp.accounting import (  # noqa: E402
    ORDERS,
    adaptive_clip_noise_multiplier,
    adaptive_clip_update_noise,
    check_delta,
    gaussian_rdp,
    rdp_to_epsilon,
    subsampled_rdp,
)
from dp.audit import distributed_event, recompute_epsilon, run_json  # noqa: E402
from dp.budget import GaussianRound, PrivacyBudget  # noqa: E402
from dp.distributed import round_epsilon  # noqa: E402
from dp.encoding import EncodingParams  # noqa: E402
from dp.errors import PrivacyConfigError  # noqa: E402
from dp.mechanisms.dgauss import ddg_rdp_fn  # noqa: E402


@pytest.mark.parametrize("q", [0.95, 0.99, 0.999999, 1.0])
def test_subsampling_near_q_1_does_not_underflow(q: float) -> None:
    fn = ddg_rdp_fn(100.0, 300.0, 80.0, 4, 64)
    for alpha in (2, 17, 64, 256):
        value = subsampled_rdp(fn, q, alpha)
        assert math.isfinite(value) and 0 < value <= fn(alpha) + 1e-12
    assert subsampled_rdp(fn, 0.95, 64) <= subsampled_rdp(fn, 0.999999, 64) + 1e-9
    if q == 1.0:
        assert subsampled_rdp(fn, q, 64) == fn(64)


def test_ddg_bound_refuses_sigma_below_one_half() -> None:
    with pytest.raises(PrivacyConfigError, match="1/2"):
        ddg_rdp_fn(1.0, 1.0, 0.49, 3, 10)
    params = EncodingParams(dim=10, clip_norm=1.0, scale=1.0, bits=32, noise_stddev=0.3,
                            rotation_seed=0, threshold=3)
    assert math.isinf(round_epsilon(params, 0.1, 1, 1e-5))  # no bound: never fits a budget


def test_delta_at_or_above_one_over_patients_is_flagged() -> None:
    assert check_delta(1e-3, 1000) is not None and "1/1000" in check_delta(1e-3, 1000)
    assert check_delta(1e-5, 1000) is None


def test_adaptive_clipping_is_accounted_as_one_gaussian_on_the_same_sample() -> None:
    """Andrew et al. 2021 Thm. 1 vs dp-accounting composing both queries inside one
    Poisson-sampled event; the old sum of two separately subsampled curves is lower (not a
    valid bound)."""
    q, z, sigma_b, steps, delta = 256 / 60_000, 1.1, 0.75, 14_062, 1e-5
    ours = PrivacyBudget(100.0, delta).spend(GaussianRound(z, q, steps, sigma_b))[0]
    event = dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(q, dpa.ComposedDpEvent(
        [dpa.GaussianDpEvent(z), dpa.GaussianDpEvent(2 * sigma_b)])), steps)
    theirs = dpa.rdp.RdpAccountant(list(ORDERS)).compose(event).get_epsilon(delta)
    assert ours == pytest.approx(theirs, rel=1e-3)
    separate = rdp_to_epsilon(gaussian_rdp(z, q, steps)
                              + gaussian_rdp(2 * sigma_b, q, steps), delta)
    assert separate < ours
    z_eff = adaptive_clip_noise_multiplier(z, sigma_b)
    assert adaptive_clip_update_noise(z_eff, sigma_b) == pytest.approx(z)
    with pytest.raises(PrivacyConfigError, match="count stddev"):
        adaptive_clip_update_noise(2.0, 0.9)


def test_a_site_mode_run_recomputed_by_dp_accounting_matches() -> None:
    events = [GaussianRound(1.2, 0.05, 30), GaussianRound(1.2, 0.05, 30),
              GaussianRound(1.5, 0.05, 30, count_stddev=2.0)]
    budget = PrivacyBudget(50.0, 1e-5)
    for e in events:
        budget.spend(e)
    exported = run_json(events)
    assert recompute_epsilon(exported, 1e-5, "rdp") == pytest.approx(budget.spent[0], rel=1e-3)
    prv = PrivacyBudget(50.0, 1e-5, accountant="prv")  # Opacus PRV vs dp-accounting PLD
    for e in events[:2]:  # (dp-accounting's PLD cannot open a composed sampled event)
        prv.spend(e)
    pld = recompute_epsilon(run_json(events[:2]), 1e-5, "pld")
    assert pld == pytest.approx(prv.spent[0], rel=0.03)


def test_a_distributed_round_exports_as_zcdp_that_bounds_ours() -> None:
    params = EncodingParams(dim=30, clip_norm=1.0, scale=4096.0, bits=40,
                            noise_stddev=2.0 / math.sqrt(4), rotation_seed=0, threshold=4)
    full = distributed_event(params, 1.0, steps=5)
    ours = rdp_to_epsilon(full.rdp(), 1e-5)
    theirs = recompute_epsilon(run_json([full]), 1e-5)
    assert ours <= theirs * (1 + 1e-6) and theirs == pytest.approx(ours, rel=0.02)
    sampled = run_json([distributed_event(params, 0.1)])
    assert sampled["events"][0]["event"]["class_name"] == "PoissonSampledDpEvent"
    with pytest.raises(PrivacyConfigError, match="subsamples only Gaussians"):
        recompute_epsilon(sampled, 1e-5)
    assert np.all(np.isfinite(distributed_event(params, 0.1).rdp()))


def test_calibration_after_earlier_releases_composes_to_the_budget() -> None:
    """Rounds calibrated with ``prior_rdp`` (e.g. the noised feature statistics) compose
    with it to the budget: not above it, and not far below (no budget wasted)."""
    from dp.accounting import gaussian_rdp, noise_multiplier_for, rdp_to_epsilon
    from dp.distributed import noise_for_budget, round_rdp
    from dp.encoding import EncodingParams

    prior = gaussian_rdp(3.0, 1.0, 1)
    z = noise_multiplier_for(3.0, 1e-5, 0.05, 200, prior_rdp=prior)
    total = rdp_to_epsilon(prior + gaussian_rdp(z, 0.05, 200), 1e-5)
    assert 0.995 * 3.0 < total <= 3.0 and z > noise_multiplier_for(3.0, 1e-5, 0.05, 200)
    template = EncodingParams(dim=33, clip_norm=1.0, scale=4096.0, bits=40,
                              noise_stddev=0.0, rotation_seed=0, threshold=3)
    params = noise_for_budget(template, 3.0, 1e-5, 0.1, 20, prior_rdp=prior)
    total = rdp_to_epsilon(prior + round_rdp(params, 0.1, 20), 1e-5)
    assert 0.98 * 3.0 < total <= 3.0
    assert params.noise_stddev > noise_for_budget(template, 3.0, 1e-5, 0.1, 20).noise_stddev
    with pytest.raises(PrivacyConfigError, match="rdp accountant"):
        noise_multiplier_for(3.0, 1e-5, 0.05, 200, "prv", prior_rdp=prior)


def test_an_unrecomputable_run_names_the_event_dp_accounting_lacks() -> None:
    """A site-mode run after the noised feature statistics (a zCDP release) recomputes with
    RDP; PLD has no zCDP event and says so, and a subsampled distributed round names its
    sampling probability."""
    params = EncodingParams(dim=30, clip_norm=1.0, scale=4096.0, bits=40,
                            noise_stddev=2.0 / math.sqrt(4), rotation_seed=0, threshold=4)
    run = run_json([distributed_event(params, 1.0), GaussianRound(1.2, 0.05, 30)])
    assert recompute_epsilon(run, 1e-5, "rdp") > 0
    with pytest.raises(PrivacyConfigError, match=r"ZCDpEvent .*no privacy loss distribution"
                                                 r".*recompute the run with 'rdp'"):
        recompute_epsilon(run, 1e-5, "pld")
    sampled = run_json([GaussianRound(1.2, 0.05, 30), distributed_event(params, 0.1)])
    with pytest.raises(PrivacyConfigError, match=r"PoissonSampledDpEvent of a ZCDpEvent "
                                                 r"\(sampling probability 0\.1\).*zhu-wang"):
        recompute_epsilon(sampled, 1e-5, "rdp")
    assert recompute_epsilon(sampled, 1e-5, "zhu-wang") > 0


@pytest.mark.parametrize("q", [0.01, 0.1, 0.5])
def test_zhu_wang_recompute_is_never_below_dp_accountings_exact_gaussian(q: float) -> None:
    """The 'zhu-wang' recomputation (the event description's RDP curves, subsampled with Zhu
    & Wang's general bound) checked where dp-accounting is exact: a Poisson-subsampled
    Gaussian. The general bound may only be looser, and not by much."""
    run = run_json([GaussianRound(1.1, q, 200)])
    exact = recompute_epsilon(run, 1e-5, "rdp")
    general = recompute_epsilon(run, 1e-5, "zhu-wang")
    assert exact * (1 - 1e-9) <= general <= exact * 1.25


@pytest.mark.parametrize("q", [0.05, 0.3])
def test_a_subsampled_distributed_round_is_recomputed_from_its_event(q: float) -> None:
    """What dp-accounting cannot compose (a Poisson-subsampled zCDP round) is recomputed
    from the exported event alone, and is never below what the run reported."""
    params = EncodingParams(dim=30, clip_norm=1.0, scale=4096.0, bits=40,
                            noise_stddev=2.0 / math.sqrt(4), rotation_seed=0, threshold=4)
    event = distributed_event(params, q, steps=25)
    reported = PrivacyBudget(1e9, 1e-5).epsilon_after(event)
    recomputed = recompute_epsilon(run_json([event]), 1e-5, "zhu-wang")
    assert recomputed >= reported * (1 - 1e-9)
    assert recomputed <= reported * 1.01
