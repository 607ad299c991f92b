"""MQTT 3.1.1 conformance, written from the OASIS specification (section numbers cited).

Every test runs against the embedded broker and against Mosquitto (when installed) with the
configuration ``transport.mosquitto`` generates: what Mosquitto does, the embedded broker
must do too. Client ids equal usernames here, as both brokers bind them to each other.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Awaitable, Callable, Iterator

import pytest
from mqtt_raw import (
    PINGRESP,
    PUBACK,
    PUBCOMP,
    PUBLISH,
    PUBREC,
    PUBREL,
    UNSUBACK,
    RawClient,
    ack,
    connect_packet,
    mqtt_str,
    packet,
    publish_packet,
)

from transport.broker import EmbeddedBroker
from transport.mosquitto import MosquittoBroker, mosquitto_available

USERS = {f"u{i}": secrets.token_hex(8) for i in range(1, 6)}

KINDS = [
    "embedded",
    pytest.param("mosquitto", marks=[
        pytest.mark.mosquitto,
        pytest.mark.skipif(not mosquitto_available(), reason="mosquitto is not installed")]),
]


@pytest.fixture(scope="module", params=KINDS)
def port(request: pytest.FixtureRequest) -> Iterator[int]:
    if request.param == "embedded":
        with EmbeddedBroker(users=USERS).run_in_thread() as handle:
            yield handle.port
    else:
        with MosquittoBroker(users=USERS) as broker:
            yield broker.port


def run(scenario: Callable[[], Awaitable[None]], timeout: float = 15.0) -> None:
    async def bounded() -> None:
        await asyncio.wait_for(scenario(), timeout)

    asyncio.run(bounded())


async def login(port: int, user: str, **kwargs: object) -> RawClient:
    return await RawClient.login(port, user, user, USERS[user], **kwargs)


def topic(name: str) -> str:
    return f"conf/{secrets.token_hex(4)}/{name}"


# --------------------------------------------------------------------------- CONNECT


def test_connack_accepts_a_clean_session_without_session_present(port: int) -> None:
    async def scenario() -> None:
        client = await login(port, "u1")  # 3.2.2.2: clean session -> session present 0
        assert not client.session_present
        await client.ping()  # 3.12/3.13
        client.disconnect()

    run(scenario)


def test_bad_password_gets_return_code_5(port: int) -> None:
    async def scenario() -> None:
        client = await RawClient.open(port)
        client.send(connect_packet("u1", "u1", "wrong"))
        assert (await client.connack())[1] == 5  # 3.2.2.3
        assert await client.closed()

    run(scenario)


def test_unsupported_protocol_level_gets_return_code_1(port: int) -> None:
    async def scenario() -> None:
        client = await RawClient.open(port)
        body = mqtt_str("MQTT") + bytes([9, 0x02]) + (60).to_bytes(2, "big") + mqtt_str("u1")
        client.send(packet(0x10, body))
        assert (await client.connack())[1] == 1  # 3.1.2-2
        assert await client.closed()

    run(scenario)


def test_reserved_connect_flag_closes_the_connection(port: int) -> None:
    async def scenario() -> None:
        client = await RawClient.open(port)
        body = mqtt_str("MQTT") + bytes([4, 0x03]) + (60).to_bytes(2, "big") + mqtt_str("u1")
        client.send(packet(0x10, body))
        assert await client.closed()  # 3.1.2-3

    run(scenario)


def test_second_connect_closes_the_connection(port: int) -> None:
    async def scenario() -> None:
        client = await login(port, "u1")
        client.send(connect_packet("u1", "u1", USERS["u1"]))
        assert await client.closed()  # 3.1.0-2

    run(scenario)


def test_empty_client_id_needs_a_clean_session(port: int) -> None:
    async def scenario() -> None:
        client = await RawClient.open(port)
        client.send(connect_packet("", "u1", USERS["u1"], clean=False))
        assert (await client.connack())[1] == 2  # 3.1.3-8
        assert await client.closed()

    run(scenario)


def test_a_new_connection_with_the_same_client_id_closes_the_old_one(port: int) -> None:
    async def scenario() -> None:
        old = await login(port, "u2")
        new = await login(port, "u2")
        assert await old.closed()  # 3.1.4-2
        await new.ping()
        new.disconnect()

    run(scenario)


# --------------------------------------------------------------------------- PUBLISH / SUBSCRIBE


def test_qos1_publish_is_acknowledged_with_its_packet_id(port: int) -> None:
    async def scenario() -> None:
        client = await login(port, "u1")
        client.send(publish_packet(topic("q1"), b"x", qos=1, packet_id=4321))
        got = await client.read_kind(PUBACK)
        assert got.packet_id == 4321  # 3.4, 4.3.2
        client.disconnect()

    run(scenario)


def test_qos2_inbound_handshake_delivers_once(port: int) -> None:
    async def scenario() -> None:
        t = topic("q2")
        sub = await login(port, "u2")
        assert await sub.subscribe([(t, 1)]) == [1]
        pub = await login(port, "u1")
        pub.send(publish_packet(t, b"once", qos=2, packet_id=7))
        assert (await pub.read_kind(PUBREC)).packet_id == 7  # 4.3.3
        pub.send(publish_packet(t, b"once", qos=2, packet_id=7, dup=True))
        assert (await pub.read_kind(PUBREC)).packet_id == 7
        pub.send(ack(PUBREL, 7))
        assert (await pub.read_kind(PUBCOMP)).packet_id == 7
        got = await sub.read_kind(PUBLISH)
        assert got.payload == b"once"
        sub.send(ack(PUBACK, got.packet_id))
        assert await sub.no_packet(0.3)  # not delivered twice
        pub.disconnect()
        sub.disconnect()

    run(scenario)


def test_granted_qos_never_exceeds_the_request(port: int) -> None:
    async def scenario() -> None:
        client = await login(port, "u1")
        base = topic("g")
        codes = await client.subscribe([(base + "/0", 0), (base + "/1", 1), (base + "/2", 2)])
        assert codes[0] == 0 and codes[1] == 1 and codes[2] in (1, 2)  # 3.9.3
        client.disconnect()

    run(scenario)


def test_wildcards_match_by_level_and_hash_matches_the_parent(port: int) -> None:
    async def scenario() -> None:
        base = topic("w")
        sub = await login(port, "u2")
        assert await sub.subscribe([(base + "/+/x", 0), (base + "/h/#", 0)]) == [0, 0]
        pub = await login(port, "u1")
        for name in ("a/x", "a/y", "a/b/x", "h", "h/1/2"):
            pub.send(publish_packet(f"{base}/{name}", name.encode()))
        await pub.ping()  # everything above was processed
        seen = set()
        while True:
            try:
                seen.add((await sub.read_kind(PUBLISH, 0.5)).payload)
            except (asyncio.TimeoutError, TimeoutError):
                break
        assert seen == {b"a/x", b"h", b"h/1/2"}  # 4.7.1.2, 4.7.1.3
        pub.disconnect()
        sub.disconnect()

    run(scenario)


def test_wildcard_at_the_first_level_does_not_match_dollar_topics(port: int) -> None:
    async def scenario() -> None:
        sub = await login(port, "u2")
        await sub.subscribe([("+/conf-dollar", 0)])
        pub = await login(port, "u1")
        pub.send(publish_packet("$x/conf-dollar", b"no"))
        pub.send(publish_packet("y/conf-dollar", b"yes"))
        got = await sub.read_kind(PUBLISH)
        assert got.payload == b"yes"  # 4.7.2-1
        assert await sub.no_packet(0.3)
        pub.disconnect()
        sub.disconnect()

    run(scenario)


def test_publish_to_a_wildcard_topic_closes_the_connection(port: int) -> None:
    async def scenario() -> None:
        client = await login(port, "u1")
        client.send(publish_packet("conf/+/bad", b"x"))
        assert await client.closed()  # 3.3.2-2

    run(scenario)


def test_retained_message_reaches_new_subscribers_flagged_and_is_cleared(port: int) -> None:
    async def scenario() -> None:
        t = topic("r")
        pub = await login(port, "u1")
        live = await login(port, "u3")
        await live.subscribe([(t, 0)])
        await pub.publish(t, b"kept", qos=1, retain=True)
        got = await live.read_kind(PUBLISH)
        assert got.payload == b"kept" and not got.retain  # 3.3.1-9: live copy, RETAIN 0
        late = await login(port, "u2")
        await late.subscribe([(t, 0)])
        got = await late.read_kind(PUBLISH)
        assert got.payload == b"kept" and got.retain  # 3.3.1-6/-8
        await pub.publish(t, b"", qos=1, retain=True)  # 3.3.1-10/-11: clears
        later = await login(port, "u4")
        await later.subscribe([(t, 0)])
        assert await later.no_packet(0.3)
        for c in (pub, live, late, later):
            c.disconnect()

    run(scenario)


def test_unsubscribe_stops_delivery(port: int) -> None:
    async def scenario() -> None:
        t = topic("u")
        sub = await login(port, "u2")
        await sub.subscribe([(t, 0)])
        sub.send(packet(0xA2, (9).to_bytes(2, "big") + mqtt_str(t)))
        assert (await sub.read_kind(UNSUBACK)).packet_id == 9  # 3.10.4
        pub = await login(port, "u1")
        await pub.publish(t, b"gone", qos=1)
        assert await sub.no_packet(0.3)
        pub.disconnect()
        sub.disconnect()

    run(scenario)


def test_qos1_messages_keep_their_order_and_distinct_packet_ids(port: int) -> None:
    async def scenario() -> None:
        t = topic("o")
        sub = await login(port, "u2")
        await sub.subscribe([(t, 1)])
        pub = await login(port, "u1")
        for i in range(10):
            pub.send(publish_packet(t, bytes([i]), qos=1, packet_id=i + 1))
        got = [await sub.read_kind(PUBLISH) for _ in range(10)]  # never acknowledged
        assert [g.payload for g in got] == [bytes([i]) for i in range(10)]  # 4.6
        assert len({g.packet_id for g in got}) == 10  # 2.3.1-2: ids in flight are distinct
        pub.disconnect()
        sub.disconnect()

    run(scenario)


# --------------------------------------------------------------------------- wills, sessions


def test_will_is_published_on_abrupt_close_not_after_disconnect(port: int) -> None:
    async def scenario() -> None:
        t = topic("will")
        sub = await login(port, "u2")
        await sub.subscribe([(t, 0)])
        polite = await login(port, "u3", will=(t, b"polite", 0, False))
        polite.disconnect()  # 3.1.2-10: no will after DISCONNECT
        assert await sub.no_packet(0.4)
        rude = await login(port, "u3", will=(t, b"rude", 0, False))
        rude.drop()  # 3.1.2-8
        assert (await sub.read_kind(PUBLISH)).payload == b"rude"
        sub.disconnect()

    run(scenario)


def test_silent_client_is_closed_after_one_and_a_half_keepalives(port: int) -> None:
    async def scenario() -> None:
        t = topic("ka")
        sub = await login(port, "u2")
        await sub.subscribe([(t, 0)])
        silent = await login(port, "u3", keepalive=1, will=(t, b"late", 0, False))
        # 1.5 x keepalive is 1.5 s: the embedded broker closed it after 1.5-2.0 s, Mosquitto
        # 2.0.11 after 5.2-5.7 s in 5 of 5 runs with a fresh broker (its keepalive check is
        # coarse; the former 4 s wait failed whenever this test ran first on its broker)
        assert await silent.closed(15.0)  # 3.1.2-24
        assert (await sub.read_kind(PUBLISH)).payload == b"late"
        sub.disconnect()

    run(scenario, 30.0)


def test_persistent_session_keeps_subscriptions_and_queues_qos1(port: int) -> None:
    async def scenario() -> None:
        t = topic("ps")
        first = await login(port, "u5", clean=False)
        await first.subscribe([(t, 1)])
        first.disconnect()
        pub = await login(port, "u1")
        await pub.publish(t, b"while away", qos=1)
        again = await login(port, "u5", clean=False)
        assert again.session_present  # 3.2.2-2
        got = await again.read_kind(PUBLISH)  # 3.1.2.4: queued while offline
        assert got.payload == b"while away"
        again.send(ack(PUBACK, got.packet_id))
        again.disconnect()
        fresh = await login(port, "u5", clean=True)  # 3.1.2-6: a clean session ends it
        assert not fresh.session_present
        await pub.publish(t, b"nobody", qos=1)
        assert await fresh.no_packet(0.3)
        fresh.disconnect()
        pub.disconnect()

    run(scenario)


def test_unacknowledged_qos1_is_redelivered_with_dup_on_reconnect(port: int) -> None:
    async def scenario() -> None:
        t = topic("dup")
        first = await login(port, "u5", clean=False)
        await first.subscribe([(t, 1)])
        pub = await login(port, "u1")
        await pub.publish(t, b"again", qos=1)
        got = await first.read_kind(PUBLISH)
        assert not got.dup
        first.drop()  # never acknowledged
        await asyncio.sleep(0.2)
        second = await login(port, "u5", clean=False)
        again = await second.read_kind(PUBLISH)
        assert again.payload == b"again" and again.dup  # 4.4-1
        second.send(ack(PUBACK, again.packet_id))
        second.disconnect()
        cleanup = await login(port, "u5", clean=True)
        cleanup.disconnect()
        pub.disconnect()

    run(scenario)


def test_pingresp_answers_pingreq(port: int) -> None:
    async def scenario() -> None:
        client = await login(port, "u1")
        client.send(packet(0xC0, b""))
        assert (await client.read()).kind == PINGRESP  # 3.12.4-1
        client.disconnect()

    run(scenario)
