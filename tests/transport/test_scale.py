"""What breaks a round of hundreds of sites, staged small (docs/performance.md "Round
deadlines"; the 300- and 500-client runs are in benchmarks/bench_simulate_scale.py):

* ``secagg simulate`` logs every site in from loopback at once: the broker the runner starts
  has a login place for each of them (``--parties``, ``BrokerLimits.for_parties``) instead of
  evicting honest sites beyond the fixed per-address cap, and nothing else gets looser;
* hundreds of sites on one event loop compute their answers one per loop iteration, so the
  loop keeps serving keepalive pings and receipts between them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import secrets

import numpy as np
import pytest

import transport.drivers as drivers
from secagg import Config
from secagg.client import Client
from tests.transport.mqtt_raw import RawClient, connect_packet
from transport.broker import EmbeddedBroker
from transport.broker.config import BrokerLimits
from transport.broker.errors import BrokerConfigError
from transport.launch import _embedded_broker_process
from transport.memory import MemoryNetwork
from transport.rounds import run_round
from transport.topics import acl_table, site_name

PARTIES = 300


def test_limits_for_parties_only_raise_the_login_and_connection_places() -> None:
    base = BrokerLimits()
    sized = base.for_parties(PARTIES)
    assert sized.max_pending_logins_per_address >= PARTIES + 1
    assert sized.max_pending_logins >= PARTIES + 1
    assert sized.max_connections >= PARTIES + 1
    assert sized.max_session_queue >= 2 * PARTIES  # the server: one message from each, twice
    raised = {"max_pending_logins_per_address", "max_pending_logins", "max_connections",
              "max_session_queue"}
    for spec in dataclasses.fields(base):
        if spec.name not in raised:
            assert getattr(sized, spec.name) == getattr(base, spec.name), spec.name
    assert base.for_parties(3) == base  # small rounds keep the defaults
    with pytest.raises(BrokerConfigError, match="parties"):
        base.for_parties(-1)
    with pytest.raises(BrokerConfigError, match="65536"):  # no unbounded places
        base.for_parties(10_000_000)
    # off loopback each party has its own address: one address gains no login place
    remote = base.for_parties(PARTIES, one_address=False)
    assert remote.max_pending_logins_per_address == base.max_pending_logins_per_address
    assert remote.max_pending_logins == sized.max_pending_logins


async def _waiting_sockets(port: int, count: int) -> list[RawClient]:
    """``count`` connections that have not sent CONNECT yet (as a busy site's would look)."""
    return [await RawClient.open(port) for _ in range(count)]


def test_the_simulate_broker_lets_every_party_wait_for_its_login_from_one_address() -> None:
    users = {site_name(cid): secrets.token_urlsafe(12) for cid in range(1, PARTIES + 1)}

    async def first_logs_in(port: int) -> int:
        sockets = await _waiting_sockets(port, PARTIES)
        try:
            first = sockets[0]
            first.send(connect_packet(site_name(1), site_name(1), users[site_name(1)]))
            try:
                return (await first.connack(timeout=10.0))[1]
            except (asyncio.IncompleteReadError, ConnectionError):
                return -1  # evicted before its CONNECT was read
        finally:
            for sock in sockets:
                sock.writer.close()

    with _embedded_broker_process(users, acl_table(list(range(1, PARTIES + 1)))) as port:
        assert asyncio.run(first_logs_in(port)) == 0

    async def fixed_limits() -> int:  # the same burst against the fixed caps: evicted
        async with EmbeddedBroker(users=users) as broker:
            return await first_logs_in(broker.port)

    assert BrokerLimits().max_pending_logins_per_address < PARTIES
    assert asyncio.run(fixed_limits()) != 0


def test_clients_on_one_loop_compute_one_per_loop_iteration(monkeypatch) -> None:
    """Every client's answer is computed in a loop iteration of its own (a callback that
    re-schedules itself counts the iterations), so the loop serves I/O between them."""
    n = 12
    config = Config(num_clients=n, dim=64, bits=16)
    rng = np.random.default_rng(5)
    inputs = {cid: rng.integers(0, 1 << 16, size=64, dtype=np.uint64)
              for cid in range(1, n + 1)}
    seen: list[int] = []
    real_stream = Client.stream  # what the client driver calls (masked inputs stream)

    def stream(self: Client, raw: bytes) -> object:
        seen.append(iterations)
        return real_stream(self, raw)

    monkeypatch.setattr(Client, "stream", stream)
    iterations = 0

    async def scenario() -> object:
        loop = asyncio.get_running_loop()

        def tick() -> None:
            nonlocal iterations
            iterations += 1
            loop.call_soon(tick)

        loop.call_soon(tick)
        return await run_round(MemoryNetwork(acl=acl_table(list(inputs))), config, inputs,
                               timeouts=drivers.Timeouts(stage=30.0))

    report = asyncio.run(scenario())
    assert report.included == frozenset(inputs)  # type: ignore[attr-defined]
    assert len(seen) >= 3 * n  # share_keys, masked_input, unmasking
    assert len(set(seen)) == len(seen), "two clients computed in one loop iteration"
