"""Review PoC (the site role's answers to control messages, fl/remote/site.py
``_on_delivery``): a control message naming a run the site has not seen makes it say
:class:`Hello` again ("a new coordinator run: say we are here") and remember the run in
``SiteProcess.runs``. Neither is bounded: whoever can publish on the federation's control
topic (the coordinator, or the broker) sends ``Waiting`` messages (40 bytes each) with fresh
run ids, and the site publishes one Hello per message -- its whole column list, chunked, so
a 20,000-column table answers each 40 bytes with hundreds of kilobytes -- and keeps every run
id for the rest of its life.

The Ready re-send has the same shape and is paced (fl/remote/site.py ``READY_PACE``,
tests/security/test_review_session_ready_resend.py). Fixed the same way
(fl/remote/site.py ``SiteProcess._on_delivery``, ``_hello_new_run``): the site keeps the last
``RUNS_KEPT`` (64) runs, as ``_follow``'s ``handled`` keeps 64 announcements, and says Hello
for a new run at once when its last one for a new run is ``READY_PACE`` old, else once when
the pace allows, naming the latest run then: a flood of run ids costs the site at most one
Hello a second and constant memory, and a genuine new run still gets its Hello at once
(tests/fl/test_site_idle.py, tests/fl/test_remote_roles.py).

In one event loop over the in-memory bus (the production topic ACL): one site role, and
500 ``Waiting`` messages of 500 fresh runs on its control topic."""

from __future__ import annotations

import asyncio
import math
import os

import pytest
from adversary import threat

from fl.remote.inputs import demo_site_data
from fl.remote.messages import HELLO, FedTopics, Hello, Waiting, decode_site_message, framed
from fl.remote.site import READY_PACE, SiteOptions, SiteProcess
from tests.fl.site_cores import site_core
from tests.fl.test_remote_roles import IDS, CountingNetwork
from tests.fl.test_site_idle import SETTINGS
from transport import Reassembler

pytestmark = pytest.mark.timeout(60)

RUNS = 500
KEPT = 64
"""Runs a site may remember (``_follow`` keeps 64 announcements)."""


@threat(attack="Hello flood by fresh run ids", adversary="malicious server",
        controls="500 Waiting messages with fresh run ids on the federation's control topic",
        protocol="a site says Hello for a new run at most once per READY_PACE and remembers "
                 "a bounded number of runs")
def test_a_flood_of_fresh_runs_does_not_flood_the_sites_hellos() -> None:
    network = CountingNetwork()
    topics = FedTopics("fed")
    hello = topics.upstream(1, HELLO)
    sent: list[int] = []  # the bytes of each Hello frame site 1 published
    named: list[bytes] = []  # the run each Hello names
    flood = len(framed(Waiting(os.urandom(16))))
    frames = Reassembler(1 << 20)

    def tap(user: str, topic: str, payload: bytes) -> list[bytes]:
        if topic == hello:
            sent.append(len(payload))
            got = frames.feed("hello", payload, 0.0)
            if got is not None:
                message = decode_site_message(got.payload, HELLO, 1)
                assert isinstance(message, Hello)
                named.append(message.run)
        return [payload]

    network.tap = tap
    site = SiteProcess(demo_site_data(SETTINGS, 1, IDS), network,
                       SiteOptions(federation="fed", idle_timeout=60, guard=site_core()),
                       lambda text: None)

    runs = [os.urandom(16) for _ in range(RUNS)]

    async def main() -> float:
        task = asyncio.create_task(site.run())
        loop = asyncio.get_running_loop()
        while not sent:  # connected and said its first Hello
            await asyncio.sleep(0.01)
        started = loop.time()
        for run in runs:
            network.inject(topics.control, framed(Waiting(run)))
            await asyncio.sleep(0.002)
        deadline, seen = loop.time() + 10, (-1, -1)
        while loop.time() < deadline and (named[-1] != runs[-1]
                                          or seen != (len(sent), len(site.runs))):
            seen = (len(sent), len(site.runs))
            await asyncio.sleep(0.5)  # until the site is done with them
        waited = loop.time() - started
        task.cancel()
        await asyncio.wait([task], timeout=10)
        return waited

    waited = asyncio.run(main())
    hellos = len(sent) - 1  # after the first (30 columns: one frame each)
    bound = 1 + math.ceil(waited / READY_PACE) + 1
    assert hellos <= bound and len(site.runs) <= KEPT, (
        f"the site said Hello {hellos} times in {waited:.1f} s for {RUNS} fresh run ids "
        f"(bound {bound}; {sum(sent[1:])} bytes for {RUNS * flood}) and keeps "
        f"{len(site.runs)} run ids (bound {KEPT})")
    assert named[-1] == runs[-1], "the last Hello names the latest run (a paced one too)"
