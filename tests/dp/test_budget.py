"""The budget is fixed up front and never exceeded, whatever the schedule."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("opacus")

from dp.accounting import gaussian_epsilon
from dp.adaptive_clip import QuantileClipper
from dp.budget import GaussianRound, PrivacyBudget, RdpRound
from dp.distributed import round_rdp
from dp.encoding import EncodingParams
from dp.errors import BudgetExceeded, PrivacyConfigError

rounds = st.builds(
    GaussianRound,
    noise_multiplier=st.sampled_from([0.5, 0.8, 1.0, 1.7, 3.0, 6.0]),
    sample_rate=st.sampled_from([0.001, 0.01, 0.05, 0.3, 1.0]),
    steps=st.integers(1, 50),
)


@settings(max_examples=40, deadline=None)
@given(epsilon=st.floats(0.1, 10.0), schedule=st.lists(rounds, min_size=1, max_size=12))
def test_budget_is_never_exceeded_under_arbitrary_schedules(
        epsilon: float, schedule: list[GaussianRound]) -> None:
    budget = PrivacyBudget(epsilon, 1e-5)
    previous = 0.0
    for event in schedule:
        fits = budget.can_run(event)
        if fits:
            spent, _ = budget.spend(event)
            assert spent >= previous
        else:
            before = (budget.spent, budget.rounds)
            with pytest.raises(BudgetExceeded) as info:
                budget.spend(event)
            assert info.value.epsilon_after > epsilon
            assert (budget.spent, budget.rounds) == before  # a refused round costs nothing
        assert budget.spent[0] <= epsilon
        previous = budget.spent[0]


def test_spent_matches_opacus_after_every_round() -> None:
    budget = PrivacyBudget(50.0, 1e-5)
    for r in range(1, 6):
        eps, delta = budget.spend(GaussianRound(1.1, 0.05, 10))
        assert delta == 1e-5
        assert eps == pytest.approx(gaussian_epsilon(1.1, 0.05, 10 * r, 1e-5), rel=1e-6)


def test_prv_budget_and_its_limits() -> None:
    budget = PrivacyBudget(2.0, 1e-5, accountant="prv")
    eps, _ = budget.spend(GaussianRound(1.0, 0.01, 100))
    assert eps == pytest.approx(gaussian_epsilon(1.0, 0.01, 100, 1e-5, "prv"), rel=1e-6)
    with pytest.raises(PrivacyConfigError, match="rdp"):
        budget.spend(RdpRound.from_array(round_rdp(_params(), 0.01)))


def _params() -> EncodingParams:
    return EncodingParams(dim=100, clip_norm=1.0, scale=100.0, bits=32, noise_stddev=0.5,
                          rotation_seed=0, threshold=4)


def test_distributed_rounds_with_the_clip_count_are_accounted_jointly() -> None:
    budget = PrivacyBudget(4.0, 1e-5)
    clipper = QuantileClipper(clip_norm=1.0, count_stddev=5.0, expected_units=100, threshold=4)
    joint = RdpRound.from_array(round_rdp(_params(), 0.05, clipper=clipper), "update+count")
    alone = round_rdp(_params(), 0.05)
    assert np.all(joint.rdp() >= alone)  # the count costs something
    stopped = None
    for r in range(1, 1000):
        try:
            budget.spend(joint)
        except BudgetExceeded:
            stopped = r
            break
    assert stopped is not None and budget.spent[0] <= 4.0
    assert budget.remaining < 1.0


def test_budget_validation_messages() -> None:
    with pytest.raises(PrivacyConfigError, match="epsilon"):
        PrivacyBudget(0.0, 1e-5)
    with pytest.raises(PrivacyConfigError, match="delta"):
        PrivacyBudget(1.0, 1.5)
    with pytest.raises(PrivacyConfigError, match="accountant"):
        PrivacyBudget(1.0, 1e-5, accountant="gdp")
    with pytest.raises(PrivacyConfigError, match="sample_rate"):
        GaussianRound(1.0, 0.0)
    assert PrivacyBudget(1.0, 1e-5).spent == (0.0, 0.0)
    assert math.isinf(round_rdp(EncodingParams(dim=4, clip_norm=1.0, scale=1.0, bits=16,
                                               noise_stddev=0.0, rotation_seed=0), 0.1)[0])


def _budgets() -> list[tuple[object, object, object]]:
    """(budget, a release that fits, a release that does not) of each Budget."""
    from dp.idp import GroupLedger, group_patients, plan_idp

    plan = plan_idp(group_patients([f"p{i % 10}" for i in range(20)], 2.0), delta=1e-5,
                    sample_rate=0.1, steps=20)
    return [(PrivacyBudget(1.0, 1e-5), GaussianRound(2.0, 0.01, 10),
             GaussianRound(0.6, 1.0, 50)),
            (GroupLedger(plan), 10, 40)]


@pytest.mark.parametrize("index", [0, 1])
def test_every_budget_spends_with_one_signature(index: int) -> None:
    """``spend(release)`` returns the spent (epsilon, delta), or raises BudgetExceeded and
    records nothing; ``can_run`` answers the same question (dp.budget.Budget)."""
    budget, fits, too_much = _budgets()[index]
    assert budget.spent == (0.0, 0.0)  # type: ignore[attr-defined]
    assert budget.can_run(fits) and not budget.can_run(too_much)  # type: ignore[attr-defined]
    spent = budget.spend(fits)  # type: ignore[attr-defined]
    assert spent == budget.spent and spent[0] > 0 and spent[1] == 1e-5  # type: ignore[attr-defined]
    with pytest.raises(BudgetExceeded):
        budget.spend(too_much)  # type: ignore[attr-defined]
    assert budget.spent == spent  # type: ignore[attr-defined]
