"""The embedded broker's sessions and routing: QoS 1 window, offline queue, wills at
shutdown, the subscription index (MQTT 3.1.1 sections 3.1.2.4, 3.1.2.5, 4.4, 4.7)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable

from mqtt_raw import PUBACK, PUBLISH, RawClient, ack

from transport.broker import BrokerLimits, EmbeddedBroker, TopicAcl, topic_matches
from transport.broker.packets import Message
from transport.broker.routing import RetainedStore, SubscriptionIndex
from transport.broker.session import Session
from transport.framing import DEFAULT_MAX_PAYLOAD as FRAME_SIZE

USERS = {"a": "pw-a", "b": "pw-b"}


def run(scenario: Callable[[], Awaitable[None]], timeout: float = 15.0) -> None:
    async def bounded() -> None:
        await asyncio.wait_for(scenario(), timeout)

    asyncio.run(bounded())


async def login(broker: EmbeddedBroker, user: str, **kwargs: object) -> RawClient:
    return await RawClient.login(broker.port, user, user, USERS[user], **kwargs)


def test_qos1_window_holds_back_what_does_not_fit_until_acknowledged() -> None:
    async def scenario() -> None:
        async with EmbeddedBroker(users=USERS, max_inflight=4) as broker:
            sub = await login(broker, "a")
            await sub.subscribe([("w/#", 1)])
            pub = await login(broker, "b")
            for i in range(10):
                await pub.publish(f"w/{i}", bytes([i]), qos=1, packet_id=i + 1)
            first = [await sub.read_kind(PUBLISH) for _ in range(4)]
            assert [m.payload for m in first] == [bytes([i]) for i in range(4)]
            assert len({m.packet_id for m in first}) == 4
            assert await sub.no_packet(0.3)  # the window is full
            for message in first[:2]:
                sub.send(ack(PUBACK, message.packet_id))
            more = [await sub.read_kind(PUBLISH) for _ in range(2)]
            assert [m.payload for m in more] == [bytes([4]), bytes([5])]
            assert len({m.packet_id for m in first[2:] + more}) == 4  # ids in flight differ

    run(scenario)


def test_offline_persistent_session_queue_is_bounded() -> None:
    async def scenario() -> None:
        async with EmbeddedBroker(users=USERS, max_session_queue=3) as broker:
            sub = await login(broker, "a", clean=False)
            await sub.subscribe([("q", 1)])
            sub.disconnect()
            pub = await login(broker, "b")
            for i in range(5):
                await pub.publish("q", bytes([i]), qos=1, packet_id=i + 1)
            back = await login(broker, "a", clean=False)
            assert back.session_present
            got = [(await back.read_kind(PUBLISH)).payload for _ in range(3)]
            assert got == [b"\x00", b"\x01", b"\x02"]
            assert await back.no_packet(0.3)
            assert broker.stats.messages_dropped == 2

    run(scenario)


def test_wills_are_published_when_the_broker_shuts_down() -> None:
    async def scenario() -> None:
        broker = EmbeddedBroker(users=USERS)
        await broker.start()
        watcher = await login(broker, "a")
        await watcher.subscribe([("wills/#", 0)])
        await login(broker, "b", will=("wills/b", b"b is gone", 0, False))
        await broker.stop()
        got = await watcher.read_kind(PUBLISH)
        assert (got.topic, got.payload) == ("wills/b", b"b is gone")
        assert broker.stats.wills_published >= 1
        assert await watcher.closed()

    run(scenario)


def test_sessions_of_one_user_are_capped_oldest_offline_first() -> None:
    async def scenario() -> None:
        async with EmbeddedBroker(users=USERS, max_sessions_per_user=2) as broker:
            for cid in ("a", "a-1", "a-2"):
                client = await RawClient.login(broker.port, cid, "a", USERS["a"],
                                               clean=False)
                await client.subscribe([(f"s/{cid}", 1)])
                client.disconnect()
                await asyncio.sleep(0.05)
            again = await RawClient.login(broker.port, "a", "a", USERS["a"], clean=False)
            assert not again.session_present  # the oldest offline session made room
            latest = await RawClient.login(broker.port, "a-2", "a", USERS["a"], clean=False)
            assert latest.session_present

    run(scenario)


def test_subscription_index_matches_like_the_specification() -> None:
    rng = random.Random(7)
    levels = ["a", "b", "$s", "", "c"]

    def name(n: int) -> str:
        return "/".join(rng.choice(levels) for _ in range(n))

    filters = set()
    while len(filters) < 300:
        parts = [rng.choice([*levels, "+"]) for _ in range(rng.randint(1, 4))]
        if rng.random() < 0.3:
            parts.append("#")
        filters.add("/".join(parts))
    sessions = [Session("u", f"c{i}", persistent=False, max_inflight=1, max_queued_bytes=1,
                        max_queue=1) for i in range(len(filters))]
    index = SubscriptionIndex()
    table = list(zip(sorted(filters), sessions, strict=True))
    for topic_filter, session in table:
        index.add(topic_filter, session, 1)
    for topic_filter, session in table[::3]:
        index.remove(topic_filter, session)
    live = [(f, s) for i, (f, s) in enumerate(table) if i % 3]
    assert index.count == len(live)
    for _ in range(500):
        topic = name(rng.randint(1, 5))
        if not topic or "+" in topic:
            continue
        expected = {s for f, s in live if topic_matches(f, topic)}
        assert set(index.match(topic)) == expected, topic


def test_client_id_in_an_acl_pattern_counts_only_when_bound_to_the_user() -> None:
    rules = TopicAcl(publish=("up/%c",))
    assert rules.allows("publish", "up/site-1-fl", "site-1", "site-1-fl")
    assert rules.allows("publish", "up/site-1", "site-1", "site-1")
    # site-9 naming its client "site-1" gains nothing from %c
    assert not rules.allows("publish", "up/site-1", "site-9", "site-1")


def test_retained_store_caps_bytes_per_user_and_messages_overall() -> None:
    limits = BrokerLimits(max_retained_per_user=100, max_retained_bytes_per_user=1000,
                          max_retained_total=5)
    store = RetainedStore(limits)
    assert store.set(Message.build("t/0", bytes(600), 1, True), "a")
    assert store.set(Message.build("t/1", bytes(600), 1, True), "a")  # its oldest makes room
    assert [topic for topic, _ in store.items()] == ["t/1"]
    assert not store.set(Message.build("t/2", bytes(2000), 1, True), "a")  # over allowance
    for i in range(4):
        assert store.set(Message.build(f"u/{i}", b"x", 1, True), f"user{i}")
    assert not store.set(Message.build("u/9", b"x", 1, True), "other")  # 5 overall
    assert store.set(Message.build("u/0", b"", 1, True), "other")  # clearing always works
    assert len(store) == 4


def test_overall_caps_on_subscriptions_and_connections() -> None:
    async def scenario() -> None:
        async with EmbeddedBroker(users=USERS, max_subscriptions_total=3,
                                  max_connections=3) as broker:
            a = await login(broker, "a")
            assert await a.subscribe([("x/1", 1), ("x/2", 1)]) == [1, 1]
            b = await login(broker, "b")
            assert await b.subscribe([("y/1", 0), ("y/2", 0)]) == [0, 0x80]
            third = await RawClient.login(broker.port, "a-2", "a", USERS["a"])
            fourth = await RawClient.open(broker.port)
            assert await fourth.closed(2.0)  # over max_connections: closed at once
            await third.ping()
            assert broker.stats.connections_refused == 1

    run(scenario)


def test_offline_queue_is_bounded_in_bytes_too() -> None:
    async def scenario() -> None:
        async with EmbeddedBroker(users=USERS, max_queued_bytes=100_000) as broker:
            sub = await login(broker, "a", clean=False)
            await sub.subscribe([("q", 1)])
            sub.disconnect()
            pub = await login(broker, "b")
            for i in range(5):
                await pub.publish("q", bytes(40_000), qos=1, packet_id=i + 1)
            back = await login(broker, "a", clean=False)
            for _ in range(2):
                await back.read_kind(PUBLISH)
            assert await back.no_packet(0.3)
            assert broker.stats.messages_dropped == 3

    run(scenario)


def test_default_max_payload_is_the_transports_frame_size() -> None:
    assert BrokerLimits().max_payload == FRAME_SIZE == 256 << 10
