"""Datasets and splits: Dirichlet non-IID by patient, the EHR generator, the CSV loader."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fl.data import (
    DataError,
    breast_cancer,
    dirichlet_split,
    load_csv,
    split_patients,
    synthetic_ehr,
)


def _label_skew(sites: list) -> float:
    """Std over sites of the fraction of class 1 (0 for IID)."""
    return float(np.std([s.y.mean() for s in sites]))


def test_dirichlet_split_partitions_patients() -> None:
    table = synthetic_ehr(600, seed=1)
    sites = dirichlet_split(table, 5, alpha=0.5, seed=2, min_patients=10)
    assert len(sites) == 5
    assert sum(len(s) for s in sites) == len(table)
    owners: dict[int, int] = {}
    for k, s in enumerate(sites):
        assert s.num_patients >= 10
        for p in np.unique(s.patient_ids):
            assert owners.setdefault(int(p), k) == k  # every patient at exactly one site
    assert len(owners) == table.num_patients
    again = dirichlet_split(table, 5, alpha=0.5, seed=2, min_patients=10)
    assert all(np.array_equal(a.patient_ids, b.patient_ids)
               for a, b in zip(sites, again, strict=True))


def test_dirichlet_alpha_controls_skew() -> None:
    table = breast_cancer()
    skewed = np.mean([_label_skew(dirichlet_split(table, 5, 0.1, seed=s)) for s in range(5)])
    iid = np.mean([_label_skew(dirichlet_split(table, 5, 100.0, seed=s)) for s in range(5)])
    assert skewed > 3 * iid


def test_dirichlet_refuses_impossible() -> None:
    with pytest.raises(DataError, match="fewer --sites"):
        dirichlet_split(breast_cancer(), 200, 1.0, seed=0)


def test_ehr_has_several_records_per_patient() -> None:
    table = synthetic_ehr(300, min_records=2, max_records=8, seed=0)
    counts = np.bincount(table.patient_ids)
    assert counts.min() >= 2 and counts.max() <= 8 and counts.mean() > 3
    assert table.standardized and 0.2 < table.y.mean() < 0.8
    # Records of one patient share a latent risk: labels correlate within patients.
    per_patient = np.array([table.y[table.patient_ids == p].mean() for p in range(300)])
    assert per_patient.var() > 1.5 * table.y.var() / counts.mean()


def test_split_keeps_patients_on_one_side() -> None:
    table = synthetic_ehr(200, seed=3)
    train, test = split_patients(table, 0.25, seed=0)
    assert not set(train.patient_ids) & set(test.patient_ids)
    assert len(train) + len(test) == len(table)
    assert 0.2 < test.num_patients / table.num_patients < 0.3


def test_csv_loader_with_patient_column(tmp_path: Path) -> None:
    path = tmp_path / "hospital.csv"
    path.write_text("mrn,age,bp,outcome\n"
                    "A17,61,130.5,sick\nA17,62,128,sick\nB02,45,118,well\n"
                    "C33,70,145,sick\nB02,46,121,well\n", encoding="utf-8")
    table = load_csv(path, patient_column="mrn", label_column="outcome")
    assert table.x.shape == (5, 2) and table.num_classes == 2
    assert table.y.tolist() == [0, 0, 1, 0, 1]  # labels numbered in sorted order
    assert table.patient_ids.tolist() == [0, 0, 1, 2, 1]
    assert table.num_patients == 3
    with pytest.raises(DataError, match="--patient-column"):
        load_csv(path, patient_column="id", label_column="outcome")
    path.write_text("mrn,age,outcome\nA,x,1\nB,3,0\n", encoding="utf-8")
    with pytest.raises(DataError, match="row 1, column 'age'"):
        load_csv(path, patient_column="mrn", label_column="outcome")


def test_breast_cancer_matches_scikit_learn() -> None:
    """The direct read of scikit-learn's CSV gives exactly ``load_breast_cancer()``."""
    from sklearn.datasets import load_breast_cancer

    table, reference = breast_cancer(), load_breast_cancer()
    assert np.array_equal(table.x, np.asarray(reference.data, dtype=np.float32))
    assert np.array_equal(table.y, reference.target)
