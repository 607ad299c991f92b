"""A site with one valid login against the server's reassembly of chunked messages.

Frames (``transport.framing``) carry a message id, chunk index and count; the server keeps
incomplete messages until their last chunk arrives. These tests stage what a site can send
under its own name to make the server hold memory, burn CPU, or drop an honest site's
masked input, through a real round on the embedded broker where the attack needs one.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import secrets
import struct
import time

import numpy as np
import pytest
from adversary import threat

from secagg import Config, Stage
from tests.transport.mqtt_raw import RawClient, publish_packet
from transport.broker import EmbeddedBroker
from transport.drivers import StageProgress, Timeouts
from transport.framing import (
    CHUNK_OVERHEAD,
    HEADER_BYTES,
    FrameError,
    Reassembler,
    frame,
    round_reassembler,
)
from transport.mqtt import BrokerSettings, MqttNetwork
from transport.rounds import run_round
from transport.topics import SERVER_USER, Topics, acl_table, site_name

pytestmark = pytest.mark.security

_HEADER = struct.Struct(">4s32sIII")


def raw_frame(index: int, count: int, total: int, chunk: bytes,
              digest: bytes = b"\x01" * 32) -> bytes:
    return _HEADER.pack(b"SGF1", digest, index, count, total) + chunk


@threat(attack="Reassembly exhaustion by a site",
        adversary="malicious client",
        controls="a valid login as a site of the round (a second connection under its own "
                 "name): 5,000 frames under made-up <kind> levels and 300 never-finished "
                 "chunk sets, while the honest sites send chunked masked inputs",
        protocol="the server drops unknown kinds and senders outside the roster before "
                 "buffering; each sender has its own quota (partial messages and bytes, "
                 "overhead counted), so the other sites' messages complete")
def test_junk_kinds_and_partial_sets_do_not_disturb_the_round() -> None:
    ids = [1, 2, 3, 4, 5, 6]
    config = Config(num_clients=6, dim=2000)
    rng = np.random.default_rng(4)
    inputs = {c: rng.integers(0, 1 << 32, config.dim, dtype=np.uint64) for c in ids}
    users = {site_name(c): secrets.token_hex(8) for c in ids}
    users[SERVER_USER] = secrets.token_hex(8)
    topics = Topics("junk")
    sent: list[int] = []

    async def attack(port: int) -> None:
        evil = await RawClient.login(port, "site-2-evil", "site-2", users["site-2"])
        for i in range(5000):  # first chunks under made-up kinds: never buffered
            digest = hashlib.sha256(b"k" + i.to_bytes(4, "big")).digest()
            evil.send(publish_packet(topics.upstream(2, f"k{i}"),
                                     raw_frame(0, 4, 4000, bytes(1000), digest)))
        for i in range(300):  # first chunks of messages that never complete
            digest = hashlib.sha256(i.to_bytes(4, "big")).digest()
            evil.send(publish_packet(topics.stage_upstream(2, Stage.MASKED_INPUT),
                                     raw_frame(0, 4, 4000, bytes(1000), digest)))
        await evil.ping(10.0)  # the broker has taken (and routed) all of it
        sent.append(5300)
        evil.disconnect()

    async def scenario() -> object:
        async with EmbeddedBroker(users=users, acl=acl_table(ids)) as broker:
            tasks = []

            def on_stage(progress: StageProgress) -> None:
                if progress.stage is Stage.ADVERTISE_KEYS:
                    tasks.append(asyncio.create_task(attack(broker.port)))

            settings = BrokerSettings(port=broker.port, passwords=users)
            # site 5 is silent in masked_input: the stage stays open during the attack
            timeouts = Timeouts(stage=4.0, start=10.0, retry=1.0, answer=4.0, give_up=30.0)
            report = await run_round(MqttNetwork(settings), config, inputs,
                                     {5: Stage.MASKED_INPUT}, round_name=topics.round_name,
                                     timeouts=timeouts, on_stage=on_stage, drop_mode="silent",
                                     max_payload=HEADER_BYTES + 1024)
            await asyncio.gather(*tasks)
            return report

    report = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert sent == [5300]
    assert report.included >= {1, 3, 4, 6}  # type: ignore[attr-defined]
    expected = sum((inputs[c] for c in report.included),  # type: ignore[attr-defined]
                   np.zeros(config.dim, np.uint64)) & np.uint64(0xFFFFFFFF)
    assert np.array_equal(report.result.total, expected)  # type: ignore[attr-defined]
    assert report.invalid_payloads >= 5000  # type: ignore[attr-defined]


@threat(attack="Reassembly exhaustion by a site",
        adversary="malicious client",
        controls="tens of thousands of incomplete chunk sets (one per sender name it "
                 "could use), then more frames",
        protocol="incomplete messages expire oldest-first in constant time per message; "
                 "the cost of a frame does not grow with what is buffered")
def test_expiry_is_constant_time_per_message() -> None:
    reassembler = Reassembler(10_000, max_partial=1, ttl=5.0)
    n = 20_000
    for i in range(n):
        reassembler.feed(i, raw_frame(0, 2, 200, bytes(100)), 0.0)
    assert reassembler.buffered_bytes == n * 100
    started = time.perf_counter()
    for i in range(n):  # every feed also runs expiry over n open messages
        reassembler.feed(n + i, raw_frame(0, 2, 200, bytes(100)), 1.0 + i * 1e-6)
    reassembler.feed("late", raw_frame(0, 2, 200, bytes(100)), 10.0)
    assert time.perf_counter() - started < 5.0  # a scan per frame: 4e8 steps, minutes
    assert reassembler.buffered_bytes == 100  # everything older than the ttl is gone


@threat(attack="Reassembly exhaustion by a site",
        adversary="malicious client",
        controls="chunk sets of 1-byte chunks and sets it never finishes, all under its "
                 "own name, while another site sends a large chunked message",
        protocol="per-sender quota in bytes charged with per-chunk and per-message "
                 "overhead: the attacker exhausts only its own quota")
def test_one_sender_cannot_use_up_another_senders_room() -> None:
    reassembler = Reassembler(1 << 20, max_partial=100_000, max_sender_bytes=256 << 10,
                              max_buffered_bytes=1 << 20)
    refused = 0
    for i in range(20_000):
        digest = hashlib.sha256(i.to_bytes(4, "big")).digest()
        try:
            reassembler.feed("attacker", raw_frame(0, 1000, 1000, b"x", digest), 0.0)
        except FrameError:
            refused += 1
    # its quota holds: a frame over it is refused or, since dead frames release their
    # quota (issue 30), drops the attacker's own oldest messages, never anyone else's
    assert refused > 0 or reassembler.buffered_bytes < 20_000
    assert reassembler.charged_bytes <= 256 << 10  # tiny chunks pay their real cost
    assert reassembler.charged_bytes >= reassembler.buffered_bytes * (1 + CHUNK_OVERHEAD) // 2
    honest = bytes(range(256)) * 500
    got = None
    for data in frame(honest, max_payload=HEADER_BYTES + 4096):
        got = reassembler.feed("honest", data, 0.0)
    assert got is not None and got.payload == honest


@threat(attack="Reassembly exhaustion by a site",
        adversary="malicious client",
        controls="chunk sets whose chunks are not full-size (a 1-byte first chunk of a "
                 "1,000-chunk megabyte, chunks of varying length)",
        protocol="every chunk but the last must have the same length and the count must "
                 "be the one that length implies (what framing.frame produces)")
@pytest.mark.parametrize("frames", [
    [raw_frame(0, 1000, 1_000_000, b"x")],
    [raw_frame(0, 3, 25, bytes(10)), raw_frame(1, 3, 25, bytes(9))],
    [raw_frame(2, 3, 25, bytes(6))],
    [raw_frame(0, 4, 25, bytes(10))],
])
def test_chunking_that_is_not_full_size_is_refused(frames: list[bytes]) -> None:
    reassembler = Reassembler(1 << 20)
    with pytest.raises(FrameError, match="full-size"):
        for data in frames:
            reassembler.feed("s", data, 0.0)
    assert reassembler.buffered_bytes == 0


def _interleaved(reassembler: Reassembler, messages: dict[str, bytes], payload: int
                 ) -> dict[str, bytes]:
    """Feed every sender's chunks round-robin (all of them in flight at once)."""
    frames = {who: frame(data, max_payload=payload) for who, data in messages.items()}
    done: dict[str, bytes] = {}
    for i in range(max(len(f) for f in frames.values())):
        for who, chunks in frames.items():
            if i < len(chunks):
                try:
                    got = reassembler.feed(who, chunks[i], 0.0, quota=who)
                except FrameError:
                    continue
                if got is not None:
                    done[who] = got.payload
    return done


