"""Patient-idp's rate groups: which patient, and which record, is in which group, from the
operator's declared classes (:class:`IdpClasses`) and the patients' records and targets
(:func:`group_patients`); the plans over those groups are :mod:`dp.idp`."""

from __future__ import annotations

import hashlib
import math
from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import numpy.typing as npt

from dp.errors import PrivacyConfigError

#: Patients with up to this many records are grouped by their exact count; above it by
#: :func:`accounted_records`.
EXACT_RECORDS = 16
#: The records-per-patient cut K when the operator declares none (``--max-records-per-patient``):
#: a patient's first K records are used, the rest never sampled; the record classes are
#: ``accounted_records(1..K)``.
DEFAULT_MAX_RECORDS = 8


@dataclass(frozen=True)
class PatientGroups:
    """Which rate group each patient (and each record) belongs to, and which records are kept."""

    keys: list[Hashable]
    """Distinct patients, in order of first appearance."""
    group_of_patient: npt.NDArray[np.int64]
    record_group: npt.NDArray[np.int64]
    """Group index of every record; -1 for a record beyond the cut-off (never used)."""
    sizes: tuple[tuple[int, float, int], ...]
    """``(records, target_epsilon, patients)`` per group, in group-index order. With declared
    classes the groups are every declared class (a class may hold no patient); the patient
    counts stay at the site (reports), the planner never reads them."""
    excluded_patients: int = 0
    """Patients whose target is below the smallest declared target class (never sampled)."""

    @property
    def dropped_records(self) -> int:
        """Records beyond the cut-off (never sampled)."""
        return int(np.count_nonzero(self.record_group < 0))

    def digest(self) -> str:
        """SHA-256 of which patient is in which group (a site's ledger matches its per-group
        spending to the same grouping only; it stays at the site)."""
        text = "\n".join(f"{k!r}\t{self.sizes[g][0]}\t{self.sizes[g][1]!r}"
                         for k, g in zip(self.keys, self.group_of_patient.tolist(), strict=True))
        return hashlib.sha256(text.encode()).hexdigest()


def accounted_records(records: int) -> int:
    """The group size a patient with ``records`` kept records is accounted at: exact up to
    :data:`EXACT_RECORDS`, above it the next of four sizes per doubling (17..20 -> 20,
    21..24 -> 24, ..., 81..96 -> 96). A larger group only overstates the patient's loss (an
    upper bound) and keeps a heavy-tailed table (1 to 92 records) at ~26 rate groups, each
    planned on its own."""
    if records <= EXACT_RECORDS:
        return records
    step = 1 << max(0, (records - 1).bit_length() - 3)  # a quarter of the enclosing power
    return -(-records // step) * step


@dataclass(frozen=True)
class IdpClasses:
    """The operator's declared rate classes: public, fixed before the data is read.

    ``max_records``: the cut K (a patient's first K records are used); the record classes are
    ``accounted_records(1..K)``. ``targets``: the target-epsilon classes (a patient's budget
    is rounded down to the largest class at or below it; below the smallest class a patient
    is never sampled). ``weights``: one public weight per class (in :meth:`classes` order) for
    the planner's mean rate; default: 1 on each one-record class, 0 elsewhere (so
    ``sample_rate`` is the rate of a patient with one record)."""

    max_records: int = DEFAULT_MAX_RECORDS
    targets: tuple[float, ...] = ()
    weights: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.max_records, int) or self.max_records < 1:
            raise PrivacyConfigError(f"max_records must be an integer >= 1, got "
                                     f"{self.max_records}")
        if not self.targets or not all(math.isfinite(t) and t > 0 for t in self.targets):
            raise PrivacyConfigError(f"declare at least one positive target class, got "
                                     f"{list(self.targets)}")
        if self.weights is not None and (len(self.weights) != len(self.classes())
                                         or min(self.weights) < 0 or sum(self.weights) <= 0):
            raise PrivacyConfigError(f"need {len(self.classes())} non-negative class weights "
                                     "(one per declared class), not all zero")

    def record_classes(self) -> list[int]:
        return sorted({accounted_records(k) for k in range(1, self.max_records + 1)})

    def classes(self) -> list[tuple[int, float]]:
        """Every declared ``(records, target)`` class, in group-index order."""
        return [(k, t) for t in sorted(set(self.targets)) for k in self.record_classes()]

    def class_weights(self) -> list[float]:
        if self.weights is not None:
            return list(self.weights)
        return [1.0 if k == 1 else 0.0 for k, _ in self.classes()]

    def target_class(self, target: float) -> float | None:
        """The largest declared target at or below ``target`` (None: below them all)."""
        below = [t for t in self.targets if t <= target * (1 + 1e-12)]
        return max(below) if below else None

    def report(self) -> dict[str, Any]:
        return {"max_records": self.max_records, "targets": sorted(set(self.targets)),
                "record_classes": self.record_classes(), "weights": self.class_weights()}


