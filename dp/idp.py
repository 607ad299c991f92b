"""Patient-level DP by individual privacy assignment (docs/patient_privacy.md).

Record-level DP-SGD in which the records of a patient with k records are treated so that the
patient's k records *together* meet the patient's target (epsilon, delta): Kaiser, Eigenmann,
Rueckert, Kaissis, "User-level differential privacy in medical machine learning by individual
privacy assignment". Patients are put in *rate groups* by (records after the cut-off, target
epsilon); every group gets

* ``method="sampling"`` (the paper's strategy 1): its own per-record Poisson rate ``q_g``;
  one noise multiplier ``z`` for everyone, the smallest at which every group can meet its
  target and the groups' largest rates reach plain DP-SGD's rate on (record-weighted)
  average; the largest rates are then scaled to that mean (same expected batch).
  Patients with fewer records get higher rates (:func:`_plan_rates`).
* ``method="clipping"`` (strategy 2): one rate for every record, a per-record clip norm
  ``c_g`` (the per-record sensitivity), the largest that meets the target; ``z`` is chosen
  so the record-weighted mean clip equals the reference clip norm.
* ``method="uniform"`` (baselines): one rate and one clip for everyone, the noise chosen for
  the most demanding group (with ``max_records`` this is the paper's naive cut-off baseline).

Individual budgets (Boenisch et al. 2023, "Have it your way: individualized privacy
assignment for DP-SGD") are the same construction with a per-patient target epsilon.

A patient's guarantee is accounted by ``bound``:

* ``"rdp"``: the RDP of the patient's mixture of Gaussians
  (:func:`dp.accounting.group_gaussian_rdp`), composed over steps, converted once;
* ``"pld"``: the privacy loss distribution of the same mixture, by dp-accounting
  (:func:`dp.accounting.group_gaussian_pld_epsilon`; far tighter for large groups, where
  RDP's high orders are dominated by all k records being sampled);
* ``"group-privacy"``: record-level (epsilon_r, delta_r) of Opacus' sampled-Gaussian RDP,
  then approximate-DP group privacy for k records, ``(k eps_r, k e^((k-1) eps_r) delta_r)``
  (what the paper's implementation uses; looser).

**Every parameter is public.** The rate groups are the operator's *declared classes*
(:class:`IdpClasses`: the records-per-patient cut K, hence the record classes
``accounted_records(1..K)``, and the target classes), never the sizes found in the table; the
planner weighs the classes by declared, public weights (default: the one-record classes), never
by how many patients each holds. A patient's own count only picks its class (which changes no
other patient's rate, noise or clip); a target between two classes is rounded down. So adding
or removing a patient, even one with 92 records, leaves the noise multiplier, every class's
rate and clip unchanged (``tests/dp/test_public_parameters.py``). The patients per class stay
at the site (its report and ledger), never in a mechanism parameter.
This module needs no torch; the training step is :mod:`dp.idp_engine`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import numpy.typing as npt

from dp.accounting import (
    F64,
    _check,
    gaussian_rdp,
    group_gaussian_event,
    group_gaussian_pld_epsilon,
    group_gaussian_rdp,
    rdp_to_epsilon,
)
from dp.budget import Budget, PrivacyBudget, RdpRound
from dp.errors import PrivacyConfigError
from dp.idp_groups import DEFAULT_MAX_RECORDS as DEFAULT_MAX_RECORDS
from dp.idp_groups import EXACT_RECORDS as EXACT_RECORDS
from dp.idp_groups import IdpClasses as IdpClasses
from dp.idp_groups import PatientGroups as PatientGroups
from dp.idp_groups import accounted_records as accounted_records
from dp.idp_groups import group_patients as group_patients
from dp.idp_search import largest, largest_log, largest_log_in, log_ratio
from dp.randomness import RandomSource, SystemRandom, uniform_words

METHODS = ("sampling", "clipping", "uniform")
BOUNDS = ("rdp", "pld", "group-privacy")
#: Highest RDP order used for patient groups (below epsilon ~0.3 at delta 1e-5 it is loose).
MAX_ORDER = 64
#: Orders for the record-level RDP under group privacy (integer orders: Opacus' fast path).
_INTEGER_ORDERS = (*range(2, 65), 72, 80, 96, 112, 128)
#: Noise multipliers searched by the planner.
Z_RANGE = (0.3, 500.0)
#: The smallest per-record rate the planner gives a group: a group that cannot meet its
#: target at this rate is infeasible at that noise.
MIN_RATE = 1e-6


def poisson_sample(rates: F64, source: RandomSource | None = None) -> npt.NDArray[np.int64]:
    """Indices ``i`` drawn independently with probability ``rates[i]``, with coins from the
    cryptographic source (amplification by sampling assumes the sample stays secret)."""
    u = uniform_words(source or SystemRandom(), len(rates)) >> np.uint64(11)
    return np.flatnonzero(u.astype(np.float64) / 2.0**53 < rates)


@dataclass(frozen=True)
class RateGroup:
    """Patients with the same accounted number of (kept) records and the same target
    epsilon (``records``: :func:`accounted_records` of each patient's count)."""

    records: int
    target_epsilon: float
    patients: int
    sample_rate: float
    clip_norm: float
    epsilon: float
    """Accounted patient-level epsilon after the plan's steps (at most ``target_epsilon``)."""

    @property
    def key(self) -> str:
        """The group's name in a site's ledger: its patients' (kept) records and target."""
        return f"records={self.records},target={self.target_epsilon!r}"

    def as_dict(self) -> dict[str, Any]:
        return {"records": self.records, "target_epsilon": self.target_epsilon,
                "patients": self.patients, "sample_rate": self.sample_rate,
                "clip_norm": self.clip_norm, "epsilon": self.epsilon}


def max_order(target_epsilon: float | None, delta: float) -> int:
    """The highest RDP order a group is accounted at: about three times the order at which
    the conversion term ``log(1/delta) / (a - 1)`` alone equals the target (the optimum lies
    well below it), between 12 and :data:`MAX_ORDER`. The cost of a group's RDP grows with
    the square of it (every order expands a polynomial of degree a k); fewer orders only
    loosen the bound."""
    if target_epsilon is None:
        return MAX_ORDER
    return int(min(MAX_ORDER, max(12, math.ceil(1 + 3 * math.log(1 / delta) / target_epsilon))))


def patient_epsilon(noise_multiplier: float, sample_rate: float, records: int, steps: int,
                    delta: float, bound: str = "rdp", target_epsilon: float | None = None
                    ) -> float:
    """Patient-level epsilon after ``steps`` DP-SGD steps, for a patient whose ``records``
    records are each Poisson-sampled at ``sample_rate`` and clipped to C, noise ``z C``.

    ``bound="group-privacy"`` needs ``target_epsilon``: delta is split as
    ``delta_r = delta / (k e^((k-1) target/k))``, so an answer at most the target certifies
    (answer, <= delta); an answer above the target is only a lower estimate of the cost.
    """
    if steps < 1:
        return 0.0
    if bound == "rdp":
        rdp = group_gaussian_rdp(noise_multiplier, sample_rate, records, steps,
                                 max_order=max_order(target_epsilon, delta))
        return rdp_to_epsilon(rdp, delta)
    if bound == "pld":
        return group_gaussian_pld_epsilon(noise_multiplier, sample_rate, records, steps, delta)
    if bound == "group-privacy":
        if target_epsilon is None:
            raise PrivacyConfigError("bound='group-privacy' needs the target epsilon")
        k = records
        delta_r = delta / (k * math.exp((k - 1) * target_epsilon / k))
        rdp = gaussian_rdp(noise_multiplier, sample_rate, steps, _INTEGER_ORDERS)
        return k * rdp_to_epsilon(rdp, delta_r, _INTEGER_ORDERS)
    raise PrivacyConfigError(f"bound must be one of {', '.join(BOUNDS)}, got {bound!r}")


@dataclass(frozen=True)
class IdpPlan:
    """Rates, clips and noise of one individually-assigned DP-SGD run, fixed before training."""

    method: str
    bound: str
    noise_multiplier: float
    """Noise stddev is ``noise_multiplier * clip_norm`` (the reference clip)."""
    clip_norm: float
    steps: int
    delta: float
    max_records: int | None
    groups: tuple[RateGroup, ...]
    weights: tuple[float, ...] = ()
    """The public class weights the plan's mean rate is taken over (one per group)."""

    @property
    def planned_mean_rate(self) -> float:
        """The mean per-record rate over the public class weights: ``sample_rate`` for
        ``method="sampling"`` (unless the noise cap left it out of reach)."""
        w = self.weights or tuple(1.0 for _ in self.groups)
        return sum(x * g.sample_rate for x, g in zip(w, self.groups, strict=True)) / sum(w)

    @property
    def records(self) -> int:
        return sum(g.records * g.patients for g in self.groups)

    @property
    def mean_sample_rate(self) -> float:
        """Record-weighted mean rate over the site's own patients (a site-local figure for
        its report; the planner's mean is over the declared class weights)."""
        records = self.records
        return (sum(g.sample_rate * g.records * g.patients for g in self.groups) / records
                if records else 0.0)

    @property
    def expected_batch_size(self) -> float:
        return sum(g.sample_rate * g.records * g.patients for g in self.groups)

    def group_epsilon(self, group: RateGroup, steps: int) -> float:
        """The group's patient-level epsilon after ``steps`` steps."""
        return patient_epsilon(self.noise_multiplier * self.clip_norm / group.clip_norm,
                               group.sample_rate, group.records, steps, self.delta, self.bound,
                               group.target_epsilon)

    def group_rdp(self, group: RateGroup, steps: int) -> F64:
        """RDP curve (at :data:`dp.accounting.ORDERS`) of ``steps`` steps for one patient of
        ``group`` (``bound="rdp"`` only: group privacy is not an RDP statement)."""
        if self.bound != "rdp":
            raise PrivacyConfigError("per-step RDP exists for bound='rdp' only")
        return group_gaussian_rdp(self.noise_multiplier * self.clip_norm / group.clip_norm,
                                  group.sample_rate, group.records, steps,
                                  max_order=max_order(group.target_epsilon, self.delta))

    def group_events(self, steps: int) -> list[Any]:
        """One :class:`dp.budget.RdpRound` per group: ``steps`` steps for one of its patients
        (what :class:`GroupLedger` and a site's :class:`dp.policy.Ledger` compose)."""
        return [RdpRound.from_array(self.group_rdp(g, steps), "idp",
                                    {"records": g.records, "sample_rate": g.sample_rate,
                                     "noise_multiplier": self.noise_multiplier * self.clip_norm
                                     / g.clip_norm, "steps": steps})
                for g in self.groups]

    def group_dp_event(self, group: RateGroup, steps: int) -> dict[str, Any]:
        """``steps`` steps for one patient of ``group`` as a dp-accounting ``DpEvent`` (JSON,
        :func:`dp.audit.recompute_epsilon` composes it): the mixture over Binomial(k, q)
        records sampled of Gaussians of sensitivity m, whatever ``bound`` the plan used."""
        return group_gaussian_event(self.noise_multiplier * self.clip_norm / group.clip_norm,
                                    group.sample_rate, group.records, steps)

    def describe(self) -> str:
        return (f"individual privacy assignment ({self.method}, {self.bound} accounting): noise "
                f"multiplier {self.noise_multiplier:.3f}, clip {self.clip_norm}, mean record "
                f"rate {self.mean_sample_rate:.4f}, {len(self.groups)} groups, {self.steps} "
                "steps" + (f", at most {self.max_records} records per patient"
                           if self.max_records else ""))

    def report(self) -> dict[str, Any]:
        return {"method": self.method, "bound": self.bound,
                "noise_multiplier": self.noise_multiplier, "clip_norm": self.clip_norm,
                "steps": self.steps, "delta": self.delta, "max_records": self.max_records,
                "planned_mean_rate": self.planned_mean_rate, "weights": list(self.weights),
                "mean_sample_rate": self.mean_sample_rate,
                "groups": [g.as_dict() for g in self.groups], "sources": PLAN_SOURCES}


#: Where every figure of a patient-idp plan comes from (``secagg train --plan``, reports):
#: ``operator`` (declared), ``public`` (computed from declared figures only), ``site-local``
#: (from the site's records; stays at the site, reaches no mechanism).
PLAN_SOURCES = {
    "max_records": "operator (--max-records-per-patient: the declared record classes)",
    "targets": "operator (--epsilon, or --budget-classes with a budget column)",
    "weights": "public (declared class weights: the one-record classes)",
    "sample_rate": "operator (--sample-rate: the one-record classes' per-record rate)",
    "clip_norm": "operator (--clip-norm)", "steps": "operator (--rounds x steps per round)",
    "delta": "operator (--delta)",
    "noise_multiplier": "public (planned from the declared classes and weights)",
    "groups.sample_rate": "public (planned from the declared classes and weights)",
    "groups.clip_norm": "public (planned from the declared classes and weights)",
    "groups.epsilon": "public (the accountant at the planned rate and noise)",
    "groups.patients": "site-local (the site's own count; in no mechanism parameter)",
    "mean_sample_rate": "site-local (record-weighted over the site's own patients)",
    "noised": "none: no patient-idp figure is released through a noised channel; the counts "
              "are used by no mechanism",
}


def plan_idp(groups: PatientGroups, *, delta: float, sample_rate: float, steps: int,
             clip_norm: float = 1.0, method: str = "sampling", bound: str = "rdp",
             max_records: int | None = None, noise_multiplier: float | None = None,
             weights: Sequence[float] | None = None) -> IdpPlan:
    """Rates and clips per group so that every patient's epsilon is at most its target.

    Reads only the groups' classes ``(records, target)`` and the public ``weights`` (one per
    group; default 1 on the one-record groups: :meth:`IdpClasses.class_weights`), never how
    many patients a group holds. ``sample_rate`` is plain DP-SGD's per-record rate: the
    weighted mean rate of the plan (``method="sampling"``; by default the rate of a patient
    with one record) or every record's rate (the other methods). The noise multiplier is found
    here unless given. ``max_records`` only labels the plan; the cut-off itself is applied by
    :func:`group_patients`.
    """
    if method not in METHODS:
        raise PrivacyConfigError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    if bound not in BOUNDS:
        raise PrivacyConfigError(f"bound must be one of {', '.join(BOUNDS)}, got {bound!r}")
    _check(noise_multiplier or 1.0, sample_rate, steps, delta)
    if steps < 1:
        raise PrivacyConfigError(f"steps must be >= 1, got {steps}")
    if not clip_norm > 0:
        raise PrivacyConfigError(f"clip norm must be > 0, got {clip_norm}")
    sizes = groups.sizes
    if weights is None:
        weights = [1.0 if k == 1 else 0.0 for k, _, _ in sizes]
        if not any(weights):
            weights = [1.0 / k for k, _, _ in sizes]  # no one-record class: each class alike
    weight = np.asarray(weights, dtype=np.float64)
    if weight.shape != (len(sizes),) or weight.min() < 0 or not weight.sum() > 0:
        raise PrivacyConfigError(f"need {len(sizes)} non-negative public class weights, not "
                                 "all zero")

    def eps(z: float, q: float, k: int, target: float) -> float:
        return patient_epsilon(z, q, k, steps, delta, bound, target)

    if method == "sampling":
        noise_multiplier, qs = _plan_rates(eps, sizes, weight, sample_rate, noise_multiplier)
        clips = [clip_norm] * len(sizes)
    else:
        # z_g: the smallest noise multiplier (relative to the group's own clip) that fits.
        def excess(s: float, k: int, t: float) -> float:
            return eps(1.0 / s, sample_rate, k, t) - t

        scale = [largest(partial(excess, k=k, t=t), 1 / Z_RANGE[1], 1 / Z_RANGE[0])
                 for k, t, _ in sizes]
        if min(scale) <= 0:
            raise PrivacyConfigError(f"no noise multiplier up to {Z_RANGE[1]:g} meets the "
                                     "targets: raise them, or lower the sample rate or steps")
        need = [1.0 / s for s in scale]
        if method == "clipping":
            # record-weighted mean clip = clip_norm  <=>  z = sum(w) / sum(w / z_g)
            z = float(weight.sum() / np.dot(weight, 1.0 / np.asarray(need)))
            noise_multiplier = noise_multiplier or z
            clips = [clip_norm * noise_multiplier / z_g for z_g in need]
        else:
            noise_multiplier = noise_multiplier or max(need)
            if noise_multiplier < max(need) * (1 - 1e-9):
                raise PrivacyConfigError(f"noise multiplier {noise_multiplier:g} is below "
                                         f"the {max(need):.4g} the strictest group needs")
            clips = [clip_norm] * len(sizes)
        qs = [sample_rate] * len(sizes)
    out = []
    for (k, t, n), q, c in zip(sizes, qs, clips, strict=True):
        e = eps(noise_multiplier * clip_norm / c, q, k, t)
        if e > t * (1 + 1e-9):
            raise PrivacyConfigError(f"patients with {k} records would reach epsilon {e:.4g} "
                                     f"> their target {t:g}; raise the noise multiplier")
        out.append(RateGroup(k, t, n, q, c, e))
    return IdpPlan(method, bound, float(noise_multiplier), clip_norm, steps, delta,
                   max_records, tuple(out), tuple(float(w) for w in weight))


def _at(ratio: Callable[[float, float, int, float], float], q: float, s: float, *, k: int,
        t: float) -> float:
    """``ratio`` at rate ``q`` and noise multiplier ``1 / s`` (a search in ``s``)."""
    return ratio(q, 1.0 / s, k, t)


def _predict(known: dict[float, list[float]], z: float, i: int) -> float | None:
    """Group ``i``'s largest rate at ``z``, interpolated (log-log) from the two nearest
    noise multipliers already solved, or None."""
    near = sorted((x for x in known if known[x][i] > 0), key=lambda x: abs(math.log(x / z)))
    if len(near) < 2:
        return None
    (z1, z2) = near[:2]
    q1, q2 = known[z1][i], known[z2][i]
    slope = math.log(q2 / q1) / math.log(z2 / z1)
    return float(min(1.0, q1 * math.exp(slope * math.log(z / z1))))


def _plan_rates(eps: Callable[[float, float, int, float], float],
                sizes: Sequence[tuple[int, float, int]], weight: npt.NDArray[np.float64],
                sample_rate: float, fixed_z: float | None) -> tuple[float, list[float]]:
    """``method="sampling"``: the noise multiplier and every group's per-record rate.

    A group's *largest rate* at noise z is the largest q in [MIN_RATE, 1] whose patient
    epsilon is at most its target (0: infeasible at z). The noise is the smallest z (to
    1 %) at which every group is feasible and the record-weighted mean of the largest
    rates reaches ``sample_rate``, capped at ``Z_RANGE[1]`` (or ``fixed_z``); the rates are
    the largest rates scaled down so their mean is ``sample_rate`` (when the cap leaves it
    out of reach: the largest rates, the highest mean there is). Raises
    :class:`PrivacyConfigError` naming the one number to change when a group is infeasible
    at the cap.
    """
    total = float(weight.sum())
    known: dict[float, list[float]] = {}

    def ratio(q: float, z: float, k: int, t: float) -> float:
        return log_ratio(eps(z, q, k, t), t)

    def largest_rates(z: float) -> list[float]:
        if z in known:
            return known[z]
        below = max((x for x in known if x < z), default=None)
        above = min((x for x in known if x > z), default=None)
        out: list[float] = []
        for i, (k, t, _) in enumerate(sizes):
            lo = known[below][i] if below is not None and known[below][i] > 0 else MIN_RATE
            hi = known[above][i] if above is not None else 1.0
            if i and sizes[i - 1][1] == t and sizes[i - 1][0] < k and out[-1] > 0:
                hi = min(hi, out[-1])  # more records: a lower rate
            hi = max(hi, lo)
            guess = _predict(known, z, i)
            if guess is not None:  # a narrow bracket around log q interpolated in log z
                lo, hi = max(lo, guess / 1.02), min(hi, guess * 1.02)
            out.append(largest_log_in(partial(ratio, z=z, k=k, t=t), lo, hi * 1.001,
                                       MIN_RATE, 1.0, rel=5e-3, grow=1.5))
        known[z] = out
        return out

    def mean(z: float) -> float:
        return float(np.dot(weight, largest_rates(z)) / total)

    def feasible(z: float) -> bool:
        return min(largest_rates(z)) > 0

    if fixed_z is not None:
        z = fixed_z
    else:  # the smallest z whose largest rates reach the mean (infeasible groups count 0)
        # a lower bound to start from: one record at rate q for the strictest target
        # (some group of the plan samples at a rate >= q)
        t_min = min(t for _, t, _ in sizes)
        s_rec = largest_log(lambda s: log_ratio(eps(1.0 / s, sample_rate, 1, t_min), t_min),
                             1.0 / Z_RANGE[1], 1.0 / Z_RANGE[0], rel=1e-2)
        s_rec = s_rec or 1.0 / Z_RANGE[1]
        s = largest_log_in(lambda s: log_ratio(sample_rate, mean(1.0 / s) or 1e-300),
                            s_rec / 1.1, s_rec, 1.0 / Z_RANGE[1], 1.0 / Z_RANGE[0], rel=1e-2,
                            grow=1.2)
        z = 1.0 / s if s > 0 else Z_RANGE[1]
        for i, r in enumerate(largest_rates(z)):
            if r <= 0:  # then raise z until this group is feasible too
                k, t, _ = sizes[i]
                s = largest_log_in(partial(_at, ratio, MIN_RATE, k=k, t=t), 1.0 / z,
                                    1.0 / z, 1.0 / Z_RANGE[1], 1.0 / z, rel=5e-3, grow=1.3)
                z = 1.0 / s if s > 0 else Z_RANGE[1]
    if not feasible(z):
        worst = [i for i, r in enumerate(largest_rates(z)) if r <= 0]
        k, t, _ = max((sizes[i] for i in worst), key=lambda g: g[0] / g[1])
        floor = eps(Z_RANGE[1], MIN_RATE, k, t)
        if fixed_z is not None and floor <= t:
            s = largest_log(lambda s: log_ratio(eps(1.0 / s, MIN_RATE, k, t), t),
                             1.0 / Z_RANGE[1], 1.0 / fixed_z)
            raise PrivacyConfigError(
                f"noise multiplier {fixed_z:g} cannot meet the target {t:g} of patients with "
                f"{k} records at any sampling rate: raise it to at least {1.0 / s:.4g}")
        raise PrivacyConfigError(
            f"no noise multiplier up to {Z_RANGE[1]:g} meets the target {t:g} of patients "
            f"with {k} records at any sampling rate: raise that epsilon to at least "
            f"{floor * 1.01:.4g}")
    rates = largest_rates(z)
    scale = min(1.0, sample_rate / mean(z))
    return z, [r * scale for r in rates]


class GroupLedger(Budget[int]):
    """Every rate group's spending under a plan, kept across rounds (one per site).

    With ``bound="rdp"`` each group holds a :class:`dp.budget.PrivacyBudget` at its target
    and composes RDP; with ``"pld"`` or ``"group-privacy"`` the plan certifies its own
    ``steps`` (every step has the same rates and noise, so the epsilon after n steps is the
    group's figure for n steps, at most the planned one).
    """

    def __init__(self, plan: IdpPlan) -> None:
        self.plan = plan
        self.budgets = [PrivacyBudget(g.target_epsilon, plan.delta) for g in plan.groups]
        self.steps_done = 0

    def _events(self, steps: int) -> list[Any]:
        return self.plan.group_events(steps)

    def can_run(self, steps: int) -> bool:
        """Whether ``steps`` more steps keep every group within its target."""
        if self.plan.bound != "rdp":
            return self.steps_done + steps <= self.plan.steps
        return all(b.can_run(e) for b, e in zip(self.budgets, self._events(steps), strict=True))

    def check(self, steps: int) -> None:
        """Raise :class:`dp.errors.BudgetExceeded` if ``steps`` more steps do not fit."""
        from dp.errors import BudgetExceeded

        if self.can_run(steps):
            return
        after = [self.plan.group_epsilon(g, self.steps_done + steps) for g in self.plan.groups]
        i = int(np.argmax([a - g.target_epsilon for a, g in zip(after, self.plan.groups,
                                                                 strict=True)]))
        g = self.plan.groups[i]
        raise BudgetExceeded(
            f"{steps} more steps would bring patients with {g.records} records to epsilon "
            f"{after[i]:.4g} > their target {g.target_epsilon:g}; stop training here",
            epsilon_limit=g.target_epsilon, epsilon_after=after[i])

    def spend(self, steps: int) -> tuple[float, float]:
        """Record ``steps`` steps (checked first, :class:`dp.budget.Budget`); returns the
        largest group's spent ``(epsilon, delta)`` (:meth:`epsilons`: every group's)."""
        self.check(steps)
        if self.plan.bound == "rdp":
            for budget, event in zip(self.budgets, self._events(steps), strict=True):
                budget.spend(event)
        self.steps_done += steps
        return self.spent

    @property
    def spent(self) -> tuple[float, float]:
        """The largest epsilon any rate group has spent, at the plan's delta."""
        if not self.steps_done:
            return (0.0, 0.0)
        return (max(self.epsilons()), self.plan.delta)

    def epsilons(self) -> list[float]:
        """Patient-level epsilon spent so far, per rate group."""
        if self.plan.bound == "rdp":
            return [b.spent[0] for b in self.budgets]
        return [self.plan.group_epsilon(g, self.steps_done) for g in self.plan.groups]

    def report(self) -> list[dict[str, Any]]:
        """The plan's groups with the epsilon spent so far."""
        return [{**g.as_dict(), "epsilon_spent": e}
                for g, e in zip(self.plan.groups, self.epsilons(), strict=True)]
