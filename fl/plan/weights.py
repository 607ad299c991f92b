"""The coordinator's side of DP-FedAvg+'s heterogeneity-aware site weights
(:mod:`dp.site_weights`; docs/privacy.md, "DP-FedAvg+ privately"): the release's plan and its
share of the budget,
the weights computed from the sites' releases alone, and (simulated federation) the release
charged write-ahead to the coordinator's budget. A site's side, its release from its own
table, is :mod:`fl.site.weights`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dp import RandomSource, event_json, event_to_json, site_weights
from fl.settings import TrainSettings
from fl.site.weights import CENTRES, I64, release

if TYPE_CHECKING:
    from fl.coordinator import Coordinator

#: The weights' share of ``--epsilon`` when ``--weights-epsilon`` is not given.
WEIGHTS_FRACTION = 0.25
#: Their epsilon when the run has no ``--epsilon`` (a fixed ``--noise-multiplier``).
WEIGHTS_EPSILON_WITHOUT_BUDGET = 0.5


def weights_epsilon(settings: TrainSettings) -> float:
    if settings.weights_epsilon is not None:
        return float(settings.weights_epsilon)
    if settings.epsilon is None:
        return WEIGHTS_EPSILON_WITHOUT_BUDGET
    return WEIGHTS_FRACTION * float(settings.epsilon)


def release_plan(settings: TrainSettings) -> site_weights.HistogramRelease | None:
    """The weights' release of a run (None without ``--site-weights``): its noise is
    calibrated to the weights' share of the budget."""
    if settings.site_weights is None:
        return None
    return site_weights.release_for_budget(weights_epsilon(settings), settings.delta,
                                           len(CENTRES))


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


def weights_from_releases(settings: TrainSettings, plan: site_weights.HistogramRelease,
                          releases: dict[int, I64]) -> SiteWeights:
    """The site weights from the releases alone (:func:`dp.site_weights.site_weights`)."""
    if settings.site_weights is None:
        raise ValueError("site weights need --site-weights (their strength)")
    weights = site_weights.site_weights(releases, CENTRES, strength=settings.site_weights,
                                        min_weight=settings.min_site_weight,
                                        max_weight=settings.max_site_weight)
    return SiteWeights(weights, site_weights.released_units(releases),
                       {k: [int(x) for x in v] for k, v in releases.items()}, plan)


def release_and_weigh(coordinator: Coordinator, plan: site_weights.HistogramRelease,
                      settings: TrainSettings, source: RandomSource | None = None
                      ) -> SiteWeights:
    """In a simulated federation: charge the release to the coordinator's budget (write
    ahead; :class:`dp.errors.BudgetExceeded` if it does not fit, and nothing is released),
    let every site make its release from its own table, and give the coordinator the
    weights computed from the releases alone."""
    budget = coordinator.budget
    if budget is None:
        raise ValueError("site weights are a DP release: the run needs a privacy budget")
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

