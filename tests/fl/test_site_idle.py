"""A site's waits are bounded by what it was told: its idle limit, its broker, its coordinator.

In one event loop over the in-memory bus (the production topic ACL): the coordinator role
and three site roles, with faults injected on the bus (``MemoryNetwork.tap``, ``restart``,
``kill``). Each wait a site may be in is tried: a round whose end the broker lost when it
restarted (issue 30: sites stayed in the finished round until their driver gave up, about
120 s, and missed the rounds after it), the wait for ``go`` under a coordinator gone silent,
and under a broker lost for good. The bounds the sites are given (``round_timeout`` 300 s,
a driver's give-up about 120 s) are far past what the tests wait, so a site that waits for
them instead of its idle limit or its lost link fails the test.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from fl.remote.coordinator import RemoteOptions, train_coordinator_async
from fl.remote.inputs import demo_site_data
from fl.remote.messages import READY, FedTopics
from fl.remote.site import SiteOptions, SiteProcess
from fl.settings import TrainSettings
from tests.fl.site_cores import site_core
from tests.fl.test_remote_roles import IDS, CountingNetwork
from transport.topics import ROOT, SERVER_USER

pytestmark = pytest.mark.timeout(120)

ROUND_TIMEOUT = 300.0
"""What a site would wait for a blob or a go without its idle limit: past every bound here."""
SETTINGS = TrainSettings(sites=3, rounds=4, dataset="breast-cancer", seed=0)


async def _run(network: CountingNetwork, options: dict[int, SiteOptions], logs: list[str],
               ready_timeout: float, until: Callable[[list[asyncio.Task[int]]], bool],
               bound: float,
               fault: Callable[[asyncio.Task[Any]], Awaitable[None]] | None = None,
               coordinator_ends: bool = False) -> tuple[list[int | None], Any]:
    """The coordinator and the sites until ``until(site_tasks)`` holds (or ``bound`` s),
    with ``fault(coordinator_task)`` running beside them, and then, if
    ``coordinator_ends``, until the coordinator has ended too (within ``bound``: it writes
    its report after the sites have left); returns each site's exit code (None: still
    running, then cancelled) and the coordinator's report (None unless it finished)."""
    sites = [SiteProcess(demo_site_data(SETTINGS, cid, IDS), network, options[cid],
                         lambda text, cid=cid: logs.append(f"[site {cid}] {text}"))
             for cid in IDS]
    site_tasks = [asyncio.create_task(site.run()) for site in sites]
    coordinator = asyncio.create_task(train_coordinator_async(
        SETTINGS, RemoteOptions(site_ids=IDS, federation="fed", join_timeout=30,
                                ready_timeout=ready_timeout, stage_timeout=10,
                                insecure_verify=True),
        network, lambda text: logs.append(f"[coordinator] {text}")))
    extra = [asyncio.create_task(fault(coordinator))] if fault is not None else []
    loop = asyncio.get_running_loop()
    deadline = loop.time() + bound
    while not until(site_tasks) and loop.time() < deadline:
        await asyncio.sleep(0.05)
    if coordinator_ends:
        await asyncio.wait([coordinator], timeout=max(0.0, deadline - loop.time()))
    codes = [t.result() if t.done() else None for t in site_tasks]
    report = (coordinator.result() if coordinator.done() and not coordinator.cancelled()
              else None)
    tasks = [*site_tasks, coordinator, *extra]
    for task in tasks:
        task.cancel()
    await asyncio.wait(tasks, timeout=15)  # bounded: a failure shows its logs
    return codes, report


def _options(idle: float) -> dict[int, SiteOptions]:
    return {cid: SiteOptions(federation="fed", idle_timeout=idle, round_timeout=ROUND_TIMEOUT,
                             insecure_verify=True, guard=site_core()) for cid in IDS}


def _every_site_gives_up(network: CountingNetwork, logs: list[str], round_line: str, *,
                         idle: float, ready_timeout: float,
                         fault: Callable[[asyncio.Task[Any]], Awaitable[None]] | None = None
                         ) -> str:
    """Run until every site ended: each must exit 1, its round ending with ``round_line``
    and then "no word from the coordinator"; returns the log."""
    codes, _ = asyncio.run(_run(network, _options(idle=idle), logs,
                                ready_timeout=ready_timeout,
                                until=lambda tasks: all(t.done() for t in tasks), bound=100,
                                fault=fault))
    text = "\n".join(logs)
    assert codes == [1, 1, 1], text
    for cid in IDS:
        assert f"[site {cid}] feature scaling: {round_line}" in text, text
        assert f"[site {cid}] no word from the coordinator for" in text, text
    return text


