"""Review (withdrawal rule, site role): "a charge is withdrawn exactly when the site's masked
input never left it" -- the boundary case, through real site processes. HOLDS.

A coordinator receives every site's masked input of round 1, then claims they dropped: it
never delivers the unmasking requests (the tap drops them), so the round aborts in
unmasking with every site's client at stage ``masked_input`` exactly, and the coordinator
retries the round. Each site's ledger must keep the aborted attempt's charge (its masked
input left: fl/site/session.py ``abandon`` withdraws only below ``Stage.MASKED_INPUT``) and
charge the retry anew; nothing of the run is withdrawn.

The Flower and NVFlare runtimes have this case (tests/security/test_review_epsilon_after_abort.py,
``test_review_epsilon_after_abort_nvflare.py``); the site role's tests withdraw rounds that
never reached the masked input (tests/fl/test_roster.py, test_site_session.py,
test_session_rules_every_runtime.py) or send the clear vector with ``--insecure-verify``,
which keeps every charge whatever the stage. Here the sites run without it, so the stage
alone decides: with ``stage <= Stage.MASKED_INPUT`` in ``abandon`` this test fails.

In one event loop over the in-memory bus (the production topic ACL): the coordinator role and
three site roles, as tests/fl/test_site_idle.py.
"""

from __future__ import annotations

import asyncio

import pytest
from adversary import threat

from fl.remote.coordinator import RemoteOptions, train_coordinator_async
from fl.remote.inputs import demo_site_data
from fl.remote.site import SiteOptions, SiteProcess
from fl.settings import TrainSettings
from tests.fl.site_cores import site_core
from tests.fl.test_remote_roles import IDS, CountingNetwork
from transport.topics import ROOT, SERVER_USER

pytestmark = pytest.mark.timeout(120)

SETTINGS = TrainSettings(sites=3, rounds=2, dataset="breast-cancer", seed=0)


@threat(attack="Withdrawal of a charge whose masked input left (site role)",
        adversary="malicious server",
        controls="the unmasking requests of round 1 withheld after every masked input "
                 "arrived; the round retried",
        protocol="abandon withdraws only below Stage.MASKED_INPUT; the retry is charged anew")
def test_a_round_aborted_after_the_masked_inputs_stays_charged_at_every_site() -> None:
    network = CountingNetwork()
    rounds: list[str] = []  # secagg round names, in the order they started
    withheld: list[str] = []

    def tap(user: str, topic: str, payload: bytes) -> list[bytes]:
        parts = topic.split("/")
        if user != SERVER_USER or parts[0] != ROOT or len(parts) < 3 \
                or parts[2] != "client":
            return [payload]
        if parts[1] not in rounds:
            rounds.append(parts[1])
        # the first training round's first attempt (feature scaling is the first secagg
        # round): its unmasking requests never reach the sites
        if len(rounds) == 2 and parts[1] == rounds[1] and parts[-1] == "unmasking":
            withheld.append(topic)
            return []
        return [payload]

    network.tap = tap
    options = {cid: SiteOptions(federation="fed", idle_timeout=60, round_timeout=120,
                                guard=site_core()) for cid in IDS}  # no --insecure-verify
    logs: list[str] = []

    async def main() -> tuple[dict, list[int]]:
        sites = [SiteProcess(demo_site_data(SETTINGS, cid, IDS), network, options[cid],
                             lambda text, cid=cid: logs.append(f"[site {cid}] {text}"))
                 for cid in IDS]
        tasks = [asyncio.create_task(site.run()) for site in sites]
        report = await train_coordinator_async(
            SETTINGS, RemoteOptions(site_ids=IDS, federation="fed", join_timeout=30,
                                    ready_timeout=60, stage_timeout=5),
            network, lambda text: logs.append(f"[coordinator] {text}"))
        return report, list(await asyncio.wait_for(asyncio.gather(*tasks), 30))

    report, codes = asyncio.run(main())
    text = "\n".join(logs[-60:])
    assert codes == [0, 0, 0] and withheld, text
    first = report["rounds"][0]
    assert first["attempts"] == 2, text  # the first attempt aborted, the retry released
    for cid in IDS:
        charges = options[cid].guard.ledger.charges
        aborted = [c for c in charges if c.label.endswith("-1-0-train]")]
        retried = [c for c in charges if c.label.endswith("-1-1-train]")]
        assert len(aborted) == 1 and len(retried) == 1, [c.label for c in charges]
        assert aborted[0].withdrawn is None, (
            f"site {cid}: the charge of the attempt whose masked input left was withdrawn: "
            f"{aborted[0].withdrawn!r}")
        assert all(c.withdrawn is None for c in charges), [c.withdrawn for c in charges]
        options[cid].guard.close()
