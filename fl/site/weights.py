"""DP-FedAvg+'s heterogeneity-aware site weights on a survival federation, from DP releases
only (the mechanism and the weights: :mod:`dp.site_weights`; docs/privacy.md, "DP-FedAvg+
privately").

The released scalar is a patient's observed-time interval on the discrete-time model's
public grid (:data:`fl.survival.INTERVAL_EDGES`: years 1-10, then one open interval; 11
cells), a public range by construction, and the outcome whose distribution differs most
between the Fed-TCGA-BRCA centers (follow-up length). One patient is in one cell.

Each site releases once, before training (the run's first release, charged to the budget
before it is made; the rounds are calibrated to compose with it, ``prior=``); the weights
are post-processing of the releases. The site computes its release from its own table
(:func:`release`); the coordinator computes every weight from the releases alone
(:func:`weights_from_releases`) and sends each site its weight in the round task.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from dp import RandomSource, event_json, event_to_json, site_weights
from fl.data import Table

I64 = npt.NDArray[np.int64]

#: The weights' share of ``--epsilon`` when ``--weights-epsilon`` is not given.
WEIGHTS_FRACTION = 0.25
#: Their epsilon when the run has no ``--epsilon`` (a fixed ``--noise-multiplier``).
WEIGHTS_EPSILON_WITHOUT_BUDGET = 0.5
#: The grid's cell centres in years (public): the middle of years 1-10, and 10.5 for the
#: open interval beyond 10 years.
CENTRES = tuple(k + 0.5 for k in range(11))


def weights_epsilon(settings: Any) -> float:
    if settings.weights_epsilon is not None:
        return float(settings.weights_epsilon)
    if settings.epsilon is None:
        return WEIGHTS_EPSILON_WITHOUT_BUDGET
    return WEIGHTS_FRACTION * float(settings.epsilon)


def release_plan(settings: Any) -> site_weights.HistogramRelease | None:
    """The weights' release of a run (None without ``--site-weights``): its noise is
    calibrated to the weights' share of the budget."""
    if getattr(settings, "site_weights", None) is None:
        return None
    return site_weights.release_for_budget(weights_epsilon(settings), settings.delta,
                                           len(CENTRES))


def patient_cells(table: Table) -> I64:
    """Each patient's observed-time interval (its cell) in a person-period table: the last
    interval of its rows (the interval one-hot is the last 11 features)."""
    intervals = np.asarray(table.x[:, -len(CENTRES):]).argmax(axis=1)
    _, inverse = np.unique(table.patient_ids, return_inverse=True)
    cells = np.zeros(int(inverse.max()) + 1 if inverse.size else 0, dtype=np.int64)
    np.maximum.at(cells, inverse, intervals)
    return cells


def release(plan: site_weights.HistogramRelease, table: Table,
            source: RandomSource | None = None) -> I64:
    """A site's release: its noised histogram of :func:`patient_cells` and noised count."""
    return plan.release(patient_cells(table), source)


@dataclass(frozen=True)
class SiteWeights:
    """The weights a run uses and what they came from (all public: the releases)."""

    weights: dict[int, float]
    units: float
    """The noised patient count over all sites (post-processing)."""
    releases: dict[int, list[int]]
    plan: site_weights.HistogramRelease

    def record(self, epsilon_before: float, epsilon_after: float) -> dict[str, Any]:
        """The release's line of the audit trail."""
        return {"round": 0, "to": "the coordinator (and whoever it shares the model with)",
                "what": "each site's noised histogram of its patients' observed-time "
                        "intervals (11 public cells) and noised patient count; the site "
                        "weights computed from them",
                "included": sorted(self.releases), "mode": "distributed",
                "mechanism": "discrete Gaussian per site (L2 sensitivity sqrt(2))",
                "noise_stddev": self.plan.noise_stddev, "sample_rate": 1.0,
                "releases": {str(k): v for k, v in self.releases.items()},
                "weights": {str(k): w for k, w in self.weights.items()},
                "epsilon_charged": epsilon_after - epsilon_before,
                "epsilon_after": epsilon_after, "dp_event": event_json(self.plan.event())}


def weights_from_releases(settings: Any, plan: site_weights.HistogramRelease,
                          releases: dict[int, I64]) -> SiteWeights:
    """The site weights from the releases alone (:func:`dp.site_weights.site_weights`)."""
    weights = site_weights.site_weights(releases, CENTRES, strength=settings.site_weights,
                                        min_weight=settings.min_site_weight,
                                        max_weight=settings.max_site_weight)
    return SiteWeights(weights, site_weights.released_units(releases),
                       {k: [int(x) for x in v] for k, v in releases.items()}, plan)


def release_and_weigh(coordinator: Any, plan: site_weights.HistogramRelease, settings: Any,
                      source: RandomSource | None = None) -> SiteWeights:
    """In a simulated federation: charge the release to the coordinator's budget (write
    ahead; :class:`dp.errors.BudgetExceeded` if it does not fit, and nothing is released),
    let every site make its release from its own table, and give the coordinator the
    weights computed from the releases alone."""
    budget = coordinator.budget
    before = budget.spent[0]
    after = budget.spend(plan.event())[0]
    coordinator.events.append(event_to_json(plan.event()))
    releases = {cid: release(plan, site.table, source)
                for cid, site in sorted(coordinator.sites.items())}
    weights = weights_from_releases(settings, plan, releases)
    coordinator.weights = weights.weights
    coordinator.weight_units = weights.units
    coordinator.releases.append(weights.record(before, after))
    return weights

