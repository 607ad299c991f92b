"""A link's subscriptions over real MQTT: released by ``unsubscribe`` (at the broker and in
what a reconnection renews), and a refusal that names the broker's subscription cap."""

from __future__ import annotations

import asyncio
import secrets

import pytest

from transport.broker import EmbeddedBroker, TopicAcl
from transport.link import Delivery, LinkLost
from transport.mosquitto import _free_port
from transport.mqtt import BrokerSettings, MqttNetwork
from transport.topics import Topics

pytestmark = pytest.mark.timeout(60)

USER = "probe"
ACL = {USER: TopicAcl(subscribe=("secagg/#",), publish=("secagg/#",))}


def _settings(port: int, users: dict[str, str]) -> BrokerSettings:
    return BrokerSettings(port=port, passwords=users, connect_timeout=5.0,
                          reconnect_timeout=5.0, publish_timeout=5.0)


async def _delivered(link: object, topic: str) -> bool:
    event = await link.receive(0.5)  # type: ignore[attr-defined]
    return isinstance(event, Delivery) and event.topic == topic


def test_two_hundred_rounds_of_subscriptions_on_one_connection_stay_under_the_cap() -> None:
    """The embedded broker caps a session at 64 subscriptions: 200 rounds that each
    subscribe and release their topic run on one connection, the broker ends holding the
    one lasting filter, and a released topic is no longer delivered."""
    users = {USER: secrets.token_hex(8)}

    async def scenario() -> tuple[int, int]:
        async with EmbeddedBroker(users=users, acl=ACL) as broker, \
                MqttNetwork(_settings(broker.port, users)).connect(USER) as link:
            await link.subscribe("secagg/fed/server/#")
            for n in range(200):
                topics = Topics(f"r{n}")
                await link.subscribe(topics.server_filter)
                await link.publish(topics.server_filter[:-1] + "x", b"in round")
                assert await _delivered(link, topics.server_filter[:-1] + "x")
                await link.unsubscribe(topics.server_filter)
            await link.publish(Topics("r0").server_filter[:-1] + "y", b"late")
            late = await link.receive(0.3)
            return broker.router.index.count, 0 if late is None else 1

    held, late = asyncio.run(scenario())
    assert held == 1
    assert late == 0


def test_a_refusal_at_the_cap_names_the_cap() -> None:
    users = {USER: secrets.token_hex(8)}

    async def scenario() -> str:
        async with EmbeddedBroker(users=users, acl=ACL, max_subscriptions=4) as b, \
                MqttNetwork(_settings(b.port, users)).connect(USER) as link:
            for n in range(4):
                await link.subscribe(Topics(f"r{n}").server_filter)
            with pytest.raises(LinkLost) as refused:
                await link.subscribe(Topics("r4").server_filter)
            return str(refused.value)

    message = asyncio.run(scenario())
    assert "holds 4 other subscriptions" in message and "4 is its cap on subscriptions per " \
        "session" in message
    assert "max_subscriptions" in message and "secagg/r4/server/#" in message


def test_a_reconnection_renews_only_the_subscriptions_still_held() -> None:
    users = {USER: secrets.token_hex(8)}
    port = _free_port("127.0.0.1")

    async def scenario() -> tuple[int, bool, bool]:
        first = EmbeddedBroker(users=users, acl=ACL, port=port)
        await first.start()
        async with MqttNetwork(_settings(port, users)).connect(USER) as link:
            for n in range(10):
                await link.subscribe(Topics(f"r{n}").server_filter)
            for n in range(9):
                await link.unsubscribe(Topics(f"r{n}").server_filter)
            await first.stop()
            second = EmbeddedBroker(users=users, acl=ACL, port=port)
            await second.start()
            try:
                event = await link.receive(10.0)
                assert event is not None and not isinstance(event, Delivery), event
                await link.publish("secagg/r9/server/x", b"kept")
                kept = await _delivered(link, "secagg/r9/server/x")
                await link.publish("secagg/r0/server/x", b"released")
                released = await link.receive(0.3) is not None
                return second.router.index.count, kept, released
            finally:
                await second.stop()

    held, kept, released = asyncio.run(scenario())
    assert held == 1 and kept and not released