@threat(attack="Concurrent large updates evict each other",
        adversary="malicious client",
        controls="every site streams a whole-size masked input at once, chunk by chunk; "
                 "one site also opens a second, never-finished set of the same size",
        protocol="the round's reassembly gives each site a quota of one whole message and "
                 "a pool that is the sum of the quotas (transport.framing.round_reassembler):"
                 " a site can only lose its own partial sets")
def test_a_round_reassembles_every_sites_whole_update_at_once() -> None:
    """At 400 MB per update five sites needed 2 GB of a 512 MiB shared pool and the round
    died ('reassembly buffers are full'); here the same ratio at a small size."""
    size, payload, n = 200_000, HEADER_BYTES + 4096, 5
    messages = {f"site-{i}": secrets.token_bytes(size) for i in range(n)}
    shared = Reassembler(size + 4096, max_buffered_bytes=int(2.5 * size))  # the old pool
    assert len(_interleaved(shared, messages, payload)) < n
    fresh = round_reassembler(size + 4096, n, payload)
    assert _interleaved(fresh, messages, payload) == messages
    # a site that also opens a second set of the same size loses only its own
    attacker = round_reassembler(size + 4096, n, payload)
    junk = frame(secrets.token_bytes(size), max_payload=payload)
    for chunk in junk[: len(junk) // 2]:
        with contextlib.suppress(FrameError):
            attacker.feed("site-0", chunk, 0.0, quota="site-0")
    got = _interleaved(attacker, messages, payload)
    assert {k: v for k, v in got.items() if k != "site-0"} == {
        k: v for k, v in messages.items() if k != "site-0"}

