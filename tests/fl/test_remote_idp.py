"""``--unit patient-idp`` across machines (``--role coordinator`` + ``--role site``): each
site plans its own rate groups from its own table and budget column, charges every group its
own cost in its ledger before computing anything, and refuses a round that would take any
group past its target; the unit is the site operator's (docs/patient_privacy.md section 5)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_multiprocess_training import Party, federation_broker
from test_train_idp import _table

from transport.topics import SERVER_USER, site_name

pytest.importorskip("opacus")

pytestmark = pytest.mark.timeout(240)

CSV = ["--patient-column", "pid", "--label-column", "label", "--seed", "0",
       "--stage-timeout", "30", "--connect-timeout", "90", "--federation", "idp-fed",
       "--sample-rate", "0.34"]


def test_sites_plan_charge_and_cap_their_own_rate_groups(tmp_path: Path) -> None:
    """Site 1 reads its patients' budgets (1 or 3) from its own column, capped by its
    operator's epsilon 3; site 2 gives every patient its operator's epsilon 2."""
    tables = {cid: _table(tmp_path / f"site-{cid}.csv", patients=80, seed=cid) for cid in (1, 2)}
    rows = [line.split(",") for line in tables[2].read_text().splitlines()]
    tables[2].write_text("\n".join(",".join(r[:4] + r[5:]) for r in rows) + "\n")  # no budgets
    own = {1: ["--epsilon", "3", "--budget-column", "budget"], 2: ["--epsilon", "2"]}
    targets = {1: {1.0, 3.0}, 2: {2.0}}
    report = tmp_path / "report.json"
    with federation_broker() as urls:
        coordinator = Party(["--role", "coordinator", "--sites", "1,2", "--rounds", "2",
                             "--csv", str(tables[1]), "--labels", "no,yes",
                             # Each site plans its own noise from its own budgets; the
                             # coordinator's patient-unit multiplier is not used by them.
                             "--dp", "site", "--unit", "patient-idp",
                             "--noise-multiplier", "1",
                             "--broker", urls[SERVER_USER], "--report", str(report),
                             "--join-timeout", "120", "--ready-timeout", "120", *CSV])
        sites = {cid: Party(["--role", "site", "--site-id", str(cid), "--csv",
                             str(tables[cid]), "--broker", urls[site_name(cid)],
                             "--idle-timeout", "120", "--dp", "site", "--unit", "patient-idp",
                             *own[cid], "--ledger", str(tmp_path / f"ledger-{cid}.json"),
                             *CSV])
                 for cid in (1, 2)}
        try:
            assert coordinator.wait(200) == 0, coordinator.log
            for party in sites.values():
                assert party.wait(30) == 0, party.log
        finally:
            for party in (coordinator, *sites.values()):
                party.kill()
    out = json.loads(report.read_text())
    assert [r["round"] for r in out["rounds"]] == [1, 2]
    assert all(r["included"] == [1, 2] for r in out["rounds"])
    # The coordinator learns no group, rate, noise or epsilon of any site.
    assert "idp" not in out and out["final_epsilon"] is None
    assert all(r["epsilon"] is None for r in out["rounds"])
    assert all("noise_multiplier" not in r and "ledger" in r["mechanism"]
               for r in out["releases"])
    assert out["model_info"]["in_features"] == 3  # the budget column is not a feature
    for cid in (1, 2):
        charges = json.loads((tmp_path / f"ledger-{cid}.json").read_text())["charges"]
        assert [c["label"] for c in charges] == ["round 1", "round 2"]
        assert all(c["unit"] == "patient-idp" and c["withdrawn"] is None for c in charges)
        first, last = ({g["group"]: g for g in c["groups"]} for c in charges)
        assert first.keys() == last.keys()
        assert {g["target_epsilon"] for g in last.values()} == targets[cid]
        for key, g in last.items():
            assert first[key]["epsilon_after"] < g["epsilon_after"]
            assert g["epsilon_after"] <= g["target_epsilon"] * (1 + 1e-9)
            # planned for the two rounds proposed: every group's budget is used, not wasted
            assert g["epsilon_after"] > 0.9 * g["target_epsilon"]
        assert charges[-1]["epsilon_after"] == max(g["epsilon_after"] for g in last.values())
