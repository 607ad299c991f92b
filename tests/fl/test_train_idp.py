"""``secagg train --unit patient-idp [--budget-column COL]`` end to end (fl/site/idp.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("opacus")

from fl.data import DataError, load_csv
from fl.settings import TrainSettings


def _table(path: Path, patients: int = 120, seed: int = 0) -> Path:
    """Patients with 1-2 visits; half ask for epsilon 1, the others allow 3."""
    rng = np.random.default_rng(seed)
    lines = ["pid,a,b,c,budget,label"]
    for p in range(patients):
        budget = 1.0 if (p // 2) % 2 == 0 else 3.0
        for _ in range(1 + p % 2):
            a, b, c = rng.normal(size=3)
            lines.append(f"P{p},{a:.4f},{b:.4f},{c:.4f},{budget},{'yes' if a + b > 0 else 'no'}")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_budget_column_is_not_a_feature(tmp_path: Path) -> None:
    table = load_csv(_table(tmp_path / "t.csv"), patient_column="pid", label_column="label",
                     budget_column="budget")
    assert table.num_features == 3 and set(table.budgets.tolist()) == {1.0, 3.0}
    assert table.subset(np.array([0, 1])).budgets.tolist() == table.budgets[:2].tolist()
    bad = tmp_path / "bad.csv"
    bad.write_text("pid,a,budget,label\nP1,1.0,strong,yes\nP2,2.0,3,no\n", encoding="utf-8")
    with pytest.raises(DataError, match="--budget-column"):
        load_csv(bad, patient_column="pid", label_column="label", budget_column="budget")
    with pytest.raises(DataError, match="no column 'nope'"):
        load_csv(bad, patient_column="pid", label_column="label", budget_column="nope")


def test_settings_refuse_what_the_mechanism_cannot_do(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="needs --dp site"):
        TrainSettings(dp="distributed", epsilon=2.0, unit="patient-idp")
    with pytest.raises(ValueError, match="--budget-column goes with"):
        TrainSettings(dp="site", epsilon=2.0, unit="patient", budget_column="b")


def test_train_reports_every_group_within_its_budget(tmp_path: Path) -> None:
    from fl.federation import train

    csv = _table(tmp_path / "t.csv")
    settings = TrainSettings(sites=2, rounds=2, csv=str(csv), patient_column="pid",
                             label_column="label", dp="site", epsilon=3.0, delta=1e-4,
                             unit="patient-idp", budget_column="budget",
                             budget_classes=(1.0, 3.0), sample_rate=0.34,
                             broker="memory", scaling="none", alpha=100.0)
    report = train(settings)
    assert "individual privacy assignment" in report["privacy"]
    assert [r["round"] for r in report["rounds"]] == [1, 2] and report["stopped"] is None
    worst = 0.0
    for site in report["idp"].values():
        assert site["steps"] == 2 * settings.steps_per_round
        assert site["planned_mean_rate"] == pytest.approx(0.34, rel=3e-3)
        targets = {g["target_epsilon"] for g in site["groups"]}
        assert targets == {1.0, 3.0}
        for g in site["groups"]:
            assert 0 < g["sample_rate"] <= 1 and g["patients"] >= 0  # declared classes
            assert g["epsilon_spent"] <= g["target_epsilon"] * (1 + 1e-9)
            assert g["epsilon_spent"] == pytest.approx(g["epsilon"])  # all planned steps ran
            worst = max(worst, g["epsilon_spent"])
        rate = {(g["records"], g["target_epsilon"]): g["sample_rate"] for g in site["groups"]}
        for k in (1, 2):  # a stricter budget: a lower rate; more records: a lower rate
            assert rate[(k, 1.0)] < rate[(k, 3.0)]
            assert k == 1 or rate[(k, 3.0)] < rate[(k - 1, 3.0)]
    eps = [r["epsilon"] for r in report["rounds"]]
    assert eps[0] < eps[1] == pytest.approx(worst) and eps[1] <= 3.0
    assert all("noise_multiplier" not in r and "'idp'" in r["mechanism"]
               for r in report["releases"])
    json.dumps(report)  # the report is plain JSON


def test_the_budget_column_is_a_sites_own(capsys: pytest.CaptureFixture[str]) -> None:
    """Across machines each site reads its own budget column; the coordinator cannot."""
    from dp.policy import DEFAULT_EPSILON
    from fl.cli import main

    code = main(["train", "--role", "coordinator", "--sites", "2", "--rounds", "1", "--dp",
                 "site", "--epsilon", "2", "--unit", "patient-idp", "--csv", "t.csv",
                 "--patient-column", "pid", "--label-column", "label",
                 "--budget-column", "budget", "--budget-classes", "1,3",
                 "--broker", "mqtt://127.0.0.1:1"])
    assert code == 2 and "never by the coordinator" in capsys.readouterr().err
    code = main(["train", "--role", "site", "--site-id", "1", "--sites", "2", "--dp", "site",
                 "--unit", "patient-idp", "--budget-column", "budget",
                 "--broker", "mqtt://127.0.0.1:1"])
    assert code == 2 and "with --csv" in capsys.readouterr().err
    code = main(["train", "--role", "site", "--site-id", "1", "--sites", "2", "--dataset",
                 "ehr", "--dp", "site", "--unit", "patient-idp",
                 "--broker", "mqtt://127.0.0.1:1"])  # no --epsilon: the default budget
    err = capsys.readouterr().err  # (not a usage error: it goes on to the broker)
    assert code == 1 and f"at most {DEFAULT_EPSILON:g} in total" in err, err


def test_site_charges_each_round_once(tmp_path: Path) -> None:
    """A retried attempt of a round is not charged twice; a round past the plan is refused."""
    from dp.errors import BudgetExceeded
    from fl.models import make_model
    from fl.site.idp import SiteIdp
    from fl.site.training import Site
    from fl.vector import ParameterLayout

    table = load_csv(_table(tmp_path / "t.csv", patients=30), patient_column="pid",
                     label_column="label", budget_column="budget")
    settings = TrainSettings(rounds=1, dp="site", epsilon=3.0, delta=1e-4, unit="patient-idp",
                             sample_rate=0.5, csv="t.csv", patient_column="pid",
                             label_column="label", budget_column="budget",
                             budget_classes=(1.0, 3.0))
    site = Site(1, table)
    site.idp = SiteIdp.for_site(site, settings)
    model = make_model("logreg", 3, 2)
    layout = ParameterLayout.of(model)
    for _ in range(2):  # round 1, then a retry of round 1
        site.site_dp_update(model, layout, noise_multiplier=1.0, clip_norm=1.0,
                            sample_rate=0.5, steps=2, lr=0.1, unit="patient-idp",
                            round_number=1)
    assert site.idp.ledger.steps_done == 2
    with pytest.raises(BudgetExceeded, match="target"):
        site.site_dp_update(model, layout, noise_multiplier=1.0, clip_norm=1.0,
                            sample_rate=0.5, steps=2, lr=0.1, unit="patient-idp",
                            round_number=2)


def test_plan_shows_the_groups_not_patient_units(tmp_path: Path) -> None:
    from fl.federation import privacy_plan

    settings = TrainSettings(sites=2, rounds=3, csv=str(_table(tmp_path / "t.csv")),
                             patient_column="pid", label_column="label", dp="site",
                             epsilon=3.0, delta=1e-4, unit="patient-idp",
                             budget_column="budget",
                             budget_classes=(1.0, 3.0), sample_rate=0.34, scaling="none")
    out = privacy_plan(settings)
    assert "individual privacy assignment" in out["description"]
    eps = out["epsilon_after"]
    assert len(eps) == 3 and eps == sorted(eps) and eps[-1] <= 3.0 * (1 + 1e-9)
    assert {g["target_epsilon"] for s in out["idp"].values() for g in s["groups"]} == {1.0, 3.0}
    assert "noise_multiplier" not in out


def test_resume_accounts_every_group_as_an_uninterrupted_run(tmp_path: Path) -> None:
    """--resume replays the checkpoint's charged rounds into every site's group ledger: a
    run stopped after round 2 and resumed ends with the uninterrupted run's per-round and
    per-group epsilons; a round released just before a crash stays charged (at the
    coordinator and the sites alike), so its re-run makes the plan's last round unaffordable.
    (A fixed patient-unit --noise-multiplier only skips calibrating a multiplier that
    patient-idp sites do not use: each site plans its own.)"""
    from dataclasses import replace

    from fl import checkpoint as ckpt
    from fl.coordinator import RoundCapture
    from fl.federation import train

    settings = TrainSettings(sites=2, rounds=3, csv=str(_table(tmp_path / "t.csv", 60)),
                             patient_column="pid", label_column="label", dp="site",
                             noise_multiplier=2.0, delta=1e-4, unit="patient-idp",
                             budget_column="budget",
                             budget_classes=(1.0, 3.0), sample_rate=0.34, broker="memory",
                             scaling="none", alpha=100.0)

    def groups(report: dict) -> list[float]:
        return [g["epsilon_spent"] for s in report["idp"].values() for g in s["groups"]]

    straight = train(settings)
    stopped = replace(settings, checkpoint=str(tmp_path / "a"))

    def stop_after_round_2(text: str) -> None:  # logged once round 2 is checkpointed
        if text.startswith("round   2/"):
            raise KeyboardInterrupt("stopped after round 2")

    with pytest.raises(KeyboardInterrupt):
        train(stopped, log=stop_after_round_2)
    saved = ckpt.load(tmp_path / "a")
    assert saved is not None and saved.round == 2 and len(saved.events) == 2
    resumed = train(replace(stopped, resume=True))
    assert [r["round"] for r in resumed["rounds"]] == [1, 2, 3]
    assert [r["epsilon"] for r in resumed["rounds"]] == pytest.approx(
        [r["epsilon"] for r in straight["rounds"]], rel=1e-12)
    assert groups(resumed) == pytest.approx(groups(straight), rel=1e-12)
    with pytest.raises(ValueError, match="other settings"):  # the groups' rates: 3 rounds
        train(replace(stopped, rounds=4, resume=True))

    crashed = replace(settings, checkpoint=str(tmp_path / "b"))

    def power_cut(capture: RoundCapture) -> None:
        if capture.round == 2:
            raise KeyboardInterrupt("power cut after round 2 was released")

    with pytest.raises(KeyboardInterrupt):
        train(crashed, on_capture=power_cut)
    again = train(replace(crashed, resume=True))
    # Rounds 1, 2 (released, lost), 2 (re-run): three rounds' cost, the whole plan.
    assert [r["round"] for r in again["rounds"]] == [1, 2]
    assert again["stopped"] is not None and "round 3 not run" in again["stopped"]
    assert groups(again) == pytest.approx(groups(straight), rel=1e-12)