def test_a_round_end_lost_with_the_broker_costs_no_later_round() -> None:
    """The broker restarts the moment the coordinator ends a round, and with it goes
    everything the round's server said after its unmasking request (the receipts and the
    round end): the sites, still in that round, leave it when the coordinator announces
    the next one, and every later round includes all three sites at its first attempt."""
    network = CountingNetwork()
    seen: list[str] = []  # secagg rounds, in the order their unmasking began
    cut: dict[str, Any] = {}

    def tap(user: str, topic: str, payload: bytes) -> list[bytes]:
        parts = topic.split("/")
        if user != SERVER_USER or parts[0] != ROOT or len(parts) < 3:
            return [payload]
        name = parts[1]
        if parts[2] == "client" and parts[-1] == "unmasking" and name not in seen:
            seen.append(name)
            if len(seen) == 3:  # the second training round (the first is feature scaling)
                cut["round"] = name
                return [payload]
        if cut.get("round") != name or parts[-1] not in ("receipt", "control"):
            return [payload]
        if parts[-1] == "control" and "restart" not in cut:  # its round end: lost with it
            cut["restart"] = asyncio.get_running_loop().create_task(network.restart())
        return []

    network.tap = tap
    logs: list[str] = []

    def finished(tasks: list[asyncio.Task[int]]) -> bool:
        return all(t.done() for t in tasks)

    codes, report = asyncio.run(_run(network, _options(idle=60), logs, ready_timeout=60,
                                     until=finished, bound=100, coordinator_ends=True))
    text = "\n".join(logs)
    assert "restart" in cut, text  # the fault happened
    assert codes == [0, 0, 0], text
    assert report is not None, text
    rows = report["rounds"]
    assert [row["round"] for row in rows] == [1, 2, 3, 4], text
    for row in rows:  # the cut round completed at the coordinator, and so did every later one
        assert row["included"] == [1, 2, 3] and row["aggregate_correct"] is True, text
    assert "did not complete" not in text, text  # no later round needed a second attempt
    for cid in IDS:  # each site was in the cut round and left it when the next was announced
        assert f"[site {cid}] round 2: lost (the coordinator moved on" in text, text


def test_a_coordinator_gone_mid_round_ends_the_round_at_the_idle_limit() -> None:
    """The coordinator vanishes (and nothing of it reaches the sites: no round end, no last
    will, as when the broker goes down with it) in the middle of a round's unmasking: each
    site, still in the round, leaves it at its idle limit (3 s) and exits 1, not after its
    driver's give-up time (about 120 s)."""
    network = CountingNetwork()
    gone: dict[str, Any] = {}

    def tap(user: str, topic: str, payload: bytes) -> list[bytes]:
        if user != SERVER_USER:
            return [payload]
        if "round" in gone:
            return []  # everything it says from then on is lost
        parts = topic.split("/")
        if parts[0] == ROOT and parts[2:3] == ["client"] and parts[-1] == "unmasking":
            gone["round"] = parts[1]
            return [payload]
        return [payload]

    network.tap = tap
    logs: list[str] = []

    async def fault(coordinator: asyncio.Task[Any]) -> None:
        while "round" not in gone:
            await asyncio.sleep(0.05)
        coordinator.cancel()

    _every_site_gives_up(network, logs, "lost (no word from the coordinator for", idle=3,
                         ready_timeout=60, fault=fault)


def test_a_silent_coordinator_ends_the_wait_for_go_at_the_idle_limit() -> None:
    """The coordinator never hears the sites' Ready (dropped on the bus) and waits for them
    in silence: each site gives up on the round after its idle limit (3 s) and exits 1,
    not after ``round_timeout`` (300 s) and then its idle limit again."""
    network = CountingNetwork()
    readies = {FedTopics("fed").upstream(cid, READY) for cid in IDS}
    network.tap = lambda user, topic, payload: [] if topic in readies else [payload]
    _every_site_gives_up(network, [], "not in the round's roster", idle=3,
                         ready_timeout=ROUND_TIMEOUT)


def test_a_retained_message_re_delivered_on_every_reconnection_is_no_news() -> None:
    """The coordinator is gone while the sites wait for ``go`` (its announcement stays
    retained on the broker), and the broker restarts every half second, keeping its
    retained messages, so each site's every reconnection delivers that announcement again:
    a repeat is no word from the coordinator, and each site exits 1 at its idle limit
    (6 s) instead of hearing the same message for ever."""
    network = CountingNetwork()
    readies = {FedTopics("fed").upstream(cid, READY) for cid in IDS}
    dropped: list[str] = []

    def tap(user: str, topic: str, payload: bytes) -> list[bytes]:
        if topic in readies:
            dropped.append(user)
            return []
        return [payload]

    network.tap = tap
    logs: list[str] = []
    restarts: list[float] = []

    async def fault(coordinator: asyncio.Task[Any]) -> None:
        while not dropped:
            await asyncio.sleep(0.05)
        coordinator.cancel()  # gone, in the middle of its first round
        with contextlib.suppress(BaseException):
            await coordinator
        while True:
            await asyncio.sleep(0.5)
            await network.restart(downtime=0.05, persistent=True)
            restarts.append(asyncio.get_running_loop().time())

    text = _every_site_gives_up(network, logs, "not in the round's roster", idle=6,
                                ready_timeout=ROUND_TIMEOUT, fault=fault)
    # the announcement stayed retained and was re-delivered at every restart
    assert FedTopics("fed").control in network.retained and len(restarts) >= 4, text


def test_a_broker_lost_for_good_ends_the_wait_for_go_at_once() -> None:
    """Site 1's connection dies (and stays dead) while it waits for ``go``: it exits 1 as
    soon as its link gives up, with idle limit and ``round_timeout`` both 300 s."""
    network = CountingNetwork()

    def tap(user: str, topic: str, payload: bytes) -> list[bytes]:
        if user == "site-1" and topic == FedTopics("fed").upstream(1, READY):
            asyncio.get_running_loop().call_soon(network.kill, "site-1")
            return []
        return [payload]

    network.tap = tap
    logs: list[str] = []
    codes, _ = asyncio.run(_run(network, _options(idle=ROUND_TIMEOUT), logs,
                                ready_timeout=ROUND_TIMEOUT,
                                until=lambda tasks: tasks[0].done(), bound=100))
    text = "\n".join(logs)
    assert codes[0] == 1, text
    assert "[site 1] lost the broker" in text, text
