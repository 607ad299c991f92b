"""The multi-machine roles (``fl.remote``) in one event loop over the in-memory bus with the
production topic ACL: the coordinator role and three site roles train, each party holds
exactly one connection (a broker that binds client ids to usernames allows no more), and a
site that requires another privacy mode refuses the round instead of contributing."""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import pytest

from fl.remote.coordinator import RemoteOptions, train_coordinator_async
from fl.remote.inputs import demo_site_data
from fl.remote.site import SiteOptions, SiteProcess
from fl.settings import TrainSettings
from transport.link import Will
from transport.memory import MemoryNetwork
from transport.server_driver import ServerDriver
from transport.topics import acl_table

pytestmark = pytest.mark.timeout(90)
IDS = (1, 2, 3)


class CountingNetwork(MemoryNetwork):
    """The memory bus, counting the connections each user opens."""

    def __init__(self) -> None:
        super().__init__(acl=acl_table(list(IDS)))
        self.connections: Counter[str] = Counter()

    @contextlib.asynccontextmanager
    async def connect(self, username: str, *, will: Will | None = None) -> AsyncIterator[Any]:
        self.connections[username] += 1
        async with super().connect(username, will=will) as link:
            yield link


async def _federation(settings: TrainSettings, network: CountingNetwork,
                      site_options: dict[int, SiteOptions], logs: list[str]
                      ) -> tuple[dict[str, Any], list[int]]:
    sites = [SiteProcess(demo_site_data(settings, cid, IDS), network, site_options[cid],
                         lambda text, cid=cid: logs.append(f"[site {cid}] {text}"))
             for cid in IDS]
    tasks = [asyncio.create_task(site.run()) for site in sites]
    # Sites train before they say Ready: a first in-process round took 4.1 s at load
    # average 7; the deadlines are ceilings only.
    options = RemoteOptions(site_ids=IDS, federation="fed", join_timeout=20,
                            ready_timeout=60, stage_timeout=10, insecure_verify=True)
    report = await train_coordinator_async(settings, options, network,
                                           lambda text: logs.append(f"[coordinator] {text}"))
    codes = await asyncio.wait_for(asyncio.gather(*tasks), 30)
    return report, codes


def test_remote_roles_train_with_one_connection_per_party(monkeypatch: Any) -> None:
    settings = TrainSettings(sites=3, rounds=2, dataset="breast-cancer", seed=0)
    network = CountingNetwork()
    drivers: list[ServerDriver] = []
    real_init = ServerDriver.__init__

    def recording_init(self: ServerDriver, *args: Any, **kwargs: Any) -> None:
        real_init(self, *args, **kwargs)
        drivers.append(self)

    monkeypatch.setattr(ServerDriver, "__init__", recording_init)
    logs: list[str] = []
    options = {cid: SiteOptions(federation="fed", idle_timeout=30, insecure_verify=True)
               for cid in IDS}
    report, codes = asyncio.run(_federation(settings, network, options, logs))
    text = "\n".join(logs)
    assert codes == [0, 0, 0], text
    assert [row["round"] for row in report["rounds"]] == [1, 2]
    for row in report["rounds"]:
        assert row["included"] == [1, 2, 3] and row["aggregate_correct"] is True
        assert row["accuracy"] > 0.85  # chance is ~0.63 on this split
    # Feature scaling and two rounds, each one secagg session, over a single link per party.
    assert network.connections == {"server": 1, "site-1": 1, "site-2": 1, "site-3": 1}
    assert "took part in 3 aggregations" in text
    # every masked input came through the streaming path: granted slots, chunks
    assert len(drivers) == 3 and all(d.chunks >= 3 for d in drivers)


def test_a_site_refuses_rounds_of_another_privacy_mode() -> None:
    settings = TrainSettings(sites=3, rounds=1, dataset="ehr", ehr_patients=90, seed=1,
                             dp="site", epsilon=50.0, site_steps=1)
    network = CountingNetwork()
    logs: list[str] = []
    options = {cid: SiteOptions(federation="fed", idle_timeout=30,
                                require_dp="distributed" if cid == 3 else None,
                                insecure_verify=True) for cid in IDS}
    report, codes = asyncio.run(_federation(settings, network, options, logs))
    text = "\n".join(logs)
    assert codes == [0, 0, 0], text
    assert "[site 3] round 1: refusing the round: the coordinator asks for --dp site" in text
    (row,) = report["rounds"]
    assert row["included"] == [1, 2] and row["dropped"] == {"3": "declined"}
    assert "site 3 declined round 1" in text
    assert row["aggregate_correct"] is True and 0 < row["epsilon"] <= 50.0


def test_one_connection_routes_each_round_apart_from_the_federation() -> None:
    """The coordinator's single link: the open round's view gets that round's deliveries
    only (another round's, e.g. a late one, never reach its driver); the federation gets
    the rest; a forwarded will reaches the open round and is dropped when none is open."""
    from fl.remote.link import connect_party
    from transport.link import Delivery
    from transport.topics import Topics

    async def scenario() -> tuple[list[str], list[str], bool]:
        network = MemoryNetwork(acl=acl_table(list(IDS)))
        open_round, old_round = Topics("r-open"), Topics("r-old")
        will = Will("secagg/fed/control", b"gone")
        async with connect_party(network, "server", will) as party, \
                network.connect("site-1") as site:
            await party.subscribe("secagg/fed/server/#")
            await party.subscribe(old_round.server_filter)
            async with party.round(open_round) as view:
                await view.subscribe(open_round.server_filter)
                await site.publish("secagg/fed/server/hello/site-1", b"a")
                await site.publish(open_round.upstream(1, "advertise_keys"), b"b")
                await site.publish(old_round.upstream(1, "advertise_keys"), b"c")
                party.to_round(Delivery(open_round.offline(2), b"will"))
                got_round = [(await view.receive(2.0)) for _ in range(2)]
                assert await view.receive(0.2) is None
            # The round's subscription ended with it; the federation's stay.
            assert party.link.subscriptions == ("secagg/fed/server/#", old_round.server_filter)
            party.to_round(Delivery(open_round.offline(3), b"late"))  # no round: dropped
            got_fed = [(await party.receive(2.0)) for _ in range(2)]
            quiet = await party.receive(0.2) is None
        return ([e.topic for e in got_round if isinstance(e, Delivery)],
                [e.topic for e in got_fed if isinstance(e, Delivery)], quiet)

    to_round, to_federation, quiet = asyncio.run(scenario())
    assert sorted(to_round) == ["secagg/r-open/server/advertise_keys/site-1",
                                "secagg/r-open/server/offline/site-2"]
    assert sorted(to_federation) == ["secagg/fed/server/hello/site-1",
                                     "secagg/r-old/server/advertise_keys/site-1"]
    assert quiet
