"""Datasets for the federation: a real clinical set, a longitudinal EHR generator, user CSVs.

Every table carries a patient id per record, because the privacy unit is a patient
(docs/privacy.md): splits keep all records of one patient at one site and on one side of
the train/test split. Randomness here (splits, synthetic data) comes from seeded numpy
generators: it is simulation, not a secret.

* :func:`breast_cancer`: the Wisconsin diagnostic breast cancer set bundled with
  scikit-learn (569 patients, 30 features, malignant/benign); one record per patient.
* :func:`synthetic_ehr`: several visits per patient whose labels share the patient's latent
  risk, so record-level DP would under-protect a patient with many visits.
* :func:`load_csv`: a user's own table with a patient-id column and a label column.
* ``tcga-brca``: FLamby's Fed-TCGA-BRCA survival set, 6 natural centers
  (:func:`fl.survival.tcga_brca`).
* :func:`dirichlet_split`: non-IID sites, label proportions per site ~ Dirichlet(alpha).
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from .errors import FLError

DATASETS = ("breast-cancer", "ehr", "digits", "tcga-brca")


class DataError(FLError, ValueError):
    """The data cannot be used as given; the message says what to change."""


@dataclass(frozen=True)
class Table:
    """Records with features ``x`` (float32), integer labels ``y`` and ``patient_ids``."""

    x: npt.NDArray[np.float32]
    y: npt.NDArray[np.int64]
    patient_ids: npt.NDArray[np.int64]
    num_classes: int
    name: str = "table"
    standardized: bool = False
    """True when features are already on a common, public scale (no scaler needed)."""
    budgets: npt.NDArray[np.float64] | None = None
    """Per-record target epsilon of the record's patient (``--budget-column``), if any."""
    times: npt.NDArray[np.float64] | None = None
    """Survival data (:mod:`fl.survival`): each record's time to event or censoring; ``y``
    is then the event indicator (1 observed, 0 censored)."""

    def __post_init__(self) -> None:
        n = len(self.y)
        if self.x.ndim != 2 or len(self.x) != n or len(self.patient_ids) != n:
            raise DataError(f"{self.name}: x {self.x.shape}, y {self.y.shape} and patient_ids "
                            f"{self.patient_ids.shape} must have one row per record")
        if self.budgets is not None and self.budgets.shape != (n,):
            raise DataError(f"{self.name}: need one privacy budget per record")
        if self.times is not None and self.times.shape != (n,):
            raise DataError(f"{self.name}: need one survival time per record")

    def __len__(self) -> int:
        return len(self.y)

    @property
    def num_features(self) -> int:
        return int(self.x.shape[1])

    @property
    def num_patients(self) -> int:
        return int(np.unique(self.patient_ids).size)

    def subset(self, rows: npt.NDArray[np.int64], name: str | None = None) -> Table:
        return Table(self.x[rows], self.y[rows], self.patient_ids[rows], self.num_classes,
                     name or self.name, self.standardized,
                     None if self.budgets is None else self.budgets[rows],
                     None if self.times is None else self.times[rows])

    def rows_of_patients(self, patients: npt.ArrayLike) -> npt.NDArray[np.int64]:
        return np.flatnonzero(np.isin(self.patient_ids, np.asarray(patients)))

    def patient_labels(self) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """Distinct patients and each one's majority label (for stratified splits)."""
        patients, inverse = np.unique(self.patient_ids, return_inverse=True)
        counts = np.zeros((len(patients), self.num_classes), dtype=np.int64)
        np.add.at(counts, (inverse, self.y), 1)
        return patients, counts.argmax(axis=1)


