"""Patient-level DP on Fed-TCGA-BRCA through the discrete-time survival model: the
person-period rows, the separability of the loss by patient (why per-patient clipping bounds
one patient's influence there and not with the Cox partial likelihood), and DP runs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from fl.cli import main
from fl.models import make_model
from fl.survival import AGE_SCALE, INTERVAL_EDGES, cox_loss, person_period, tcga_brca

pytestmark = pytest.mark.timeout(150)


def test_person_period_rows_match_a_patient_by_patient_construction() -> None:
    center = tcga_brca().train[5]
    assert center.times is not None
    rows = person_period(center)
    expected_x, expected_y, expected_ids = [], [], []
    for i in range(len(center)):
        k = sum(1 for edge in INTERVAL_EDGES[1:] if center.times[i] >= edge)
        for j in range(k + 1):
            x = center.x[i].astype(np.float64).copy()
            x[0] /= AGE_SCALE
            expected_x.append(np.concatenate([x, np.eye(len(INTERVAL_EDGES))[j]]))
            expected_y.append(int(j == k and center.y[i] == 1))
            expected_ids.append(center.patient_ids[i])
    np.testing.assert_allclose(rows.x, np.array(expected_x), rtol=1e-6)
    assert rows.y.tolist() == expected_y and rows.patient_ids.tolist() == expected_ids
    assert rows.y.sum() == center.y.sum()  # one event row per observed event
    assert rows.standardized and rows.num_patients == len(center)


def test_discrete_time_loss_is_a_sum_of_per_patient_terms() -> None:
    """Each patient's gradient row (what the DP modes clip) is the gradient of that
    patient's own rows only: removing another patient leaves it unchanged. The Cox partial
    likelihood is not like that: one patient's presence changes the others' risk sets."""
    from dp.units import site_unit_gradients

    table = person_period(tcga_brca().train[5])
    model = make_model("discrete-time", table.num_features, 2, seed=0)
    x, y = torch.from_numpy(table.x), torch.from_numpy(table.y)
    loss = torch.nn.CrossEntropyLoss(reduction="sum")
    keys, grads = site_unit_gradients(model, loss, x, y, table.patient_ids.tolist())
    by_patient = dict(zip(keys, grads, strict=True))
    assert len(by_patient) == table.num_patients
    for patient in list(by_patient)[:10]:
        mask = torch.from_numpy(table.patient_ids == patient)
        model.zero_grad()
        loss(model(x[mask]), y[mask]).backward()
        own = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).double().numpy()
        np.testing.assert_allclose(by_patient[patient], own, rtol=1e-5, atol=1e-6)
    drop = table.patient_ids != keys[0]
    keys2, grads2 = site_unit_gradients(model, loss, x[torch.from_numpy(drop)],
                                        y[torch.from_numpy(drop)],
                                        table.patient_ids[drop].tolist())
    for key, row in zip(keys2, grads2, strict=True):
        np.testing.assert_allclose(row, by_patient[key], rtol=1e-5, atol=1e-6)

    # The Cox loss of a batch: removing patient 0 changes patient 1's loss term.
    risk = torch.tensor([0.3, -0.2, 0.5], dtype=torch.float64)
    target = torch.tensor([[0.0, 9.0], [1.0, 2.0], [0.0, 5.0]], dtype=torch.float64)
    with_0 = 3 * float(cox_loss(risk, target))
    without_0 = 2 * float(cox_loss(risk[1:], target[1:]))
    assert abs(with_0 - without_0) > 0.1  # patient 0 (censored, no own term) still counts


@pytest.mark.parametrize("mode", ["distributed", "site"])
def test_train_tcga_brca_discrete_time_with_patient_dp(mode: str, tmp_path: Path) -> None:
    report = tmp_path / "r.json"
    assert main(["train", "--dataset", "tcga-brca", "--model", "discrete-time", "--dp", mode,
                 "--epsilon", "4", "--delta", "1e-5", "--unit", "patient", "--rounds", "3",
                 "--sample-rate", "0.5", "--strategy", "fedadam", "--server-lr", "0.02",
                 "--broker", "memory", "--report", str(report)]) == 0
    data = json.loads(report.read_text())
    assert len(data["rounds"]) == 3 and data["model_parameters"] == 2 * (39 + 11) + 2
    for row in data["rounds"]:
        assert 0 <= row["c_index"] <= 1 and 0 < row["epsilon"] <= 4
        assert set(row["c_index_by_site"]) == {"1", "2", "3", "4", "5", "6"}
