"""``--unit patient-idp``: site-mode DP-SGD with individual privacy assignment per site.

Each site plans its own rate groups from its own table (:func:`dp.idp.group_patients`:
records per patient, and each patient's budget from ``--budget-column`` or ``--epsilon``)
for the whole run (``rounds * steps`` steps, mean record rate ``--sample-rate``), keeps a
:class:`dp.idp.GroupLedger` across rounds, and trains each round with
:class:`dp.idp_engine.IdpSgd`. Sites hold disjoint patients and each site's release is
private on its own, so a patient's guarantee is its group's at its site
(docs/patient_privacy.md). The coordinator's side (its budget over every site's groups, the
report and the plan summary) is :mod:`fl.plan.idp`.

Across machines (``--role coordinator`` / ``--role site``) each site process does the same
from its own table (:class:`SitePatients`: records per patient and its ``--budget-column``,
capped by its operator's ``--epsilon``, never sent); its :class:`dp.ledger.Ledger` charges
every rate group its own cost before the site computes anything and refuses a round that
would take any group past its target. The coordinator only proposes the steps per round, the
mean record rate, the clip and the planned steps (:class:`fl.contribution.RoundTask`); it
keeps no budget of its own (:func:`fl.plan.idp.remote_report`).

Site mode only: distributed mode sums per-patient integer updates (docs/patient_privacy.md).
"""

from __future__ import annotations

import copy
import warnings
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch
from torch.utils.data import TensorDataset

from dp import (
    DEFAULT_MAX_RECORDS,
    GroupLedger,
    IdpClasses,
    group_patients,
    plan_idp,
)

if TYPE_CHECKING:
    from dp import IdpPlan, PatientGroups
    from fl.data import Table
    from fl.settings import TrainSettings
    from fl.vector import ParameterLayout


class IdpData(Protocol):
    """What a site's individual privacy needs of it: its id, its table (records per patient,
    budgets) and the table's tensors (:class:`fl.site.training.Site`)."""

    site_id: int
    table: Table
    x: torch.Tensor
    y: torch.Tensor


class IdpTask(Protocol):
    """What a patient-idp round proposes that a site plans its groups for
    (:class:`fl.contribution.RoundTask`): the mean record rate, the run's planned steps and
    the clip."""

    @property
    def sample_rate(self) -> float: ...

    @property
    def plan_steps(self) -> int | None: ...

    @property
    def clip_norm(self) -> float: ...


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
    def for_site(cls, site: IdpData, settings: TrainSettings) -> SiteIdp:
        """``--role all``: plan the site's groups for the whole run."""
        groups = site_groups(site.site_id, site.table, settings.epsilon,
                             settings.max_records_per_patient, settings.budget_classes)
        plan = plan_idp(groups, delta=settings.delta, sample_rate=settings.sample_rate,
                        steps=settings.rounds * settings.steps_per_round,
                        clip_norm=settings.clip_norm, bound=settings.accountant,
                        max_records=settings.max_records_per_patient or DEFAULT_MAX_RECORDS)
        return cls(groups, plan, GroupLedger(plan))

    def update(self, site: IdpData, model: torch.nn.Module, layout: ParameterLayout, *,
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

    def for_task(self, task: IdpTask) -> SiteIdp:
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