def breast_cancer() -> Table:
    """scikit-learn's bundled Wisconsin diagnostic breast cancer data (works offline).

    The CSV scikit-learn ships is read directly when it can be found without importing
    scikit-learn: the import costs about two CPU-seconds, paid by every site process of a
    federation on one machine (``secagg train --role site``). The values are the same as
    ``sklearn.datasets.load_breast_cancer()``'s (tests/fl/test_data.py checks it).
    """
    import importlib.util

    spec = importlib.util.find_spec("sklearn")
    origin = spec.origin if spec is not None else None
    path = (Path(origin).parent / "datasets" / "data" / "breast_cancer.csv"
            if origin else None)
    if path is not None and path.is_file():
        raw = np.loadtxt(path, delimiter=",", skiprows=1, dtype=np.float64)
        x = raw[:, :-1].astype(np.float32)
        y = raw[:, -1].astype(np.int64)
    else:
        from sklearn.datasets import load_breast_cancer

        data = load_breast_cancer()
        x = np.asarray(data.data, dtype=np.float32)
        y = np.asarray(data.target, dtype=np.int64)
    return Table(x, y, np.arange(len(y), dtype=np.int64), 2, "breast-cancer")


def digits() -> Table:
    """scikit-learn's bundled handwritten digits: 1,797 grey-scale 8x8 images, 10 classes.

    A small image task for the convolutional model (``--model cnn``): each record is one
    image flattened row by row into 64 pixels on the public scale 0..1 (raw 0..16 / 16), so
    no feature scaler is needed. Each image counts as its own patient.
    """
    import importlib.util

    spec = importlib.util.find_spec("sklearn")
    origin = spec.origin if spec is not None else None
    path = Path(origin).parent / "datasets" / "data" / "digits.csv.gz" if origin else None
    if path is not None and path.is_file():
        raw = np.loadtxt(path, delimiter=",", dtype=np.float64)
        x, y = raw[:, :-1], raw[:, -1]
    else:
        from sklearn.datasets import load_digits

        data = load_digits()
        x, y = data.data, data.target
    return Table((np.asarray(x) / 16.0).astype(np.float32), np.asarray(y, dtype=np.int64),
                 np.arange(len(y), dtype=np.int64), 10, "digits", standardized=True)


def heavy_tailed_counts(num_patients: int, *, max_records: int = 92, single: float = 0.41,
                        seed: int = 0) -> np.ndarray:
    """Records per patient as in Kaiser et al.'s CheXpert setting: a share ``single`` of the
    patients have one record, the rest 2..``max_records`` from a discrete power law
    (P(k) ~ k^-1.6), and one patient has ``max_records``; fixed by ``seed``."""
    if num_patients < 2 or max_records < 2 or not 0 <= single < 1:
        raise DataError("need >= 2 patients, max_records >= 2 and 0 <= single < 1")
    rng = np.random.default_rng([seed, 0x7A1])
    k = np.arange(2, max_records + 1)
    p = k ** -1.6
    counts = np.where(rng.random(num_patients) < single, 1,
                      rng.choice(k, size=num_patients, p=p / p.sum()))
    counts[rng.integers(num_patients)] = max_records
    return counts.astype(np.int64)


def synthetic_ehr(num_patients: int = 1000, *, min_records: int = 2, max_records: int = 8,
                  num_features: int = 12, seed: int = 0,
                  record_counts: np.ndarray | None = None) -> Table:
    """Longitudinal EHR: each patient has ``min_records..max_records`` visits (or
    ``record_counts[i]`` visits, e.g. :func:`heavy_tailed_counts`).

    A patient has static covariates and a latent risk; each visit adds drifting lab values.
    The visit's label (e.g. an adverse event) depends on the visit's features and the
    patient's latent risk, so a patient's records are correlated, as in real EHR. Features
    are standardized by construction (``standardized=True``).
    """
    if not 1 <= min_records <= max_records:
        raise DataError("need 1 <= min_records <= max_records")
    if num_patients < 2 or num_features < 2:
        raise DataError("need at least 2 patients and 2 features")
    rng = np.random.default_rng([seed, 0xE11])
    weights = rng.normal(size=num_features) * 1.5 / math.sqrt(num_features / 4)
    counts = rng.integers(min_records, max_records + 1, size=num_patients)
    if record_counts is not None:
        if len(record_counts) != num_patients or int(np.min(record_counts)) < 1:
            raise DataError("record_counts: one count >= 1 per patient")
        counts = np.asarray(record_counts, dtype=np.int64)
        max_records = int(counts.max())
    patient = np.repeat(np.arange(num_patients, dtype=np.int64), counts)
    static = rng.normal(size=(num_patients, num_features))
    risk = rng.normal(scale=0.8, size=num_patients)
    visit = np.concatenate([np.arange(c) for c in counts]).astype(np.float64)
    drift = rng.normal(scale=0.3, size=(num_patients, num_features))
    noise = rng.normal(scale=0.6, size=(len(patient), num_features))
    x = (static[patient] + drift[patient] * visit[:, None] / max_records + noise)
    x = (x - x.mean(axis=0)) / x.std(axis=0)
    logits = x @ weights + risk[patient] - 0.3
    y = (rng.random(len(patient)) < 1 / (1 + np.exp(-logits))).astype(np.int64)
    return Table(x.astype(np.float32), y, patient, 2, "ehr", standardized=True)


