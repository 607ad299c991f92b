"""``--unit patient-idp``: site-mode DP-SGD with individual privacy assignment per site.

Each site plans its own rate groups from its own table (:func:`dp.idp.group_patients`:
records per patient, and each patient's budget from ``--budget-column`` or ``--epsilon``)
for the whole run (``rounds * steps`` steps, mean record rate ``--sample-rate``), keeps a
:class:`dp.idp.GroupLedger` across rounds, and trains each round with
:class:`dp.idp_engine.IdpSgd`. Sites hold disjoint patients and each site's release is
private on its own, so a patient's guarantee is its group's at its site
(docs/patient_privacy.md). The coordinator's budget (:class:`FederationBudget`) reports the
largest epsilon of any rate group at any site per round and stops before any group would
pass its target; the report lists every site's groups.

Site mode with ``--role all`` only: distributed mode sums per-patient integer updates, and
the remote roles would need each site's plan in the round protocol.
"""

from __future__ import annotations

import copy
import warnings
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from dp.idp import GroupLedger, group_patients, plan_idp

if TYPE_CHECKING:
    from fl.data import Table
    from fl.settings import TrainSettings
    from fl.site import Site
    from fl.vector import ParameterLayout


class SiteIdp:
    """One site's plan, its records' groups and its ledger."""

    def __init__(self, site: Site, settings: TrainSettings) -> None:
        table = site.table
        if table.budgets is not None:
            if settings.epsilon is not None and float(table.budgets.max()) > settings.epsilon:
                raise ValueError(f"site {site.site_id}: --budget-column has a budget "
                                 f"{float(table.budgets.max()):g} above --epsilon "
                                 f"{settings.epsilon:g} (the largest budget allowed)")
            targets: Any = table.budgets
        elif settings.epsilon is not None:
            targets = settings.epsilon
        else:
            raise ValueError("--unit patient-idp needs --epsilon (every patient's budget) "
                             "or --budget-column COL")
        self.groups = group_patients(table.patient_ids.tolist(), targets)
        self.plan = plan_idp(self.groups, delta=settings.delta,
                             sample_rate=settings.sample_rate,
                             steps=settings.rounds * settings.steps_per_round,
                             clip_norm=settings.clip_norm)
        self.ledger = GroupLedger(self.plan)
        self.charged: set[int] = set()

    def update(self, site: Site, model: torch.nn.Module, layout: ParameterLayout, *,
               steps: int, lr: float, round_number: int | None = None) -> np.ndarray:
        """``w_local - w_global`` after ``steps`` steps; refuses (``BudgetExceeded``) a round
        that would take any of this site's groups past its target.

        A retried attempt of an already charged ``round_number`` is not charged again: an
        aborted round releases nothing and the coordinator charges each round once
        (:class:`fl.coordinator.Coordinator`, write-ahead).
        """
        from torch.utils.data import TensorDataset

        from dp.idp_engine import IdpSgd

        charge = round_number is None or round_number not in self.charged
        if charge:
            self.ledger.check(steps)
        local = copy.deepcopy(model)
        local.train()
        optimizer = torch.optim.SGD([p for p in local.parameters() if p.requires_grad], lr=lr)
        engine = IdpSgd(local, optimizer, TensorDataset(site.x, site.y),
                        loss_fn=torch.nn.CrossEntropyLoss(reduction="sum"), plan=self.plan,
                        record_group=self.groups.record_group, ledger=self.ledger)
        with warnings.catch_warnings():  # inputs need no grad; Opacus' hook warns about it
            warnings.simplefilter("ignore", UserWarning)
            for _ in range(steps):
                engine.step()
        if charge:
            self.ledger.spend(steps)
            if round_number is not None:
                self.charged.add(round_number)
        update: np.ndarray = layout.to_vector(engine.model) - layout.to_vector(model)
        engine.close()
        return update


def configure(settings: TrainSettings, sites: dict[int, Site]) -> str:
    """Plan every site (``--unit patient-idp``); returns the run's privacy description."""
    for site in sites.values():
        site.idp = SiteIdp(site, settings)
    groups = sum(len(s.idp.plan.groups) for s in sites.values() if s.idp is not None)
    zs = [s.idp.plan.noise_multiplier for s in sites.values() if s.idp is not None]
    return (f"site DP-SGD with individual privacy assignment (per-record sampling rates per "
            f"rate group, RDP group accounting): {groups} rate groups over {len(sites)} "
            f"sites, noise multipliers {min(zs):.3f}-{max(zs):.3f}, clip "
            f"{settings.clip_norm}, mean record rate {settings.sample_rate}, "
            f"{settings.steps_per_round} steps per round")


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
            from dp.errors import BudgetExceeded

            after = self.epsilon_after(event)
            raise BudgetExceeded(f"round {self.rounds + 1} would take a rate group past its "
                                 "target", epsilon_limit=self.epsilon, epsilon_after=after)
        self.rounds += 1
        return self.spent

    @property
    def spent(self) -> tuple[float, float]:
        return (self._worst(self.rounds)[0] if self.rounds else 0.0,
                self.delta if self.rounds else 0.0)


def finish_report(settings: TrainSettings, sites: dict[int, Site], report: dict[str, Any],
                  description: str) -> dict[str, Any]:
    """The report of a ``--unit patient-idp`` run: the mechanism, and every site's rate groups
    (records, target, patients, rate, clip, planned and spent epsilon)."""
    plans = {cid: s.idp for cid, s in sites.items() if s.idp is not None}
    report["privacy"] = description
    report["model_info"]["privacy"] = description
    report["dp_events"] = None  # per-group RDP curves: see "idp"
    for release in report["releases"]:  # the coordinator's plan was only the round's task
        for key in ("noise_multiplier", "sample_rate", "count_stddev", "dp_event"):
            release.pop(key, None)
        release["mechanism"] = ("sampled Gaussian with individual per-record rates per rate "
                                "group at each site (see 'idp')")
    report["idp"] = {str(cid): {**p.plan.report(), "groups": p.ledger.report()}
                     for cid, p in plans.items()}
    return report


def plan_summary(settings: TrainSettings, tables: list[Table], out: dict[str, Any]) -> None:
    """``secagg train --plan`` under ``--unit patient-idp``: every site's rate groups and the
    largest group epsilon after each round, in place of the patient-unit schedule."""
    from fl.site import Site

    sites = {i + 1: Site(i + 1, t) for i, t in enumerate(tables)}
    out["description"] = configure(settings, sites)
    budget = FederationBudget(settings, sites)
    eps = [budget._worst(r)[0] for r in range(1, settings.rounds + 1)]
    for key in ("noise_multiplier", "effective_noise_multiplier", "sample_rate",
                "count_stddev"):
        out.pop(key, None)
    out.update(mechanism="sampled Gaussian with individual per-record rates per rate group "
                         "(see 'idp')", epsilon_after=eps, epsilon_final=eps[-1],
               rounds_run=settings.rounds, rounds_affordable=settings.rounds,
               idp={str(cid): s.idp.plan.report() for cid, s in sites.items()
                    if s.idp is not None})
