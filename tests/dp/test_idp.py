"""Patient-level DP by individual privacy assignment (dp/idp.py, dp/idp_engine.py).

Checks the group accountant against independent computations, that every rate group's
accounted epsilon is at most its target, and that an empirical membership attack on the
real sampler and noise stays below the accounted figure (and catches a wrong calibration).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from dp.accounting import (
    ORDERS,
    gaussian_rdp,
    group_gaussian_rdp,
    noise_multiplier_for,
    rdp_to_epsilon,
)
from dp.errors import BudgetExceeded, PrivacyConfigError
from dp.idp import group_patients, patient_epsilon, plan_idp, poisson_sample

stats = pytest.importorskip("scipy.stats")
integrate = pytest.importorskip("scipy.integrate")


# --- the group accountant ----------------------------------------------------------------
def test_group_of_one_is_opacus_sampled_gaussian() -> None:
    ints = [a for a in ORDERS if a == int(a) and a <= 64]
    for z, q in ((1.1, 0.05), (0.8, 0.3), (3.0, 0.01)):
        ours = group_gaussian_rdp(z, q, 1, 7, ints, max_order=64)
        np.testing.assert_allclose(ours, gaussian_rdp(z, q, 7, ints), rtol=1e-9)


def _quad_log(log_f, centre: float, span: float) -> float:
    """log of the integral of exp(log_f) by adaptive quadrature around its peak."""
    grid = np.linspace(centre - span, centre + span, 4001)
    values = np.array([log_f(x) for x in grid])
    top = float(values.max())
    peak = float(grid[values.argmax()])
    lo, hi = peak - span, peak + span
    value, _ = integrate.quad(lambda x: math.exp(log_f(x) - top), lo, hi, points=[peak],
                              limit=400, epsabs=0.0, epsrel=1e-11)
    return top + math.log(value)


@pytest.mark.parametrize("z,q,k", [(1.0, 0.1, 3), (2.0, 0.2, 5), (0.9, 0.05, 2)])
def test_group_rdp_matches_numerical_integration(z: float, q: float, k: int) -> None:
    """Both directions of the mixture's Renyi divergence, integrated independently."""
    b = stats.binom.pmf(np.arange(k + 1), k, q)

    def log_ratio(x: float) -> float:  # log P/Q, P = sum_m b_m N(m, z^2), Q = N(0, z^2)
        terms = [math.log(b[m]) + (2 * m * x - m * m) / (2 * z * z) for m in range(k + 1)]
        top = max(terms)
        return top + math.log(sum(math.exp(t - top) for t in terms))

    def log_q(x: float) -> float:
        return -x * x / (2 * z * z) - math.log(z * math.sqrt(2 * math.pi))

    orders = [2, 5, 12]
    ours = group_gaussian_rdp(z, q, k, 1, orders, max_order=16)
    for a, value in zip(orders, ours, strict=True):
        forward = _quad_log(lambda x, a=a: log_q(x) + a * log_ratio(x), a * k / 2, 40 * z + a * k)
        reverse = _quad_log(lambda x, a=a: log_q(x) + (1 - a) * log_ratio(x), 0.0, 40 * z + k)
        assert value == pytest.approx(max(forward, reverse) / (a - 1), rel=1e-6, abs=1e-12)
        assert forward >= reverse  # the remove direction dominates here


def test_group_epsilon_dominates_dp_accounting_pld() -> None:
    """RDP of the patient's mixture is an upper bound on dp-accounting's (tighter) PLD of the
    same mixture of Gaussians (both adjacencies), and not a loose one."""
    from dp_accounting.pld import privacy_loss_distribution as pld

    for z, q, k, steps in ((2.0, 0.2, 5, 20), (4.0, 0.05, 8, 50)):
        b = stats.binom.pmf(np.arange(k + 1), k, q)
        dist = pld.from_mixture_gaussian_mechanism(z, list(range(k + 1)), list(b),
                                                   value_discretization_interval=5e-3)
        tight = dist.self_compose(steps).get_epsilon_for_delta(1e-5)
        ours = rdp_to_epsilon(group_gaussian_rdp(z, q, k, steps), 1e-5)
        assert tight <= ours <= 1.35 * tight, (z, q, k, tight, ours)


def test_group_epsilon_grows_with_records_and_rate() -> None:
    eps = [patient_epsilon(3.0, 0.05, k, 100, 1e-5) for k in (1, 2, 4, 8)]
    assert eps == sorted(eps) and eps[-1] > 4 * eps[0]
    assert patient_epsilon(3.0, 0.02, 4, 100, 1e-5) < patient_epsilon(3.0, 0.05, 4, 100, 1e-5)