def load_csv(path: str | Path, *, patient_column: str, label_column: str,
             feature_columns: list[str] | None = None,
             labels: list[str] | tuple[str, ...] | None = None,
             budget_column: str | None = None) -> Table:
    """A user's table: one row per record, numeric features, a patient id, a label.

    Labels may be any strings; they are numbered in sorted order, or in the order of
    ``labels`` when given: a hospital that holds only part of the federation's classes must
    number them as the federation does, so its table may then hold a single class. Patient
    ids may be any strings. Every other column (or ``feature_columns``) must be numeric and
    non-empty. ``budget_column`` (not a feature) holds each patient's target epsilon.
    """
    path = Path(path)
    try:
        with path.open(newline="", encoding="utf-8") as handle:
            reader = csv.DictReader(handle)
            header = list(reader.fieldnames or [])
            rows = list(reader)
    except OSError as exc:
        raise DataError(f"cannot read {path}: {exc}") from None
    for col, option in ((patient_column, "--patient-column"), (label_column, "--label-column")):
        if col not in header:
            raise DataError(f"{path}: no column {col!r} ({option}); columns are {header}")
    if budget_column is not None and budget_column not in header:
        raise DataError(f"{path}: no column {budget_column!r} (--budget-column); columns are "
                        f"{header}")
    features = feature_columns or [c for c in header
                                   if c not in (patient_column, label_column, budget_column)]
    if not features:
        raise DataError(f"{path}: no feature columns besides the patient and label columns")
    if not rows:
        raise DataError(f"{path}: no data rows")
    x = np.empty((len(rows), len(features)), dtype=np.float32)
    for i, row in enumerate(rows):
        for j, col in enumerate(features):
            try:
                x[i, j] = float(row[col])
            except (TypeError, ValueError):
                raise DataError(f"{path}, data row {i + 1}, column {col!r}: {row[col]!r} is "
                                "not a number; clean or drop that column") from None
    if not np.all(np.isfinite(x)):
        raise DataError(f"{path}: features contain NaN or inf; impute them first")
    if labels is None:
        labels = sorted({row[label_column] for row in rows})
        if len(labels) < 2:
            raise DataError(f"{path}: label column {label_column!r} has a single value")
    label_index = {v: k for k, v in enumerate(labels)}
    unknown = sorted({row[label_column] for row in rows} - set(label_index))
    if unknown:
        raise DataError(f"{path}: labels {unknown[:5]} are not among the federation's labels "
                        f"{list(labels)[:10]}")
    y = np.array([label_index[row[label_column]] for row in rows], dtype=np.int64)
    patient_index: dict[str, int] = {}
    pids = np.array([patient_index.setdefault(row[patient_column], len(patient_index))
                     for row in rows], dtype=np.int64)
    budgets = None
    if budget_column is not None:
        try:
            budgets = np.array([float(row[budget_column]) for row in rows], dtype=np.float64)
        except (TypeError, ValueError):
            raise DataError(f"{path}: column {budget_column!r} (--budget-column) must hold "
                            "a number (the patient's epsilon) on every row") from None
        if not np.all(np.isfinite(budgets) & (budgets > 0)):
            raise DataError(f"{path}: column {budget_column!r} (--budget-column) must hold "
                            "positive epsilons")
    return Table(x, y, pids, len(labels), path.stem, budgets=budgets)


