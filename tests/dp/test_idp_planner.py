"""The patient-idp planner on the record counts of issue 19, and the PLD group accountant.

The planner always finds a plan when one exists (raising the noise until every rate group is
feasible, then scaling the groups' largest rates to the mean rate) or names the one number
to change; the PLD accountant (dp-accounting's privacy loss distribution of a patient's
mixture) is checked against an independent numerical computation of the same loss.
"""

from __future__ import annotations

import numpy as np
import pytest

from dp.accounting import group_gaussian_pld_epsilon, group_gaussian_rdp, rdp_to_epsilon
from dp.errors import PrivacyConfigError
from dp.idp import accounted_records, group_patients, patient_epsilon, plan_idp

stats = pytest.importorskip("scipy.stats")
pytest.importorskip("dp_accounting")


def _ids(counts: dict[int, int]) -> list[str]:
    return [f"p{k}-{i}" for k, n in counts.items() for i in range(n) for _ in range(k)]


def _check_plan(plan, sample_rate: float) -> None:
    for g in plan.groups:
        assert g.sample_rate > 0
        again = plan.group_epsilon(g, plan.steps)
        assert again == pytest.approx(g.epsilon) and again <= g.target_epsilon * (1 + 1e-9)
    assert plan.planned_mean_rate == pytest.approx(sample_rate, rel=1e-9)


def test_issue_19_counts_are_planned_not_refused() -> None:
    """600 x 1, 300 x 2, 80 x 5, 20 x 10 records at epsilon 8, q 0.01, 1,500 steps: the
    old planner refused ('cannot meet every target at any sampling rate')."""
    g = group_patients(_ids({1: 600, 2: 300, 5: 80, 10: 20}), 8.0)
    plan = plan_idp(g, delta=1e-5, sample_rate=0.01, steps=1500)
    _check_plan(plan, 0.01)
    rates = [x.sample_rate for x in plan.groups]
    assert rates == sorted(rates, reverse=True)
    assert plan.noise_multiplier < 1.0  # the issue's hand plan used z = 1.0


def test_the_noise_is_the_smallest_that_reaches_the_mean() -> None:
    g = group_patients(_ids({1: 40, 2: 20, 6: 5}), 2.0)
    plan = plan_idp(g, delta=1e-5, sample_rate=0.1, steps=40)
    _check_plan(plan, 0.1)
    # 2 % less noise: the groups' largest rates no longer reach the mean rate
    low = plan_idp(g, delta=1e-5, sample_rate=1.0, steps=40,
                   noise_multiplier=plan.noise_multiplier / 1.02)
    assert low.planned_mean_rate < 0.1


def test_fixed_noise_gets_the_highest_reachable_mean_or_the_noise_to_raise_to() -> None:
    g = group_patients(_ids({1: 30, 4: 10}), 1.0)
    plan = plan_idp(g, delta=1e-5, sample_rate=0.9, steps=20, noise_multiplier=2.0)
    assert plan.planned_mean_rate < 0.9  # out of reach: every group at its largest rate
    assert all(x.epsilon > 0.98 * x.target_epsilon for x in plan.groups)
    with pytest.raises(PrivacyConfigError, match="raise it to at least") as err:
        plan_idp(g, delta=1e-7, sample_rate=0.1, steps=20000, noise_multiplier=0.3)
    need = float(str(err.value).rsplit(" ", 1)[1])
    plan = plan_idp(g, delta=1e-7, sample_rate=1e-5, steps=20000, noise_multiplier=need * 1.01)
    assert all(x.epsilon <= x.target_epsilon for x in plan.groups)


def test_an_unreachable_target_names_the_epsilon_to_raise_to() -> None:
    g = group_patients(_ids({1: 5, 64: 2}), 1e-4)
    with pytest.raises(PrivacyConfigError,
                       match=r"64 records at any sampling rate: raise that epsilon"):
        plan_idp(g, delta=1e-9, sample_rate=0.1, steps=10**6)


def test_many_records_are_accounted_in_a_few_sizes() -> None:
    assert [accounted_records(k) for k in (1, 16, 17, 20, 21, 33, 92)] == [
        1, 16, 20, 20, 24, 40, 96]
    ks = list(range(1, 93))
    assert all(accounted_records(k) >= k for k in ks)
    assert len({accounted_records(k) for k in ks}) == 26
    # a larger group never has a smaller epsilon: accounting 17 records as 20 is a bound
    assert patient_epsilon(3.0, 0.01, 20, 50, 1e-5) >= patient_epsilon(3.0, 0.01, 17, 50, 1e-5)


