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
from tests.fl.site_cores import UNCAPPED, site_core
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


async def _federation(settings: TrainSettings, network: MemoryNetwork,
                      site_options: dict[int, SiteOptions], logs: list[str],
                      ids: tuple[int, ...] = IDS) -> tuple[dict[str, Any], list[int]]:
    sites = [SiteProcess(demo_site_data(settings, cid, ids), network, site_options[cid],
                         lambda text, cid=cid: logs.append(f"[site {cid}] {text}"))
             for cid in ids]
    tasks = [asyncio.create_task(site.run()) for site in sites]
    # Sites train before they say Ready: a first in-process round took 4.1 s at load
    # average 7; the deadlines are ceilings only.
    options = RemoteOptions(site_ids=ids, federation="fed", join_timeout=20,
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
    options = {cid: SiteOptions(federation="fed", idle_timeout=30, insecure_verify=True,
                                guard=site_core())
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
    assert "took part in 3 secure aggregations (the training rounds it joined, plus one for " \
           "the feature statistics" in text
    # every masked input came through the streaming path: granted slots, chunks
    assert len(drivers) == 3 and all(d.chunks >= 3 for d in drivers)


def test_a_site_refuses_rounds_of_another_privacy_mode() -> None:
    settings = TrainSettings(sites=3, rounds=1, dataset="ehr", ehr_patients=90, seed=1,
                             dp="site", epsilon=50.0, site_steps=1)
    network = CountingNetwork()
    logs: list[str] = []
    options = {cid: SiteOptions(federation="fed", idle_timeout=30,
                                require_dp="distributed" if cid == 3 else None,
                                guard=site_core(UNCAPPED)) for cid in IDS}
    report, codes = asyncio.run(_federation(settings, network, options, logs))
    text = "\n".join(logs)
    assert codes == [0, 0, 0], text
    assert "[site 3] round 1: refusing the round: the coordinator asks for --dp site" in text
    (row,) = report["rounds"]
    assert row["included"] == [1, 2] and row["dropped"] == {"3": "declined"}
    assert "site 3 declined round 1" in text
    assert 0 < row["epsilon"] <= 50.0


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


def test_remote_roles_run_private_adaptive_clipping_in_distributed_mode(
        tmp_path: Any) -> None:
    """``--dp distributed --adaptive-clip`` across the roles: the clip count travels in the
    round's secure sum from the site processes, the coordinator moves the clip from it, and
    each site's core charges the count jointly with the update (its ledger's epsilon is the
    joint event's, and the coordinator's: it planned the rounds at the sites' own-share
    figure, the count included)."""
    from dp.accounting import rdp_to_epsilon
    from dp.policy import SitePolicy
    from fl.contribution import round_task
    from fl.federation import federation_plan, load_split, site_charge
    from fl.site.core import lone_share, open_site_core, site_proposal

    settings = TrainSettings(sites=3, rounds=2, dataset="ehr", ehr_patients=90, seed=1,
                             dp="distributed", epsilon=30.0, adaptive_clip=0.5,
                             clip_count_stddev=4.0, sample_rate=0.5, max_units=1000)
    network = CountingNetwork()
    logs: list[str] = []
    policy = SitePolicy(modes=("distributed",), epsilon=100.0, round_epsilon=None,
                        min_noise_multiplier=0.0)  # the joint charge, not a cap
    guards = {cid: open_site_core(policy=policy, ledger_path=str(tmp_path / f"{cid}.json"))
              for cid in IDS}
    options = {cid: SiteOptions(federation="fed", idle_timeout=30, guard=guards[cid])
               for cid in IDS}
    report, codes = asyncio.run(_federation(settings, network, options, logs))
    text = "\n".join(logs)
    assert codes == [0, 0, 0], text
    rows = report["rounds"]
    assert [row["included"] for row in rows] == [[1, 2, 3]] * 2
    assert rows[0]["clip_norm"] == 1.0 and rows[1]["clip_norm"] != 1.0
    split = load_split(settings)
    # the coordinator's plan as the sites (no peer keys) charge it: their own share only
    _, threshold, plan = federation_plan(settings, split.train.num_features,
                                         split.train.num_classes, charged=site_charge(False))
    task = round_task(settings, plan, 1, 3, max_units=1000)
    assert task.clip_count
    proposal = lone_share(task, site_proposal(task, secagg_threshold=threshold))
    assert proposal.event is not None
    one_round = rdp_to_epsilon(proposal.event.rdp() * 2, settings.delta)
    # the coordinator planned the two rounds' joint (update and count) cost at 30 as charged
    assert one_round == pytest.approx(report["final_epsilon"], rel=1e-9)
    assert 29.5 < one_round <= 30.0
    for guard in guards.values():
        charges = list(guard.ledger.active())
        assert len(charges) == 2 and all(
            c.event is not None and c.event["spec"]["count_sigma"] > 0 for c in charges)
        assert charges[-1].epsilon_after == pytest.approx(one_round, rel=1e-9)
        guard.close()


@pytest.mark.parametrize("strategy", ["fedadam", "fedadagrad", "scaffold"])
def test_server_optimizers_across_the_roles_equal_the_in_process_run(strategy: str) -> None:
    """A server optimizer (Reddi et al. 2021) run by the coordinator role over the site
    roles' secure sums gives the same model, bit for bit, as the simulated federation with
    the same seed (the strategy is applied to the released sum only); so does SCAFFOLD,
    whose server control variate travels in the round's blob and whose site control
    variates live in the site roles, adopted when a round completes with them."""
    import numpy as np

    from fl.federation import train

    settings = TrainSettings(sites=3, rounds=3, dataset="breast-cancer", seed=0,
                             strategy=strategy, server_lr=0.1, lr=0.05, local_steps=5)
    logs: list[str] = []
    options = {cid: SiteOptions(federation="fed", idle_timeout=30, insecure_verify=True,
                                guard=site_core())
               for cid in IDS}
    report, codes = asyncio.run(_federation(settings, CountingNetwork(), options, logs))
    assert codes == [0, 0, 0], "\n".join(logs)
    local = train(settings)
    np.testing.assert_array_equal(np.asarray(report["model"]), np.asarray(local["model"]))
    assert [r["accuracy"] for r in report["rounds"]] == [r["accuracy"] for r in
                                                         local["rounds"]]


@pytest.mark.parametrize("strategy", ["scaffold", "fedadam"])
def test_tcga_brca_across_the_roles_equals_the_in_process_run(strategy: str) -> None:
    """Fed-TCGA-BRCA's Cox model with SCAFFOLD or FedAdam (FLamby's protocol, fewer local
    updates) run by the coordinator role over six site roles, one per natural center:
    the same model and pooled-test C-index as ``--role all`` with the same seed."""
    import numpy as np

    from fl.federation import train
    from fl.settings import tcga_brca_settings

    settings = tcga_brca_settings(strategy, seed=1, rounds=2, local_steps=10)
    ids = (1, 2, 3, 4, 5, 6)
    logs: list[str] = []
    options = {cid: SiteOptions(federation="fed", idle_timeout=30, insecure_verify=True,
                                guard=site_core())
               for cid in ids}
    report, codes = asyncio.run(_federation(
        settings, MemoryNetwork(acl=acl_table(list(ids))), options, logs, ids))
    assert codes == [0] * 6, "\n".join(logs)
    local = train(settings)
    np.testing.assert_allclose(np.asarray(report["model"]), np.asarray(local["model"]),
                               rtol=0, atol=1e-12)
    assert [r["c_index"] for r in report["rounds"]] == pytest.approx(
        [r["c_index"] for r in local["rounds"]], abs=1e-12)
    assert all(r["aggregate_correct"] for r in report["rounds"])
