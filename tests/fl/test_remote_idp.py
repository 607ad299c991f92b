"""``--unit patient-idp`` across machines (``--role coordinator`` + ``--role site``): each
site plans its own rate groups from its own table and budget column, charges every group its
own cost in its ledger before computing anything, and refuses a round that would take any
group past its target; the unit is the site operator's (docs/patient_privacy.md section 5)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("opacus")

from test_multiprocess_training import Party, federation_broker
from test_site_policy_review import _announce, _blob
from test_train_idp import _table

from dp.ledger import read_charges
from dp.policy import UNITS, PolicyRefused, SitePolicy
from fl.contribution import RoundTask
from fl.remote.inputs import SiteData
from fl.remote.site import SiteOptions, SiteProcess
from fl.site.core import open_site_core
from fl.site.idp import SitePatients
from transport.memory import MemoryNetwork
from transport.topics import SERVER_USER, site_name

pytestmark = pytest.mark.timeout(240)

CSV = ["--patient-column", "pid", "--label-column", "label", "--seed", "0",
       "--stage-timeout", "60", "--connect-timeout", "90", "--federation", "idp-fed",
       "--sample-rate", "0.34"]


def test_sites_plan_charge_and_cap_their_own_rate_groups(tmp_path: Path) -> None:
    """Site 1 reads its patients' budgets (1 or 3) from its own column, capped by its
    operator's epsilon 3; site 2 gives every patient its operator's epsilon 2."""
    tables = {cid: _table(tmp_path / f"site-{cid}.csv", patients=80, seed=cid) for cid in (1, 2)}
    rows = [line.split(",") for line in tables[2].read_text().splitlines()]
    tables[2].write_text("\n".join(",".join(r[:4] + r[5:]) for r in rows) + "\n")  # no budgets
    own = {1: ["--epsilon", "3", "--budget-column", "budget", "--budget-classes", "1,3"],
           2: ["--epsilon", "2"]}
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
        charges = [asdict(c) for c in read_charges(tmp_path / f"ledger-{cid}.json")]
        assert [c["label"].split(" [key ")[0] for c in charges] == ["round 1", "round 2"]
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


def _idp_task(round_number: int = 1, *, unit: str = "patient-idp", plan_steps: int = 6
              ) -> RoundTask:
    """A site-mode round of 3 DP-SGD steps at mean record rate 0.34 (what the coordinator
    proposes; the site plans its own groups for ``plan_steps`` steps)."""
    return RoundTask(mode="site", round=round_number, cohort=3, seed=0, unit=unit,
                     noise_multiplier=3.0, sample_rate=0.34, steps=3,
                     plan_steps=plan_steps if unit == "patient-idp" else None)


def _guard(tmp_path: Path, unit: str) -> tuple[SiteData, Any]:
    """Site 1 with its table and budget column, and its operator's policy and ledger."""
    data = SiteData(1, csv=str(_table(tmp_path / "site.csv", patients=40)),
                    patient_column="pid", label_column="label", budget_column="budget")
    policy = SitePolicy(modes=("site",), unit=unit, epsilon=3.0, delta=1e-4,
                        round_epsilon=None)
    guard = open_site_core(policy=policy, ledger_path=str(tmp_path / "ledger.json"))
    if unit == "patient-idp":
        data.idp = SitePatients(1, data.table(data.schema.labels), epsilon=3.0, delta=1e-4,
                                budget_classes=(1.0, 3.0))
    return data, guard


@pytest.mark.parametrize("unit", UNITS)
def test_the_unit_is_the_site_operators(tmp_path: Path, unit: str) -> None:
    """A patient-idp site refuses rounds computed per patient unit or per record, a
    patient-unit or record-unit site refuses a patient-idp round, each naming [unit] with
    nothing charged; each takes part in its own unit's round (charged, then withdrawn: the
    round never started)."""
    data, guard = _guard(tmp_path, unit)
    network = MemoryNetwork()
    site = SiteProcess(data, network, SiteOptions(federation="fed", idle_timeout=30,
                                                  stage_timeout=10.0, guard=guard),
                       lambda text: None)
    others = [u for u in UNITS if u != unit]
    blobs = [_blob(_idp_task(unit=u), ["no", "yes"], ("a", "b", "c")) for u in (*others, unit)]
    answers = _announce(site, network, blobs)
    assert all(a is not None and "refused by site policy [unit]" in a for a in answers[:-1])
    assert answers[-1] is None  # its own unit: ready
    (charge,) = guard.ledger.charges
    assert charge.unit == unit and charge.withdrawn
    assert (charge.groups is not None) == (unit == "patient-idp")
    guard.ledger.close()