# --- PLD -------------------------------------------------------------------------------------
def _epsilon_lower_bound(z: float, q: float, k: int, steps: int, delta: float) -> float:
    """An independent *lower* bound on the patient's epsilon: the exact identity
    delta(eps) = E_P[(1 - e^(eps - sum of T losses))_+] with every per-step loss rounded
    down to a 1e-3 grid, on a grid of x (mass outside dropped), composed by FFT; both
    directions (P = mixture, Q = N(0, z^2), and swapped)."""
    m = np.arange(k + 1)
    b = stats.binom.pmf(m, k, q)
    edges = np.arange(-14 * z, k + 14 * z, 2e-3 * z)

    def loss(x: np.ndarray) -> np.ndarray:  # log P/Q, increasing in x
        t = np.log(b)[None, :] + (2 * m[None, :] * x[:, None] - m[None, :] ** 2) / (2 * z * z)
        return np.logaddexp.reduce(t, axis=1)

    l_edges = loss(edges)
    mix_cdf = (b[None, :] * stats.norm.cdf((edges[:, None] - m[None, :]) / z)).sum(axis=1)
    gauss_cdf = stats.norm.cdf(edges / z)
    h = 1e-3
    best = 0.0
    # remove: x ~ mixture, loss L (lowest on a cell at its left edge)
    # add: x ~ N(0, z^2), loss -L (lowest on a cell at its right edge)
    for mass, low in ((np.diff(mix_cdf), l_edges[:-1]), (np.diff(gauss_cdf), -l_edges[1:])):
        idx = np.floor(low / h).astype(np.int64)
        base = idx.min()
        pmf = np.bincount(idx - base, weights=mass)
        size = steps * (len(pmf) - 1) + 1
        n = 1 << (size - 1).bit_length()
        composed = np.fft.irfft(np.fft.rfft(pmf, n) ** steps, n)[:size].clip(min=0)
        losses = (np.arange(size) + steps * base) * h

        def delta_of(eps: float, c: np.ndarray = composed, v: np.ndarray = losses) -> float:
            keep = v > eps
            return float(np.sum(c[keep] * -np.expm1(eps - v[keep])))

        lo, hi = 0.0, float(losses.max())
        if delta_of(lo) <= delta:
            continue
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if delta_of(mid) > delta else (lo, mid)
        best = max(best, lo)
    return best


@pytest.mark.parametrize("z,q,k,steps", [(1.0, 0.05, 3, 20), (2.0, 0.1, 5, 10),
                                         (0.8, 0.02, 1, 50)])
def test_pld_is_never_below_an_independent_computation(z: float, q: float, k: int,
                                                       steps: int) -> None:
    ours = group_gaussian_pld_epsilon(z, q, k, steps, 1e-5)
    low = _epsilon_lower_bound(z, q, k, steps, 1e-5)
    assert low <= ours <= 1.1 * low + 0.02, (low, ours)
    # RDP, kept as a check, is a looser upper bound of the same mixture
    assert ours <= rdp_to_epsilon(group_gaussian_rdp(z, q, k, steps), 1e-5) * (1 + 1e-9)


@pytest.mark.slow  # ~20 s: PLD planning
def test_the_plan_uses_pld_when_selected_and_every_group_meets_its_target() -> None:
    g = group_patients(_ids({1: 40, 6: 6}), 1.5)
    pld = plan_idp(g, delta=1e-5, sample_rate=0.1, steps=20, bound="pld")
    rdp = plan_idp(g, delta=1e-5, sample_rate=0.1, steps=20, bound="rdp")
    assert pld.bound == "pld" and pld.report()["bound"] == "pld"
    _check_plan(pld, 0.1)
    for x in pld.groups:
        z = pld.noise_multiplier
        assert x.epsilon == pytest.approx(
            group_gaussian_pld_epsilon(z, x.sample_rate, x.records, 20, 1e-5))
        rdp_figure = rdp_to_epsilon(group_gaussian_rdp(z, x.sample_rate, x.records, 20), 1e-5)
        assert x.epsilon <= rdp_figure  # the RDP check: PLD is the tighter bound
    assert pld.noise_multiplier < rdp.noise_multiplier  # tighter accounting, less noise


@pytest.mark.slow  # ~30 s: dp-accounting's PLD at its default 1e-4 discretization
def test_each_groups_exported_event_recomputes_its_epsilon() -> None:
    """What the report exports per group (IdpPlan.group_dp_event): dp-accounting's own PLD
    accountant (finer discretization) recomputes every group's figure, never above it."""
    from dp.audit import recompute_epsilon

    g = group_patients(_ids({1: 30, 2: 10}), 1.0)
    for bound in ("pld", "rdp"):
        plan = plan_idp(g, delta=1e-5, sample_rate=0.2, steps=10, bound=bound)
        for x in plan.groups:
            again = recompute_epsilon(plan.group_dp_event(x, plan.steps), 1e-5, "pld")
            assert again <= x.epsilon * (1 + 1e-9)
            assert again >= (0.9 if bound == "pld" else 0.5) * x.epsilon, (bound, x, again)
