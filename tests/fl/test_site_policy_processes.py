"""A hostile coordinator against real site processes (``secagg train --role site``) with
their operators' policies: every site takes part in the (acceptably) noised feature
statistics and charges them, refuses the round naming the rule, nothing of the round is
released or charged, and the coordinator cannot train (issue 13, docs/privacy.md 1)."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import pytest
from test_multiprocess_training import COMMON, SITES, Party, federation_broker

from dp.ledger import read_charges
from transport.topics import SERVER_USER, site_name

pytestmark = pytest.mark.timeout(180)


def test_sites_refuse_a_coordinator_proposing_too_little_noise(tmp_path: Path) -> None:
    with federation_broker() as urls:
        coordinator = Party(["--role", "coordinator", "--sites", "1,2,3", "--rounds", "2",
                             "--dp", "distributed", "--noise-multiplier", "0.05",
                             "--sample-rate", "0.1", "--broker", urls[SERVER_USER],
                             "--join-timeout", "60", "--ready-timeout", "30", *COMMON])
        sites = {cid: Party(["--role", "site", "--site-id", str(cid), "--sites", "3",
                             "--broker", urls[site_name(cid)], "--idle-timeout", "60",
                             "--dp", "distributed", "--epsilon", "4",
                             "--min-noise-multiplier", "0.8", "--max-sample-rate", "0.2",
                             "--ledger", str(tmp_path / f"ledger-{cid}.json"), *COMMON])
                 for cid in SITES}
        try:
            for party in sites.values():
                party.wait_for("refused by site policy [min_noise_multiplier]", 120)
            assert coordinator.wait(120) == 1, coordinator.log
            assert "declined" in coordinator.log
        finally:
            for party in (coordinator, *sites.values()):
                party.kill()
    for cid in SITES:
        ledger = tmp_path / f"ledger-{cid}.json"
        charges = [asdict(c) for c in read_charges(ledger)]
        # The noised feature statistics (fl/site/private_scaler.py) were acceptable and charged
        # before they were computed; the round was refused before anything was charged.
        assert [c["kind"] for c in charges] == ["scaler"]
        assert 0 < charges[0]["epsilon_after"] < 4 and charges[0]["mode"] == "distributed"
