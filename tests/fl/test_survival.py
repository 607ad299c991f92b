"""Fed-TCGA-BRCA and the survival task: the bundled split, the Cox loss against lifelines'
CoxPHFitter, the C-index against brute-force pairs and lifelines, the CLI's report and
the saved model's risk scores."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from fl.cli import main
from fl.data import DataError
from fl.survival import (
    CENTERS,
    concordance_index,
    cox_loss,
    evaluate_cox,
    targets,
    tcga_brca,
)

pytestmark = pytest.mark.timeout(150)

FLAMBY_COUNTS = [(248, 63), (156, 40), (164, 42), (129, 33), (129, 33), (40, 11)]
"""FLamby's records per center, train/test (its README and paper)."""


def test_tcga_brca_counts_per_center_match_flamby() -> None:
    data = tcga_brca()
    assert [(len(a), len(b)) for a, b in zip(data.train, data.test, strict=True)] \
        == FLAMBY_COUNTS
    assert len(CENTERS) == 6
    train, test = data.pooled_train, data.pooled_test
    assert len(train) + len(test) == 1088 and train.num_features == 39
    assert not set(train.patient_ids) & set(test.patient_ids)  # a patient on one side only
    assert train.num_patients == len(train)  # one record per patient
    assert set(np.unique(train.y)) == {0, 1} and train.times is not None
    assert np.all(train.times >= 0)


def brute_force_c_index(times: np.ndarray, risk: np.ndarray, events: np.ndarray) -> float:
    """Harrell's definition, pair by pair."""
    num = den = 0.0
    for i, j in itertools.permutations(range(len(times)), 2):
        if not events[i]:
            continue
        if times[i] < times[j] or (times[i] == times[j] and not events[j]):
            den += 1
            num += 1.0 if risk[i] > risk[j] else 0.5 if risk[i] == risk[j] else 0.0
    return num / den


@pytest.mark.parametrize("seed", range(5))
def test_concordance_index_matches_brute_force_pairs_and_lifelines(seed: int) -> None:
    from lifelines.utils import concordance_index as lifelines_c_index

    rng = np.random.default_rng(seed)
    n = 60
    times = rng.integers(1, 15, size=n).astype(float)  # many tied times
    risk = rng.integers(0, 6, size=n).astype(float)  # and tied risks
    events = rng.random(n) < 0.6
    ours = concordance_index(times, risk, events)
    assert ours == pytest.approx(brute_force_c_index(times, risk, events), abs=1e-12)
    assert ours == pytest.approx(lifelines_c_index(times, -risk, events), abs=1e-12)


def test_concordance_index_refuses_undefined_and_ragged_input() -> None:
    with pytest.raises(DataError, match="no comparable pair"):
        concordance_index([1.0, 2.0], [0.1, 0.2], [0, 0])
    with pytest.raises(DataError, match="one each"):
        concordance_index([1.0, 2.0], [0.1], [1, 0])


def brute_force_breslow(risk: np.ndarray, events: np.ndarray, times: np.ndarray) -> float:
    total = 0.0
    for i in range(len(risk)):
        if events[i]:
            at_risk = [j for j in range(len(risk)) if times[j] >= times[i]]
            total += np.log(sum(np.exp(risk[j]) for j in at_risk)) - risk[i]
    return total / len(risk)


def test_cox_loss_equals_breslow_partial_likelihood_with_ties() -> None:
    rng = np.random.default_rng(3)
    n = 40
    risk = rng.normal(size=n)
    events = (rng.random(n) < 0.5).astype(float)
    times = rng.integers(1, 8, size=n).astype(float)
    target = torch.tensor(np.stack([events, times], axis=1))
    got = float(cox_loss(torch.tensor(risk).reshape(-1, 1), target))
    assert got == pytest.approx(brute_force_breslow(risk, events, times), rel=1e-12)


