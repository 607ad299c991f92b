"""``secagg train --unit patient-idp`` on a heavy-tailed table (issue 19): the cut-off
``--max-records-per-patient``, the report's idp section with a DpEvent per group, and no
library warning on the terminal."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("opacus")
pytest.importorskip("dp_accounting")

from fl.data import heavy_tailed_counts, synthetic_ehr


def _heavy_table(path: Path, patients: int, max_records: int, seed: int = 1) -> Path:
    counts = heavy_tailed_counts(patients, max_records=max_records, seed=seed)
    table = synthetic_ehr(patients, record_counts=counts, num_features=3, seed=seed)
    lines = ["pid,a,b,c,y"] + [f"P{p}," + ",".join(f"{v:.3f}" for v in x) + f",{y}"
                               for p, x, y in zip(table.patient_ids, table.x, table.y,
                                                  strict=True)]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _train(tmp_path: Path, *extra: str) -> tuple[subprocess.CompletedProcess[str], dict]:
    report = tmp_path / "report.json"
    cmd = [sys.executable, "-m", "fl.cli", "train", "--csv", str(tmp_path / "t.csv"),
           "--patient-column", "pid", "--label-column", "y", "--dp", "site", "--unit",
           "patient-idp", "--epsilon", "8", "--sample-rate", "0.02", "--rounds", "2",
           "--sites", "2", "--broker", "memory", "--report", str(report), *extra]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=os.environ)
    assert done.returncode == 0, done.stderr
    return done, json.loads(report.read_text(encoding="utf-8"))


@pytest.mark.slow  # ~1-2 min on 2 busy cores
def test_cutoff_report_and_events_per_group(tmp_path: Path) -> None:
    from dp.audit import recompute_epsilon

    _heavy_table(tmp_path / "t.csv", 200, 40)
    done, report = _train(tmp_path, "--max-records-per-patient", "6")
    terminal = done.stdout + done.stderr
    assert "Warning" not in terminal and "warn" not in terminal.lower(), terminal
    line = [x for x in terminal.splitlines() if "--max-records-per-patient 6 drops" in x]
    assert len(line) == 1
    dropped = sum(site["dropped_records"] for site in report["idp"].values())
    assert f"drops {dropped} of" in line[0] and dropped > 0
    for cid, site in report["idp"].items():
        assert site["accountant"] == "rdp" and site["max_records"] == 6
        assert max(g["records"] for g in site["groups"]) <= 6
        assert site["planned_mean_rate"] == pytest.approx(0.02, rel=1e-6)
        for g in site["groups"]:
            assert g["sample_rate"] > 0 and g["epsilon_spent"] <= g["target_epsilon"]
            event = report["dp_events"][cid][g["key"]]
            assert event == g["dp_event"] and event["count"] == site["steps_done"]
            if g["records"] == 1:  # dp-accounting's own PLD: at most the RDP figure
                again = recompute_epsilon(event, site["delta"], "pld")
                assert 0.3 * g["epsilon_spent"] < again <= g["epsilon_spent"]


@pytest.mark.slow  # ~1 min
def test_heavy_tail_without_cutoff_trains_every_group(tmp_path: Path) -> None:
    """1 to 40 records per patient, a cut-off above them all (declared classes 1..40):
    planned and trained (refused before)."""
    _heavy_table(tmp_path / "t.csv", 200, 40)
    done, report = _train(tmp_path, "--max-records-per-patient", "40")
    assert "Optimal order" not in done.stderr
    counts = {g["records"] for site in report["idp"].values() for g in site["groups"]}
    assert max(counts) >= 20 and len(report["rounds"]) == 2
    assert all(g["epsilon_spent"] <= g["target_epsilon"]
               for site in report["idp"].values() for g in site["groups"])


def test_a_site_applies_its_own_cutoff() -> None:
    """The site role (fl.site.idp.SitePatients, what `--role site --max-records-per-patient K`
    builds): its groups are at most K records and its plan for a task says so."""
    from fl.contribution import RoundTask
    from fl.site.idp import SitePatients

    counts = heavy_tailed_counts(60, max_records=30, seed=2)
    table = synthetic_ehr(60, record_counts=counts, num_features=3, seed=2)
    site = SitePatients(1, table, epsilon=4.0, delta=1e-5, max_records=5)
    assert max(k for k, _, _ in site.groups.sizes) <= 5
    assert site.groups.dropped_records == int(np.maximum(counts - 5, 0).sum()) > 0
    task = RoundTask(mode="site", round=1, cohort=2, seed=0, unit="patient-idp",
                     sample_rate=0.05, steps=5, plan_steps=20)
    plan = site.for_task(task).plan
    assert plan.max_records == 5 and all(g.epsilon <= g.target_epsilon for g in plan.groups)


@pytest.mark.parametrize("argv,message", [
    (["--role", "coordinator", "--sites", "2", "--rounds", "1", "--dp", "site",
      "--unit", "patient-idp", "--max-records-per-patient", "4",
      "--broker", "mqtt://127.0.0.1:1"], "never by the coordinator"),
    (["--role", "site", "--site-id", "1", "--dp", "site", "--unit", "patient-idp",
      "--accountant", "pld", "--broker", "mqtt://127.0.0.1:1"], "plans with --accountant rdp"),
    (["--sites", "2", "--rounds", "1", "--dp", "site", "--epsilon", "1",
      "--max-records-per-patient", "4"], "--max-records-per-patient 4: a count >= 1, with "),
    (["--sites", "2", "--rounds", "1", "--dp", "site", "--epsilon", "1",
      "--accountant", "pld"], "--accountant pld is for --unit patient-idp"),
])
def test_the_command_line_refuses_what_it_cannot_do(
        argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    from fl.cli import main

    assert main(["train", *argv]) == 2
    assert message in capsys.readouterr().err


def test_calibrating_the_noise_warns_nothing(recwarn: pytest.WarningsRecorder) -> None:
    """The patient-unit noise `--unit patient-idp` runs still calibrate (eps 8, q 0.01,
    500 steps) printed Opacus' 'optimal order is the largest alpha' before training."""
    import warnings

    from dp.accounting import gaussian_epsilon, noise_multiplier_for

    warnings.simplefilter("always")
    z = noise_multiplier_for(8.0, 1e-5, 0.01, 500)
    assert gaussian_epsilon(z, 0.01, 500, 1e-5) <= 8.0
    assert not [w for w in recwarn if "alpha" in str(w.message)]
