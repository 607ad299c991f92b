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

Across machines (``--role coordinator`` / ``--role site``) each site process does the same
from its own table (:class:`SitePatients`: records per patient and its ``--budget-column``,
capped by its operator's ``--epsilon``, never sent); its :class:`dp.ledger.Ledger` charges
every rate group its own cost before the site computes anything and refuses a round that
would take any group past its target. The coordinator only proposes the steps per round, the
mean record rate, the clip and the planned steps (:class:`fl.contribution.RoundTask`); it
keeps no budget of its own (:func:`remote_report`).

Site mode only: distributed mode sums per-patient integer updates (docs/patient_privacy.md).
"""

from __future__ import annotations

import copy
import warnings
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.utils.data import TensorDataset

from dp import (
    DEFAULT_MAX_RECORDS,
    PLAN_SOURCES,
    BudgetExceeded,
    GroupLedger,
    IdpClasses,
    group_patients,
    plan_idp,
)

if TYPE_CHECKING:
    from dp import IdpPlan, PatientGroups
    from fl.contribution import RoundTask
    from fl.coordinator import Coordinator
    from fl.data import Table
    from fl.settings import TrainSettings
    from fl.site.training import Site
    from fl.vector import ParameterLayout


def declared_classes(epsilon: float | None, max_records: int | None,
                     budget_classes: tuple[float, ...] | None, budget_column: bool
                     ) -> IdpClasses:
    """The operator's declared rate classes (public, fixed before the table is read): the
    cut ``--max-records-per-patient`` (default :data:`dp.idp.DEFAULT_MAX_RECORDS`) and the
    target classes: ``--budget-classes`` with a budget column, else ``--epsilon``."""
    if budget_classes:
        targets = tuple(budget_classes)
        if epsilon is not None and max(targets) > epsilon:
            raise ValueError(f"--budget-classes has a class {max(targets):g} above --epsilon "
                             f"{epsilon:g} (the largest budget allowed)")
    elif budget_column:
        raise ValueError("--budget-column needs the declared target classes, "
                         "--budget-classes E1,E2,... (public; a patient's budget is rounded "
                         "down to a class): the classes must not be read from the column")
    elif epsilon is not None:
        targets = (epsilon,)
    else:
        raise ValueError("--unit patient-idp needs --epsilon (every patient's budget) "
                         "or --budget-column COL with --budget-classes")
    return IdpClasses(max_records=max_records or DEFAULT_MAX_RECORDS, targets=targets)


def site_groups(site_id: int, table: Table, epsilon: float | None,
                max_records: int | None = None,
                budget_classes: tuple[float, ...] | None = None) -> PatientGroups:
    """A site's rate groups: the declared classes (:func:`declared_classes`); each patient's
    target is its ``--budget-column`` value (at most ``epsilon``) rounded down to a class,
    or ``epsilon``; a patient keeps its first K records (``--max-records-per-patient``)."""
    classes = declared_classes(epsilon, max_records, budget_classes, table.budgets is not None)
    if table.budgets is not None:
        if epsilon is not None and float(table.budgets.max()) > epsilon:
            raise ValueError(f"site {site_id}: --budget-column has a budget "
                             f"{float(table.budgets.max()):g} above --epsilon "
                             f"{epsilon:g} (the largest budget allowed)")
        targets: Any = table.budgets
    else:
        targets = classes.targets[0]
    return group_patients(table.patient_ids.tolist(), targets, classes=classes)


class SiteIdp:
    """One site's plan and its records' groups; ``ledger`` (``--role all``) keeps the
    spending in this process, None when the site's persistent :class:`dp.ledger.Ledger`
    charged the round before it was computed (the site role)."""

    def __init__(self, groups: PatientGroups, plan: IdpPlan,
                 ledger: GroupLedger | None) -> None:
        self.groups = groups
        self.plan = plan
        self.ledger = ledger
        self.charged: set[int] = set()

    @classmethod
    def for_site(cls, site: Site, settings: TrainSettings) -> SiteIdp:
        """``--role all``: plan the site's groups for the whole run."""
        groups = site_groups(site.site_id, site.table, settings.epsilon,
                             settings.max_records_per_patient, settings.budget_classes)
        plan = plan_idp(groups, delta=settings.delta, sample_rate=settings.sample_rate,
                        steps=settings.rounds * settings.steps_per_round,
                        clip_norm=settings.clip_norm, bound=settings.accountant,
                        max_records=settings.max_records_per_patient or DEFAULT_MAX_RECORDS)
        return cls(groups, plan, GroupLedger(plan))

    def update(self, site: Site, model: torch.nn.Module, layout: ParameterLayout, *,
               steps: int, lr: float, round_number: int | None = None,
               expected_batch: float | None = None) -> np.ndarray:
        """``w_local - w_global`` after ``steps`` steps; refuses (``BudgetExceeded``) a round
        that would take any of this site's groups past its target.

        A retried attempt of an already charged ``round_number`` is not charged again: an
        aborted round releases nothing and the coordinator charges each round once
        (:class:`fl.coordinator.Coordinator`, write-ahead).
        """
        from dp import IdpSgd

        charge = self.ledger is not None and (round_number is None
                                              or round_number not in self.charged)
        if charge:
            assert self.ledger is not None
            self.ledger.check(steps)
        local = copy.deepcopy(model)
        local.train()
        optimizer = torch.optim.SGD([p for p in local.parameters() if p.requires_grad], lr=lr)
        engine = IdpSgd(local, optimizer, TensorDataset(site.x, site.y),
                        loss_fn=torch.nn.CrossEntropyLoss(reduction="sum"), plan=self.plan,
                        record_group=self.groups.record_group, expected_batch=expected_batch)
        with warnings.catch_warnings():  # inputs need no grad; Opacus' hook warns about it
            warnings.simplefilter("ignore", UserWarning)
            for _ in range(steps):
                engine.step()
        if charge:
            assert self.ledger is not None
            self.ledger.spend(steps)
            if round_number is not None:
                self.charged.add(round_number)
        update: np.ndarray = layout.to_vector(engine.model) - layout.to_vector(model)
        engine.close()
        return update


class SitePatients:
    """A site process's patients under ``--unit patient-idp`` (the site role): its rate
    groups from its own table, computed once (the budget column is read here and never
    sent), and its plan for a proposed round, recomputed only when the coordinator proposes
    other parameters. ``epsilon``/``delta``: the site operator's budget; ``max_records``:
    its ``--max-records-per-patient``; ``budget_classes``: its declared target classes.
    Its ledger composes each group's RDP, so the site role plans with the RDP accountant."""

    def __init__(self, site_id: int, table: Table, *, epsilon: float | None,
                 delta: float, max_records: int | None = None,
                 budget_classes: tuple[float, ...] | None = None) -> None:
        self.groups = site_groups(site_id, table, epsilon, max_records, budget_classes)
        self.delta = delta
        self.max_records = max_records
        self._plans: dict[tuple[float, int, float], IdpPlan] = {}

    def for_task(self, task: RoundTask) -> SiteIdp:
        """The site's plan for ``task`` (raises :class:`dp.errors.PrivacyConfigError` if no
        plan meets every target: the site declines)."""
        if task.plan_steps is None:
            raise ValueError("a patient-idp task carries its planned steps")
        key = (task.sample_rate, task.plan_steps, task.clip_norm)
        if key not in self._plans:
            self._plans = {key: plan_idp(self.groups, delta=self.delta,
                                         sample_rate=task.sample_rate,
                                         steps=task.plan_steps, clip_norm=task.clip_norm,
                                         max_records=self.max_records or DEFAULT_MAX_RECORDS)}
        return SiteIdp(self.groups, self._plans[key], None)


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
        for cid in coordinator._cohort(r):
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