def csv_schema(path: str | Path, *, patient_column: str,
               label_column: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The feature column names (in file order) and the sorted distinct labels of a CSV.

    A site process announces this schema (never its records) so the coordinator can check
    that every hospital's table has the same columns and number the labels federation-wide.
    """
    path = Path(path)
    try:
        with path.open(newline="", encoding="utf-8") as handle:
            reader = csv.DictReader(handle)
            header = list(reader.fieldnames or [])
            if patient_column not in header or label_column not in header:
                raise DataError(f"{path}: needs columns {patient_column!r} and "
                                f"{label_column!r}; columns are {header}")
            labels = sorted({row[label_column] for row in reader})
    except OSError as exc:
        raise DataError(f"cannot read {path}: {exc}") from None
    features = tuple(c for c in header if c not in (patient_column, label_column))
    return features, tuple(labels)


def split_patients(table: Table, test_fraction: float, seed: int) -> tuple[Table, Table]:
    """Train/test split by patient, stratified by each patient's majority label."""
    if not 0 < test_fraction < 1:
        raise DataError(f"test fraction must be in (0, 1), got {test_fraction}")
    rng = np.random.default_rng([seed, 0x7E57])
    patients, labels = table.patient_labels()
    test: list[np.int64] = []
    for c in range(table.num_classes):
        members = rng.permutation(patients[labels == c])
        test.extend(members[:round(test_fraction * len(members))])
    test_rows = table.rows_of_patients(np.array(test))
    train_rows = np.setdiff1d(np.arange(len(table)), test_rows)
    return (table.subset(train_rows, f"{table.name}-train"),
            table.subset(test_rows, f"{table.name}-test"))


def dirichlet_split(table: Table, num_sites: int, alpha: float, seed: int,
                    min_patients: int = 5, max_tries: int = 1000) -> list[Table]:
    """Non-IID sites: per class, patients go to sites in proportions ~ Dirichlet(alpha).

    Small ``alpha`` gives skewed label mixes; large ``alpha`` approaches IID. Each patient
    lands at exactly one site; every site gets at least ``min_patients`` patients (the draw is
    repeated otherwise).
    """
    if num_sites < 2:
        raise DataError(f"need at least 2 sites, got {num_sites}")
    if not alpha > 0:
        raise DataError(f"Dirichlet alpha must be > 0, got {alpha}")
    patients, labels = table.patient_labels()
    if len(patients) < num_sites * min_patients:
        raise DataError(f"{len(patients)} patients cannot give {num_sites} sites "
                        f"{min_patients} each; use fewer --sites")
    rng = np.random.default_rng([seed, 0xD1])
    for _ in range(max_tries):
        owner = np.empty(len(patients), dtype=np.int64)
        for c in range(table.num_classes):
            members = np.flatnonzero(labels == c)
            members = members[rng.permutation(len(members))]
            shares = rng.dirichlet(np.full(num_sites, alpha))
            cuts = (np.cumsum(shares)[:-1] * len(members)).astype(np.int64)
            for site, part in enumerate(np.split(members, cuts)):
                owner[part] = site
        if np.bincount(owner, minlength=num_sites).min() >= min_patients:
            return [table.subset(table.rows_of_patients(patients[owner == s]),
                                 f"{table.name}-site{s + 1}") for s in range(num_sites)]
    raise DataError(f"no Dirichlet({alpha}) draw gave every site {min_patients} patients in "
                    f"{max_tries} tries; raise alpha or use fewer sites")


def load_dataset(name: str, seed: int, num_patients: int | None = None) -> Table:
    """A bundled dataset by name (see :data:`DATASETS`)."""
    if name == "breast-cancer":
        return breast_cancer()
    if name == "ehr":
        return synthetic_ehr(num_patients or 1000, seed=seed)
    if name == "digits":
        return digits()
    if name == "tcga-brca":
        return tcga_brca().pooled_train
    raise DataError(f"unknown dataset {name!r}; choose one of {', '.join(DATASETS)} or --csv")


# --- Fed-TCGA-BRCA (FLamby); the survival task on it is fl/survival.py ---------------

DATA_DIR = Path(__file__).resolve().parent / "datasets" / "tcga_brca"
CENTERS = ("Northeast", "South", "West", "Midwest", "Europe", "Canada")
"""FLamby's centers 0..5: the regions of the tissue source sites (``centers.csv``)."""
NUM_FEATURES = 39


@dataclass(frozen=True)
class TcgaBrca:
    """Fed-TCGA-BRCA by center: ``train[k]`` and ``test[k]`` are center ``k``'s records."""

    train: tuple[Table, ...]
    test: tuple[Table, ...]

    @property
    def pooled_train(self) -> Table:
        return pooled(self.train, "tcga-brca-train")

    @property
    def pooled_test(self) -> Table:
        return pooled(self.test, "tcga-brca-test")


def pooled(tables: tuple[Table, ...] | list[Table], name: str) -> Table:
    """The records of several tables in one (patient ids, times and scale kept)."""
    times = [t.times for t in tables if t.times is not None]
    return Table(np.concatenate([t.x for t in tables]), np.concatenate([t.y for t in tables]),
                 np.concatenate([t.patient_ids for t in tables]), 2, name,
                 all(t.standardized for t in tables),
                 times=np.concatenate(times) if len(times) == len(tables) else None)


def tcga_brca(data_dir: Path = DATA_DIR) -> TcgaBrca:
    """The bundled Fed-TCGA-BRCA set with FLamby's static split (``train_test_split.csv``:
    ``fold2`` is ``train_k``/``test_k`` for center ``k``). Patients of ``brca.csv`` not in
    the split file are left out, as FLamby's loader does (1,096 rows, 1,088 in the split)."""
    try:
        with (data_dir / "train_test_split.csv").open(newline="", encoding="utf-8") as handle:
            fold = {row["pid"]: row["fold2"] for row in csv.DictReader(handle)}
        with (data_dir / "brca.csv").open(newline="", encoding="utf-8") as handle:
            reader = csv.reader(handle)
            header = next(reader)
            rows = list(reader)
    except (OSError, KeyError, StopIteration) as exc:
        raise DataError(f"cannot read the bundled Fed-TCGA-BRCA files in {data_dir}: "
                        f"{exc}; reinstall the package") from None
    if header[0] != "pid" or header[-2:] != ["E", "T"] or len(header) != NUM_FEATURES + 3:
        raise DataError(f"{data_dir / 'brca.csv'}: expected pid, {NUM_FEATURES} features, E, T")
    parts: dict[str, list[int]] = {}
    for i, row in enumerate(rows):
        if row[0] in fold:
            parts.setdefault(fold[row[0]], []).append(i)
    x = np.array([[float(v) for v in row[1:-2]] for row in rows], dtype=np.float32)
    events = np.array([int(float(row[-2])) for row in rows], dtype=np.int64)
    times = np.array([float(row[-1]) for row in rows], dtype=np.float64)
    ids = np.arange(len(rows), dtype=np.int64)  # one record per patient (TCGA barcode)

    def table(key: str) -> Table:
        sel = np.array(parts.get(key, []), dtype=np.int64)
        if len(sel) == 0:
            raise DataError(f"{data_dir}: no patients in fold {key}")
        return Table(x[sel], events[sel], ids[sel], 2, f"tcga-brca-{key}", times=times[sel])

    return TcgaBrca(tuple(table(f"train_{k}") for k in range(len(CENTERS))),
                    tuple(table(f"test_{k}") for k in range(len(CENTERS))))
