"""Review PoC (the site role's Ready re-send, fl/remote/site.py ``_go``): a site waiting for
``go`` says Ready again after a reconnection or a control message heard again, so a Ready
lost with a restarting broker is not waited out (tests/fl/test_site_ready_resend.py). Are the
re-sends bounded?

Before the fix every control message the site was delivered -- repeats of the round's own
announcement included -- woke ``_go`` and published one more Ready: whoever can publish on
the federation's control topic (the coordinator, or the broker) set the site's publish rate.
300 repeats of the retained announcement (about 290 bytes each) made a site publish about
300 Readies in the one round; with ``--insecure-verify`` each carries the site's clear
vector, so the flood is amplified in bytes too.

Now a re-send is paced (fl/remote/site.py ``READY_PACE``): a re-heard control message or a
reconnection asks for one, and it goes out at most once per pace, so a round's wait for
``go`` of ``w`` seconds publishes at most ``1 + w / READY_PACE`` Readies whatever the bus
carries (a logical bound: the test measures the wait it allowed, it does not bound time).
Every Ready of the wait is the round's own (its run, round, attempt and kind): a re-send
never carries the input to another round. The re-send's purpose still holds
(tests/fl/test_site_ready_resend.py). Other sites, even
with a valid login, cannot trigger a re-send: the topic ACL lets a site publish only on its
own upstream topics (transport/topics.py ``site_acl``; checked by
tests/transport/test_memory.py), and bytes that are not a whole, valid control message do
not count.

In one event loop over the in-memory bus (the production topic ACL), as
tests/fl/test_site_idle.py: the coordinator role and three site roles; site 3's Readies of
the first round are dropped, so the coordinator waits for them (its ready wait) while sites
1 and 2 wait for ``go``; meanwhile the bus delivers the round's announcement again 300
times (after 40 bytes of garbage)."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import pytest
from adversary import threat

from fl.remote.messages import (
    READY,
    Announce,
    FedTopics,
    decode_coordinator_message,
    decode_site_message,
)
from fl.remote.site import READY_PACE
from tests.fl.test_remote_roles import CountingNetwork
from tests.fl.test_site_idle import _options, _run
from transport import Reassembler
from transport.topics import SERVER_USER

pytestmark = pytest.mark.timeout(120)

READY_TIMEOUT = 4.0
REPEATS = 300


@threat(attack="Ready re-send flood", adversary="malicious server",
        controls="the round's retained announcement delivered again 300 times while the "
                 "site waits for go",
        protocol="a site re-sends its Ready at most once per READY_PACE seconds")
def test_a_flood_of_repeated_announcements_does_not_flood_the_sites_readies() -> None:
    network = CountingNetwork()
    topics = FedTopics("fed")
    readies = {cid: topics.upstream(cid, READY) for cid in (1, 2, 3)}
    frames = Reassembler(1 << 20)
    state: dict[str, Any] = {"open": None, "ready_at": None, "go_at": None, "flood": None,
                             "count": 0, "bytes": 0, "injected": 0, "keys": set()}

    async def flood(payload: bytes) -> None:
        network.inject(topics.control, b"x" * 40)  # raw bytes: dropped as invalid
        for _ in range(REPEATS):
            if state["go_at"] is not None:
                return
            network.inject(topics.control, payload)
            state["injected"] += len(payload)
            await asyncio.sleep(0.003)

    def tap(user: str, topic: str, payload: bytes) -> list[bytes]:
        loop = asyncio.get_running_loop()
        if user == SERVER_USER and topic == topics.control:
            got = frames.feed(("c", user), payload, loop.time())
            message = None if got is None else decode_coordinator_message(got.payload)
            if isinstance(message, Announce):
                if state["open"] is None:
                    if message.phase == "open":  # the first round's: its repeats flood
                        state["open"] = (message.key, payload)
                elif message.key != state["open"][0] or message.phase == "go":
                    state["go_at"] = state["go_at"] or loop.time()  # the wait ended
            return [payload]
        if state["open"] is None or state["go_at"] is not None:
            return [payload]
        if topic == readies[3]:
            return []  # the coordinator waits for site 3 (its ready wait)
        if topic == readies[1]:
            state["count"] += 1
            state["bytes"] += len(payload)
            got = frames.feed(("r", user), payload, loop.time())
            if got is not None:  # every Ready of the wait is this round's, never another's
                ready = decode_site_message(got.payload, READY, 1, 1 << 20)
                state["keys"].add((ready.run, ready.round, ready.attempt, ready.kind))
            if state["ready_at"] is None:
                state["ready_at"] = loop.time()
                state["flood"] = loop.create_task(flood(state["open"][1]))
        return [payload]

    network.tap = tap
    logs: list[str] = []

    def finished(tasks: list[asyncio.Task[int]]) -> bool:
        return all(t.done() for t in tasks)  # the run goes on to its end

    codes, _ = asyncio.run(_run(network, _options(idle=60), logs,
                                ready_timeout=READY_TIMEOUT, until=finished, bound=90))
    text = "\n".join(logs[-40:])
    assert codes == [0, 0, 0], text  # the run went on and finished
    assert state["ready_at"] is not None and state["go_at"] is not None, text
    waited = state["go_at"] - state["ready_at"]
    assert state["injected"] > 0, text
    assert state["keys"] == {state["open"][0]}, state["keys"]  # its own round's only
    bound = 1 + math.ceil(waited / READY_PACE) + 1  # the first, one per pace, a boundary
    assert state["count"] <= bound, (
        f"site 1 published {state['count']} Readies ({state['bytes']} bytes) in one round's "
        f"{waited:.1f} s wait for go, for {state['injected']} bytes of repeated "
        f"announcements (bound {bound})")