def test_cox_loss_matches_lifelines_coxph_log_likelihood() -> None:
    """On a small pooled set without tied event times (where Breslow and lifelines' Efron
    agree): ``-n * cox_loss`` at lifelines' fitted coefficients is its log-likelihood, and
    the loss's gradient there is zero (lifelines' optimum is ours)."""
    import pandas as pd
    from lifelines import CoxPHFitter

    train = tcga_brca().pooled_train
    assert train.times is not None
    event_times = train.times[train.y == 1]
    unique_events = {t for t in event_times if np.sum(event_times == t) == 1}
    keep = np.array([(e == 0) or (t in unique_events) for e, t in zip(train.y, train.times,
                                                                      strict=True)])
    x = train.x[keep][:, :4].astype(np.float64)
    x[:, 0] = (x[:, 0] - x[:, 0].mean()) / x[:, 0].std()  # age, for a well-scaled fit
    events, times = train.y[keep], train.times[keep]
    assert events.sum() > 50 and len(x) > 500
    frame = pd.DataFrame(x, columns=[f"f{i}" for i in range(4)])
    frame["T"], frame["E"] = times, events
    fitted = CoxPHFitter().fit(frame, duration_col="T", event_col="E")
    beta = torch.tensor(fitted.params_.to_numpy(), dtype=torch.float64, requires_grad=True)
    target = torch.tensor(np.stack([events, times], axis=1), dtype=torch.float64)
    loss = cox_loss(torch.from_numpy(x) @ beta, target)
    assert -len(x) * float(loss.detach()) == pytest.approx(fitted.log_likelihood_, rel=1e-9)
    loss.backward()
    assert beta.grad is not None and float(beta.grad.abs().max()) < 1e-6


def test_train_tcga_brca_reports_c_index_and_saves_a_risk_model(tmp_path: Path) -> None:
    report, saved = tmp_path / "r.json", tmp_path / "cox.pt"
    assert main(["train", "--dataset", "tcga-brca", "--strategy", "fedadam", "--rounds", "2",
                 "--local-steps", "10", "--broker", "memory", "--seed", "1",
                 "--report", str(report), "--save-model", str(saved)]) == 0
    data = json.loads(report.read_text())
    assert data["settings"]["sites"] == 6 and data["settings"]["batch_size"] == 8
    assert data["settings"]["lr"] == 0.01 and data["settings"]["server_lr"] == 0.1
    for row in data["rounds"]:
        assert 0 <= row["c_index"] <= 1 and row["loss"] > 0 and row["accuracy"] is None
        assert set(row["c_index_by_site"]) == {"1", "2", "3", "4", "5", "6"}
        assert row["aggregate_correct"] is True and row["included"] == [1, 2, 3, 4, 5, 6]
    from fl.checkpoint import load_model

    model, meta = load_model(saved)
    assert meta["task"] == "survival" and meta["model"] == "cox"
    test = tcga_brca().pooled_test
    c_index, _ = evaluate_cox(model, torch.from_numpy(test.x), targets(test))
    assert c_index == pytest.approx(data["final_c_index"], abs=1e-12)
    assert model(torch.from_numpy(test.x[:3])).shape == (3, 1)  # one risk score per record


def test_train_tcga_brca_refuses_what_it_cannot_do(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--dataset", "tcga-brca", "--dp", "site", "--epsilon", "4"]) == 2
    assert "couples the patients" in capsys.readouterr().err
    assert main(["train", "--dataset", "tcga-brca", "--sites", "5"]) == 2
    assert "6 natural centers" in capsys.readouterr().err
    assert main(["train", "--dataset", "tcga-brca", "--model", "logreg"]) == 2
    assert "--model cox" in capsys.readouterr().err
    assert main(["train", "--dataset", "tcga-brca", "--strategy", "fedprox",
                 "--fedprox-mu", "0"]) == 2
    assert "--fedprox-mu > 0" in capsys.readouterr().err
    # tcga-brca and SCAFFOLD run across the roles now (tests/fl/test_remote_roles.py,
    # tests/fl/test_multiprocess_training.py)


def test_default_fedadam_matches_flambys_best_strategy(capsys: pytest.CaptureFixture[str]
                                                       ) -> None:
    """docs/quickstart.md: ``secagg train --dataset tcga-brca --strategy fedadam --seed 1``
    (FLamby's protocol) reaches FLamby's best published mean C-index (FedAdam, 0.842)."""
    assert main(["train", "--dataset", "tcga-brca", "--strategy", "fedadam", "--seed", "1",
                 "--broker", "memory", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert len(report["rounds"]) == 5 and report["settings"]["local_steps"] == 100
    assert report["final_c_index"] == pytest.approx(0.861, abs=5e-3)
    assert report["final_c_index"] > 0.842
