"""docs/quickstart.md section 3's coordinator and site commands, taken from the docs' text and
run as printed, each party its own process (issue 27: every documented pair of a site
policy and a server trains): the embedded broker with a password and ACL per party stands
for the TLS Mosquitto (``--broker`` swapped), the files are the test's own (three
hospitals' visit tables, the coordinator's held-out table and public feature bounds),
``--rounds`` shortened as the docs show a flag overriding. The sites run their operators'
default policy (``--dp distributed``, no budget flags). Every site takes part in every
round, the held-out loss falls, the accuracy is above chance and each site's ledger holds
the epsilon the coordinator reports, within the command's 4. Run twice: as printed, and with
the section's recommended site identities (``secagg keygen`` per site, the flags its
keyed lines add: ``--signing-key``/``--peer-keys`` on a site, ``--peer-keys`` on the
coordinator), where the rounds run authenticated and each site counts the round's whole
noise."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")

from test_docs_quickstart_dp import DOC, _command
from test_multiprocess_training import READY_TIMEOUT, Party, federation_broker, finish

from dp.ledger import read_charges
from fl.cli import main
from transport.topics import SERVER_USER, site_name

SITES = (1, 2, 3)

pytestmark = pytest.mark.timeout(600)


def command(marker: str) -> list[str]:
    """The docs' ``secagg train ...`` command of the code block containing ``marker``."""
    argv = _command(marker)
    assert argv[0] == "train"
    return argv[1:]


def swap(argv: list[str], flag: str, value: str) -> None:
    argv[argv.index(flag) + 1] = value


def keyed(marker: str) -> list[str]:
    """The flags the docs' keyed line starting with ``marker`` adds after its ``...``."""
    (line,) = [x for x in DOC.read_text().splitlines() if x.startswith(marker + "...")]
    return line.split("...", 1)[1].split()


def visits(path: Path, seed: int, patients: int) -> None:
    """A hospital's table in the docs' columns: several visits per patient, readmission
    driven by a latent risk the blood pressure and creatinine show."""
    rng = np.random.default_rng(seed)
    with path.open("w", newline="") as out:
        rows = csv.writer(out)
        rows.writerow(["mrn", "age", "systolic_bp", "creatinine", "readmitted"])
        for p in range(patients):
            age, risk = rng.normal(60, 12), rng.normal()
            for v in range(int(rng.integers(1, 4))):
                y = risk + 0.02 * (age - 60) + rng.normal(0, 0.5) > 0
                rows.writerow([f"H{seed}-{p}", round(age + v, 1),
                               round(125 + 15 * risk + rng.normal(0, 5), 1),
                               round(1.0 + 0.3 * risk + rng.normal(0, 0.1), 2),
                               "yes" if y else "no"])


@pytest.mark.parametrize("keys", [False, True], ids=["as-printed", "site-identities"])
def test_the_quickstart_coordinator_and_sites_train_with_dp(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, keys: bool) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))  # the sites' ledgers
    coordinator_argv = command("--role coordinator --sites 1,2,3")
    site_argv = command("--role site --site-id 2 --csv visits.csv")
    assert coordinator_argv[coordinator_argv.index("--epsilon") + 1] == "4"
    assert "--epsilon" not in site_argv  # the site's operator's default budget
    visits(tmp_path / "sites.csv", 0, 5)  # the coordinator reads its columns only
    visits(tmp_path / "heldout.csv", 99, 200)
    for cid in SITES:
        visits(tmp_path / f"visits-{cid}.csv", cid, 200)
    # public bounds, fixed without looking at the data (docs/quickstart.md section 2)
    (tmp_path / "bounds.json").write_text(json.dumps({"low": [18, 80, 0.3],
                                                      "high": [100, 200, 3.0]}))
    site_keys: dict[int, list[str]] = {cid: [] for cid in SITES}
    if keys:
        peers = tmp_path / "federation"
        peers.mkdir()
        for cid in SITES:
            assert main(["keygen", "--out", str(tmp_path / f"site-{cid}.key"), "-q"]) == 0
            (tmp_path / f"site-{cid}.pub").rename(peers / f"site-{cid}.pub")
            site_keys[cid] = keyed("secagg train --role site --site-id 2 ")
            assert site_keys[cid] == ["--signing-key", "site-2.key", "--peer-keys",
                                      "federation/"]
            swap(site_keys[cid], "--signing-key", str(tmp_path / f"site-{cid}.key"))
            swap(site_keys[cid], "--peer-keys", str(peers))
        coordinator_keys = keyed("secagg train --role coordinator ")
        assert coordinator_keys == ["--peer-keys", "federation/"]
        coordinator_argv += ["--peer-keys", str(peers)]
    report = tmp_path / "report.json"
    with federation_broker(SITES) as urls:
        for flag, value in (("--broker", urls[SERVER_USER]), ("--report", str(report)),
                            ("--checkpoint", str(tmp_path / "ckpt")),
                            ("--csv", str(tmp_path / "sites.csv")),
                            ("--eval-csv", str(tmp_path / "heldout.csv")),
                            ("--feature-bounds", str(tmp_path / "bounds.json"))):
            swap(coordinator_argv, flag, value)
        coordinator = Party([*coordinator_argv, "--rounds", "3", "--join-timeout", "60",
                             "--ready-timeout", READY_TIMEOUT])
        sites = {}
        for cid in SITES:
            argv = list(site_argv)
            swap(argv, "--site-id", str(cid))
            swap(argv, "--csv", str(tmp_path / f"visits-{cid}.csv"))
            swap(argv, "--broker", urls[site_name(cid)])
            # above the coordinator's longest silence (its ready wait, docs/deployment.md)
            sites[cid] = Party([*argv, *site_keys[cid], "--idle-timeout", "300"])
        finish(coordinator, sites, timeout=240)
    if keys:
        for party in sites.values():
            assert "rounds run authenticated (secagg malicious mode)" in party.log, party.log
    result = json.loads(report.read_text())
    rows = result["rounds"]
    assert [r["round"] for r in rows] == [1, 2, 3]
    assert all(r["included"] == list(SITES) for r in rows), rows
    with (tmp_path / "heldout.csv").open() as held:
        labels = [row["readmitted"] for row in csv.DictReader(held)]
    chance = max(labels.count("yes"), labels.count("no")) / len(labels)  # 0.50
    assert rows[-1]["loss"] < rows[0]["loss"] and rows[-1]["accuracy"] > chance + 0.05, rows
    final = rows[-1]["epsilon"]
    assert 0 < final <= 4.0
    ledgers = sorted((tmp_path / "state").rglob("ledger-site-*.json"))
    assert len(ledgers) == len(SITES), ledgers
    for ledger in ledgers:
        assert read_charges(ledger)[-1].epsilon_after == pytest.approx(final, rel=1e-6)
