"""A Ready lost with a restarting broker is sent again: the round starts at its first attempt.

CI (issue 34) twice saw every site of ``tests/fl/test_broker_restart_processes.py`` wait for
the ``go`` of the round the restart cut while the coordinator waited (its whole ready wait)
for their Ready: a broker without persistence forgets the coordinator's subscription, so a
Ready published before the coordinator subscribed again reached no one, and a site that
heard the coordinator's announcement again (re-published after its reconnection) took it as
no news and said nothing. A site waiting for ``go`` now says Ready again after each of its
own reconnections and each time it hears the round's announcement again.

In one event loop over the in-memory bus (the production topic ACL), as
tests/fl/test_site_idle.py: the broker restarts (retaining nothing) the moment the first
Ready of the first training round is published, and every Ready published before the
restart ends is lost with it. The ready wait (60 s) is far past what the test allows for
the run (the rounds take about a second each), so a coordinator that has to wait it out
fails the test.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from fl.remote.messages import READY, FedTopics
from tests.fl.test_remote_roles import IDS, CountingNetwork
from tests.fl.test_site_idle import _options, _run

pytestmark = pytest.mark.timeout(120)

READY_TIMEOUT = 60.0


def test_readies_lost_with_a_restarting_broker_are_sent_again() -> None:
    network = CountingNetwork()
    readies = {FedTopics("fed").upstream(cid, READY) for cid in IDS}
    seen: list[str] = []
    cut: dict[str, Any] = {}

    def tap(user: str, topic: str, payload: bytes) -> list[bytes]:
        if topic not in readies:
            return [payload]
        seen.append(user)
        if len(seen) <= len(IDS):  # the feature-scaling round's: untouched
            return [payload]
        if "restart" not in cut:
            cut["restart"] = asyncio.get_running_loop().create_task(network.restart(0.2))
        if not cut["restart"].done():
            cut.setdefault("lost", []).append(user)
            return []  # published into a broker going down: lost with it
        return [payload]

    network.tap = tap
    logs: list[str] = []
    loop_time: dict[str, float] = {}

    def finished(tasks: list[asyncio.Task[int]]) -> bool:
        return all(t.done() for t in tasks)

    async def main() -> tuple[list[int | None], Any]:
        loop_time["start"] = asyncio.get_running_loop().time()
        out = await _run(network, _options(idle=READY_TIMEOUT + 30), logs,
                         ready_timeout=READY_TIMEOUT, until=finished, bound=100)
        loop_time["end"] = asyncio.get_running_loop().time()
        return out

    codes, report = asyncio.run(main())
    text = "\n".join(logs)
    assert cut.get("lost"), text  # the fault happened: at least one Ready was lost
    assert codes == [0, 0, 0], text
    assert report is not None
    for row in report["rounds"]:
        assert row["included"] == [1, 2, 3] and row["aggregate_correct"] is True, text
    assert "did not complete" not in text, text  # no round waited out its ready wait
    assert loop_time["end"] - loop_time["start"] < READY_TIMEOUT, text
