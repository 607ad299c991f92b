"""The site's own privacy policy and its write-ahead ledger (dp/policy.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("opacus")

from dp.encoding import EncodingParams
from dp.errors import PrivacyConfigError
from dp.ledger import Ledger, read_charges
from dp.policy import PolicyRefused, Proposal, SitePolicy

POLICY = SitePolicy(modes=("site", "distributed"), min_noise_multiplier=0.8, min_threshold=3,
                    max_sample_rate=0.2, max_steps=50, epsilon=3.0, delta=1e-5)


def _site(z: float = 1.0, q: float = 0.05, steps: int = 10, t: int = 3) -> Proposal:
    return Proposal.site_dp(noise_multiplier=z, sample_rate=q, steps=steps, clip_norm=1.0,
                            secagg_threshold=t)


def _dist(sd: float, threshold: int, secagg: int, q: float = 0.1) -> Proposal:
    params = EncodingParams(dim=20, clip_norm=1.0, scale=4096.0, bits=40, noise_stddev=sd,
                            rotation_seed=1, threshold=threshold)
    return Proposal.distributed(params, sample_rate=q, secagg_threshold=secagg)


@pytest.mark.parametrize(("proposal", "rule"), [
    (_site(z=0.0), "min_noise_multiplier"),
    (_site(z=0.5), "min_noise_multiplier"),
    (_site(q=1.0), "max_sample_rate"),
    (_site(t=1), "min_threshold"),
    (_site(steps=500), "max_steps"),
    (_dist(0.0, 3, 3), "min_noise_multiplier"),
    (_dist(1.0, 1, 3), "min_threshold"),
    (_dist(1.0 / 3**0.5, 3, 2), "min_threshold"),
    (_dist(1.0, 3, 3, q=1.0), "max_sample_rate"),
    (Proposal.exact("scaler", secagg_threshold=3), "exact-release"),
    (Proposal.exact("train", secagg_threshold=3), "exact-release"),
])
def test_a_proposal_breaking_the_policy_is_refused_naming_the_rule(
        tmp_path: Path, proposal: Proposal, rule: str) -> None:
    with Ledger.open(tmp_path / "ledger.json", POLICY) as ledger:
        with pytest.raises(PolicyRefused, match=rf"\[{rule}\]") as err:
            ledger.charge(proposal)
        assert err.value.rule == rule
        assert ledger.charges == [] and not (tmp_path / "ledger.json").exists()


def test_the_coordinators_worst_case_noise0_threshold1_q1_is_refused(tmp_path: Path) -> None:
    """The issue's attack: noise 0, threshold 1, q = 1 decoded an exact patient count."""
    with Ledger.open(tmp_path / "l.json", POLICY) as ledger:
        for proposal in (_dist(0.0, 1, 1, q=1.0), _site(z=0.0, q=1.0, t=1)):
            with pytest.raises(PolicyRefused):
                ledger.charge(proposal)
        assert ledger.releases == 0


def test_ledger_survives_a_restart_and_enforces_the_budget_across_it(tmp_path: Path) -> None:
    path = tmp_path / "ledger.json"
    with Ledger.open(path, POLICY) as ledger:
        first = ledger.charge(_site(z=1.0, q=0.05, steps=20))
        spent = ledger.epsilon
        assert 0 < spent <= 3.0 and first.epsilon_after == pytest.approx(spent)
    with Ledger.open(path, POLICY) as again:  # a new process: the same record
        assert again.releases == 1 and again.epsilon == pytest.approx(spent)
        n = 1
        with pytest.raises(PolicyRefused, match=r"\[budget\]"):
            while True:
                again.charge(_site(z=1.0, q=0.05, steps=20))
                n += 1
        assert again.epsilon <= 3.0
    with Ledger.open(path, POLICY) as third:
        assert third.releases == n and third.epsilon <= 3.0


def test_withdrawn_charges_cost_nothing_and_stay_on_record(tmp_path: Path) -> None:
    path = tmp_path / "ledger.json"
    with Ledger.open(path, POLICY) as ledger:
        c = ledger.charge(_site())
        ledger.withdraw(c, "not in the roster: the input never left")
        assert ledger.epsilon == 0.0 and ledger.releases == 0
    (charge,) = read_charges(path)
    assert charge.withdrawn is not None and charge.withdrawn.startswith("not in the roster")


def test_one_process_per_ledger_and_corrupt_ledgers_are_not_reset(tmp_path: Path) -> None:
    path = tmp_path / "ledger.json"
    with Ledger.open(path, POLICY), pytest.raises(PrivacyConfigError, match="in use"):
        Ledger.open(path, POLICY)
    path.write_text("{not json")
    with pytest.raises(PrivacyConfigError, match="unreadable"):
        Ledger.open(path, POLICY)
    assert path.read_text() == "{not json"


def test_policy_files_and_bad_policies(tmp_path: Path) -> None:
    f = tmp_path / "policy.json"
    f.write_text(json.dumps(POLICY.to_json()))
    assert SitePolicy.load(f) == POLICY
    f.write_text(json.dumps({"min_noise": 1}))
    with pytest.raises(PrivacyConfigError, match="unknown keys"):
        SitePolicy.load(f)
    with pytest.raises(PrivacyConfigError, match="max_sample_rate"):
        SitePolicy(max_sample_rate=0)
    with pytest.raises(PrivacyConfigError, match="modes"):
        SitePolicy(modes=("central",))