# --- grouping and planning -----------------------------------------------------------------
def _ids(counts: dict[int, int]) -> list[str]:
    """Patient ids: ``counts[k]`` patients with k records each, records interleaved."""
    return [f"p{k}-{i}" for k, n in counts.items() for i in range(n) for _ in range(k)]


def test_groups_cutoff_and_budget_column() -> None:
    ids = ["a", "b", "a", "c", "a", "b", "a"]
    g = group_patients(ids, 2.0, max_records=2)
    assert g.keys == ["a", "b", "c"]
    assert g.sizes == ((1, 2.0, 1), (2, 2.0, 2))  # c has 1; a is cut to 2; b has 2
    assert g.record_group.tolist() == [1, 1, 1, 0, -1, 1, -1]  # a keeps its first two
    budgets = [1.0, 4.0, 1.0, 4.0, 1.0, 4.0, 1.0]
    g = group_patients(ids, budgets)
    assert g.sizes == ((4, 1.0, 1), (1, 4.0, 1), (2, 4.0, 1))
    with pytest.raises(PrivacyConfigError, match="two target epsilons"):
        group_patients(ids, [1.0, 4.0, 2.0, 4.0, 1.0, 4.0, 1.0])
    with pytest.raises(PrivacyConfigError, match="positive"):
        group_patients(ids, [1.0, 4.0, 1.0, float("nan"), 1.0, 4.0, 1.0])
    with pytest.raises(PrivacyConfigError, match="one target epsilon per record"):
        group_patients(ids, [1.0, 2.0])


@pytest.mark.parametrize("method,bound,budgets", [
    ("sampling", "rdp", True), ("clipping", "rdp", True), ("uniform", "rdp", True),
    ("uniform", "group-privacy", False), ("sampling", "group-privacy", False)])
def test_every_group_meets_its_target(method: str, bound: str, budgets: bool) -> None:
    ids = _ids({1: 30, 2: 20, 5: 8})
    strict = [p.endswith(("-0", "-1", "-2")) for p in ids]
    g = group_patients(ids, np.where(strict, 0.5, 2.0) if budgets else 2.0)
    plan = plan_idp(g, delta=1e-5, sample_rate=0.1, steps=20, method=method, bound=bound)
    assert len(plan.groups) == (6 if budgets else 3)
    for group in plan.groups:
        again = plan.group_epsilon(group, plan.steps)  # recomputed independently of the plan
        assert again == pytest.approx(group.epsilon)
        assert again <= group.target_epsilon * (1 + 1e-9)
    if method == "sampling":
        # the mean over the public class weights (the one-record groups), not the counts
        assert plan.planned_mean_rate == pytest.approx(0.1, rel=3e-3)
        for t in {x.target_epsilon for x in plan.groups}:
            rates = [x.sample_rate for x in plan.groups if x.target_epsilon == t]
            assert rates == sorted(rates, reverse=True)  # fewer records: higher rate
        assert all(x.epsilon > 0.97 * x.target_epsilon for x in plan.groups)  # budget used
    if method == "clipping":
        weights = plan.weights  # public: the one-record groups, whatever the counts
        clips = [x.clip_norm for x in plan.groups]
        assert np.average(clips, weights=weights) == pytest.approx(1.0)
    if method == "uniform":
        assert min(x.target_epsilon - x.epsilon for x in plan.groups) < 1e-3


def test_plan_refuses_what_it_cannot_meet() -> None:
    g = group_patients(_ids({1: 5, 4: 5}), 1.0)
    with pytest.raises(PrivacyConfigError, match="strictest group"):
        plan_idp(g, delta=1e-5, sample_rate=0.1, steps=10, method="uniform",
                 noise_multiplier=0.5)
    with pytest.raises(PrivacyConfigError, match="method"):
        plan_idp(g, delta=1e-5, sample_rate=0.1, steps=10, method="magic")
    with pytest.raises(PrivacyConfigError, match="sample rate"):
        plan_idp(g, delta=1e-5, sample_rate=0.0, steps=10)


