"""The coordinator's side of ``--unit patient-idp`` (site-mode DP-SGD with individual privacy
assignment; each site's own groups, plan and ledger are :mod:`fl.site.idp`).

``--role all``: :func:`configure` plans every site, :class:`FederationBudget` is the
coordinator's budget (the largest epsilon of any rate group at any site per round; it stops
before any group would pass its target), :func:`restore` rebuilds it and every site's group
ledger on ``--resume``, :func:`finish_report` lists every site's groups and
:func:`plan_summary` is ``secagg train --plan``'s. ``--role coordinator``: the coordinator
keeps no budget and knows no site's groups (:func:`remote_report`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from dp import PLAN_SOURCES, BudgetExceeded
from fl.settings import TrainSettings
from fl.site.idp import SiteIdp

if TYPE_CHECKING:
    from fl.coordinator import Coordinator
    from fl.site.training import Site


def configure(settings: TrainSettings, sites: dict[int, Site]) -> str:
    """Plan every site (``--unit patient-idp``); returns the run's privacy description."""
    for site in sites.values():
        site.idp = SiteIdp.for_site(site, settings)
    idps = [s.idp for s in sites.values() if s.idp is not None]
    groups = sum(len(i.plan.groups) for i in idps)
    zs = [i.plan.noise_multiplier for i in idps]
    rates = [i.plan.mean_sample_rate for i in idps]
    cut = settings.max_records_per_patient
    dropped = sum(i.groups.dropped_records for i in idps)
    kept = sum(int(np.count_nonzero(i.groups.record_group >= 0)) for i in idps)
    return (f"site DP-SGD with individual privacy assignment (per-record sampling rates per "
            f"rate group, {settings.accountant.upper()} group accounting): {groups} rate "
            f"groups over {len(sites)} sites, noise multipliers {min(zs):.3f}-{max(zs):.3f}, "
            f"clip {settings.clip_norm}, mean record rate {min(rates):.4g}-{max(rates):.4g} "
            f"(asked {settings.sample_rate}), {settings.steps_per_round} steps per round"
            + (f"; --max-records-per-patient {cut} drops {dropped} of {dropped + kept} "
               "records" if cut is not None else ""))


class FederationBudget:
    """The coordinator's budget under ``--unit patient-idp`` (duck-types
    :class:`dp.budget.PrivacyBudget` for :class:`fl.coordinator.Coordinator`): a round fits
    if, after it, every rate group at every site is within its target; ``spent`` is the
    largest epsilon of any group (an upper bound: a site runs at most one round's steps per
    round). The sites' own ledgers enforce the same limit on their side."""

    def __init__(self, settings: TrainSettings, sites: dict[int, Site]) -> None:
        self.plans = [s.idp.plan for s in sites.values() if s.idp is not None]
        self.steps = settings.steps_per_round
        self.delta = settings.delta
        self.epsilon = max(g.target_epsilon for p in self.plans for g in p.groups)
        self.rounds = 0

    def _worst(self, rounds: int) -> tuple[float, float]:
        """(largest epsilon, largest epsilon / target - 1) over all groups after ``rounds``."""
        eps = [(p.group_epsilon(g, rounds * self.steps), g.target_epsilon)
               for p in self.plans for g in p.groups]
        return max(e for e, _ in eps), max(e / t - 1 for e, t in eps)

    def epsilon_after(self, event: object) -> float:
        return self._worst(self.rounds + 1)[0]

    def can_run(self, event: object) -> bool:
        return self._worst(self.rounds + 1)[1] <= 1e-9

    def spend(self, event: object) -> tuple[float, float]:
        if not self.can_run(event):
            after = self.epsilon_after(event)
            raise BudgetExceeded(f"round {self.rounds + 1} would take a rate group past its "
                                 "target", epsilon_limit=self.epsilon, epsilon_after=after)
        self.rounds += 1
        return self.spent

    @property
    def spent(self) -> tuple[float, float]:
        return (self._worst(self.rounds)[0] if self.rounds else 0.0,
                self.delta if self.rounds else 0.0)


