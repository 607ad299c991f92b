"""One hostile login cannot delay, drop or bloat anyone else's round (issue 29).

Each test attacks through the public surface (the drivers over a bus, the embedded broker
over TCP, the framing's reassembly) and asserts the bound docs/security.md states for it:
a lost receipt never costs an honest site its place; a flooding login is throttled at the
broker and costs the server a bounded amount per stage; a slow reader cannot hold the
server's connection; buffered chunks are charged at least what they cost in memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hashlib
import os
import secrets
import time
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from adversary import threat

from secagg import Config, Stage
from tests.secagg.test_streaming import _exact
from tests.transport.mqtt_raw import RawClient, publish_packet
from transport.broker import EmbeddedBroker
from transport.broker.config import DEFAULT_MAX_PAYLOAD
from transport.broker.packets import PUBACK, PUBLISH
from transport.control import Receipt, decode_control
from transport.credentials import (
    MIN_PASSWORD_BITS,
    CredentialsError,
    password_strength,
    write_federation,
)
from transport.drivers import StageProgress, Timeouts
from transport.framing import _HEADER, HEADER_BYTES, MAGIC, Reassembler, frame
from transport.launch import running_broker
from transport.memory import MemoryNetwork, Tap
from transport.mosquitto import (
    DEFAULT_MEMORY_LIMIT,
    PACKET_SLACK,
    MosquittoBroker,
    mosquitto_available,
)
from transport.mqtt import MqttNetwork
from transport.rounds import RoundReport, run_round
from transport.topics import RECEIPT, SERVER_USER, Topics, acl_table, site_name

pytestmark = [pytest.mark.security, pytest.mark.timeout(120)]

CONFIG = Config(num_clients=4, threshold=3, dim=400, bits=32)
IDS = [1, 2, 3, 4]


def _inputs(seed: int) -> dict[int, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {cid: rng.integers(0, 1 << 32, CONFIG.dim, dtype=np.uint64) for cid in IDS}


def _memory_round(network: MemoryNetwork, topics: Topics, inputs: dict[int, np.ndarray],
                  tap: Tap, timeouts: Timeouts) -> RoundReport:
    """A round of ``CONFIG`` on ``network`` with ``tap``, masked inputs streamed in 10
    chunks of 40 elements (window 4)."""
    network.tap = tap

    async def scenario() -> RoundReport:
        return await run_round(network, CONFIG, inputs, round_name=topics.round_name,
                               timeouts=timeouts, chunk_bytes=160)

    return asyncio.run(asyncio.wait_for(scenario(), 60))


# --------------------------------------------------------------------------- lost receipts


@threat(attack="Lost receipts drop honest sites", adversary="network attacker",
        controls="loses the receipt of one chunk of two sites' streamed masked inputs and "
                 "delays their later receipts past the retry interval, as a busy server "
                 "does (t = n - 1: losing two sites aborts the round)",
        protocol="the server keeps the digest of every chunk it accepted of a stream and "
                 "confirms a re-sent one again; a client takes a refusal of a chunk the "
                 "server must have accepted (a later chunk was confirmed) as a confirmation")
@pytest.mark.parametrize("lost", [1, 3])  # the first chunk's receipt, a later one's
def test_lost_chunk_receipts_do_not_drop_honest_sites(lost: int) -> None:
    topics = Topics(f"fair-{secrets.token_hex(4)}")
    inputs = _inputs(lost)
    seen: dict[int, int] = {}
    dropped: list[int] = []
    network = MemoryNetwork(acl=acl_table(IDS))

    def tap(user: str, topic: str, payload: bytes) -> list[bytes]:
        parsed = topics.parse_downstream(topic)
        if user != SERVER_USER or parsed is None or parsed[1] != RECEIPT:
            return [payload]
        receipt = decode_control(payload[HEADER_BYTES:])
        cid = parsed[0]
        if cid in (1, 2) and isinstance(receipt, Receipt) and receipt.ok:
            seen[cid] = seen.get(cid, 0) + 1
            # receipts 1 and 2 confirm advertise_keys and share_keys; then chunks
            if seen[cid] == 2 + lost:
                dropped.append(cid)
                return []
            if seen[cid] > 2 + lost + 4:  # the server accepted a window more: slow now
                loop = asyncio.get_running_loop()
                loop.call_later(1.0, network.inject, topic, payload)
                return []
        return [payload]

    report = _memory_round(network, topics, inputs, tap, Timeouts(
        stage=20.0, retry=0.3, answer=3.0, give_up=30.0))
    assert sorted(dropped) == [1, 2]
    assert report.included == set(IDS), report.outcomes
    assert all(o.status == "done" for o in report.outcomes.values()), report.outcomes
    assert report.result.total.tolist() == _exact(inputs, report.included, 32)


@threat(attack="Lost receipts drop honest sites", adversary="network attacker",
        controls="replays a chunk of a site's stream that the server accepted long ago "
                 "(a late QoS 1 redelivery, or a client that re-sends after losing its "
                 "receipt), after the stream moved on by more than a window",
        protocol="the server confirms it again (a digest per accepted chunk is kept), "
                 "never refuses it as a second, different message")
@pytest.mark.parametrize("when", ["mid-stream", "after the stream completed"])
def test_an_accepted_chunk_sent_again_is_confirmed_again(when: str) -> None:
    topics = Topics(f"fair-{secrets.token_hex(4)}")
    inputs = _inputs(7)
    chunks: list[bytes] = []
    receipts: list[Receipt] = []
    network = MemoryNetwork(acl=acl_table(IDS))
    resend_at = 7 if when == "mid-stream" else 10  # of 10 chunks; window 4

    def tap(user: str, topic: str, payload: bytes) -> list[bytes]:
        if user == site_name(1) and topic == topics.stage_upstream(1, Stage.MASKED_INPUT):
            chunks.append(payload)
            if len(chunks) == resend_at:
                asyncio.get_running_loop().call_soon(
                    network.route, user, topic, chunks[0], False)
        parsed = topics.parse_downstream(topic)
        if user == SERVER_USER and parsed == (1, RECEIPT):
            receipt = decode_control(payload[HEADER_BYTES:])
            if chunks and isinstance(receipt, Receipt) and receipt.digest == chunks[0][4:36]:
                receipts.append(receipt)
        return [payload]

    report = _memory_round(network, topics, inputs, tap,
                           Timeouts(stage=20.0, retry=5.0, answer=10.0))
    assert report.included == set(IDS), report.outcomes
    assert len(receipts) == 2 and all(r.ok for r in receipts), receipts


# --------------------------------------------------------------------------- memory charge


def _held_and_charged(chunk: int, chunks: int, messages: int) -> tuple[float, float]:
    """Feed ``messages`` incomplete messages of ``chunks`` chunks of ``chunk`` bytes each
    (hand-made frames, as a hostile site sends them; the caller keeps no reference): the
    memory the reassembly holds per chunk (tracemalloc) and what it charged per chunk."""
    reassembler = Reassembler(1 << 30, max_partial=messages + 1,
                              max_buffered_bytes=1 << 40, max_sender_bytes=1 << 40)
    total = chunk * (chunks + 1)  # never completes: the last chunk never comes
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for m in range(messages):
            digest = hashlib.sha256(m.to_bytes(8, "big")).digest()
            for i in range(chunks):
                reassembler.feed("site", _HEADER.pack(MAGIC, digest, i, chunks + 1, total)
                                 + bytes(chunk), 0.0)
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    count = chunks * messages
    assert reassembler.buffered_bytes == chunk * count
    return held / count, reassembler.charged_bytes / count


@threat(attack="Reassembly exhaustion by a site", adversary="malicious client",
        controls="its own login: incomplete messages of tiny (1 and 16 byte) and larger "
                 "chunks, kept as views into their frames",
        protocol="each buffered chunk is charged at least the memory it holds (measured "
                 "with tracemalloc), so a quota bounds real memory; never more than 1.5x "
                 "it (an honest large message is not refused for phantom cost)")
@pytest.mark.parametrize(("chunk", "chunks", "messages"),
                         [(1, 2000, 1), (16, 2000, 1), (1000, 1000, 1), (65536, 64, 1),
                          (16, 1, 2000)])  # the last: many one-chunk messages (partials)
def test_buffered_chunks_are_charged_what_they_cost(chunk: int, chunks: int,
                                                    messages: int) -> None:
    held, charged = _held_and_charged(chunk, chunks, messages)
    assert held <= charged <= 1.5 * held + 64, (held, charged)


# --------------------------------------------------------------------------- broker files


@threat(attack="Broker configuration: packets and memory", adversary="malicious client",
        controls="a valid login on the Mosquitto that transport.mosquitto configures: one "
                 "PUBLISH far above the largest frame the parties send",
        protocol="max_packet_size is max_payload + PACKET_SLACK: Mosquitto disconnects "
                 "the sender instead of taking (and retaining) the packet")
@pytest.mark.skipif(not mosquitto_available(), reason="mosquitto is not installed")
def test_mosquitto_refuses_packets_above_the_largest_frame() -> None:
    users = {SERVER_USER: secrets.token_hex(12), site_name(3): secrets.token_hex(12)}
    topics = Topics("cfg")

    async def scenario() -> None:
        async with MosquittoBroker(users=users, acl=acl_table([3])) as broker:
            assert f"memory_limit {DEFAULT_MEMORY_LIMIT}" in broker.config_text
            site = await RawClient.login(broker.port, site_name(3), site_name(3),
                                         users[site_name(3)])
            topic = topics.stage_upstream(3, Stage.ADVERTISE_KEYS)
            site.send(publish_packet(topic, bytes(DEFAULT_MAX_PAYLOAD), qos=1, packet_id=1))
            assert (await site.read_kind(PUBACK, 5.0)).packet_id == 1  # a frame: taken
            site.send(publish_packet(topic, bytes(DEFAULT_MAX_PAYLOAD + 4 * PACKET_SLACK),
                                     qos=1, retain=True, packet_id=2))
            assert await site.closed(5.0)

    asyncio.run(asyncio.wait_for(scenario(), 30))


@threat(attack="Broker credentials: weak or exposed passwords kept",
        adversary="malicious client",
        controls="a credentials folder where an existing site password is one repeated "
                 "letter, or is strong but in a file others can read (mode 0644)",
        protocol="secagg broker (write_federation) refuses both and says to delete the "
                 "file; a strong password in a 0600 file is kept")
def test_weak_or_exposed_existing_passwords_are_refused(tmp_path: Path) -> None:
    root = tmp_path / "creds"
    first = write_federation(root, [1, 2])
    kept = first.passwords[site_name(1)].read_text()
    assert write_federation(root, [1, 2]).passwords[site_name(1)].read_text() == kept
    weak = first.passwords[site_name(2)]
    weak.write_text("a" * 40 + "\n")
    with pytest.raises(CredentialsError, match="weak password"):
        write_federation(root, [1, 2])
    weak.unlink()
    write_federation(root, [1, 2])  # a new one
    assert password_strength(weak.read_text().strip()) >= MIN_PASSWORD_BITS
    os.chmod(weak, 0o644)
    with pytest.raises(CredentialsError, match="mode 0644"):
        write_federation(root, [1, 2])


# --------------------------------------------------------------------------- slow reader

BROKER_USERS = {SERVER_USER: secrets.token_hex(8), site_name(3): secrets.token_hex(8),
                site_name(9): secrets.token_hex(8)}
BROKER_TOPICS = Topics("r1")
SLOW = 4.0  # slow_consumer_timeout: what a held publisher would wait, far above 1.5 s


async def _login(port: int, user: str, **kwargs: Any) -> RawClient:
    return await RawClient.login(port, user, user, BROKER_USERS[user], **kwargs)


@threat(attack="Slow subscriber stalls routing", adversary="malicious client",
        controls="a valid site login that reads its own inbox at 160 KiB/s (progress, "
                 "so never idle) while the server publishes megabytes to it, then a "
                 "message to another site",
        protocol="the broker never stops reading the server's connection for one "
                 "subscriber (it delivers to others too); the slow site is disconnected "
                 "once its queue passes twice its limit or stays over it for "
                 "slow_consumer_timeout; the other site's message arrives at once")
@pytest.mark.parametrize("sent", [90, 200])  # 5.6 MiB: over its limit; 12.5: over twice
def test_a_slow_reader_cannot_hold_the_servers_connection(sent: int) -> None:
    async def scenario() -> None:
        async with EmbeddedBroker(users=BROKER_USERS, acl=acl_table([3, 9]),
                                  max_queued_bytes=256 << 10,
                                  slow_consumer_timeout=SLOW) as broker:
            server = await _login(broker.port, SERVER_USER)
            slow = await _login(broker.port, site_name(3), recv_buffer=4096)
            await slow.subscribe([(BROKER_TOPICS.client_filter(3), 0)])
            other = await _login(broker.port, site_name(9))
            await other.subscribe([(BROKER_TOPICS.client_filter(9), 0)])

            async def trickle() -> None:  # 16 KiB every 0.1 s until the broker closes it
                with contextlib.suppress(ConnectionError, OSError):
                    while await slow.reader.read(16 << 10):
                        await asyncio.sleep(0.1)

            reader = asyncio.create_task(trickle())
            started = time.monotonic()
            for _ in range(sent):  # beyond what the kernel's socket buffers absorb
                server.send(publish_packet(BROKER_TOPICS.downstream(3, RECEIPT),
                                           bytes(64 << 10)))
            server.send(publish_packet(BROKER_TOPICS.downstream(9, RECEIPT), b"next"))
            got = await other.read_kind(PUBLISH, 30.0)
            waited = time.monotonic() - started
            assert got.payload == b"next"
            assert waited < 1.5, f"the other site's message waited {waited:.1f} s"
            while not broker.stats.slow_consumers_dropped:
                assert time.monotonic() - started < SLOW + 3.0, "the slow reader stayed"
                await asyncio.sleep(0.1)
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)

    asyncio.run(asyncio.wait_for(scenario(), 60))


# --------------------------------------------------------------------------- flood

FLOOD = 100_000  # publishes of 16-byte payloads or tiny framed garbage (about 7 MB)


async def _flood(client: RawClient, topic: str) -> None:
    """``FLOOD`` publishes on ``topic``: 16-byte junk (not a frame) and valid one-chunk
    frames of garbage (each a refused message the server used to answer), alternately."""
    junk = publish_packet(topic, bytes(range(16)))
    garbage = publish_packet(topic, frame(b"\x00" * 16)[0])
    for i in range(FLOOD):
        client.send(junk if i % 2 else garbage)
        if i % 1000 == 999:
            await client.writer.drain()


@threat(attack="Flood from one login", adversary="malicious client",
        controls="a valid login, in the round (a second connection under its own name) or "
                 "outside it, sending 100,000 tiny publishes on topics its ACL allows while "
                 "a round runs with 6 s stage deadlines",
        protocol="the broker throttles each login's publish rate (max_publish_rate); the "
                 "server takes deliveries in turn per sender, drops a sender's messages "
                 "unread past waste_budget per stage and stops waiting for it: every "
                 "stage closes on the honest sites' answers, no deadline passes, every "
                 "honest site is included")
@pytest.mark.parametrize("evil", [1, 9])  # in the round; a login outside it
def test_a_flooding_login_does_not_delay_the_round(evil: int) -> None:
    users = {site_name(c): secrets.token_hex(8) for c in [*IDS, 9]}
    users[SERVER_USER] = secrets.token_hex(8)
    topics = Topics(f"flood-{secrets.token_hex(4)}")
    inputs = _inputs(evil)
    stages: list[StageProgress] = []

    async def scenario() -> RoundReport:
        # the broker in its own process, as secagg simulate and deployments run it
        async with running_broker("embedded", users, acl_table([*IDS, 9])) as settings:
            flooder = await RawClient.login(settings.port, f"{site_name(evil)}-flood",
                                            site_name(evil), users[site_name(evil)])
            flood = asyncio.create_task(_flood(flooder, topics.stage_upstream(
                evil, Stage.ADVERTISE_KEYS)))
            try:
                return await run_round(
                    MqttNetwork(settings), CONFIG, inputs, round_name=topics.round_name,
                    on_stage=stages.append,
                    timeouts=Timeouts(stage=6.0, retry=1.0, answer=3.0, give_up=30.0))
            finally:
                flood.cancel()
                await asyncio.gather(flood, return_exceptions=True)
                flooder.drop()

    report = asyncio.run(asyncio.wait_for(scenario(), 90))
    honest = set(IDS) - {evil}
    # not even the flooder's own stage waits (past its budget it is not waited for)
    assert not [p.stage.label for p in stages if p.deadline_hit], stages
    assert honest <= report.included, report.outcomes
    assert report.result.total.tolist() == _exact(inputs, report.included, 32)