# --- empirical membership attack on the real sampler and noise -----------------------------
def _empirical_epsilon(rate: float, k: int, z: float, delta: float, trials: int) -> float:
    """Lower bound on epsilon from a threshold test on one step's output for one patient
    with k records (present vs absent), Clopper-Pearson at 99.9 % on both rates."""
    rng = np.random.default_rng(1)
    sampled = poisson_sample(np.full(k * trials, rate))  # the real (os.urandom) sampler
    present = np.bincount(sampled // k, minlength=trials) + rng.normal(scale=z, size=trials)
    absent = rng.normal(scale=z, size=trials)
    best = 0.0
    for tau in np.quantile(absent, [0.9, 0.99, 0.999, 0.9999]):
        fp, tp = int((absent > tau).sum()), int((present > tau).sum())
        fpr_hi = stats.beta.ppf(1 - 1e-3, fp + 1, trials - fp)
        tpr_lo = stats.beta.ppf(1e-3, tp, trials - tp + 1) if tp else 0.0
        if tpr_lo > delta:
            best = max(best, math.log((tpr_lo - delta) / fpr_hi))
    return best


def test_empirical_membership_stays_below_accounted() -> None:
    """One step; patients with one record vs six records, each group at its own rate."""
    eps, delta, trials = 3.0, 1e-5, 300_000
    g = group_patients(_ids({1: 40, 6: 10}), eps)
    # a mean rate of 1 is out of reach at z = 3: every group gets its largest rate
    plan = plan_idp(g, delta=delta, sample_rate=1.0, steps=1, noise_multiplier=3.0)
    rates = {x.records: x.sample_rate for x in plan.groups}
    assert rates[1] > 4 * rates[6]
    for x in plan.groups:
        measured = _empirical_epsilon(x.sample_rate, x.records, 3.0, delta, trials)
        assert 0.5 < measured <= x.epsilon <= eps, (x, measured)
    # The same attack catches record-level calibration: six records at the mean rate.
    z_record = noise_multiplier_for(eps, delta, 0.25, 1)
    assert _empirical_epsilon(0.25, 6, z_record, delta, trials) > eps


# --- the training engine --------------------------------------------------------------------
def test_engine_trains_and_refuses_past_every_target() -> None:
    torch = pytest.importorskip("torch")
    from torch.utils.data import TensorDataset

    from dp.idp_engine import IdpSgd
    from dp.randomness import SeededRandom

    ids = _ids({1: 30, 3: 20})
    n = len(ids)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, generator=gen)
    y = (x[:, 0] > 0).long()
    g = group_patients(ids, np.where([p.startswith("p1") for p in ids], 1.0, 3.0))
    plan = plan_idp(g, delta=1e-5, sample_rate=0.2, steps=30, method="clipping")
    model = torch.nn.Linear(4, 2)
    engine = IdpSgd(model, torch.optim.SGD(model.parameters(), lr=0.5), TensorDataset(x, y),
                    loss_fn=torch.nn.CrossEntropyLoss(reduction="sum"), plan=plan,
                    record_group=g.record_group, source=SeededRandom(3))
    before = [p.detach().clone() for p in model.parameters()]
    spent = engine.train_round(20)
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    spent = engine.train_round(10)
    for e, group in zip(spent, plan.groups, strict=True):
        assert e <= group.target_epsilon and e == pytest.approx(group.epsilon, rel=1e-6)
    with pytest.raises(BudgetExceeded, match="target"):
        engine.train_round(1)
    assert engine.steps_done == 30
    engine.close()
    # A later round's engine (a fresh model copy) shares the ledger: still refused.
    again = IdpSgd(model, torch.optim.SGD(model.parameters(), lr=0.5), TensorDataset(x, y),
                   loss_fn=torch.nn.CrossEntropyLoss(reduction="sum"), plan=plan,
                   record_group=g.record_group, ledger=engine.ledger)
    with pytest.raises(BudgetExceeded):
        again.train_round(1)
    assert again.steps_done == 0 and [r["epsilon_spent"] for r in engine.ledger.report()] == spent
    again.close()


def test_engine_clips_each_record_to_its_group() -> None:
    torch = pytest.importorskip("torch")
    from torch.utils.data import TensorDataset

    from dp.idp_engine import IdpSgd

    ids = _ids({1: 4, 2: 2})
    x = torch.full((len(ids), 3), 50.0)
    y = torch.zeros(len(ids), dtype=torch.long)
    g = group_patients(ids, 2.0)
    plan = plan_idp(g, delta=1e-5, sample_rate=0.5, steps=5, method="clipping")
    model = torch.nn.Linear(3, 2)
    torch.nn.init.zeros_(model.weight)  # every record's gradient has norm ~70 > any clip
    engine = IdpSgd(model, torch.optim.SGD(model.parameters(), lr=0.1), TensorDataset(x, y),
        loss_fn=torch.nn.CrossEntropyLoss(reduction="sum"), plan=plan,
        record_group=g.record_group)
    from dp.units import per_unit_gradients

    per_unit_gradients(engine.module, engine.loss_fn, x, y, np.arange(len(ids)), len(ids))
    engine._clip_each(torch.as_tensor(engine.clip))
    norms = torch.cat([p.grad_sample.reshape(len(ids), -1) for p in engine.module.parameters()],
                      dim=1).norm(dim=1)
    np.testing.assert_allclose(norms.numpy(), engine.clip, rtol=1e-5)
    assert len(set(np.round(engine.clip, 6))) == 2  # two groups, two different clips
    engine.close()