def restore(settings: TrainSettings, sites: dict[int, Site], coordinator: Coordinator
            ) -> FederationBudget:
    """``--resume``: the budget and every site's group ledger as they were, by replaying the
    checkpoint's charged rounds (one event per round, written before the round ran) with
    each round's (seeded) cohort. A round charged but not completed (a crash after its
    release) stays charged and is charged again when it is run again, at the coordinator
    and at its sites alike."""
    budget = FederationBudget(settings, sites)
    for r in range(1, len(coordinator.events) + 1):
        budget.spend(None)
        for cid in coordinator.cohort(r):
            idp = sites[cid].idp
            assert idp is not None and idp.ledger is not None
            idp.ledger.spend(settings.steps_per_round)
            if r <= coordinator.round:
                idp.charged.add(r)
    return budget


def _report_mechanism(report: dict[str, Any], description: str, where: str) -> None:
    report["privacy"] = description
    report["model_info"]["privacy"] = description
    report["dp_events"] = None  # per-group events, at the sites (finish_report: --role all)
    for release in report["releases"]:  # the coordinator's plan was only the round's task
        for key in ("noise_multiplier", "sample_rate", "count_stddev", "dp_event"):
            release.pop(key, None)
        release["mechanism"] = ("sampled Gaussian with individual per-record rates per rate "
                                f"group at each site ({where})")


def finish_report(settings: TrainSettings, sites: dict[int, Site], report: dict[str, Any],
                  description: str) -> dict[str, Any]:
    """The report of a ``--unit patient-idp`` run: the mechanism, and every site's rate groups
    (records, target, patients, rate, clip, planned and spent epsilon)."""
    plans = {cid: s.idp for cid, s in sites.items() if s.idp is not None}
    _report_mechanism(report, description, "see 'idp'")
    report["idp"] = {str(cid): site_report(p) for cid, p in plans.items()
                     if p.ledger is not None}
    # per site, per rate group: the steps run as a DpEvent (dp.audit.recompute_epsilon)
    report["dp_events"] = {cid: {g["key"]: g["dp_event"] for g in site["groups"]}
                           for cid, site in report["idp"].items()}
    return report


def site_report(idp: SiteIdp) -> dict[str, Any]:
    """One site's idp section: the plan, the accountant, the records the cut-off dropped,
    and per group its rate, planned and spent epsilon and the steps run as a DpEvent."""
    assert idp.ledger is not None
    steps = idp.ledger.steps_done
    groups = [{**g, "key": group.key, "dp_event": idp.plan.group_dp_event(group, steps)}
              for g, group in zip(idp.ledger.report(), idp.plan.groups, strict=True)]
    return {**idp.plan.report(), "accountant": idp.plan.bound, "steps_done": steps,
            "dropped_records": idp.groups.dropped_records, "groups": groups}


REMOTE_DESCRIPTION = ("site DP-SGD with individual privacy assignment: each site plans its "
                      "own rate groups from its own table and budgets, and its ledger "
                      "charges and caps every group (the coordinator keeps no budget)")


def remote_report(report: dict[str, Any]) -> dict[str, Any]:
    """The coordinator's report under ``--unit patient-idp`` (``--role coordinator``): it
    knows no group, rate, noise or epsilon of any site, so its rounds carry ``epsilon``
    None; every site's per-group epsilons are in that site's own ledger."""
    _report_mechanism(report, REMOTE_DESCRIPTION, "each site's ledger")
    return report


def plan_summary(settings: TrainSettings, sites: dict[int, Site], out: dict[str, Any]) -> None:
    """``secagg train --plan`` under ``--unit patient-idp``: every site's rate groups and the
    largest group epsilon after each round, in place of the patient-unit schedule
    (``sites``: the run's sites, numbered from 1)."""
    out["description"] = configure(settings, sites)
    budget = FederationBudget(settings, sites)
    eps = [budget._worst(r)[0] for r in range(1, settings.rounds + 1)]
    for key in ("noise_multiplier", "effective_noise_multiplier", "sample_rate",
                "count_stddev"):
        out.pop(key, None)
    out.update(mechanism="sampled Gaussian with individual per-record rates per rate group "
                         "(see 'idp')", accountant=settings.accountant,
               epsilon_after=eps, epsilon_final=eps[-1],
               rounds_run=settings.rounds, rounds_affordable=settings.rounds,
               idp={str(cid): s.idp.plan.report() for cid, s in sites.items()
                    if s.idp is not None}, sources=PLAN_SOURCES)
