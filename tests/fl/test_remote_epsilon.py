"""One epsilon across machines: ``secagg train --role coordinator`` plans, spends and
reports distributed DP at the figure its sites' ledgers charge (docs/privacy.md section 1,
"One epsilon").

Without ``--peer-keys`` a site counts only its own share of a round's noise (the roster is
the coordinator's word, :func:`fl.site.core.lone_share`), so the coordinator plans the noise
whose rounds fit ``--epsilon`` as so counted, the noised feature statistics included
(:func:`fl.federation.site_charge`); with ``--peer-keys`` every share is counted on both
sides. Either way the epsilon the coordinator reports (after the feature statistics and
every round) is the one every site's ledger holds, and ``--plan`` prints it beforehand.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from test_multiprocess_training import COMMON, SITES

from dp.ledger import read_charges
from dp.policy import SitePolicy
from fl.cli import main
from fl.remote.coordinator import RemoteOptions, train_coordinator_async
from fl.remote.inputs import demo_site_data
from fl.remote.site import SiteOptions, SiteProcess
from fl.settings import TrainSettings
from fl.site.core import open_site_core
from fl.site.identity import SiteIdentity, generate, load_peer_keys
from transport.memory import MemoryNetwork
from transport.topics import acl_table

pytestmark = pytest.mark.timeout(120)
EPSILON = 4.0
DP = ["--dp", "distributed", "--epsilon", str(EPSILON), "--rounds", "2",
      "--sample-rate", "0.2"]
"""Breast cancer (public feature bounds): the noised feature statistics, then two rounds."""


def _ledger_epsilons(paths: list[Path]) -> list[list[tuple[str, float]]]:
    return [[(c.kind, c.epsilon_after) for c in read_charges(p) if c.withdrawn is None]
            for p in paths]


def _ledger_multipliers(paths: list[Path]) -> set[float]:
    """The noise multiplier each site's ledger recorded for the training rounds."""
    return {c.noise_multiplier for p in paths for c in read_charges(p) if c.kind == "train"}


def _check(report: dict[str, Any], ledgers: list[list[tuple[str, float]]]) -> None:
    """Every site charged the statistics and both rounds, each at the coordinator's running
    epsilon, and the total is the coordinator's reported (and budgeted) one."""
    (scaling,) = [r for r in report["releases"] if r["round"] == 0]
    rounds = [scaling["epsilon_after"]] + [row["epsilon"] for row in report["rounds"]]
    assert len(rounds) == 3 and rounds[-1] == report["final_epsilon"] <= EPSILON
    for charges in ledgers:
        assert [kind for kind, _ in charges] == ["scaler", "train", "train"]
        assert [e for _, e in charges] == pytest.approx(rounds, rel=1e-9)


def _plan(*extra: str, capsys: Any) -> dict[str, Any]:
    assert main(["train", "--role", "coordinator", "--sites", "1,2,3", "--plan", "--json",
                 "--broker", "mqtt://server:pw@127.0.0.1:1", *DP, *COMMON, *extra]) == 0
    return dict(json.loads(capsys.readouterr().out))


async def _federation(settings: TrainSettings, tmp_path: Path, keyed: bool
                      ) -> tuple[dict[str, Any], list[Path]]:
    """The coordinator role and three site roles (one event loop, the in-memory bus with
    the production ACL); ``keyed``: every operator holds the federation's keys."""
    peers = tmp_path / "peers"
    peers.mkdir()
    for cid in SITES:
        generate(peers / f"site-{cid}.key")
    network = MemoryNetwork(acl=acl_table(list(SITES)))
    policy = SitePolicy(modes=("distributed",))  # the default budget, distributed only
    ledgers = [tmp_path / f"ledger-{cid}.json" for cid in SITES]
    logs: list[str] = []
    sites = [SiteProcess(demo_site_data(settings, cid, SITES), network, SiteOptions(
        federation="fed", idle_timeout=30,
        guard=open_site_core(policy=policy, ledger_path=str(ledgers[cid - 1])),
        identity=SiteIdentity.load(cid, peers / f"site-{cid}.key", peers) if keyed else None),
        lambda text, cid=cid: logs.append(f"[site {cid}] {text}")) for cid in SITES]
    tasks = [asyncio.create_task(site.run()) for site in sites]
    options = RemoteOptions(site_ids=SITES, federation="fed", join_timeout=20,
                            ready_timeout=60, stage_timeout=10,
                            peer_keys=load_peer_keys(peers) if keyed else None)
    try:
        report = await train_coordinator_async(settings, options, network, logs.append)
        codes = list(await asyncio.wait_for(asyncio.gather(*tasks), 30))
    finally:
        for site in sites:
            site.guard.close()
    assert codes == [0, 0, 0], "\n".join(logs)
    return report, ledgers


@pytest.mark.parametrize("keyed", [False, True], ids=["own-share", "peer-keys"])
def test_the_coordinator_reports_the_epsilon_every_site_ledger_holds(
        tmp_path: Path, capsys: Any, keyed: bool) -> None:
    """Sites with their operators' default budget (distributed rounds only: epsilon 10, 4
    per release, noise multiplier floor 0.5). Without keys each site counts its own noise
    share; the coordinator plans, spends and reports at that figure (before, it counted
    every share and reported less than the ledgers held: mutation-checked, the own-share
    case fails with ``site_charge`` returning None). With keys (malicious-mode rounds, 3 of
    3) every share is counted on both sides, with less noise for the same epsilon.
    ``secagg train --role coordinator --plan`` prints the same figure beforehand."""
    settings = TrainSettings(sites=3, rounds=2, dataset="breast-cancer", seed=0,
                             dp="distributed", epsilon=EPSILON, sample_rate=0.2,
                             security="malicious" if keyed else "semi-honest")
    report, ledgers = asyncio.run(_federation(settings, tmp_path, keyed))
    _check(report, _ledger_epsilons(ledgers))
    assert ("its own noise share only" in report["privacy"]) is not keyed
    keys = ["--peer-keys", str(tmp_path / "peers")]
    plan = _plan(*(keys if keyed else []), capsys=capsys)
    assert plan["epsilon_final"] == pytest.approx(report["final_epsilon"], rel=1e-9)
    assert plan["rounds_run"] == 2
    # the multiplier a site's policy floor sees: its own share's (central / sqrt(t)) unless keyed
    (seen,) = _ledger_multipliers(ledgers)
    assert plan["counted_noise_multiplier"] == pytest.approx(seen, rel=1e-9)
    assert (plan["counted_noise_multiplier"] < plan["noise_multiplier"]) is not keyed
    assert ("its own noise share only" in plan["feature_scaling"]) is not keyed
    other = _plan(*([] if keyed else keys), capsys=capsys)
    lone, keyed_plan = (plan, other) if not keyed else (other, plan)
    assert lone["per_site_noise_stddev"] > keyed_plan["per_site_noise_stddev"]