def group_patients(patient_ids: Sequence[Hashable], target_epsilon: float | Sequence[float],
                   max_records: int | None = None, classes: IdpClasses | None = None
                   ) -> PatientGroups:
    """Rate groups by (kept records, target). ``target_epsilon`` is one number or one per
    *record* (a budget column: it must be the same for all records of a patient).

    With ``classes`` (what every run uses) the groups are the declared classes, whatever the
    table holds, and ``max_records`` is the classes' cut. Without, the groups are the
    (records, target) pairs found in the table: for experiments only, since then the set of
    groups, hence the plan, depends on the records.

    With ``max_records`` a patient keeps the first ``max_records`` of its records (in table
    order); the rest are never sampled.
    """
    if classes is not None:
        if max_records is not None and max_records != classes.max_records:
            raise PrivacyConfigError(f"max_records {max_records} differs from the declared "
                                     f"classes' cut {classes.max_records}")
        max_records = classes.max_records
    n = len(patient_ids)
    if n == 0:
        raise PrivacyConfigError("no records")
    if max_records is not None and max_records < 1:
        raise PrivacyConfigError(f"max_records must be >= 1, got {max_records}")
    targets = (np.full(n, float(cast(float, target_epsilon))) if np.isscalar(target_epsilon)
               else np.asarray(target_epsilon, dtype=np.float64))
    if targets.shape != (n,):
        raise PrivacyConfigError(f"need one target epsilon per record ({n}), got "
                                 f"{targets.shape}")
    if not np.all(np.isfinite(targets) & (targets > 0)):
        bad = targets[~(np.isfinite(targets) & (targets > 0))][:3].tolist()
        raise PrivacyConfigError(f"target epsilons must be positive numbers, got {bad}")
    keys = list(dict.fromkeys(patient_ids))
    position = {k: i for i, k in enumerate(keys)}
    patient_of = np.fromiter((position[p] for p in patient_ids), dtype=np.int64, count=n)
    first = np.full(len(keys), np.nan)
    seen = np.zeros(len(keys), dtype=np.int64)
    kept = np.zeros(n, dtype=bool)
    for i, p in enumerate(patient_of):
        if math.isnan(first[p]):
            first[p] = targets[i]
        elif targets[i] != first[p]:
            raise PrivacyConfigError(
                f"patient {keys[p]!r} has two target epsilons ({first[p]:g} and "
                f"{targets[i]:g}); a patient's budget must be the same on all its records")
        if max_records is None or seen[p] < max_records:
            kept[i] = True
            seen[p] += 1
    labels: list[tuple[int, float | None]] = list(zip(
        [accounted_records(int(k)) for k in seen.tolist()],
        [classes.target_class(t) if classes is not None else t for t in first.tolist()],
        strict=True))
    if classes is not None:
        order = classes.classes()
    else:
        order = sorted({(k, t) for k, t in labels if t is not None}, key=lambda g: (g[1], g[0]))
    index: dict[tuple[int, float | None], int] = {t: i for i, t in enumerate(order)}
    group_of_patient = np.array([index.get(t, -1) for t in labels], dtype=np.int64)
    counts = Counter(labels)
    record_group = np.where(kept & (group_of_patient[patient_of] >= 0),
                            group_of_patient[patient_of], -1)
    return PatientGroups(keys, group_of_patient, record_group,
                         tuple((k, e, counts[(k, e)]) for k, e in order),
                         int(np.count_nonzero(group_of_patient < 0)))
