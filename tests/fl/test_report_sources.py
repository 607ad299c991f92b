"""``secagg train``'s report: every release lists its parameters with their source, and the
run's epsilons stand side by side with their unit and neighbour relation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch")


@pytest.mark.parametrize("extra", [["--dp", "site", "--expected-batch", "6"],
                                   ["--dp", "distributed", "--adaptive-clip", "0.5"]])
def test_every_release_names_its_parameters_sources(tmp_path: Path, extra: list[str]) -> None:
    from fl.cli import main

    path = tmp_path / "report.json"
    assert main(["train", "--sites", "3", "--rounds", "2", "--dataset", "ehr",
                 "--epsilon", "8", "--sample-rate", "0.2", "--local-epochs", "1",
                 "--scaling", "none", "--broker", "memory", "--report", str(path),
                 *extra]) == 0
    report = json.loads(path.read_text(encoding="utf-8"))
    releases = [r for r in report["releases"] if r["round"] >= 1]
    assert releases
    for release in releases:
        sources = {k: v["source"] for k, v in release["parameters"].items()}
        assert sources and all(s.split(" ")[0] in ("operator", "public", "noised")
                               for s in sources.values()), sources
        assert "records" not in json.dumps(sources)
    first = releases[0]["parameters"]
    if "site" in extra:
        assert first["expected_batch"] == {"value": 6.0,
                                           "source": "operator (--expected-batch)"}
        assert first["sample_rate"]["source"].startswith("operator")
    else:
        assert first["clip_norm"]["source"].startswith("noised")
    patient, site = report["epsilons"]
    assert patient["unit"] == "patient" and "add/remove one patient" in patient["relation"]
    assert patient["epsilon"] == report["rounds"][-1]["epsilon"] <= 8.0
    assert site["unit"].startswith("site") and site["epsilon"] is None


def test_the_patient_idp_plan_says_what_is_declared_and_what_is_noised(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from fl.cli import main

    csv = tmp_path / "t.csv"
    csv.write_text("pid,a,label\n" + "".join(f"P{p},{p % 7 / 7:.3f},{'yes' if p % 2 else 'no'}\n"
                                             for p in range(60) for _ in range(1 + p % 3)),
                   encoding="utf-8")
    args = ["train", "--sites", "2", "--rounds", "2", "--csv", str(csv), "--patient-column",
            "pid", "--label-column", "label", "--dp", "site", "--unit", "patient-idp",
            "--epsilon", "4", "--max-records-per-patient", "3", "--scaling", "none", "--plan"]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "operator (declared): max_records, targets" in text
    assert "site-local: groups.patients" in text
    assert "noised releases: none" in text
    assert main([*args, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["sources"]["groups.patients"].startswith("site-local")
    assert all(s["max_records"] == 3 for s in plan["idp"].values())