def test_the_site_ledger_caps_every_group_whatever_the_coordinator_proposes(
        tmp_path: Path) -> None:
    data, guard = _guard(tmp_path, "patient-idp")
    assert data.schema.features == ("a", "b", "c")  # the budget column is never announced
    plan = data.idp.for_task(_idp_task()).plan
    for r in (1, 2):
        guard.admit(_idp_task(r), secagg_threshold=2, label=f"round {r}",
                    idp=data.idp.for_task(_idp_task(r)))
    # The ledger composes exactly what the site planned: 2 rounds of 3 steps = 6 steps.
    spent = {k: b.spent[0] for k, b in guard.ledger.group_budgets().items()}
    assert spent == pytest.approx({g.key: plan.group_epsilon(g, 6) for g in plan.groups},
                                  rel=1e-9)
    assert {g.target_epsilon for g in plan.groups} == {1.0, 3.0}
    assert all(spent[g.key] <= g.target_epsilon * (1 + 1e-9) for g in plan.groups)
    with pytest.raises(PolicyRefused, match=r"\[budget\]") as refused:
        guard.admit(_idp_task(3), secagg_threshold=2, label="round 3",
                    idp=data.idp.for_task(_idp_task(3)))
    assert "records=" not in str(refused.value)  # the refusal names no group
    guard.ledger.close()
    # The ledger survives a restart; a coordinator claiming the run is 1 step long (so the
    # site would plan high rates) gets a refusal, not a count: 3 steps of that plan exceed.
    data, guard = _guard(tmp_path, "patient-idp")
    again = {k: b.spent[0] for k, b in guard.ledger.group_budgets().items()}
    assert again == pytest.approx(spent, rel=1e-12)
    assert guard.ledger.epsilon == pytest.approx(max(spent.values()), rel=1e-12)
    with pytest.raises(PolicyRefused, match=r"\[budget\]"):
        guard.admit(_idp_task(3, plan_steps=1), secagg_threshold=2, label="round 3",
                    idp=data.idp.for_task(_idp_task(3, plan_steps=1)))
    assert len(guard.ledger.charges) == 2
    # Another table (patients regrouped) cannot go on with this ledger's group spending.
    other = SiteData(1, csv=str(_table(tmp_path / "other.csv", patients=44)),
                     patient_column="pid", label_column="label", budget_column="budget")
    regrouped = SitePatients(1, other.table(other.schema.labels), epsilon=3.0, delta=1e-4,
                                budget_classes=(1.0, 3.0))
    with pytest.raises(PolicyRefused, match="grouped differently"):
        guard.admit(_idp_task(3), secagg_threshold=2, label="round 3",
                    idp=regrouped.for_task(_idp_task(3)))
    guard.ledger.close()
    # The same ledger under another unit: a release charged to every patient still counts
    # for each rate group, so none passes its target (the strictest group is spent).
    policy = SitePolicy(modes=("site",), unit="patient", epsilon=3.0, delta=1e-4,
                        round_epsilon=None)
    guard = open_site_core(policy=policy, ledger_path=str(tmp_path / "ledger.json"))
    with pytest.raises(PolicyRefused, match=r"\[budget\]"):
        guard.admit(_idp_task(3, unit="patient"), secagg_threshold=2, label="round 3")
    assert len(guard.ledger.charges) == 2
    guard.ledger.close()


@pytest.mark.parametrize("ceiling", [{"max_sample_rate": 0.34},
                                     {"min_noise_multiplier": 50.0},
                                     {"max_clip_norm": 1e-3}])
def test_a_refusal_tells_the_coordinator_the_rule_not_the_sites_private_plan(
        tmp_path: Path, ceiling: dict[str, float]) -> None:
    """A patient-idp site's rates, noise and clip come from its patients' records and
    budgets: two sites alike but for their budget columns send the coordinator the same
    refusal (the rule only), and keep the numbers for their own log."""
    answers, logged = [], []
    for share in (0.1, 0.9):
        path = tmp_path / f"site-{share}.csv"
        rows = _table(path, patients=40).read_text().splitlines()
        rows[1:] = [",".join([*r.split(",")[:4],
                              "1.0" if int(r.split(",")[0][1:]) < share * 40 else "3.0",
                              r.split(",")[5]]) for r in rows[1:]]
        path.write_text("\n".join(rows) + "\n", encoding="utf-8")
        data = SiteData(1, csv=str(path), patient_column="pid", label_column="label",
                        budget_column="budget")
        data.idp = SitePatients(1, data.table(data.schema.labels), epsilon=3.0, delta=1e-4,
                                budget_classes=(1.0, 3.0))
        policy = SitePolicy(modes=("site",), unit="patient-idp", epsilon=3.0, delta=1e-4,
                            round_epsilon=None, **ceiling)
        guard = open_site_core(policy=policy, ledger_path=str(tmp_path / f"l-{share}.json"))
        network = MemoryNetwork()
        site = SiteProcess(data, network, SiteOptions(federation="fed", idle_timeout=30,
                                                      stage_timeout=10.0, guard=guard),
                           logged.append)
        (answer,) = _announce(site, network, [_blob(_idp_task(), ["no", "yes"],
                                                    ("a", "b", "c"))])
        answers.append(answer)
        assert guard.ledger.charges == []  # nothing charged
        guard.ledger.close()
    (rule,) = ceiling
    assert answers[0] == answers[1] and f"refused by site policy [{rule}]" in answers[0]
    assert not any(ch.isdigit() for ch in answers[0].split("]", 1)[1]), answers[0]
