"""``dp.audit.recompute_epsilon`` recomputes every mode's export (docs/privacy.md, "The audit
trail"): dp-accounting's PLD where it composes the event (site mode, adaptive clipping
rewritten as its one Gaussian, patient-idp groups, a site role's patient-idp ledger), its RDP
accountant for unsubsampled zCDP, and the Zhu-Wang routine for subsampled zCDP, itself
checked against a numerical integration of the subsampled Gaussian's Renyi divergence."""

from __future__ import annotations

import math

import numpy as np
import pytest

from dp.audit import distributed_event, event_json, recompute, recompute_epsilon, run_json
from dp.budget import GaussianRound, PrivacyBudget
from dp.encoding import EncodingParams
from dp.idp import IdpClasses, group_patients, plan_idp
from dp.policy import Proposal

pytest.importorskip("dp_accounting")
integrate = pytest.importorskip("scipy.integrate")
DELTA = 1e-5


def test_adaptive_clipping_recomputes_with_dp_accountings_pld() -> None:
    """PLD refused PoissonSampled(Composed(Gaussian, Gaussian)); as the one Gaussian it is,
    PLD composes it, at or below the reported (RDP) epsilon, and equal to PLD of the
    Gaussian at the effective noise multiplier the run accounts."""
    event = GaussianRound(1.1, 0.05, 200, count_stddev=3.0)
    reported = PrivacyBudget(1e9, DELTA).epsilon_after(event)
    exported = run_json([event])
    pld = recompute_epsilon(exported, DELTA, "pld")
    single = recompute_epsilon(run_json([GaussianRound(event.effective_noise_multiplier, 0.05,
                                                       200)]), DELTA, "pld")
    assert pld == pytest.approx(single, rel=1e-9)
    assert 0.8 * reported < pld <= reported
    assert recompute(exported, DELTA) == (pld, "pld")


def test_a_site_roles_patient_idp_ledger_exports_recomputable_events() -> None:
    """The site role charges each rate group an RDP event (dp.policy.Proposal.site_idp);
    exported, it is the group's mixture of Gaussians, not an UnsupportedDpEvent, and
    dp-accounting's PLD recomputes it at or below the charged epsilon."""
    ids = [i for i in range(30) for _ in range(1 + i % 3)]
    classes = IdpClasses(max_records=3, targets=(4.0,))
    plan = plan_idp(group_patients(ids, 4.0, classes=classes), delta=DELTA, sample_rate=0.1,
                    steps=50)
    proposal = Proposal.site_idp(plan, steps=50, secagg_threshold=2)
    assert proposal.groups
    for (_key, _target, event), group in zip(proposal.groups, plan.groups, strict=True):
        exported = event_json(event)
        assert exported["class_name"] == "SelfComposedDpEvent"
        assert exported["event"]["class_name"] == "MixtureOfGaussiansDpEvent"
        charged = PrivacyBudget(1e9, DELTA).epsilon_after(event)
        assert charged == pytest.approx(group.epsilon, rel=1e-6)
        again, used = recompute(exported, DELTA)
        assert used == "pld" and 0.3 * charged < again <= charged * (1 + 1e-9)


def _subsampled_gaussian_rdp(z: float, q: float, order: int) -> float:
    """RDP at ``order`` of the Poisson-subsampled Gaussian (sensitivity 1), both directions,
    by numerical integration (scipy, in log space), independent of every accountant here."""
    def log_density(x: float, mean: float) -> float:
        return -(x - mean) ** 2 / (2 * z * z) - math.log(z * math.sqrt(2 * math.pi))

    def log_mix(x: float) -> float:
        a, b = math.log1p(-q) + log_density(x, 0.0), math.log(q) + log_density(x, 1.0)
        top = max(a, b)
        return top + math.log(math.exp(a - top) + math.exp(b - top))

    span = 20 * z + order
    forward, _ = integrate.quad(
        lambda x: math.exp(order * log_mix(x) + (1 - order) * log_density(x, 0.0)),
        -span, span, limit=400, epsrel=1e-10)
    reverse, _ = integrate.quad(
        lambda x: math.exp(order * log_density(x, 0.0) + (1 - order) * log_mix(x)),
        -span, span, limit=400, epsrel=1e-10)
    return max(math.log(forward), math.log(reverse)) / (order - 1)


@pytest.mark.parametrize("z,q", [(2.0, 0.1), (4.0, 0.05), (1.5, 0.3)])
def test_zhu_wang_bounds_the_numerically_integrated_subsampled_gaussian(z: float,
                                                                        q: float) -> None:
    """The package's own routine (what recomputes subsampled distributed rounds) on a zCDP
    event with the Gaussian's curve (rho = 1/(2 z^2), xi = 0), against a third computation:
    never below the exact Renyi divergence integrated numerically (the general bound is 2-4x
    above it at low orders), and below the unsampled Gaussian's."""
    from dp.accounting import ORDERS
    from dp.audit import _event_rdp

    event = {"class_name": "PoissonSampledDpEvent", "sampling_probability": q,
             "event": {"class_name": "ZCDpEvent", "rho": 1 / (2 * z * z), "xi": 0.0}}
    ours = _event_rdp(event)
    for order in (2, 3, 5, 8):
        i = list(ORDERS).index(order)
        exact = _subsampled_gaussian_rdp(z, q, order)
        assert ours[i] >= exact * (1 - 1e-6)
        assert ours[i] < order / (2 * z * z)  # amplified: below the unsampled Gaussian


def test_auto_recomputes_every_modes_export() -> None:
    """Site (PLD), adaptive clipping (PLD), patient-idp (PLD), the noised scaler and other
    unsubsampled distributed releases (RDP), subsampled distributed rounds (Zhu-Wang): each
    recomputes, never more than 1 % below (PLD: at or below) nor above the reported figure
    by more than the method allows."""
    params = EncodingParams(dim=30, clip_norm=1.0, scale=4096.0, bits=40,
                            noise_stddev=2.0 / math.sqrt(4), rotation_seed=0, threshold=4)
    cases = {
        "site": (run_json([GaussianRound(1.2, 0.1, 50)]), "pld"),
        "adaptive": (run_json([GaussianRound(1.2, 0.1, 50, count_stddev=4.0)]), "pld"),
        "scaler": (run_json([distributed_event(params, 1.0, steps=1)]), "rdp"),
        "distributed": (run_json([distributed_event(params, 0.2, steps=10)]), "zhu-wang"),
        "scaler+distributed": (run_json([distributed_event(params, 1.0, steps=1),
                                         distributed_event(params, 0.2, steps=10)]),
                               "zhu-wang"),
    }
    for name, (exported, want) in cases.items():
        epsilon, used = recompute(exported, DELTA)
        assert used == want, name
        assert np.isfinite(epsilon) and epsilon > 0, name
